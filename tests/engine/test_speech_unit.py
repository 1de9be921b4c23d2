"""End to end: the official `openai` client speaks through a real local unit (tiny random
CSM + tiny random Mimi on CPU): a voice uploaded, a WAV streamed whose length is the
frames x the codec's samples per frame, the voice a prefix-cache hit the second time."""

from __future__ import annotations

import io
import wave

import numpy as np
import openai

from pdunit.engine.local import LocalConfig, LocalUnit
from tests.engine.unit_client import upload_demo_voice

MODEL, CODEC = "random:csm-tiny:0", "random:mimi-tiny:0"


def test_openai_client_gets_a_wav_of_frames_x_samples_per_frame_from_a_local_unit(tmp_path) -> None:
    cfg = LocalConfig(model=MODEL, codec=CODEC, voices=str(tmp_path / "voices"), pool_tokens=4096,
                      cache_tokens=4096, lb_port=0, guard=False, log_level="warning")
    with LocalUnit(cfg) as unit:
        assert unit.voices_token_file is not None  # a unit with a codec guards its store's writes
        audio = upload_demo_voice(unit.url, unit.voices_token_file, seconds=1.5)
        rate, spf = audio["sample_rate"], audio["samples_per_frame"]
        client = openai.OpenAI(base_url=f"{unit.url}/v1", api_key="unused", max_retries=0, timeout=120)
        cached = []
        for text in ("Hello there.", "Hello again."):
            with client.audio.speech.with_streaming_response.create(
                model=MODEL, voice="demo", input=text, response_format="wav",
                extra_body={"max_frames": 12, "min_frames": 12},  # no early EOS: 12 frames of audio
            ) as r:
                cached.append(int(r.headers["x-pdunit-cached-rows"]))
                data = r.read()
            with wave.open(io.BytesIO(data)) as w:
                assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (rate, 1, 2)
                pcm = w.readframes(w.getnframes())
            assert len(pcm) == 2 * 12 * spf
            assert np.abs(np.frombuffer(pcm, "<i2")).max() > 0  # the codec's (random) audio, not silence
        assert cached[0] == 0 and cached[1] > 0, cached  # the voice's turn is a shared prefix
