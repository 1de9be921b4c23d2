"""`--codec SPEC`: which codec an engine decodes its frames with, and the AudioFormat it announces.

Owns the spec forms (`random:mimi-tiny:<seed>`, a directory saved by `save_pretrained`,
`checkpoint`: the CSM checkpoint's own `codec_config` + `codec_model.*` tensors) and the
check that the codec's codebooks are the model's (count and size, naming `--codec`).
It must never download anything, nor hand out a codec that does not match the model.
transformers is imported only when a codec is built, so `import pdunit.engine` stays light.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdunit.engine.audio.mimi_stream import MimiCodec
from pdunit.engine.proto import pdunit_pb2 as pb

if TYPE_CHECKING:
    from transformers import MimiModel

TINY = "mimi-tiny"
CHECKPOINT = "checkpoint"  # the model checkpoint's own codec (a CSM directory)
_CODEC_PREFIX = "codec_model."


def tiny_mimi_model(
    n_codebooks: int = 4,
    codebook_size: int = 32,
    seed: int = 0,
    sampling_rate: int = 800,
    ratios: tuple[int, ...] = (4, 4),
    window: int = 6,
) -> MimiModel:
    """Mimi's layout at toy width, random weights (torch seed `seed`): a 2-layer decoder
    transformer with a short sliding window (so streams outlive it), 32 samples a frame at
    800 Hz by default; `ratios=(8, 6, 5, 4)` at 24 kHz gives the real conv stack."""
    from transformers import MimiConfig, MimiModel

    if n_codebooks < 1 or codebook_size < 2:
        raise ValueError(f"a Mimi codec needs >= 1 codebook of >= 2 ids (got {n_codebooks} of {codebook_size})")
    cfg = MimiConfig(
        sampling_rate=sampling_rate, hidden_size=16, num_filters=4, upsampling_ratios=list(ratios),
        num_hidden_layers=2, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
        codebook_size=codebook_size, codebook_dim=8, num_quantizers=n_codebooks,
        num_semantic_quantizers=1,
        vector_quantization_hidden_dimension=8, upsample_groups=16, sliding_window=window,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    return MimiModel(cfg).eval()


def load_codec(
    spec: str,
    *,
    n_codebooks: int,
    codebook_size: int,
    device: str = "cpu",
    model_dir: str | None = None,
) -> MimiCodec:
    """The codec `spec` names, on `device`, checked against the model's frames (`n_codebooks`
    codebooks of `codebook_size` ids each: `TTSModel.codec_books`). Forms:

    - `random:mimi-tiny:<seed>`: a tiny random Mimi built here, shaped to the model;
    - a local directory saved by `MimiModel.save_pretrained` (never a download);
    - `checkpoint`: the `codec_config` and `codec_model.*` tensors of the model's own
      checkpoint directory `model_dir` (transformers' CSM saves its Mimi there).

    Raises ValueError naming `--codec` for an unknown form, a missing directory and a
    codec whose codebooks differ from the model's (both values named)."""
    if spec.startswith("random:"):
        parts = spec.split(":")
        if len(parts) != 3 or parts[1] != TINY or not parts[2].isdigit():
            raise ValueError(f"--codec {spec!r}: the random form is random:{TINY}:<seed> (a non-negative integer)")
        codec = MimiCodec(tiny_mimi_model(n_codebooks, codebook_size, seed=int(parts[2])))
    elif spec == CHECKPOINT:
        if not model_dir or not Path(model_dir).is_dir():
            raise ValueError(
                f"--codec {CHECKPOINT} reads the model checkpoint's codec_config and codec_model.* tensors; "
                f"the model {model_dir!r} is not a checkpoint directory: give --codec a codec directory"
            )
        codec = _checkpoint_codec(Path(model_dir))
    else:
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"--codec {spec!r} is neither random:{TINY}:<seed>, {CHECKPOINT!r} nor a directory holding a "
                "codec saved with save_pretrained (config.json + model.safetensors)"
            )
        codec = MimiCodec.from_directory(str(path))
    check_match(codec, spec, n_codebooks=n_codebooks, codebook_size=codebook_size)
    codec.model.to(device)
    return codec


def check_match(codec: MimiCodec, spec: str, *, n_codebooks: int, codebook_size: int) -> None:
    """ValueError naming `--codec` and both values when the codec's codebooks are not the model's."""
    if (codec.num_codebooks, codec.codebook_size) != (n_codebooks, codebook_size):
        raise ValueError(
            f"--codec {spec!r} has {codec.num_codebooks} codebooks of {codec.codebook_size} ids; the model's "
            f"frames carry {n_codebooks} codebooks of {codebook_size} ids: give --codec a codec of the model"
        )


def _checkpoint_codec(directory: Path) -> MimiCodec:
    """The Mimi a CSM checkpoint carries: `codec_config` of its config.json and its
    `codec_model.*` tensors, written (prefix dropped) into a private directory that
    transformers' own loader reads as a saved Mimi (its renames of saved names apply)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    raw = json.loads((directory / "config.json").read_text())
    codec_raw = raw.get("codec_config") if isinstance(raw, dict) else None
    if not isinstance(codec_raw, dict):
        raise ValueError(f"--codec {CHECKPOINT}: {directory}/config.json has no codec_config object")
    state: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.startswith(_CODEC_PREFIX):
                    state[name[len(_CODEC_PREFIX) :]] = tensors.get_tensor(name).float()
    if not state:
        raise ValueError(f"--codec {CHECKPOINT}: the checkpoint {directory} holds no codec_model.* tensors")
    with tempfile.TemporaryDirectory(prefix="pdunit-codec-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps({**codec_raw, "model_type": "mimi"}))
        save_file(state, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        return MimiCodec.from_directory(tmp)


def audio_format(codec: MimiCodec, spec: str) -> pb.AudioFormat:
    """What an engine's Hello announces of its PCM (16-bit LE mono at the codec's rate)."""
    assert codec.samples_per_frame > 0 and math.isfinite(codec.frame_rate)
    return pb.AudioFormat(sample_rate=codec.sample_rate, samples_per_frame=codec.samples_per_frame,
                          frame_rate_hz=codec.frame_rate, codec=spec)
