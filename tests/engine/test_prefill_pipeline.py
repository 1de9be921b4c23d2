"""P's pipeline (engine/prefill/pipeline.py): RESERVE of the next batch and the transfers
of the previous one run while a forward does, and stopping P ends every request left
between the stages (D is told, the prefix lease is returned).

In-process: the real PrefillEngine, scheduler, prefix cache and tiny CPU model, with a
fake D (its Reserve/Commit/Cancel recorded) and a fake sender; each forward waits at a
gate the test opens, so "while the forward runs" is a state the test holds, not a race.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pdunit.engine.kv.prefix_cache import PrefixCache
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.packing import pack
from pdunit.engine.prefill import pipeline, worker
from pdunit.engine.prefill.scheduler import PrefillJob, PrefillScheduler
from pdunit.engine.proto import pdunit_pb2 as pb
from tests.engine.unit_client import wait_for


class FakeD:
    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def _record(self, what: str, rid: int) -> None:
        with self.lock:
            self.log.append((what, rid))

    def seen(self, what: str) -> list[int]:
        with self.lock:
            return [rid for w, rid in self.log if w == what]

    def Reserve(self, req, timeout):  # noqa: N802
        self._record("reserve", req.request_id)
        return pb.ReserveReply(status=pb.STATUS_OK, dst_slots=pack(np.arange(req.n_tokens, dtype=np.int64), "i8"))

    def Commit(self, req, timeout):  # noqa: N802
        self._record("commit", req.request_id)
        return pb.CommitReply(status=pb.STATUS_OK)

    def Cancel(self, req, timeout):  # noqa: N802
        self._record("cancel", req.request_id)
        return pb.CancelReply(found=True)


class FakeSender:
    mode = "host"

    def __init__(self, d: FakeD) -> None:
        self.d = d
        self.stall: dict[int, threading.Event] = {}  # request id -> released when set

    def write(self, request_id, src, src_slots, dst_slots, deadline_unix_ms, *, capability):
        if request_id in self.stall:
            assert self.stall[request_id].wait(20)
        self.d._record("write", request_id)

    def quiesce(self, request_id):
        return True

    def in_flight(self):
        return []

    def close(self):
        pass


class Gates:
    """Each forward blocks until the test opens its gate (forwards numbered from 0)."""

    def __init__(self, monkeypatch) -> None:
        self.opened: list[threading.Event] = [threading.Event() for _ in range(8)]
        self.entered: list[threading.Event] = [threading.Event() for _ in range(8)]
        self.calls = 0
        self.batch_sizes: list[int] = []
        real = pipeline.run_prefill

        def gated(model, storage, chunks, graphs=None):
            i = self.calls
            self.calls += 1
            self.batch_sizes.append(len(chunks))
            self.entered[i].set()
            assert self.opened[i].wait(20), f"forward {i} was never let through"
            return real(model, storage, chunks, graphs)

        monkeypatch.setattr(pipeline, "run_prefill", gated)


def gated_engine(monkeypatch, d: FakeD, max_batch_prompts: int,
                 reserve_concurrency: int = 1) -> tuple[worker.PrefillEngine, Gates]:
    """A P (not started) on the tiny CPU model whose forwards wait at gates, linked to
    `d` through a FakeSender, with batches of at most `max_batch_prompts` prompts."""
    gates = Gates(monkeypatch)
    model = load_model("random:tiny:0", device="cpu")
    e = worker.PrefillEngine(model, "random:tiny:0", "cpu", model.new_kv_storage(4096, device="cpu"),
                             PrefixCache(4096, 16), PrefillScheduler(max_batch_prompts, 4096), "d0.sock", "host", {},
                             reserve_concurrency=reserve_concurrency)
    link = e.links[0]
    link.stub, link.sender, link.instance = d, FakeSender(d), "d0-instance"  # type: ignore[assignment]
    link.pool_pages = link.free_pages = 1000
    return e, gates


@pytest.fixture(params=[1])
def engine(monkeypatch, request):
    d = FakeD()
    e, gates = gated_engine(monkeypatch, d, request.param)
    e.start()
    yield e, d, gates
    for g in gates.opened:
        g.set()
    e.stop()


def submit(e: worker.PrefillEngine, rid: int, replies: dict[int, pb.SubmitReply]) -> None:
    prompt = np.random.default_rng(rid).integers(0, 1000, size=(40, e.model.config.n_codebooks), dtype=np.int64)
    e.submit(PrefillJob(rid, prompt, SamplingParams(max_frames=8), int(time.time() * 1000) + 30_000, {},
                        done=lambda reply: replies.__setitem__(rid, reply)))


def test_next_batch_is_reserved_and_previous_batch_sent_while_a_forward_runs(engine):
    e, d, gates = engine
    replies: dict[int, pb.SubmitReply] = {}
    submit(e, 1, replies)
    assert gates.entered[0].wait(10)           # request 1's forward is running (held)
    submit(e, 2, replies)
    wait_for(lambda: d.seen("reserve") == [1, 2], what="request 2 reserved during request 1's forward")
    assert d.seen("write") == []
    gates.opened[0].set()
    assert gates.entered[1].wait(10)           # request 2's forward is running (held) ...
    wait_for(lambda: d.seen("commit") == [1], what="request 1 written and committed during request 2's forward")
    assert d.seen("write") == [1] and not gates.opened[1].is_set()
    wait_for(lambda: 1 in replies, what="request 1's reply")
    assert replies[1].status == pb.STATUS_OK
    gates.opened[1].set()
    wait_for(lambda: 2 in replies, what="request 2's reply")
    assert replies[2].status == pb.STATUS_OK and d.seen("commit") == [1, 2]


def gap_count() -> float:
    from pdunit.engine import metrics as m

    return next(s.value for s in m.P_FORWARD_GAP_SECONDS.collect()[0].samples if s.name.endswith("_count"))


def test_the_gap_between_forwards_counts_only_when_the_next_batch_was_waiting(engine):
    e, d, gates = engine
    replies: dict[int, pb.SubmitReply] = {}
    before = gap_count()
    submit(e, 1, replies)  # P idle: its forward starts when request 1 is reserved, no gap
    assert gates.entered[0].wait(10)
    submit(e, 2, replies)
    wait_for(lambda: d.seen("reserve") == [1, 2], what="request 2 reserved during forward 0")
    gates.opened[0].set()
    assert gates.entered[1].wait(10)  # request 2's batch was waiting: forward 0's end -> forward 1's start
    gates.opened[1].set()
    wait_for(lambda: len(replies) == 2, what="both replies")
    assert gap_count() == before + 1
    submit(e, 3, replies)  # P idle again: waiting for work is not a gap
    assert gates.entered[2].wait(10)
    gates.opened[2].set()
    wait_for(lambda: len(replies) == 3, what="request 3's reply")
    assert gap_count() == before + 1


def test_stop_ends_requests_left_between_stages_and_tells_d(engine):
    e, d, gates = engine
    replies: dict[int, pb.SubmitReply] = {}
    submit(e, 1, replies)
    assert gates.entered[0].wait(10)
    submit(e, 2, replies)
    wait_for(lambda: d.seen("reserve") == [1, 2], what="request 2 reserved")
    stopper = threading.Thread(target=e.stop)
    stopper.start()
    time.sleep(0.2)  # stop() is now waiting for the forward in progress
    gates.opened[0].set()
    stopper.join(30)
    assert not stopper.is_alive()
    # request 2 never ran: D was told, the client got a clear answer, P's cache holds no pin
    assert 2 in d.seen("cancel") and 2 not in d.seen("write")
    assert replies[2].status == pb.CANCELLED and "shutting down" in replies[2].message
    assert 1 in replies  # computed before the stop: written and committed, or ended the same way
    assert e.cache.stats()["pinned_blocks"] == 0


@pytest.mark.parametrize("engine", [3], indirect=True)
def test_requests_reserved_during_a_forward_all_go_into_the_next_one(engine):
    e, d, gates = engine
    replies: dict[int, pb.SubmitReply] = {}
    submit(e, 1, replies)
    assert gates.entered[0].wait(10)
    for rid in (2, 3, 4, 5):
        submit(e, rid, replies)
    # the next batch holds 3 prompts: requests 2-4 go into it, 5 is reserved too (D's
    # verdict before the wait for room: issue 24) and waits for room reserved
    wait_for(lambda: d.seen("reserve") == [1, 2, 3, 4, 5], what="requests 2-5 reserved during forward 0")
    time.sleep(0.1)
    assert d.seen("reserve") == [1, 2, 3, 4, 5]
    gates.opened[0].set()
    assert gates.entered[1].wait(10)
    gates.opened[1].set()
    gates.opened[2].set()
    wait_for(lambda: len(replies) == 5, what="every reply")
    assert gates.batch_sizes == [1, 3, 1]
    assert all(r.status == pb.STATUS_OK for r in replies.values())


def test_a_stalled_write_holds_up_only_its_own_request(engine):
    e, d, gates = engine
    stalled = threading.Event()
    e.links[0].sender.stall[1] = stalled  # type: ignore[union-attr]
    for g in gates.opened:
        g.set()
    replies: dict[int, pb.SubmitReply] = {}
    for rid in (1, 2, 3):
        submit(e, rid, replies)
    wait_for(lambda: 2 in replies and 3 in replies, what="requests 2 and 3 committed while 1's write stalls")
    assert replies[2].status == replies[3].status == pb.STATUS_OK and 1 not in replies
    stalled.set()
    wait_for(lambda: 1 in replies, what="request 1 after its write resumed")
    assert replies[1].status == pb.STATUS_OK and sorted(d.seen("commit")) == [1, 2, 3]


def test_a_request_whose_deadline_passes_before_its_forward_gets_no_forward_and_no_write(engine):
    e, d, gates = engine
    e.links.transfer_deadline_ms = 300  # RESERVE-to-COMMIT bound, the wait for the forward included
    replies: dict[int, pb.SubmitReply] = {}
    submit(e, 1, replies)
    assert gates.entered[0].wait(10)
    submit(e, 2, replies)
    wait_for(lambda: d.seen("reserve") == [1, 2], what="request 2 reserved during forward 0")
    time.sleep(0.5)  # forward 0 outlives both requests' deadlines
    gates.opened[0].set()
    wait_for(lambda: 1 in replies and 2 in replies, what="both replies")
    assert replies[2].status == pb.DEADLINE_EXCEEDED and "before its forward" in replies[2].message
    assert replies[1].status == pb.DEADLINE_EXCEEDED and "before the write" in replies[1].message
    assert d.seen("write") == [] and gates.calls == 1  # no second forward, no write
    assert e.cache.stats()["pinned_blocks"] == 0


class SlowD(FakeD):
    """RESERVE takes 0.1 s; counts how many were in flight at once."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = self.peak = 0

    def Reserve(self, req, timeout):  # noqa: N802
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        time.sleep(0.1)
        with self.lock:
            self.in_flight -= 1
        return super().Reserve(req, timeout)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_clump_queued_at_an_idle_p_goes_into_its_first_forward_with_concurrent_reserves(monkeypatch, concurrency):
    """Issue 31: a clump's RESERVEs go out together and its first forward holds the clump
    (before, one request at a time: the first forward held the first request alone)."""
    d = SlowD()
    e, gates = gated_engine(monkeypatch, d, 16, reserve_concurrency=concurrency)
    replies: dict[int, pb.SubmitReply] = {}
    for rid in (1, 2, 3, 4):
        submit(e, rid, replies)
    e.start()
    try:
        for g in gates.opened:
            g.set()
        wait_for(lambda: len(replies) == 4, what="every reply")
        assert all(r.status == pb.STATUS_OK for r in replies.values())
        assert d.seen("commit") and sorted(d.seen("commit")) == [1, 2, 3, 4]
        if concurrency == 4:
            assert d.peak == 4 and gates.batch_sizes == [4]
        else:
            assert d.peak == 1 and gates.batch_sizes[0] == 1
    finally:
        e.stop()


def test_a_group_larger_than_the_batch_waits_reserved_for_the_next_forward(monkeypatch):
    d = FakeD()
    e, gates = gated_engine(monkeypatch, d, 2, reserve_concurrency=4)
    replies: dict[int, pb.SubmitReply] = {}
    for rid in (1, 2, 3, 4):
        submit(e, rid, replies)
    e.start()
    try:
        assert gates.entered[0].wait(10)
        # 3 and 4 were reserved with the group and wait for room: no RESERVE left to make
        wait_for(lambda: sorted(d.seen("reserve")) == [1, 2, 3, 4], what="the group reserved")
        gates.opened[0].set()
        assert gates.entered[1].wait(10)
        gates.opened[1].set()
        wait_for(lambda: len(replies) == 4, what="every reply")
        assert gates.batch_sizes == [2, 2] and all(r.status == pb.STATUS_OK for r in replies.values())
    finally:
        for g in gates.opened:
            g.set()
        e.stop()


class RefusingD(FakeD):
    """Refuses the request ids in `refuse` with RATE_FLOOR (D's admission), grants the rest."""

    def __init__(self, refuse: set[int]) -> None:
        super().__init__()
        self.refuse = refuse

    def Reserve(self, req, timeout):  # noqa: N802
        if req.request_id in self.refuse:
            self._record("reserve", req.request_id)
            return pb.ReserveReply(status=pb.RATE_FLOOR, message="rate_floor: the floor would break")
        return super().Reserve(req, timeout)


@pytest.mark.parametrize("concurrency", [1, 3])
def test_a_refusal_queued_behind_requests_waiting_for_room_is_answered_during_the_forward(monkeypatch, concurrency):
    """Issue 24: D's verdict comes before P's wait for room in the open batch. With
    --reserve-concurrency 3, a refusal queued behind a granted request that waits for
    room is answered while the forward runs; with 1, it waits behind that one request."""
    d = RefusingD({4})
    e, gates = gated_engine(monkeypatch, d, 1, reserve_concurrency=concurrency)
    replies: dict[int, pb.SubmitReply] = {}
    e.start()
    try:
        submit(e, 1, replies)
        assert gates.entered[0].wait(10)  # forward 0 holds 1; 2 fills the next batch, 3 waits for room
        for rid in (2, 3, 4):
            submit(e, rid, replies)
        wait_for(lambda: 3 in d.seen("reserve"), what="request 3 reserved before its wait for room")
        if concurrency > 1:
            wait_for(lambda: 4 in replies, what="request 4's refusal during forward 0")
            assert replies[4].status == pb.RATE_FLOOR and {"p_taken", "p_reserve_sent",
                                                           "p_reserve_answered"} <= set(replies[4].stamps.ns)
        else:
            time.sleep(0.2)
            assert 4 not in replies and d.seen("reserve") == [1, 2, 3]  # behind 3, as documented
        for g in gates.opened:
            g.set()
        wait_for(lambda: len(replies) == 4, what="every reply")
        assert replies[4].status == pb.RATE_FLOOR and d.seen("reserve") == [1, 2, 3, 4]
        assert all(replies[r].status == pb.STATUS_OK for r in (1, 2, 3)) and gates.batch_sizes == [1, 1, 1]
        assert 4 not in d.seen("cancel") and e.cache.stats()["pinned_blocks"] == 0  # a refusal holds nothing
    finally:
        for g in gates.opened:
            g.set()
        e.stop()
