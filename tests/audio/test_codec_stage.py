"""The codec stage (engine/audio/codec_stage.py): chunking (the first after 1 frame, then
every 2, what is pending at the end), the finishing EOS frame never decoded, contiguous
frame ranges, PCM equal to transformers' one-shot `MimiModel.decode` of the stream's
codes (clipped to full scale, as 16-bit PCM is), streams interleaved in one batch, and no
codec slot outliving its stream."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pdunit.engine.audio.codec_stage import CodecStage
from pdunit.engine.audio.mimi_stream import MimiCodec
from pdunit.engine.audio.pcm import pcm16_to_float
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.transformer import TTSModel
from pdunit.engine.proto import pdunit_pb2 as pb
from tests.audio.tiny import tiny_mimi

BOUND = 1e-3  # of full scale
RUN, EOS, LENGTH = 0, 1, 2
AUDIO_TOKEN = 62  # random:csm-tiny's audio_token_id: a frame row is 4 codes then it


@pytest.fixture(scope="module")
def codec() -> MimiCodec:
    return tiny_mimi()


@pytest.fixture(scope="module")
def model() -> TTSModel:
    return load_model("random:csm-tiny:0")


@dataclass
class Out:
    """One step's frames as the batcher's StepOutput carries them."""

    request_ids: np.ndarray
    frames: np.ndarray
    finished: np.ndarray


def step(rows: list[tuple[int, np.ndarray, int]]) -> Out:
    return Out(np.array([r for r, _, _ in rows], dtype=np.uint64),
               np.stack([f for _, f, _ in rows]).astype(np.int32) if rows else np.zeros((0, 5), np.int32),
               np.array([c for _, _, c in rows], dtype=np.uint8))


def frames(seed: int, n: int) -> np.ndarray:
    """n csm frame rows [n, 5]: 4 random codes, then the audio token."""
    codes = np.random.default_rng(seed).integers(0, 32, size=(n, 4))
    return np.concatenate([codes, np.full((n, 1), AUDIO_TOKEN)], axis=1).astype(np.int32)


def eos_frame() -> np.ndarray:
    return np.array([0, 0, 0, 7, AUDIO_TOKEN], dtype=np.int32)  # csm: codebooks 0..K-2 are the eos id 0


def one_shot(codec: MimiCodec, rows: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        codes = torch.from_numpy(rows[:, :4].T.astype(np.int64))[None]
        return codec.model.decode(codes).audio_values[0, 0].numpy()


def stage_for(codec: MimiCodec, model: TTSModel, first: int = 1, every: int = 2) -> CodecStage:
    return CodecStage(codec.stream_decoder(), model.codec_codes, first, every)


def drive(stage: CodecStage, per_step: list[list[tuple[int, np.ndarray, int]]]) -> list[list[pb.AudioChunk]]:
    out = []
    for rows in per_step:
        chunks, errors = stage.step(step(rows))
        assert not errors
        out.append(chunks)
    return out


def check_stream(codec: MimiCodec, chunks: list[pb.AudioChunk], audio_rows: np.ndarray) -> None:
    """Contiguous ranges from frame 0 covering `audio_rows` once, `last` on the final
    chunk only, and PCM equal to the one-shot decode."""
    at = 0
    for c in chunks:
        assert c.first_frame == at and len(c.pcm) == 2 * c.frames * codec.samples_per_frame
        at += c.frames
    assert at == len(audio_rows)
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    pcm = pcm16_to_float(b"".join(c.pcm for c in chunks))
    reference = np.clip(one_shot(codec, audio_rows), -1, 1)  # 16-bit PCM clips to full scale
    assert np.abs(reference).max() > 0.05  # not silence: the bound can fail
    assert np.abs(pcm - reference).max() <= BOUND


def test_chunks_come_after_1_frame_then_every_2_and_the_eos_frame_is_not_audio(codec, model) -> None:
    stage = stage_for(codec, model)
    stage.open(5)
    rows = frames(1, 6)
    steps = [[(5, rows[i], RUN)] for i in range(6)] + [[(5, eos_frame(), EOS)]]
    got = drive(stage, steps)
    assert [[(c.first_frame, c.frames, c.last) for c in s] for s in got] == [
        [(0, 1, False)], [], [(1, 2, False)], [], [(3, 2, False)], [], [(5, 1, True)]]
    check_stream(codec, [c for s in got for c in s], rows)
    assert len(stage) == 0 and stage.decoder.open_streams == 0  # its slot went with its last chunk


def test_a_length_finished_streams_last_frame_is_audio(codec, model) -> None:
    stage = stage_for(codec, model)
    stage.open(1)
    rows = frames(2, 4)
    got = drive(stage, [[(1, rows[i], RUN if i < 3 else LENGTH)] for i in range(4)])
    assert [[(c.first_frame, c.frames, c.last) for c in s] for s in got] == [
        [(0, 1, False)], [], [(1, 2, False)], [(3, 1, True)]]
    check_stream(codec, [c for s in got for c in s], rows)


def test_an_eos_with_nothing_pending_sends_an_empty_last_chunk(codec, model) -> None:
    stage = stage_for(codec, model)
    stage.open(2)
    rows = frames(3, 3)
    got = drive(stage, [[(2, rows[i], RUN)] for i in range(3)] + [[(2, eos_frame(), EOS)]])
    assert [(c.first_frame, c.frames, c.last, c.pcm) for c in got[-1]] == [(3, 0, True, b"")]
    check_stream(codec, [c for s in got for c in s], rows)


def test_a_first_frame_that_is_eos_gives_one_empty_last_chunk(codec, model) -> None:
    stage = stage_for(codec, model)
    stage.open(3)
    (chunks,) = drive(stage, [[(3, eos_frame(), EOS)]])
    assert [(c.first_frame, c.frames, c.last) for c in chunks] == [(0, 0, True)]
    assert stage.decoder.open_streams == 0


def test_interleaved_streams_decode_in_one_batch_each_equal_to_its_one_shot(codec, model) -> None:
    """a starts first; b joins two steps later with other chunk phases; c asks for no
    audio and gets none; the first chunk sizes differ (3, then 2)."""
    stage = stage_for(codec, model, first=3, every=2)
    a, b, c = frames(4, 9), frames(5, 6), frames(6, 5)
    stage.open(10)
    per_step: list[list[tuple[int, np.ndarray, int]]] = []
    for i in range(10):
        rows = []
        if i < 9:
            rows.append((10, a[i], RUN if i < 8 else LENGTH))
        if 2 <= i < 9:
            rows.append((11, b[i - 2], RUN) if i - 2 < 6 else (11, eos_frame(), EOS))
        if i < 5:
            rows.append((12, c[i], RUN))
        per_step.append(rows)
    calls = []
    decode = stage.decoder.decode
    ids = stage.decoder._ids  # slot -> stream

    def spy(slots, codes, **kw):
        calls.append(sorted(str(ids[s]) for s in slots))
        return decode(slots, codes, **kw)

    stage.decoder.decode = spy  # type: ignore[method-assign]
    chunks: dict[int, list[pb.AudioChunk]] = {10: [], 11: [], 12: []}
    for i, rows in enumerate(per_step):
        if i == 2:
            stage.open(11)
        got, errors = stage.step(step(rows))
        assert not errors
        for ch in got:
            chunks[ch.request_id].append(ch)
    assert chunks[12] == []
    check_stream(codec, chunks[10], a)
    check_stream(codec, chunks[11], b)
    assert ["10", "11"] in calls  # one call decoded both streams' due chunks
    assert stage.decoder.open_streams == 0


def test_a_cancelled_or_forgotten_stream_frees_its_slot(codec, model) -> None:
    stage = stage_for(codec, model, first=2)
    stage.open(1)
    stage.open(2)
    stage.open(3)
    drive(stage, [[(1, frames(7, 1)[0], RUN), (2, frames(8, 1)[0], RUN)]])
    stage.drop([1])  # cancelled: what was pending is not decoded
    assert 1 not in stage and stage.decoder.open_streams == 2
    assert stage.retain([3]) == [2]  # the engine no longer has 2
    assert stage.decoder.open_streams == 1
    stage.drop([3, 3, 99])  # idempotent, unknown ids ignored
    assert stage.decoder.open_streams == 0 and len(stage) == 0
    stage.open(1)  # a freed slot serves the next stream
    (chunks,) = drive(stage, [[(1, frames(9, 1)[0], LENGTH)]])
    assert chunks[0].last and chunks[0].frames == 1


def test_an_id_outside_the_codec_ends_that_streams_audio_with_an_error(codec, model) -> None:
    stage = stage_for(codec, model)
    failed: list[int] = []
    stage.on_fail = failed.append
    stage.open(1)
    stage.open(2)
    bad = frames(10, 1)[0].copy()
    bad[2] = 40  # csm-tiny's vocabulary is 32 ids
    chunks, errors = stage.step(step([(1, bad, RUN), (2, frames(11, 1)[0], RUN)]))
    assert [c.request_id for c in chunks] == [2]
    (err,) = errors
    assert err.request_id == 1 and err.status == pb.INTERNAL and "codebook 2 has id 40" in err.message
    assert failed == [1] and 1 not in stage and stage.decoder.open_streams == 1


def test_chunk_sizes_below_one_are_refused_naming_the_flags(codec, model) -> None:
    with pytest.raises(ValueError, match="--audio-first-chunk-frames and --audio-chunk-frames"):
        stage_for(codec, model, first=0)


def test_the_pdunit_family_gives_every_column_to_the_codec() -> None:
    tiny = load_model("random:tiny:0")
    assert tiny.codec_books == (11, 1024)
    rows = np.arange(22, dtype=np.int32).reshape(2, 11)
    assert tiny.codec_codes(rows).tolist() == rows.T.tolist()
