"""The audio modules import neither transformers nor tokenizers until used (the serving
path imports engine modules; those two libraries are heavy and, today, dev pins)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_audio_modules_loads_neither_transformers_nor_tokenizers() -> None:
    code = (
        "import sys\n"
        "import pdunit.engine.audio.mimi_stream, pdunit.engine.audio.csm_prompt\n"
        "import pdunit.engine.audio.voices, pdunit.engine.audio.pcm\n"
        "print(sorted(m for m in ('transformers', 'tokenizers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
