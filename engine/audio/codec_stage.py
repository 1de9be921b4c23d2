"""The codec stage of an engine that decodes (D, the monolith): each audio stream's frames
-> streamed PCM chunks (AudioChunk) riding on the step's StepFrames.

Owns the chunking policy (first chunk after `first_chunk_frames`, then every `chunk_frames`;
`last` at a stream's end), the pending codes in arrays by codec slot, one batched `decode`
per step and chunk size (codes [B, K, n] and slots, no per-stream array work), the codec
slots (on CUDA a graph decoder sized to --max-batch and captured at start), the `--codec` flags. It must never decode a stream's finishing EOS frame (not audio),
never emit a frame twice or out of order, never raise into the step loop (a codec error
ends that stream's audio with a StreamError), nor keep a slot its engine forgot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel, Field

from pdunit.engine import metrics as m
from pdunit.engine.proto import pdunit_pb2 as pb

if TYPE_CHECKING:
    from pdunit.engine.audio.mimi_stream import MimiCodec, MimiStreamDecoder
    from pdunit.engine.model.transformer import TTSModel

_RUNNING, _EOS, _LENGTH = 0, 1, 2  # StepFrames.finished (engine/decode/batcher.py)

# The refusal of an audio stream by an engine started without --codec (D, the monolith).
NO_CODEC = ("audio: this engine has no codec (start it with --codec) and cannot turn the stream's frames into "
            "PCM; ask for frames only, or send it to an engine with a codec")
CODEC_STEP_SECONDS = m.role_metric(Histogram(
    "pdunit_codec_step_seconds", "Wall time of a step's codec decode (one batched call for every due audio stream)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0), registry=None), "decode", "monolith")
CODEC_STREAMS = m.role_metric(Gauge(
    "pdunit_codec_streams", "Audio streams holding a codec slot (their frames are decoded to PCM)", registry=None),
    "decode", "monolith")
CODEC_FRAMES = m.role_metric(Counter(
    "pdunit_codec_frames_total", "Frames decoded to PCM by the codec stage", registry=None), "decode", "monolith")
CODEC_FAILURES = m.role_metric(Counter(
    "pdunit_codec_failures_total", "Audio streams whose codec decode failed (a StreamError ended them)",
    registry=None), "decode", "monolith")


class CodecFields(BaseModel):
    """The codec flags of every engine that decodes (D, the monolith)."""

    codec: str = Field("", description="codec that turns frames into PCM for requests that ask for audio: "
                       "random:mimi-tiny:<seed> (a tiny random Mimi shaped to the model), a directory saved by "
                       "MimiModel.save_pretrained, or checkpoint (the model checkpoint's own codec_config and "
                       "codec_model.* tensors, as transformers saves CSM); empty = no codec, audio requests "
                       "are refused")
    audio_first_chunk_frames: int = Field(1, gt=0, description="frames of a stream's first PCM chunk (TTFA: 1 "
                                          "sends the first frame's audio at once)")
    audio_chunk_frames: int = Field(2, gt=0, description="frames of each later PCM chunk (fewer, larger codec "
                                    "calls vs the audio's latency)")
    codec_conv_table: str = Field("", description="the codec convolutions' launch tiles by shape, a JSON file "
                                  "`pdunit bench codec --tune-conv` wrote on this GPU model (codec-conv-*.json); "
                                  "empty, or tuned on another GPU: the hand tiles (logged at start)")


def build_codec_stage(cfg: CodecFields, model: TTSModel, model_spec: str, device: str,
                      log: logging.Logger) -> tuple[CodecStage | None, pb.AudioFormat | None]:
    """The codec stage `cfg` asks for (None, None without --codec), checked against the
    model's codebooks; ValueError naming the flag when it cannot be had. `cfg` is the
    engine's config (D's, the monolith's): its `max_batch` sizes the codec's pools and
    graphs. On CUDA the graphs are captured here, at engine start."""
    if not cfg.codec:
        log.info("codec", extra={"codec": None, "audio": "refused: no --codec"})
        return None, None
    from pdunit.engine.audio.codec_spec import audio_format, load_codec

    k, size = model.codec_books
    codec = load_codec(cfg.codec, n_codebooks=k, codebook_size=size, device=device, model_dir=model_spec)
    from pdunit.kernels.codec_fused import load_conv_table

    load_conv_table(cfg.codec_conv_table, codec.device, log)  # before the graphs capture their launches
    fmt = audio_format(codec, cfg.codec)
    max_batch = getattr(cfg, "max_batch", None)  # D's and the monolith's --max-batch
    stage = CodecStage.for_model(codec, model, cfg.audio_first_chunk_frames, cfg.audio_chunk_frames, max_batch)
    decoder, graphs = stage.decoder, stage.decoder.graphs
    log.info("codec", extra={"codec": cfg.codec, "sample_rate": fmt.sample_rate,
                             "samples_per_frame": fmt.samples_per_frame, "frame_rate_hz": fmt.frame_rate_hz,
                             "codebooks": k, "codebook_size": size, "first_chunk_frames": stage.first_chunk_frames,
                             "chunk_frames": stage.chunk_frames, "slots": decoder.slots,
                             "pool_bytes": decoder.pool_bytes, "ring": decoder.ring, "attention": decoder.attention,
                             "graphs": graphs.captures if graphs is not None else None,
                             "graph_buckets": list(graphs.buckets) if graphs is not None else None,
                             "capture_s": round(graphs.capture_seconds, 2) if graphs is not None else None})
    return stage, fmt


class Frames(Protocol):
    """What a step hands the stage (engine/decode/batcher.StepOutput)."""

    request_ids: np.ndarray  # uint64 [n]
    frames: np.ndarray       # int32 [n, C]
    finished: np.ndarray     # uint8 [n]


@dataclass(frozen=True)
class StepCost:
    """What one step's codec work cost: its wall time and the audio streams among the
    step's rows (due for a chunk or not): rate-floor admission's codec term
    (engine/decode/step_model.py `StepModel.observe_codec`)."""

    seconds: float = 0.0
    audio_streams: int = 0


class CodecStage:
    """The audio streams of one engine. `open` when a stream that asked for audio starts
    decoding; `step(out)` with every published step (from any thread: one lock) returns
    the chunks due and the errors; `drop` when the engine forgets a stream (cancelled,
    failed); `retain(live)` closes every stream not in `live` (a sweep when idle)."""

    def __init__(self, decoder: MimiStreamDecoder, codes: Callable[[np.ndarray], np.ndarray],
                 first_chunk_frames: int = 1, chunk_frames: int = 2) -> None:
        if first_chunk_frames < 1 or chunk_frames < 1:
            raise ValueError(f"audio chunks need >= 1 frame (got first {first_chunk_frames}, then {chunk_frames}): "
                             "--audio-first-chunk-frames and --audio-chunk-frames")
        self.decoder = decoder
        self.codes = codes  # frame rows [n, C] -> codec codes [K, n] (TTSModel.codec_codes)
        self.first_chunk_frames = first_chunk_frames
        self.chunk_frames = chunk_frames
        self._streams: dict[int, int] = {}  # request id -> its codec slot
        # by codec slot: its stream, frames sent, frames pending and their codes [K, frames]
        slots, books = decoder.slots, decoder.codec.num_codebooks
        self._rid = np.zeros(slots, dtype=np.uint64)
        self._sent = np.zeros(slots, dtype=np.int64)
        self._count = np.zeros(slots, dtype=np.int64)
        self._pending = np.zeros((slots, books, max(first_chunk_frames, chunk_frames)), dtype=np.int64)
        self._index: tuple[np.ndarray, np.ndarray] | None = None  # (request ids sorted, their slots)
        self._lock = threading.Lock()
        # called with a stream whose codec decode failed (its StreamError is out): the
        # engine ends the stream (never a lock the caller of `step` holds)
        self.on_fail: Callable[[int], object] | None = None

    @classmethod
    def for_model(cls, codec: MimiCodec, model: TTSModel, first_chunk_frames: int = 1, chunk_frames: int = 2,
                  max_batch: int | None = None) -> CodecStage:
        """The stage of an engine serving `model`. On CUDA the decoder replays CUDA graphs
        captured now (engine start, never in a step) for every batch bucket up to
        `max_batch` (default 512) and every call of 1..max(chunk sizes) frames, and its pools
        hold `max_batch` streams plus the graphs' scratch slot, so they never grow (and drop
        the graphs) in a step. On a CPU it runs eagerly, its pools growing with use."""
        frames = max(first_chunk_frames, chunk_frames)
        if codec.device.type != "cuda":
            return cls(codec.stream_decoder(graph_frames=frames), model.codec_codes, first_chunk_frames, chunk_frames)
        from pdunit.engine.audio.mimi_graphs import DEFAULT_BUCKETS, capped_buckets

        batch = max_batch or DEFAULT_BUCKETS[-1]
        decoder = codec.stream_decoder(graphs=True, slots=batch + 1, buckets=capped_buckets(batch),
                                       graph_frames=frames)
        decoder.graphs.prepare(frames=tuple(range(1, frames + 1)), max_batch=batch)
        return cls(decoder, model.codec_codes, first_chunk_frames, chunk_frames)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request_id: int) -> None:
        rid = int(request_id)
        with self._lock:
            if rid in self._streams:
                return
            key = str(rid)
            self.decoder.close(key)  # a slot left by an earlier stream of this id (never expected)
            slot = self.decoder.open(key)
            if slot >= len(self._rid):  # the decoder's pools grew (a CPU codec): so do the arrays
                grow = self.decoder.slots - len(self._rid)
                self._rid, self._sent, self._count, self._pending = (
                    np.concatenate([a, np.zeros((grow, *a.shape[1:]), a.dtype)])
                    for a in (self._rid, self._sent, self._count, self._pending))
            self._rid[slot], self._sent[slot], self._count[slot] = rid, 0, 0
            self._streams[rid] = slot
            self._index = None
            CODEC_STREAMS.set(len(self._streams))

    def drop(self, request_ids: Iterable[int]) -> None:
        """Streams the engine forgot (cancelled, failed): their slots are freed, nothing
        pending is decoded."""
        with self._lock:
            for rid in request_ids:
                self._close(int(rid))

    def retain(self, live: Iterable[int]) -> list[int]:
        """Close every audio stream not in `live` (the engine's streams now); returns them."""
        keep = {int(r) for r in live}
        with self._lock:
            gone = [rid for rid in self._streams if rid not in keep]
            for rid in gone:
                self._close(rid)
        return gone

    def _close(self, rid: int) -> None:
        if self._streams.pop(rid, None) is not None:
            self.decoder.close(str(rid))
            self._index = None
            CODEC_STREAMS.set(len(self._streams))

    def step(self, out: Frames) -> tuple[list[pb.AudioChunk], list[pb.StreamError]]:
        """Buffer this step's frames of the audio streams; decode the due ones in one
        batched call. A finishing EOS frame is dropped (not audio); a length-finished
        stream's last frame is audio; a finished stream's chunk is `last` (an empty one
        when nothing was pending) and its slot is freed."""
        chunks, errors, _ = self.step_costed(out)
        return chunks, errors

    def step_costed(self, out: Frames) -> tuple[list[pb.AudioChunk], list[pb.StreamError], StepCost]:
        """`step`, and what it cost (`StepCost`)."""
        if not self._streams or not len(out.request_ids):
            return [], [], StepCost()
        t0 = time.perf_counter()
        with self._lock:
            chunks, errors, audio_rows = self._step(out)
        return chunks, errors, StepCost(time.perf_counter() - t0, audio_rows)

    def _step(self, out: Frames) -> tuple[list[pb.AudioChunk], list[pb.StreamError], int]:
        """The step's audio rows found by one sorted search, their codes made by one
        `codes` call, checked and buffered by slot in array ops; the due streams decoded
        by one `decode` per distinct pending count."""
        if self._index is None:
            rids = np.fromiter(self._streams, dtype=np.uint64, count=len(self._streams))
            order = np.argsort(rids)
            self._index = rids[order], np.fromiter(self._streams.values(), np.int64, len(rids))[order]
        keys, key_slots = self._index
        ids = np.asarray(out.request_ids, dtype=np.uint64)
        at = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
        rows = np.flatnonzero(keys[at] == ids)
        if not rows.size:
            return [], [], 0
        slots, finished = key_slots[at[rows]], np.asarray(out.finished)[rows]
        errors: list[pb.StreamError] = []
        failed: list[int] = []  # slots
        audio = finished != _EOS  # a finishing EOS frame is not audio
        if audio.any():
            failed += self._buffer(slots[audio], np.asarray(out.frames)[rows[audio]], errors)
        if failed:
            keep = ~np.isin(slots, failed)
            slots, finished = slots[keep], finished[keep]
        count, last = self._count[slots], finished != _RUNNING
        due = last | (count >= np.where(self._sent[slots] == 0, self.first_chunk_frames, self.chunk_frames))
        chunks, decode_errors = self._decode(slots[due], count[due], last[due])
        return chunks, errors + decode_errors, int(rows.size)

    def _buffer(self, slots: np.ndarray, frames: np.ndarray, errors: list[pb.StreamError]) -> list[int]:
        """The frame rows' codes into the slots' pending codes; a stream whose codes are
        outside the codec's range (a model whose codebook vocabulary is wider than the
        codec's, e.g. CSM's 2051 ids vs Mimi's 2048, can sample an id no audio has) fails,
        its error naming the frame and codebook. Returns the failed streams' slots."""
        size = self.decoder.codec.codebook_size
        books, frames_at = self._pending.shape[1], self._count[slots]
        codes = np.asarray(self.codes(frames))  # [K, m]
        if codes.shape != (books, len(slots)):
            failed = slots.tolist()
            for slot in failed:
                errors.append(self._fail(int(self._rid[slot]), f"codec: the model's frames give codes of shape "
                                         f"{codes.shape}, the codec takes {books} codebooks a frame"))
            return failed
        self._pending[slots, :, frames_at] = codes.T
        self._count[slots] += 1
        bad = ((codes < 0) | (codes >= size)).any(axis=0)
        if not bad.any():
            return []
        failed = slots[bad].tolist()
        for j in np.flatnonzero(bad).tolist():
            slot, book = int(slots[j]), int(np.flatnonzero((codes[:, j] < 0) | (codes[:, j] >= size))[0])
            frame = int(self._sent[slot] + frames_at[j])
            errors.append(self._fail(int(self._rid[slot]), f"codec: frame {frame} codebook {book} has id "
                                     f"{int(codes[book, j])}, outside the codec's [0, {size}): the stream's audio "
                                     "ends here"))
        return failed

    def _decode(self, slots: np.ndarray, count: np.ndarray,
                last: np.ndarray) -> tuple[list[pb.AudioChunk], list[pb.StreamError]]:
        """The due streams (`slots`, their pending `count`, whether `last`): one `decode`
        per distinct count, its PCM made 16-bit by the decoder, a chunk a stream (an
        empty `last` one when nothing was pending)."""
        pcm: list[bytes] = [b""] * len(slots)
        ok = np.ones(len(slots), dtype=bool)
        errors: list[pb.StreamError] = []
        sizes = np.unique(count[count > 0])
        if sizes.size:
            t0 = time.perf_counter()
            for n in sizes.tolist():
                group = np.flatnonzero(count == n)
                try:  # int16 rows, little-endian as 16-bit PCM is on the wire
                    pcm16 = self.decoder.decode(slots[group], self._pending[slots[group], :, :n], pcm16=True)
                    samples = pcm16.numpy().astype("<i2", copy=False)
                except Exception as exc:  # the codec failed for the batch: those streams' audio ends
                    ok[group] = False
                    for slot in slots[group].tolist():
                        errors.append(self._fail(int(self._rid[slot]), f"codec decode failed: {exc}"))
                    continue
                for i, row in zip(group.tolist(), samples, strict=True):
                    pcm[i] = row.tobytes()
            CODEC_STEP_SECONDS.observe(time.perf_counter() - t0)
            CODEC_FRAMES.inc(int(count.sum()))
        if not ok.all():
            pcm = [data for data, kept in zip(pcm, ok.tolist(), strict=True) if kept]
            slots, count, last = slots[ok], count[ok], last[ok]
        rids, sent = self._rid[slots].tolist(), self._sent[slots].tolist()
        chunks = [pb.AudioChunk(request_id=rid, pcm=data, first_frame=first, frames=n, last=end)
                  for rid, data, first, n, end in zip(rids, pcm, sent, count.tolist(), last.tolist(), strict=True)]
        self._sent[slots] += count
        self._count[slots] = 0
        for rid, end in zip(rids, last.tolist(), strict=True):
            if end:
                self._close(rid)
        return chunks, errors

    def _fail(self, rid: int, message: str) -> pb.StreamError:
        self._close(rid)
        CODEC_FAILURES.inc()
        if self.on_fail is not None:
            self.on_fail(rid)
        return pb.StreamError(request_id=rid, status=pb.INTERNAL, message=message)
