"""The codec stage served (issue 26.4): D (plain and overlapped steps, its first frame at
COMMIT) and the monolith (prefill-first and chunked, with and without overlap), with
random:csm-tiny and `--codec random:mimi-tiny:0`, stream an audio stream's PCM in
AudioChunks that cover every frame but the finishing EOS frame exactly once and equal
transformers' one-shot `MimiModel.decode` of its codes; a stream that asks for no audio
gets none; every codec slot is freed; without a codec, audio is refused naming --codec.
Driven in process (CPU): D as tests/engine/test_decode_commit.py drives it, the monolith
as tests/engine/test_monolith_overlap.py does."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pdunit.engine.audio.codec_spec import audio_format, load_codec
from pdunit.engine.audio.codec_stage import CodecStage
from pdunit.engine.audio.mimi_stream import MimiCodec
from pdunit.engine.audio.pcm import pcm16_to_float
from pdunit.engine.decode.worker import DecodeEngine
from pdunit.engine.kv.checksum import kv_checksum
from pdunit.engine.kv.pool import PagePool
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.model.transformer import TTSModel
from pdunit.engine.monolith.worker import MonolithEngine
from pdunit.engine.packing import pack, unpack
from pdunit.engine.prefill.scheduler import PrefillJob
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.transfer.base import PoolGeometry
from tests.engine.test_decode_commit import RecordingHub, Storage

MODEL, CODEC = "random:csm-tiny:0", "random:mimi-tiny:0"
AUDIO_TOKEN, K = 62, 4
ROWS = 12
BOUND = 1e-3


@pytest.fixture(scope="module")
def model() -> TTSModel:
    return load_model(MODEL)


@pytest.fixture(scope="module")
def codec(model: TTSModel) -> MimiCodec:
    k, size = model.codec_books
    return load_codec(CODEC, n_codebooks=k, codebook_size=size)


def audio_rows(seed: int, n: int) -> np.ndarray:
    """csm audio-frame rows [n, K + 1]: random codes, then the audio token."""
    codes = np.random.default_rng(seed).integers(1, 31, size=(n, K))
    return np.concatenate([codes, np.full((n, 1), AUDIO_TOKEN)], axis=1).astype(np.int64)


def chunks_of(messages: list[pb.StepFrames], rid: int) -> list[pb.AudioChunk]:
    return [c for msg in messages for c in msg.audio if c.request_id == rid]


def frames_of(messages: list[pb.StepFrames], rid: int) -> tuple[list[np.ndarray], list[int]]:
    frames, codes = [], []
    for msg in messages:
        ids = unpack(msg.request_ids, "u8").tolist()
        if rid in ids:
            i = ids.index(rid)
            frames.append(unpack(msg.frames, "i4").reshape(len(ids), -1)[i])
            codes.append(int(unpack(msg.finished, "u1")[i]))
    return frames, codes


def check_audio(model: TTSModel, codec: MimiCodec, messages: list[pb.StepFrames], rid: int) -> int:
    """The stream's chunks cover its frames (the finishing EOS frame left out) once, in
    order, the last one `last`, and their PCM is the one-shot decode. Returns its frames."""
    frames, codes = frames_of(messages, rid)
    assert codes and codes[-1] != 0 and all(c == 0 for c in codes[:-1])
    audio = frames[:-1] if codes[-1] == 1 else frames
    chunks = chunks_of(messages, rid)
    at = 0
    for c in chunks:
        assert c.first_frame == at
        at += c.frames
    assert at == len(audio) and [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[0].frames == 1  # the first chunk is the first frame alone (TTFA)
    # a chunk rides on the step that completes it: the message with its last frame
    for msg in messages:
        for c in msg.audio:
            if c.request_id == rid and c.frames:
                ids = unpack(msg.request_ids, "u8").tolist()
                assert rid in ids
    if not audio:
        return 0
    pcm = pcm16_to_float(b"".join(c.pcm for c in chunks))
    with torch.inference_mode():
        codes_kn = torch.from_numpy(model.codec_codes(np.stack(audio)))[None]
        reference = np.clip(codec.model.decode(codes_kn).audio_values[0, 0].numpy(), -1, 1)
    assert pcm.shape == reference.shape and np.abs(reference).max() > 0.05  # not silence
    assert np.abs(pcm - reference).max() <= BOUND
    return len(audio)


# ---------------------------------------------------------------------------- D
def decode_engine(model: TTSModel, codec: MimiCodec | None, overlap: bool = False) -> tuple[DecodeEngine, RecordingHub]:
    c = model.config
    pool = PagePool(1024, 1)
    storage = model.new_kv_storage(1024)
    geometry = PoolGeometry(c.n_layers, c.n_kv_heads, c.head_dim, storage.dtype, 1024, 1)
    hub = RecordingHub()
    stage = CodecStage.for_model(codec, model) if codec is not None else None
    fmt = audio_format(codec, CODEC) if codec is not None else None
    d = DecodeEngine(model, MODEL, geometry, pool, Storage(storage), hub,  # type: ignore[arg-type]
                     "unused.sock", max_batch=8, cuda_graphs=False, overlap=overlap, codec=stage, audio_format=fmt)
    return d, hub


def commit(d: DecodeEngine, rid: int, first: np.ndarray, audio: bool, max_frames: int,
           min_frames: int = 0, reserve_audio: bool | None = None) -> pb.CommitReply:
    """RESERVE then COMMIT as P sends them: both carry `audio` (RESERVE's `reserve_audio`
    when given, to play a P that did not say it at RESERVE)."""
    reply = d.reserve(pb.ReserveRequest(request_id=rid, n_tokens=ROWS, total_tokens=ROWS + max_frames,
                                        identity=pb.Identity(sender_instance="p"),
                                        audio=audio if reserve_audio is None else reserve_audio))
    assert reply.status == pb.STATUS_OK, reply
    slots = unpack(reply.dst_slots, "i8")
    rows = torch.randn(d.storage[:, :, :ROWS].shape, dtype=d.storage.dtype,
                       generator=torch.Generator().manual_seed(rid))
    d.storage[:, :, torch.from_numpy(slots)] = rows
    return d.commit(pb.CommitRequest(
        request_id=rid, first_frame=pack(first.astype(np.int32), "i4"), checksum=kv_checksum(d.storage, slots),
        checksum_sample=1, sampling=pb.Sampling(max_frames=max_frames, min_frames=min_frames, temperature=1.0,
                                                seed=rid),
        prompt_tokens=ROWS, identity=pb.Identity(sender_instance="p"), audio=audio))


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_d_streams_an_audio_streams_pcm_and_none_for_a_frames_stream(model, codec, overlap: bool) -> None:
    d, hub = decode_engine(model, codec, overlap)
    assert d.hello().audio_format.sample_rate == codec.sample_rate
    assert d.hello().audio_format.samples_per_frame == codec.samples_per_frame
    first = audio_rows(1, 3)
    assert commit(d, 1, first[0], audio=True, max_frames=9, min_frames=9).status == pb.STATUS_OK
    assert [c.frames for c in chunks_of(hub.messages, 1)] == [1]  # the first frame's audio, with the COMMIT
    assert commit(d, 2, first[1], audio=False, max_frames=7, min_frames=7).status == pb.STATUS_OK
    steps = 0
    while d._step_once():
        steps += 1
        if steps == 2:  # a third stream joins the running ones, with its own chunk phase
            assert commit(d, 3, first[2], audio=True, max_frames=6, min_frames=6).status == pb.STATUS_OK
    assert check_audio(model, codec, hub.messages, 1) == 9  # length-finished: the last frame is audio
    assert check_audio(model, codec, hub.messages, 3) == 6
    assert chunks_of(hub.messages, 2) == []
    assert d.codec is not None and len(d.codec) == 0 and d.codec.decoder.open_streams == 0


def test_d_never_decodes_a_finishing_eos_frame(model, codec) -> None:
    d, hub = decode_engine(model, codec)
    eos = np.array([0, 0, 0, 5, AUDIO_TOKEN])  # csm's EOS frame: codebooks 0..K-2 are the eos id 0
    assert commit(d, 4, eos, audio=True, max_frames=10).status == pb.STATUS_OK
    (msg,) = hub.messages
    assert unpack(msg.finished, "u1").tolist() == [1]
    assert [(c.first_frame, c.frames, c.last, c.pcm) for c in msg.audio] == [(0, 0, True, b"")]
    assert d.codec is not None and d.codec.decoder.open_streams == 0


def test_a_cancelled_audio_stream_frees_its_codec_slot_in_d(model, codec) -> None:
    d, hub = decode_engine(model, codec)
    assert commit(d, 5, audio_rows(5, 1)[0], audio=True, max_frames=50, min_frames=50).status == pb.STATUS_OK
    d._step_once()
    assert d.codec is not None and 5 in d.codec
    assert d.cancel(5)
    while d._step_once():
        pass
    assert 5 not in d.codec and d.codec.decoder.open_streams == 0
    assert not any(c.last for c in chunks_of(hub.messages, 5))  # cancelled: the client is gone


def test_d_without_a_codec_refuses_audio_naming_the_flag(model) -> None:
    d, hub = decode_engine(model, None)
    assert not d.hello().HasField("audio_format")
    free = d.pool.free_pages
    at_reserve = d.reserve(pb.ReserveRequest(request_id=5, n_tokens=ROWS, total_tokens=ROWS + 4, audio=True,
                                             identity=pb.Identity(sender_instance="p")))
    assert at_reserve.status == pb.INVALID and "--codec" in at_reserve.message
    assert d.pool.free_pages == free and 5 not in d.reservations  # refused before any page was taken
    # a P that did not say it at RESERVE is refused at COMMIT
    reply = commit(d, 6, audio_rows(6, 1)[0], audio=True, max_frames=4, reserve_audio=False)
    assert reply.status == pb.INVALID and "--codec" in reply.message
    (msg,) = hub.messages  # the LB hears it as the stream's error
    assert msg.errors[0].request_id == 6
    assert commit(d, 7, audio_rows(7, 1)[0], audio=False, max_frames=3, min_frames=3).status == pb.STATUS_OK


# ---------------------------------------------------------------------------- the monolith
class Hub:
    def __init__(self) -> None:
        self.messages: list[pb.StepFrames] = []

    def publish(self, message: pb.StepFrames) -> None:
        self.messages.append(message)


def monolith(model: TTSModel, codec: MimiCodec | None, policy: str, overlap: bool) -> MonolithEngine:
    stage = CodecStage.for_model(codec, model) if codec is not None else None
    fmt = audio_format(codec, CODEC) if codec is not None else None
    return MonolithEngine(model, MODEL, PagePool(2048, 4), model.new_kv_storage(2048), Hub(),  # type: ignore[arg-type]
                          policy, chunk_tokens=32, max_batch=8, max_batch_rows=64, cuda_graphs=False,
                          overlap=overlap, codec=stage, audio_format=fmt)


def job(rid: int, rows: int, params: SamplingParams, replies: dict[int, pb.SubmitReply],
        audio: bool = False) -> PrefillJob:
    return PrefillJob(rid, audio_rows(100 + rid, rows), params, int(time.time() * 1000) + 600_000, {},
                      done=lambda reply: replies.__setitem__(rid, reply), audio=audio)


@pytest.mark.parametrize(("policy", "overlap"), [("prefill-first", False), ("chunked", True)])
def test_the_monolith_streams_an_audio_streams_pcm_and_none_for_a_frames_stream(model, codec, policy, overlap) -> None:
    e = monolith(model, codec, policy, overlap)
    assert e.hello().audio_format.codec == CODEC
    replies: dict[int, pb.SubmitReply] = {}
    e.submit(job(1, 20, SamplingParams(max_frames=8, min_frames=8, temperature=1.0, seed=1), replies, audio=True))
    e.submit(job(2, 9, SamplingParams(max_frames=6, min_frames=6, temperature=1.0, seed=2), replies))
    e.submit(job(3, 40, SamplingParams(max_frames=5, min_frames=5, temperature=1.0, seed=3), replies, audio=True))
    hub: Hub = e.hub  # type: ignore[assignment]
    for _ in range(200):
        e._step_once()
        if len(replies) == 3 and not len(e.batcher) and (e.overlap is None or not e.overlap.in_flight):
            break
    assert all(r.status == pb.STATUS_OK for r in replies.values()), replies
    assert check_audio(model, codec, hub.messages, 1) == 8
    assert check_audio(model, codec, hub.messages, 3) == 5
    assert chunks_of(hub.messages, 2) == []
    assert e.codec is not None and e.codec.decoder.open_streams == 0


def test_the_monolith_without_a_codec_refuses_audio_naming_the_flag(model) -> None:
    e = monolith(model, None, "prefill-first", False)
    assert not e.hello().HasField("audio_format")
    replies: dict[int, pb.SubmitReply] = {}
    e.submit(job(1, 5, SamplingParams(max_frames=3), replies, audio=True))
    assert replies[1].status == pb.INVALID and "--codec" in replies[1].message
