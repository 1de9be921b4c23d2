"""Proof (b) of PROTOCOL.md 2 cannot be forged (issue 32, finding 2): an instance id on a
message to D's socket (Hello, Reserve) is only a claim; D frees held pages by "P
restarted" only when P itself, on the socket D dials (`prefill_socket`), answers with a
new instance id. Driven on a DecodeEngine (real pool, CPU) with its gRPC handlers
called directly, and a fake P serving Info and Abort on a unix socket: Abort never
acks, like a P whose writer is wedged."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from pdunit.bench.fault_unit import (
    WEDGE_ID,
    FaultsConfig,
    Unit,
    marked_prompt,
    metric,
    proofs,
    stream_once,
)
from pdunit.engine import metrics as m
from pdunit.engine.decode.hub import FrameHub
from pdunit.engine.decode.worker import DecodeEngine, DecodeService
from pdunit.engine.grpc_server import unix_target
from pdunit.engine.kv.pool import PagePool
from pdunit.engine.model.loader import load_model
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.security import SECURITY_EVENTS
from pdunit.engine.transfer.base import KVReceiver, PoolGeometry

ROWS = 24


class WedgedPrefill(pbg.PrefillServicer):
    """A P that answers Info with its instance id and never acks an Abort."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id

    async def Info(self, request, context):  # noqa: N802 - gRPC names
        return pb.InfoReply(role="prefill", instance_id=self.instance_id)

    async def Abort(self, request, context):  # noqa: N802
        return pb.AbortReply(ack=False, instance_id=self.instance_id)


async def serve_prefill(sock: str, instance_id: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    pbg.add_PrefillServicer_to_server(WedgedPrefill(instance_id), server)
    server.add_insecure_port(unix_target(sock))
    await server.start()
    return server


class MemoryReceiver(KVReceiver):
    """D's pool in process memory: nothing in these tests writes rows."""

    mode = "host"

    def __init__(self, storage: torch.Tensor) -> None:
        self._storage = storage

    @property
    def storage(self) -> torch.Tensor:
        return self._storage

    def descriptors(self) -> list:
        return []


def decode_engine(p_sock: str, probe_interval_s: float) -> DecodeEngine:
    model = load_model("random:tiny:0")
    c = model.config
    storage = model.new_kv_storage(512)
    geometry = PoolGeometry(c.n_layers, c.n_kv_heads, c.head_dim, storage.dtype, 512, 1)
    return DecodeEngine(model, "random:tiny:0", geometry, PagePool(512, 1), MemoryReceiver(storage),
                        FrameHub(asyncio.get_running_loop()), p_sock, max_batch=8, cuda_graphs=False,
                        abort_resend_s=0.05, probe_interval_s=probe_interval_s)


def reserve_request(rid: int, sender: str) -> pb.ReserveRequest:
    return pb.ReserveRequest(request_id=rid, n_tokens=ROWS, total_tokens=ROWS + 8,
                             deadline_unix_ms=int(time.time() * 1000) + 600_000,
                             identity=pb.Identity(sender_instance=sender))


def forged_claims() -> float:
    return SECURITY_EVENTS.labels(what="forged_instance_claim")._value.get()


def released(proof: str) -> float:
    return m.D_HELD_RELEASED.labels(proof=proof)._value.get()


async def until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
def p_sock():
    d = tempfile.mkdtemp(prefix="pdrp", dir="/tmp")  # unix socket paths stay short
    yield str(Path(d) / "prefill.sock")
    shutil.rmtree(d, ignore_errors=True)


async def unit_with_held_request(p_sock: str, probe_interval_s: float):
    """D paired with P "p-one": request 1 failed (its pages held, P never acks), request
    2 reserved and live."""
    server = await serve_prefill(p_sock, "p-one")
    engine = decode_engine(p_sock, probe_interval_s)
    service = DecodeService(engine)
    loops = [asyncio.ensure_future(engine.probe_loop()), asyncio.ensure_future(engine.abort_loop())]
    await service.Hello(pb.HelloRequest(sender_instance="p-one"), None)
    assert (await service.Reserve(reserve_request(1, "p-one"), None)).status == pb.STATUS_OK
    assert (await service.Reserve(reserve_request(2, "p-one"), None)).status == pb.STATUS_OK
    engine.fail_transfer(1, pb.TRANSFER_FAILED, "test", "the write of request 1 wedged")
    assert 1 in engine.held and engine.pool.held_pages > 0
    return server, engine, service, loops


async def stop(server: grpc.aio.Server, loops: list[asyncio.Future]) -> None:
    for task in loops:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await server.stop(None)


def test_a_forged_hello_or_reserve_frees_no_held_page_and_fails_no_reservation(p_sock):
    async def scenario() -> None:
        server, engine, service, loops = await unit_with_held_request(p_sock, probe_interval_s=0.05)
        held_pages = engine.pool.held_pages
        events = forged_claims()
        # An attacker on D's socket claims that P restarted.
        await service.Hello(pb.HelloRequest(sender_instance="forged-new-p"), None)
        assert engine.pool.held_pages == held_pages and 1 in engine.held  # the claim alone moved nothing
        await until(lambda: forged_claims() > events, "D to check the claim with P and refuse it")
        reply = await service.Reserve(reserve_request(3, "forged-other-p"), None)
        assert reply.status == pb.INVALID and "forged-other-p" in reply.message
        await until(lambda: forged_claims() >= events + 2, "the forged Reserve's claim counted")
        assert engine.p_instance == "p-one"
        assert engine.pool.held_pages == held_pages and 1 in engine.held
        assert 2 in engine.reservations and 3 not in engine.reservations
        await stop(server, loops)

    asyncio.run(scenario())


def test_a_claim_while_p_does_not_answer_changes_nothing(p_sock):
    async def scenario() -> None:
        server, engine, service, loops = await unit_with_held_request(p_sock, probe_interval_s=0.05)
        await server.stop(None)  # P's socket answers nothing: the claim cannot be checked
        held_pages = engine.pool.held_pages
        await service.Hello(pb.HelloRequest(sender_instance="forged-new-p"), None)
        reply = await service.Reserve(reserve_request(3, "forged-new-p"), None)
        assert reply.status == pb.TRANSFER_FAILED and "did not answer" in reply.message
        assert engine.p_instance == "p-one"
        assert engine.pool.held_pages == held_pages and 1 in engine.held and 2 in engine.reservations
        events = forged_claims()
        server = await serve_prefill(p_sock, "p-one")  # the same P answers again: the claim was false
        # two messages made the one claim while it was pending: each is an event
        await until(lambda: forged_claims() >= events + 2, "the pending claim to be settled as forged")
        assert forged_claims() == events + 2
        assert engine.pool.held_pages == held_pages and 1 in engine.held
        await stop(server, loops)

    asyncio.run(scenario())


def test_a_reserve_without_a_sender_instance_is_refused(p_sock):
    async def scenario() -> None:
        server, engine, service, loops = await unit_with_held_request(p_sock, probe_interval_s=0.05)
        reply = await service.Reserve(reserve_request(4, ""), None)
        assert reply.status == pb.INVALID and "identity.sender_instance" in reply.message
        assert 4 not in engine.reservations
        await stop(server, loops)

    asyncio.run(scenario())


@pytest.mark.parametrize("told_by", ["hello", "probe"])
def test_a_real_p_restart_releases_held_pages_by_proof_b(p_sock, told_by):
    """A new P process on P's socket: D hears its id there and frees the old instance's
    held pages (proof b), failing its live reservations. With `hello` the periodic probe
    is too slow to be the one that sees it: the new P's Hello makes D ask at once."""

    async def scenario() -> None:
        probe_interval_s = 3600.0 if told_by == "hello" else 0.05
        server, engine, service, loops = await unit_with_held_request(p_sock, probe_interval_s)
        if told_by == "hello":
            loops[1].cancel()  # no abort re-sends either: only the Hello's claim can tell D
        before = released("new_instance")
        await server.stop(None)  # P exits ...
        server = await serve_prefill(p_sock, "p-two")  # ... and its restart serves the same socket
        if told_by == "hello":
            await service.Hello(pb.HelloRequest(sender_instance="p-two"), None)
        await until(lambda: engine.pool.held_pages == 0, "held pages released after P's restart")
        assert engine.p_instance == "p-two"
        assert released("new_instance") == before + 2  # request 1, and request 2 failed by the restart
        assert not engine.reservations and not engine.held
        assert (await service.Reserve(reserve_request(5, "p-two"), None)).status == pb.STATUS_OK
        assert (await service.Reserve(reserve_request(6, "p-one"), None)).status == pb.INVALID  # the dead P
        await stop(server, loops)

    asyncio.run(scenario())


# ------------------------------------------------------------------ real processes


@pytest.mark.timeout(240)
def test_in_a_real_unit_a_forged_restart_keeps_pages_held_and_ps_restart_frees_them(tmp_path):
    """A local unit (bench/fault_unit.py's, P with fault injection): a wedged write leaves
    pages held (P never acks); an attacker on D's socket sends Hello and Reserve
    claiming a new P; D refuses both and the pages stay held. Then P is restarted (a new
    process on P's socket): its instance frees them by proof (b)."""
    with Unit(FaultsConfig(), run_dir=str(tmp_path / "unit")) as unit:
        body = {"prompt": marked_prompt(WEDGE_ID, 48, seed=1), "max_frames": 8, "min_frames": 8}
        out = stream_once(httpx.Client(), unit.url, body, tag="wedge")
        assert out.code == "transfer_failed", out
        held = unit.wait(lambda: unit.d_info().held_pages, 30, "D holding the wedged request's pages")
        p_before = unit.d_info().peer_instance_id
        released_before = proofs(unit.d_metrics()).get("new_instance", 0)

        forged = "f" * 32
        unit._d.Hello(pb.HelloRequest(sender_instance=forged), timeout=5)
        reply = unit._d.Reserve(reserve_request(0xF0F0, forged), timeout=5)
        assert reply.status == pb.INVALID, reply
        unit.wait(lambda: metric(unit.d_metrics(), "pdunit_security_events_total") >= 2, 30,
                  "D refusing both forged claims")
        info = unit.d_info()
        assert info.held_pages == held and info.peer_instance_id == p_before
        assert proofs(unit.d_metrics()).get("new_instance", 0) == released_before

        unit.restart_p()
        unit.wait(lambda: unit.d_info().held_pages == 0, 30, "held pages freed by P's restart")
        assert unit.d_info().peer_instance_id not in ("", p_before)
        assert proofs(unit.d_metrics()).get("new_instance", 0) > released_before
