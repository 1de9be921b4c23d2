"""The codec's batched call (issue 26): the stage hands the decoder one [B, K, n] array of
codes and the slots, checked once for the batch. Its PCM is bit-identical to the per-stream
path it replaced (reimplemented here as the reference: a list of frames a stream, a tensor
and a stack per call, the graphs' host padding, a per-stream split and 16-bit conversion)
for streams of different histories, chunks of 1 and 2 frames and padded graph buckets; bad
codes, slots and shapes are refused naming the stream."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pdunit.engine.audio.codec_stage import CodecStage
from pdunit.engine.audio.mimi_stream import MimiCodec, MimiStreamDecoder, to_pcm16
from pdunit.engine.audio.pcm import float_to_pcm16
from pdunit.engine.proto import pdunit_pb2 as pb
from tests.audio.test_codec_stage import EOS, LENGTH, RUN, Out, codec, eos_frame, frames, model

__all__ = ["codec", "model"]  # pytest fixtures, imported


def old_push_many(dec: MimiStreamDecoder, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`push_many` before issue 26: a tensor a stream, grouped by frames, stacked, the
    graphs' static inputs padded on the host from a list of slots, the PCM split a row a stream."""
    groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for sid, codes in batch.items():
        c = torch.as_tensor(codes)
        groups.setdefault(c.shape[1], []).append((sid, c))
    out = {}
    with torch.inference_mode():
        for n, group in groups.items():
            stacked = torch.stack([c for _, c in group]).to(torch.int64)
            slots = [dec._slot[s] for s, _ in group]
            if dec.graphs is not None and dec.use_graphs and dec.graphs.handles(n):
                pcm = old_graphs_decode(dec, slots, stacked)
            else:
                pcm = dec.push_slots(torch.tensor(slots), stacked)
            for (sid, _), chunk in zip(group, pcm.float().cpu().numpy(), strict=True):
                out[sid] = chunk
    return out


def old_graphs_decode(dec: MimiStreamDecoder, slots: list[int], codes: torch.Tensor) -> torch.Tensor:
    """`MimiGraphs.decode` before issue 26 (on a CPU: the static push, uncaptured)."""
    g, n, out = dec.graphs, codes.shape[-1], []
    if g._version != dec.state_version:
        g._entries.clear()
        g._version = dec.state_version
    for start in range(0, len(slots), g.buckets[-1]):
        part = slots[start : start + g.buckets[-1]]
        entry = g._entry(g.bucket(len(part)), n)
        host_slots = torch.full((entry.slots.shape[0],), dec.scratch_slot, dtype=torch.int64)
        host_slots[: len(part)] = torch.tensor(part, dtype=torch.int64)
        host_codes = torch.zeros(entry.codes.shape, dtype=torch.int64)
        host_codes[: len(part)] = codes[start : start + len(part)]
        entry.slots.copy_(host_slots)
        entry.codes.copy_(host_codes)
        out.append(dec.push_slots(entry.slots, entry.codes)[: len(part)].clone())
    return out[0] if len(out) == 1 else torch.cat(out)


class OldStage:
    """The codec stage's per-stream path before issue 26 (pending frames a list a stream,
    `codes` a stream, one `push_many` dict a step): its chunks as tuples."""

    def __init__(self, dec: MimiStreamDecoder, codes: Any, first: int, every: int) -> None:
        self.dec, self.codes, self.first, self.every = dec, codes, first, every
        self.streams: dict[int, tuple[list[int], list[np.ndarray]]] = {}

    def open(self, rid: int) -> None:
        self.dec.open(str(rid))
        self.streams[rid] = ([0], [])

    def step(self, out: Out) -> list[tuple[int, int, int, bool, bytes]]:
        due: dict[int, bool] = {}
        for rid, frame, code in zip(out.request_ids.tolist(), out.frames, out.finished.tolist(), strict=True):
            if rid not in self.streams:
                continue
            sent, pending = self.streams[rid]
            if code != EOS:
                pending.append(np.array(frame, copy=True))
            if code != RUN or len(pending) >= (self.first if sent[0] == 0 else self.every):
                due[rid] = code != RUN
        batch = {str(r): self.codes(np.stack(self.streams[r][1])) for r in due if self.streams[r][1]}
        pcm = old_push_many(self.dec, batch) if batch else {}
        chunks = []
        for rid, last in due.items():
            sent, pending = self.streams[rid]
            n = len(pending)
            chunks.append((rid, sent[0], n, last, float_to_pcm16(pcm[str(rid)]) if n else b""))
            sent[0] += n
            pending.clear()
            if last:
                self.dec.close(str(rid))
                del self.streams[rid]
        return chunks


def scenario() -> tuple[list[tuple[int, int]], list[Out]]:
    """Streams joining at different steps (opens: (step, id)), each with its own length and
    end (EOS or max frames), plus a frames-only stream (9) the stage never opened."""
    plan = {1: (0, 9, LENGTH), 2: (0, 5, EOS), 3: (1, 7, LENGTH), 4: (3, 4, EOS), 5: (4, 6, LENGTH), 6: (4, 3, EOS),
            7: (6, 5, EOS), 9: (0, 12, RUN)}
    rows = {rid: frames(100 + rid, n) for rid, (_, n, _) in plan.items()}
    steps = []
    for i in range(12):
        step = []
        for rid, (start, n, end) in plan.items():
            k = i - start
            if 0 <= k < n:
                step.append((rid, rows[rid][k], LENGTH if end == LENGTH and k == n - 1 else RUN))
            elif k == n and end == EOS:
                step.append((rid, eos_frame(), EOS))
        steps.append(Out(np.array([r for r, _, _ in step], dtype=np.uint64),
                         np.stack([f for _, f, _ in step]).astype(np.int32),
                         np.array([c for _, _, c in step], dtype=np.uint8)))
    opens = [(start, rid) for rid, (start, _, _) in plan.items() if rid != 9]
    return opens, steps


@pytest.mark.parametrize(("graphs", "first", "every"), [(True, 1, 2), (False, 1, 2), (True, 2, 1), (True, 1, 1)])
def test_the_batched_stage_gives_the_per_stream_paths_pcm_bit_for_bit(codec: MimiCodec, model, graphs: bool,
                                                                      first: int, every: int) -> None:
    """Graph buckets (2, 4) pad every call of 1 or 3 streams; streams of 5+ run in pieces."""
    def decoder() -> MimiStreamDecoder:
        return MimiStreamDecoder(codec, slots=4, graphs=graphs, buckets=(2, 4), graph_frames=2)

    new, old = CodecStage(decoder(), model.codec_codes, first, every), OldStage(decoder(), model.codec_codes,
                                                                               first, every)
    opens, steps = scenario()
    sizes = set()
    for i, out in enumerate(steps):
        for rid in [r for s, r in opens if s == i]:
            new.open(rid)
            old.open(rid)
        got, errors = new.step(out)
        assert not errors
        want = old.step(out)
        assert [(c.request_id, c.first_frame, c.frames, c.last, c.pcm) for c in got] == want
        sizes |= {c.frames for c in got}
    assert 1 in sizes and max(sizes) == max(first, every)
    assert new.decoder.open_streams == 0 and len(new) == 0
    assert new.decoder.state_version > 0  # the pools grew past 4 slots under running streams


def test_the_decoders_batched_call_refuses_bad_codes_naming_the_stream(codec: MimiCodec) -> None:
    d = codec.stream_decoder(graphs=True, buckets=(4,))
    slots = np.array([d.open(s) for s in ("a", "b", "c")])
    codes = np.zeros((3, 4, 2), dtype=np.int64)
    codes[1, 3, 1] = 32
    with pytest.raises(ValueError, match=r"stream 'b' frame 1 codebook 3 has id 32, outside \[0, 32\)"):
        d.decode(slots, codes)
    codes[1, 3, 1], codes[2, 0, 0] = 0, -1
    with pytest.raises(ValueError, match=r"stream 'c' frame 0 codebook 0 has id -1"):
        d.decode(slots, torch.as_tensor(codes))
    with pytest.raises(ValueError, match=r"shape \(3, 3, 2\)"):
        d.decode(slots, codes[:, :3])
    with pytest.raises(ValueError, match="one slot a stream"):
        d.decode(slots[:2], np.zeros((3, 4, 1), dtype=np.int64))
    with pytest.raises(ValueError, match="appears twice"):
        d.decode(np.array([slots[0], slots[0]]), np.zeros((2, 4, 1), dtype=np.int64))
    d.close("b")
    with pytest.raises(KeyError, match=rf"slot {slots[1]} \(row 1\) holds no open stream"):
        d.decode(slots, np.zeros((3, 4, 1), dtype=np.int64))
    with pytest.raises(KeyError, match=r"slot 99 \(row 0\)"):
        d.decode(np.array([99]), np.zeros((1, 4, 1), dtype=np.int64))
    assert d.graphs.replays == 0 and int(d._seen.sum()) == 0  # nothing was decoded


def test_the_batched_call_returns_one_host_array_a_row_a_stream(codec: MimiCodec) -> None:
    d = codec.stream_decoder(graphs=True, buckets=(4,))
    ref = codec.stream_decoder()
    slots = np.array([d.open(s) for s in ("a", "b", "c")])
    for s in ("a", "b", "c"):
        ref.open(s)
    codes = np.random.default_rng(0).integers(0, 32, size=(3, 4, 2))
    pcm = d.decode(slots, codes)
    assert pcm.device.type == "cpu" and pcm.dtype == torch.float32 and pcm.shape == (3, 2 * codec.samples_per_frame)
    want = ref.push_many({s: codes[i] for i, s in enumerate("abc")})
    assert all(np.abs(pcm[i].numpy() - want[s]).max() <= 1e-5 for i, s in enumerate("abc"))


def test_a_bad_frame_ends_only_its_stream_when_it_arrives_naming_the_frame(codec: MimiCodec, model) -> None:
    stage = CodecStage(codec.stream_decoder(), model.codec_codes, 1, 2)
    failed: list[int] = []
    stage.on_fail = failed.append
    for rid in (1, 2, 3):
        stage.open(rid)
    good = frames(20, 3)
    bad = good[1].copy()
    bad[3] = 33
    chunks, errors = stage.step(Out(np.array([1, 2, 3], np.uint64), good.astype(np.int32), np.zeros(3, np.uint8)))
    assert not errors and len(chunks) == 3
    rows = np.stack([good[0], bad, good[2]]).astype(np.int32)
    chunks, errors = stage.step(Out(np.array([1, 2, 3], np.uint64), rows, np.zeros(3, np.uint8)))
    assert chunks == [] and [(e.request_id, e.status) for e in errors] == [(2, pb.INTERNAL)]
    assert "frame 1 codebook 3 has id 33" in errors[0].message and failed == [2]
    assert 2 not in stage and 1 in stage and 3 in stage
    chunks, errors = stage.step(Out(np.array([1, 3], np.uint64), rows[[0, 2]], np.full(2, LENGTH, np.uint8)))
    assert not errors and [(c.request_id, c.first_frame, c.frames, c.last) for c in chunks] == [
        (1, 1, 2, True), (3, 1, 2, True)]


def test_the_decoders_16_bit_samples_are_pcm_py_s_bit_for_bit() -> None:
    rng = np.random.default_rng(3)
    halves = (np.arange(-40, 40) + 0.5) / 32767.0  # x 32767 lands near .5: the rounding's ties
    x = np.concatenate([rng.uniform(-1.5, 1.5, 5000), halves, [np.nan, np.inf, -np.inf, 1.0, -1.0, 0.0, -0.0]])
    x = x.astype(np.float32)
    assert to_pcm16(torch.from_numpy(x)).numpy().astype("<i2").tobytes() == float_to_pcm16(x)
    assert to_pcm16(torch.from_numpy(x).to(torch.bfloat16)).dtype == torch.int16
