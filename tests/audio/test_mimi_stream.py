"""Streaming Mimi decode equals transformers' one-shot `MimiModel.decode` (issue 26.4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdunit.engine.audio.mimi_stream import MimiCodec, MimiStreamDecoder
from tests.audio.tiny import tiny_mimi

BOUND = 1e-3  # of full scale (float PCM: 1.0)
FRAMES = 12  # 24 decoder-transformer positions: four times the sliding window of 6


@pytest.fixture(scope="module")
def codec() -> MimiCodec:
    return tiny_mimi()


def codes(seed: int, frames: int = FRAMES) -> torch.Tensor:
    return torch.randint(0, 32, (4, frames), generator=torch.Generator().manual_seed(seed))


def one_shot(codec: MimiCodec, c: torch.Tensor) -> np.ndarray:
    with torch.inference_mode():
        return codec.model.decode(c[None]).audio_values[0, 0].numpy()


def streamed(codec: MimiCodec, c: torch.Tensor, chunk: int) -> np.ndarray:
    decoder = codec.stream_decoder()
    decoder.open("s")
    parts = [decoder.push("s", c[:, i : i + chunk]) for i in range(0, c.shape[1], chunk)]
    return np.concatenate(parts)


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_streamed_chunks_concatenate_to_the_one_shot_decode(codec: MimiCodec, chunk: int) -> None:
    c = codes(1)
    reference = one_shot(codec, c)
    audio = streamed(codec, c, chunk)
    assert audio.shape == (FRAMES * codec.samples_per_frame,) == reference.shape
    assert np.abs(reference).max() > 0.1  # not a silent codec: the bound below can fail
    assert np.abs(audio - reference).max() <= BOUND


def test_decoding_chunks_without_the_codec_state_breaks_the_bound(codec: MimiCodec) -> None:
    """The control: each chunk decoded alone (what windowed decoders do) is far off."""
    c = codes(1)
    reference = one_shot(codec, c)
    naive = np.concatenate([one_shot(codec, c[:, i : i + 2]) for i in range(0, FRAMES, 2)])
    assert np.abs(naive - reference).max() > 100 * BOUND


@pytest.mark.parametrize("slots", [1, 8])
def test_two_interleaved_streams_in_one_batch_each_equal_their_one_shot(codec: MimiCodec, slots: int) -> None:
    """Stream b opens three frames after a; the calls mix new and old streams and
    different chunk sizes (grouped per size inside one call). With one slot, b's open
    grows the state tensors under a's running state."""
    a, b = codes(2), codes(3, frames=7)
    decoder = MimiStreamDecoder(codec, slots=slots)
    decoder.open("a")
    out_a = [decoder.push("a", a[:, 0:3])]
    decoder.open("b")
    out_b: list[np.ndarray] = []
    for sa, sb in (((3, 4), (0, 1)), ((4, 6), (1, 3)), ((6, 11), (3, 4)), ((11, 12), (4, 7))):
        got = decoder.push_many({"a": a[:, sa[0] : sa[1]], "b": b[:, sb[0] : sb[1]]})
        out_a.append(got["a"])
        out_b.append(got["b"])
    assert np.abs(np.concatenate(out_a) - one_shot(codec, a)).max() <= BOUND
    assert np.abs(np.concatenate(out_b) - one_shot(codec, b)).max() <= BOUND


def test_close_frees_the_stream_and_its_slot_starts_fresh_for_the_next(codec: MimiCodec) -> None:
    decoder = MimiStreamDecoder(codec, slots=1)
    decoder.open("s")
    decoder.push("s", codes(4, frames=3))
    assert decoder.open_streams == 1
    decoder.close("s")
    assert decoder.open_streams == 0 and "s" not in decoder
    with pytest.raises(KeyError, match="'s' is not open"):
        decoder.push("s", codes(4, frames=1))
    decoder.open("t")  # the freed slot, holding s's state until reset
    c = codes(5, frames=4)
    assert np.abs(decoder.push("t", c) - one_shot(codec, c)).max() <= BOUND


def test_frames_of_the_wrong_shape_or_ids_are_refused_naming_them(codec: MimiCodec) -> None:
    decoder = codec.stream_decoder()
    decoder.open("s")
    with pytest.raises(ValueError, match=r"codes of shape \(3, 2\), expected \(4, frames >= 1\)"):
        decoder.push("s", np.zeros((3, 2), dtype=np.int64))
    bad = np.zeros((4, 2), dtype=np.int64)
    bad[2, 1] = 32
    with pytest.raises(ValueError, match=r"frame 1 codebook 2 has id 32, outside \[0, 32\)"):
        decoder.push("s", bad)
    with pytest.raises(ValueError, match="already open"):
        decoder.open("s")


def test_encode_gives_the_codecs_codes_for_a_clip(codec: MimiCodec) -> None:
    clip = np.sin(np.arange(codec.sample_rate) / 5.0).astype(np.float32) * 0.5
    got = codec.encode(clip)
    with torch.inference_mode():
        want = codec.model.encode(torch.from_numpy(clip)[None, None]).audio_codes[0].numpy()
    assert got.shape == (4, round(codec.frame_rate)) and np.array_equal(got, want)
