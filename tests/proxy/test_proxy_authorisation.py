"""The proxy trusts no client (issue 32.3): against a real proxy process, a second
session of the same uid (the allow-list admits it) cannot see D's regions, cannot copy
into D's pool without the reservation's capability, outside its slots or after its
revoke, cannot read D's memory as a source, and cannot cancel P's requests; through
the copy lane and the Copy RPC alike. Each refusal copies nothing and is counted."""

from __future__ import annotations

import os
import socket
import time
import urllib.request

import numpy as np
import pytest
import torch

from pdunit.engine.ports import free_port
from pdunit.engine.transfer.base import PoolGeometry, TransferError
from pdunit.engine.transfer.host import HostReceiver
from pdunit.engine.transfer.proxy import ProxyClient, ProxyReceiver, ProxySender
from tests.proxy.conftest import start_proxy, stop

GEO = PoolGeometry(n_layers=2, n_kv_heads=2, head_dim=4, dtype=torch.float16, n_slots=64, page_size=4)


def _deadline(ms: int = 30_000) -> int:
    return int(time.time() * 1000) + ms


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("proxy-auth")
    port = free_port()
    proc, sock = start_proxy(tmp, "--metrics-port", str(port))
    try:
        yield sock, port
    finally:
        stop(proc)


def _security_events(port: int, what: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    key = f'pdunit_security_events_total{{what="{what}"}} '
    return sum(float(line[len(key):]) for line in text.splitlines() if line.startswith(key))


@pytest.fixture
def unit(proxy):
    """D (ProxyReceiver), P (ProxySender attached to D's descriptor) and an intruder: a
    third session of the same uid that registered only a pool of its own."""
    sock, _ = proxy
    d = ProxyReceiver(GEO, "cpu", sock)
    p = ProxySender(d.descriptors()[0], GEO, "cpu", sock)
    intruder = ProxyClient(sock)
    own = HostReceiver(GEO)
    own.storage.fill_(3)
    own_region = intruder.register_host("mine", own.name, GEO)
    d.storage.fill_(-7)
    try:
        yield d, p, intruder, own, own_region
    finally:
        intruder.unregister(own_region)
        intruder.close()
        own.close()
        p.close()
        d.close()


def test_info_lists_only_the_callers_own_regions(unit):
    d, p, intruder, _, own_region = unit
    assert [r.region_id for r in intruder.info().regions] == [own_region]
    assert {r.region_id for r in d.client.info().regions} == {d.region, d.probe_region}
    assert all(len(rid) == 2 + 32 for rid in (d.region, d.probe_region, own_region))  # 128 random bits


@pytest.mark.parametrize("path", ["lane", "grpc"])
@pytest.mark.parametrize("attempt", ["no_capability", "capability_of_another_request",
                                     "slots_outside_the_grant", "forged_capability_no_region"])
def test_an_intruder_cannot_write_into_ds_pool(proxy, unit, path, attempt):
    _, port = proxy
    d, _, intruder, _, own_region = unit
    intruder.copy_lane = path == "lane"
    granted = np.arange(8, 16)
    capability = d.grant(41, granted, _deadline())
    other = d.grant(42, np.arange(16, 24), _deadline())
    rid, cap, region, slots = 41, b"", d.region, granted
    if attempt == "capability_of_another_request":
        cap = other
    elif attempt == "slots_outside_the_grant":
        cap, slots = capability, np.arange(12, 20)  # half inside, half in request 42's slots
    elif attempt == "forged_capability_no_region":
        cap, region = os.urandom(32), ""
    before = d.storage.clone()
    events = _security_events(port, "proxy_write_refused")
    with pytest.raises(TransferError, match="PERMISSION_DENIED"):
        intruder.copy(rid, own_region, np.arange(len(slots)), region, slots, _deadline(), capability=cap)
    assert torch.equal(d.storage, before)
    assert _security_events(port, "proxy_write_refused") == events + 1


@pytest.mark.parametrize("path", ["lane", "grpc"])
def test_a_revoked_grant_admits_no_write_any_more(unit, path):
    d, _, intruder, own, own_region = unit
    intruder.copy_lane = path == "lane"
    slots = np.arange(4, 8)
    capability = d.grant(43, slots, _deadline())
    intruder.copy(43, own_region, np.arange(4), "", slots, _deadline(), capability=capability)
    assert bool((d.storage[:, :, slots] == 3).all())  # the capability's holder may write
    d.revoke(43)  # COMMIT
    d.storage.fill_(-7)
    with pytest.raises(TransferError, match="FAILED_PRECONDITION.*grant ended"):
        intruder.copy(43, own_region, np.arange(4), "", slots, _deadline(), capability=capability)
    assert bool((d.storage == -7).all())


@pytest.mark.parametrize("path", ["lane", "grpc"])
def test_an_intruder_cannot_read_ds_memory_as_a_source(proxy, unit, path):
    _, port = proxy
    d, _, intruder, own, own_region = unit
    intruder.copy_lane = path == "lane"
    intruder.grant(own_region, 44, b"k" * 32, np.arange(GEO.n_slots), 0)
    events = _security_events(port, "proxy_foreign_region")
    for src in (d.probe_region, d.region):
        with pytest.raises(TransferError, match="PERMISSION_DENIED.*another session"):
            intruder.copy(44, src, np.arange(4), own_region, np.arange(4), _deadline(), capability=b"k" * 32)
    assert bool((own.storage == 3).all())
    assert _security_events(port, "proxy_foreign_region") == events + 2


def test_an_intruder_can_neither_grant_revoke_nor_unregister_ds_regions(unit):
    d, _, intruder, _, _ = unit
    with pytest.raises(TransferError, match="PERMISSION_DENIED"):
        intruder.grant(d.region, 45, b"x" * 32, np.arange(GEO.n_slots), 0, any_request=True)
    capability = d.grant(46, np.arange(4), _deadline())
    with pytest.raises(TransferError, match="PERMISSION_DENIED"):
        intruder.revoke(d.region, 46)
    with pytest.raises(TransferError, match="PERMISSION_DENIED"):
        intruder.unregister(d.region)
    assert {r.region_id for r in d.client.info().regions} == {d.region, d.probe_region}
    d.client.copy(46, d.probe_region, np.arange(4), "", np.arange(4), _deadline(), capability=capability)


def test_an_intruder_cannot_cancel_ps_requests(unit):
    """The finding: 40 cancelled ids failed the next real requests. Now a session's
    cancellations reach only its own jobs."""
    d, p, intruder, _, _ = unit
    ids = list(range(100, 140))
    quiesced, _ = intruder.quiesce(ids, cancel=True)
    assert quiesced
    src = torch.randn(GEO.shape()).to(GEO.dtype)
    for rid in ids[:5]:
        dst = np.arange(4) + 4 * (rid - 100) % GEO.n_slots
        p.write(rid, src, np.arange(4), dst, _deadline(), capability=d.grant(rid, dst, _deadline()))
        assert torch.equal(d.storage[:, :, dst], src[:, :, :4])
    # P's own quiesce still stops P's own later writes
    assert p.quiesce(104) is True
    with pytest.raises(TransferError, match="cancelled"):
        p.write(104, src, np.arange(4), np.arange(4), _deadline(), capability=d.grant(104, np.arange(4), _deadline()))


def test_the_copy_lane_refuses_a_session_of_another_process(tmp_path):
    """A token is its own process's: presented on a lane connection of another pid, it
    is refused (the lane checks SO_PEERCRED against the session's creds)."""
    from pdunit.engine.proto import proxy_pb2 as pb
    from pdunit.engine.proto.lane_framing import recv_frame, send_frame
    from pdunit.sidecars.nvlink_proxy.backend_host import HostBackend
    from pdunit.sidecars.nvlink_proxy.regions import AllowList, PeerCreds
    from pdunit.sidecars.nvlink_proxy.server import CopyLane, ProxyService

    service = ProxyService({"host": HostBackend()}, AllowList(uids=frozenset({os.getuid()})), 60.0)
    elsewhere = service.sessions.issue(PeerCreds(os.getpid() + 100_000, os.getuid(), os.getgid()))
    lane = CopyLane(str(tmp_path / "proxy.sock.copy"), service)
    lane.start()
    try:
        req = pb.CopyRequest(request_id=1, src_region="r-x", dst_region="r-y", session=elsewhere.token,
                             src_slots=np.arange(1, dtype="<i8").tobytes(),
                             dst_slots=np.arange(1, dtype="<i8").tobytes())
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            conn.connect(lane.path)
            send_frame(conn, req.SerializeToString())
            answer = pb.LaneReply.FromString(recv_frame(conn))
        assert answer.code == "PERMISSION_DENIED"
        assert "its own process" in answer.message
        assert service.jobs.running() == []
    finally:
        lane.stop(1.0)


def test_a_peer_that_handshakes_in_a_loop_cannot_grow_the_session_table():
    from pdunit.sidecars.nvlink_proxy.regions import PeerCreds, Sessions

    me = PeerCreds(os.getpid(), os.getuid(), os.getgid())
    sessions = Sessions(max_sessions=3)
    owner = sessions.issue(me)  # a session that registered regions

    def in_use(s):
        return s is owner

    for _ in range(20):
        latest = sessions.issue(me, in_use)
    assert len(sessions) == 3
    assert sessions.lookup(owner.token) is owner and sessions.lookup(latest.token) is latest


def test_ds_probe_region_takes_writes_only_with_the_probe_capability_of_its_descriptor(proxy, unit):
    sock, _ = proxy
    d, p, _, _, _ = unit
    src = torch.randn(GEO.shape()).to(GEO.dtype)
    src_sum, dst_sum = p.probe(src, np.arange(4), request_id=1 << 63)
    assert src_sum == dst_sum
    forged = d.descriptors()[0]
    forged.params["probe_capability"] = os.urandom(32).hex()
    intruder = ProxySender(forged, GEO, "cpu", sock)
    try:
        d.probe_storage.fill_(9)
        with pytest.raises(TransferError, match="PERMISSION_DENIED.*wrong write capability"):
            intruder.probe(src, np.arange(4), request_id=(1 << 63) + 1)
        assert bool((d.probe_storage == 9).all())
    finally:
        intruder.close()
