"""D's COMMIT (engine/decode/worker.py): the first frame goes to the LB with the COMMIT,
not with D's next step, exactly once; a first frame that ends the stream never enters
the batch. Driven on a DecodeEngine with the real pool, batcher and step code (CPU), a
hub that records what D publishes, and rows written into D's storage as P would.

The rows come from a generator seeded by the request id, never torch's global one (whatever ran
before in the process moves that), and every test that counts a stream's frames sets
min_frames = max_frames: a stream of random KV samples EOS now and then (1 in ~1024 per
frame), and an EOS past min_frames ends it early."""

from __future__ import annotations

import numpy as np
import torch

from pdunit.engine.decode.worker import DecodeEngine
from pdunit.engine.kv.checksum import kv_checksum
from pdunit.engine.kv.pool import PagePool
from pdunit.engine.model.loader import load_model
from pdunit.engine.packing import pack, unpack
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.transfer.base import KVReceiver, PoolGeometry

ROWS = 24


class RecordingHub:
    def __init__(self) -> None:
        self.messages: list[pb.StepFrames] = []

    def publish(self, message: pb.StepFrames) -> None:
        self.messages.append(message)

    def publish_error(self, request_id: int, status: int, message: str) -> None:
        self.messages.append(pb.StepFrames(errors=[pb.StreamError(request_id=request_id, status=status)]))

    def frames_of(self, rid: int) -> list[list[int]]:
        out = []
        for msg in self.messages:
            ids = unpack(msg.request_ids, "u8").tolist()
            if rid in ids and ids:
                rows = unpack(msg.frames, "i4").reshape(len(ids), -1)
                out.append(rows[ids.index(rid)].tolist())
        return out


class Storage(KVReceiver):
    """D's receiver as far as these tests need it: the pool tensor and the write grants."""

    mode = "host"

    def __init__(self, storage: torch.Tensor) -> None:
        self._storage = storage

    @property
    def storage(self) -> torch.Tensor:
        return self._storage

    def descriptors(self) -> list:
        return []


def engine() -> tuple[DecodeEngine, RecordingHub]:
    model = load_model("random:tiny:0")
    c = model.config
    pool = PagePool(512, 1)
    storage = model.new_kv_storage(512)
    geometry = PoolGeometry(c.n_layers, c.n_kv_heads, c.head_dim, storage.dtype, 512, 1)
    hub = RecordingHub()
    d = DecodeEngine(model, "random:tiny:0", geometry, pool, Storage(storage), hub,  # type: ignore[arg-type]
                     "unused.sock", max_batch=8, cuda_graphs=False)
    return d, hub


def commit(d: DecodeEngine, rid: int, first: np.ndarray, max_frames: int, min_frames: int = 0) -> pb.CommitReply:
    reply = d.reserve(pb.ReserveRequest(request_id=rid, n_tokens=ROWS, total_tokens=ROWS + max_frames,
                                        identity=pb.Identity(sender_instance="p")))
    assert reply.status == pb.STATUS_OK, reply
    slots = unpack(reply.dst_slots, "i8")
    rows = torch.randn(d.storage[:, :, :ROWS].shape, dtype=d.storage.dtype, generator=torch.Generator().manual_seed(rid))
    d.storage[:, :, torch.from_numpy(slots)] = rows
    return d.commit(pb.CommitRequest(
        request_id=rid, first_frame=pack(first, "i4"), checksum=kv_checksum(d.storage, slots), checksum_sample=1,
        sampling=pb.Sampling(max_frames=max_frames, min_frames=min_frames), prompt_tokens=ROWS,
        identity=pb.Identity(sender_instance="p")))


def test_the_first_frame_goes_out_with_the_commit_and_only_once():
    d, hub = engine()
    first = np.arange(11, dtype=np.int32)
    assert commit(d, 7, first, max_frames=4, min_frames=4).status == pb.STATUS_OK
    assert hub.frames_of(7) == [first.tolist()]  # before any decode step ran
    assert "first_frame_step" in hub.messages[0].stamps[7].ns
    while d._step_once():
        pass
    frames = hub.frames_of(7)
    assert len(frames) == 4 and frames[0] == first.tolist()  # exactly max_frames, the first once
    assert d.pool.state_of(7) is None  # finished: pages back


def test_a_first_frame_that_ends_the_stream_never_enters_the_batch():
    d, hub = engine()
    eos = np.full(11, 5, dtype=np.int32)
    eos[0] = d.model.config.eos_id
    assert commit(d, 9, eos, max_frames=10).status == pb.STATUS_OK
    (msg,) = hub.messages
    assert unpack(msg.finished, "u1").tolist() == [1]  # FINISHED_EOS
    assert d.pool.state_of(9) is None and len(d.batcher) == 0
    assert not d._step_once()  # nothing to decode


def test_a_one_frame_stream_ends_at_commit_with_its_pages_freed():
    d, hub = engine()
    assert commit(d, 3, np.zeros(11, dtype=np.int32), max_frames=1).status == pb.STATUS_OK
    assert unpack(hub.messages[0].finished, "u1").tolist() == [2]  # FINISHED_LENGTH
    assert d.pool.free_pages == d.pool.n_pages


def test_a_cancel_right_after_commit_stops_the_stream():
    d, hub = engine()
    assert commit(d, 5, np.zeros(11, dtype=np.int32), max_frames=50).status == pb.STATUS_OK
    assert d.cancel(5) is True  # found in the batcher, not lost between reservation and batch
    while d._step_once():
        pass
    assert len(hub.frames_of(5)) == 1 and d.pool.state_of(5) is None


def _admit_waits() -> float:
    from pdunit.engine import metrics as m

    return next(s.value for s in m.D_ADMIT_WAIT_SECONDS.collect()[0].samples if s.name.endswith("_count"))


def test_a_stream_committed_into_a_full_batch_sends_its_first_frame_when_it_joins_a_step():
    d, hub = engine()  # --max-batch 8
    waits = _admit_waits()
    for rid in range(1, 9):  # all 8 end at the same step: min_frames = max_frames, so no early EOS
        assert commit(d, rid, np.full(11, rid, dtype=np.int32), max_frames=6, min_frames=6).status == pb.STATUS_OK
    assert all(len(hub.frames_of(rid)) == 1 for rid in range(1, 9))  # room: out with the commit
    late = np.full(11, 42, dtype=np.int32)
    assert commit(d, 99, late, max_frames=6, min_frames=6).status == pb.STATUS_OK
    assert hub.frames_of(99) == []  # the batch is full: no frame yet, so no gap inside the stream
    joined = None
    while d._step_once():
        if joined is None and hub.frames_of(99):
            joined = len(hub.messages)
            assert all(d.pool.state_of(rid) is None for rid in range(1, 9))  # it took a finished stream's room
    frames = hub.frames_of(99)
    assert len(frames) == 6 and frames[0] == late.tolist()  # its first frame once, then its own steps
    first_msg = next(msg for msg in hub.messages if 99 in unpack(msg.request_ids, "u8").tolist())
    assert "first_frame_step" in first_msg.stamps[99].ns
    assert _admit_waits() - waits == 9  # every stream's wait for room is in the histogram
    assert d.pool.free_pages == d.pool.n_pages
