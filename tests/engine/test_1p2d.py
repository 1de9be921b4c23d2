"""1P2D end to end through real processes: one P feeding two D's of the unit (`pdunit
local --mode 1p2d`), the LB subscribed to both. Same frames as the monolith, both D's
carry streams, a client that leaves frees pages in the D that held it, and a stopped D
gets no new requests while the other one serves them."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest

from pdunit.engine.grpc_server import sync_channel
from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.packing import pack
from pdunit.engine.prefill.scheduler import PrefillJob, PrefillScheduler
from pdunit.engine.prefill.worker import PrefillEngine
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from tests.engine.test_unit_e2e import REQUESTS, SMALL
from tests.engine.unit_client import load, random_prompt, stream, wait_empty, wait_for


@pytest.fixture(scope="module")
def unit_1p2d():
    with LocalUnit(LocalConfig(mode="1p2d", **SMALL)) as unit:
        yield unit


@pytest.fixture(scope="module")
def monolith_unit():
    with LocalUnit(LocalConfig(mode="monolith", **SMALL)) as unit:
        yield unit


def decoders(url: str) -> dict[str, dict]:
    return {d.name: d.model_dump() for d in load(url).decoders}


def run_all(url: str) -> list[tuple[list, dict]]:
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(lambda r: stream(url, r[0], **r[1]), REQUESTS))


def test_local_1p2d_starts_two_decoders_wired_to_one_prefill_and_the_lb(unit_1p2d):
    names = [c.name for c in unit_1p2d.children]
    assert names.count("prefill") == 1 and "decode-0" in names and "decode-1" in names
    argv = {c.name: c.argv for c in unit_1p2d.children}
    both = f"{unit_1p2d.sock('decode-0')},{unit_1p2d.sock('decode-1')}"
    for who in ("prefill", "lb"):
        assert argv[who][argv[who].index("--decode-socket") + 1] == both
    doc = load(unit_1p2d.url)
    assert doc.ready and doc.empty
    assert [d.name for d in doc.decoders] == ["decode-0", "decode-1"]
    assert doc.pool_pages == sum(d.pool_pages for d in doc.decoders) > 0


def test_1p2d_frames_identical_to_monolith_and_both_decoders_stream(unit_1p2d, monolith_unit):
    before = decoders(unit_1p2d.url)
    got = run_all(unit_1p2d.url)
    want = run_all(monolith_unit.url)
    for (frames, last), (mono_frames, mono_last), (_, params) in zip(got, want, REQUESTS, strict=True):
        assert last.get("done"), last
        assert mono_last.get("done"), mono_last
        if params.get("min_frames"):
            assert len(frames) == params["max_frames"]
        assert frames == mono_frames
    after = wait_for(lambda: (lambda d: d if all(x["decode_in_flight"] == 0 for x in d.values()) else None)(
        decoders(unit_1p2d.url)), what="both decoders idle")
    checked = {name: after[name]["kv_checks_total"] - before[name]["kv_checks_total"] for name in after}
    # every request's KV was checked by exactly one D, and each D got some of them
    assert sum(checked.values()) == len(REQUESTS)
    assert all(n >= 1 for n in checked.values()), checked
    assert all(d["kv_mismatch_total"] == 0 for d in after.values())


def test_disconnecting_client_frees_its_pages_in_the_decoder_that_held_it(unit_1p2d):
    before = wait_empty(unit_1p2d.url, what="an empty unit")
    free_before = {d.name: d.free_pages for d in before.decoders}
    body = {"prompt": random_prompt(100, seed=5), "max_frames": 1500, "min_frames": 1500}
    with httpx.stream("POST", f"{unit_1p2d.url}/v1/tts/stream", json=body, timeout=60) as r:
        assert r.status_code == 200
        rid = r.headers["x-pdunit-request-id"]
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        # a D lists the request from its RESERVE on (reserved, held, committing) and counts it
        # in decode_in_flight only once it joins the batch: wait for both, not the first (the
        # flake hunt's random-order run of a8fcea6 read one D listing it with 0 decoding)
        busy = wait_for(lambda: (lambda d: d if any(rid in x["requests"] and x["decode_in_flight"] == 1
                                                     for x in d.values()) else None)(
            decoders(unit_1p2d.url)), what="the stream decoding in one D")
        holder = next(name for name, d in busy.items() if rid in d["requests"])
        other = next(name for name in busy if name != holder)
        assert busy[holder]["decode_in_flight"] == 1 and busy[holder]["free_pages"] < free_before[holder]
        assert busy[other]["free_pages"] == free_before[other]
        assert busy[holder]["streams_in_flight"] == 1  # the LB knows which D holds it
    after = wait_for(lambda: (lambda d: d if d[holder]["free_pages"] == free_before[holder] else None)(
        decoders(unit_1p2d.url)), what="the holder's pages back in its free list")
    assert after[holder]["decode_in_flight"] == 0 and after[holder]["held_pages"] == 0
    assert wait_empty(unit_1p2d.url, what="an empty unit after the cancel")


def _submit(stub: pbg.PrefillStub, rid: int, seed: int) -> pb.SubmitReply:
    prompt = np.asarray(random_prompt(80, seed=seed), dtype=np.int64)
    return stub.Submit(pb.SubmitRequest(
        request_id=rid, prompt=pack(prompt, "i8"), rows=prompt.shape[0], cols=prompt.shape[1],
        sampling=pb.Sampling(max_frames=6, min_frames=6),
        deadline_unix_ms=int(time.time() * 1000) + 10_000), timeout=30)


def _decode_info(unit: LocalUnit, name: str) -> pb.InfoReply:
    return pbg.DecodeStub(sync_channel(unit.sock(name))).Info(pb.Empty(), timeout=5)


def test_a_stopped_decoder_gets_no_new_requests_the_other_serves_them(unit_1p2d):
    stopped = unit_1p2d.child("decode-0").proc
    checks_0 = _decode_info(unit_1p2d, "decode-0").kv_checks_total
    checks_1 = _decode_info(unit_1p2d, "decode-1").kv_checks_total
    prefill = pbg.PrefillStub(sync_channel(unit_1p2d.sock("prefill")))
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        # The LB is not ready while a D does not answer (readiness needs every D), so
        # the prompts go to P directly, as the LB would send them.
        replies = [_submit(prefill, rid=(0xD0 << 32) + i, seed=100 + i) for i in range(4)]
        assert [r.status for r in replies] == [pb.STATUS_OK] * 4, [r.message for r in replies]
        assert _decode_info(unit_1p2d, "decode-1").kv_checks_total - checks_1 == 4
        with pytest.raises(grpc.RpcError):
            _decode_info_fast(unit_1p2d, "decode-0")
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    # decode-0 never saw them; whatever it reserved for a RESERVE that P gave up on is
    # returned on proof, and the unit is ready and empty again
    assert _decode_info(unit_1p2d, "decode-0").kv_checks_total == checks_0
    wait_for(lambda: load(unit_1p2d.url).ready, what="the unit ready again")
    doc = wait_empty(unit_1p2d.url, timeout=30,
                   what="every D empty (held pages returned)")
    assert doc.held_pages == 0
    frames, last = stream(unit_1p2d.url, random_prompt(60, seed=7), max_frames=5, min_frames=5)
    assert last.get("done") and len(frames) == 5


def _decode_info_fast(unit: LocalUnit, name: str) -> pb.InfoReply:
    return pbg.DecodeStub(sync_channel(unit.sock(name))).Info(pb.Empty(), timeout=0.5)


def test_a_full_decoder_gets_no_new_request_and_no_room_anywhere_is_no_capacity():
    # decode-0's pool holds one long request: the second must go to decode-1 although
    # decode-0 is the first choice when both are idle
    cfg = LocalConfig(mode="1p2d", **{**SMALL, "pool_tokens": 1024})
    with LocalUnit(cfg) as unit:
        prefill = pbg.PrefillStub(sync_channel(unit.sock("prefill")))
        prompt = np.asarray(random_prompt(40, seed=9), dtype=np.int64)

        def submit(rid: int) -> pb.SubmitReply:
            return prefill.Submit(pb.SubmitRequest(
                request_id=rid, prompt=pack(prompt, "i8"), rows=40, cols=prompt.shape[1],
                sampling=pb.Sampling(max_frames=900, min_frames=900),
                deadline_unix_ms=int(time.time() * 1000) + 20_000), timeout=30)

        first, second, third = submit(1), submit(2), submit(3)
        assert first.status == second.status == pb.STATUS_OK
        # both pools are full now: the third finds no capacity anywhere, and says so
        assert third.status == pb.NO_CAPACITY
        held = {name: np.frombuffer(_decode_info(unit, name).request_ids, "<u8").tolist()
                for name in ("decode-0", "decode-1")}
        assert sorted(held["decode-0"] + held["decode-1"]) == [1, 2]
        assert held["decode-0"] and held["decode-1"]


# ---------------------------------------------------------------- P's choice of D, in-process


class FakeDecodeStub:
    """D's Reserve as P's worker calls it: answers `status` (or raises `error`)."""

    def __init__(self, status: int = pb.STATUS_OK, error: Exception | None = None) -> None:
        self.status, self.error, self.reserves = status, error, []

    def Reserve(self, req: pb.ReserveRequest, timeout: float) -> pb.ReserveReply:  # noqa: N802
        self.reserves.append(req)
        if self.error is not None:
            raise self.error
        slots = pack(np.arange(req.n_tokens, dtype=np.int64), "i8") if self.status == pb.STATUS_OK else b""
        return pb.ReserveReply(status=self.status, dst_slots=slots, message=pb.Status.Name(self.status))


class FakeSender:
    mode = "host"

    def __init__(self, quiesced: bool = True) -> None:
        self.quiesced, self.quiesce_calls = quiesced, []

    def quiesce(self, request_id: int) -> bool:
        self.quiesce_calls.append(request_id)
        return self.quiesced

    def in_flight(self) -> list[int]:
        return []


class Unreachable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED


def two_decoder_engine(*stubs: FakeDecodeStub) -> PrefillEngine:
    engine = PrefillEngine(None, "random:tiny:0", "cpu", None, None, PrefillScheduler(4, 4096),  # type: ignore[arg-type]
                           "d0.sock,d1.sock", "host", {})
    for link, stub in zip(engine.links, stubs, strict=True):
        link.stub, link.sender, link.instance = stub, FakeSender(), f"d{link.index}-instance"
        link.pool_pages = link.free_pages = 1000
    return engine


def job(rid: int) -> PrefillJob:
    return PrefillJob(rid, np.zeros((10, 11), dtype=np.int64), SamplingParams(max_frames=20), 0, {})


@pytest.mark.parametrize("refusal", [pb.NO_CAPACITY, pb.DRAINING])
def test_reserve_moves_to_the_next_decoder_when_the_first_refuses(refusal):
    first, second = FakeDecodeStub(refusal), FakeDecodeStub()
    engine = two_decoder_engine(first, second)
    r = engine.links.reserve(job(7))
    link, reply = r.link, r.reply
    assert reply.status == pb.STATUS_OK and link is engine.links[1]
    assert len(first.reserves) == len(second.reserves) == 1
    assert engine.links.routes[7] is engine.links[1]
    # the refusing D is the last choice for the next request
    assert engine.links.ordered()[0] is engine.links[1]


def test_reserve_moves_on_when_a_decoder_does_not_answer_and_prefers_the_one_that_does():
    first, second = FakeDecodeStub(error=Unreachable()), FakeDecodeStub()
    engine = two_decoder_engine(first, second)
    r = engine.links.reserve(job(1))
    link, reply = r.link, r.reply
    assert link is engine.links[1] and reply.status == pb.STATUS_OK
    assert not engine.links[0].responsive
    link = engine.links.reserve(job(2)).link
    assert link is engine.links[1] and len(first.reserves) == 1  # not asked again


def test_reserve_reports_the_refusal_when_no_decoder_has_room():
    engine = two_decoder_engine(FakeDecodeStub(pb.NO_CAPACITY), FakeDecodeStub(pb.NO_CAPACITY))
    r = engine.links.reserve(job(3))
    link, reply = r.link, r.reply
    assert link is None and reply.status == pb.NO_CAPACITY
    assert 3 not in engine.links.routes


def test_reserve_does_not_fall_back_on_errors_that_are_not_about_capacity():
    first, second = FakeDecodeStub(pb.INVALID), FakeDecodeStub()
    engine = two_decoder_engine(first, second)
    r = engine.links.reserve(job(4))
    link, reply = r.link, r.reply
    assert link is engine.links[0] and reply.status == pb.INVALID and second.reserves == []


def test_reserve_prefers_most_free_pages_then_takes_turns():
    engine = two_decoder_engine(FakeDecodeStub(), FakeDecodeStub())
    engine.links[0].free_pages = 100
    assert engine.links.reserve(job(1)).link is engine.links[1]
    engine.links[0].free_pages = engine.links[1].free_pages = 500
    engine.links[0].streams = engine.links[1].streams = 0
    engine.links.routes.clear()
    for link in engine.links:
        link.routed.clear()
    chosen = [engine.links.reserve(job(10 + i)).link.index for i in range(4)]
    assert sorted(chosen) == [0, 0, 1, 1]


def abort(engine: PrefillEngine, rid: int, d_instance: str) -> pb.AbortReply:
    return engine.abort(pb.AbortRequest(request_id=rid, identity=pb.Identity(
        sender_instance=d_instance, receiver_instance=engine.instance_id)))


def test_abort_from_a_decoder_the_request_left_does_not_cancel_it_there():
    engine = two_decoder_engine(FakeDecodeStub(error=Unreachable()), FakeDecodeStub())
    live = job(9)
    engine.pipeline.active[9] = live
    link = engine.links.reserve(live).link  # decode-0 timed out: the request moved to decode-1
    assert link is engine.links[1]
    reply = abort(engine, 9, "d0-instance")  # decode-0 expired its reservation later
    assert reply.ack and not live.cancelled
    assert engine.links[0].sender.quiesce_calls == [9]  # decode-0's sender can never write it now
    assert engine.links[1].sender.quiesce_calls == []
    reply = abort(engine, 9, "d1-instance")  # the D it lives on aborts it: cancelled
    assert reply.ack and live.cancelled


def test_abort_is_held_per_decoder_until_that_decoders_sender_proves_quiescence():
    engine = two_decoder_engine(FakeDecodeStub(), FakeDecodeStub())
    engine.links[1].sender.quiesced = False
    assert abort(engine, 5, "d0-instance").ack
    assert not abort(engine, 5, "d1-instance").ack
    assert engine.info().held_aborts == 1
    engine.links[1].sender.quiesced = True
    assert abort(engine, 5, "d1-instance").ack and engine.info().held_aborts == 0


def test_abort_from_an_unknown_decoder_needs_every_sender_to_prove_quiescence():
    engine = two_decoder_engine(FakeDecodeStub(), FakeDecodeStub())
    engine.links[0].sender.quiesced = False
    assert not abort(engine, 6, "someone-else").ack
    assert engine.links[0].sender.quiesce_calls == [6] and engine.links[1].sender.quiesce_calls == [6]
