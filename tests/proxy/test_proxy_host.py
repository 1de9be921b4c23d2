"""nvlink-proxy over host shared memory, with real processes: registration, bit-exact
copies against kernels.reference, and every refused job copies nothing, through both
entry points of a copy job (the copy lane and the Copy RPC)."""

from __future__ import annotations

import os
import time
import urllib.request

import grpc
import numpy as np
import pytest
import torch

from pdunit.engine.ports import free_port
from pdunit.engine.proto import proxy_pb2 as pb
from pdunit.engine.proto import proxy_pb2_grpc as pb_grpc
from pdunit.engine.transfer.base import PoolGeometry, TransferError
from pdunit.engine.transfer.host import HostReceiver
from pdunit.engine.transfer.proxy import ProxyClient
from pdunit.kernels import reference
from tests.proxy.conftest import start_proxy, stop

GEO = PoolGeometry(n_layers=3, n_kv_heads=2, head_dim=8, dtype=torch.bfloat16, n_slots=128, page_size=1)
FAR = 2**62
CAP = bytes(range(32))  # the standing grant these tests' destination regions carry


def _pool(seed: int, geometry: PoolGeometry = GEO) -> HostReceiver:
    rx = HostReceiver(geometry)
    gen = torch.Generator().manual_seed(seed)
    rx.storage.copy_(torch.randn(geometry.shape(), generator=gen).to(geometry.dtype))
    return rx


@pytest.fixture(params=["lane", "grpc"])
def pools(proxy_socket, request):
    client = ProxyClient(proxy_socket, copy_lane=request.param == "lane")
    src, dst = _pool(1), _pool(2)
    src_id = client.register_host("p-pool", src.name, GEO)
    dst_id = client.register_host("d-pool", dst.name, GEO)
    client.grant(dst_id, 0, CAP, np.arange(GEO.n_slots), 0, any_request=True)
    try:
        yield client, src, src_id, dst, dst_id
    finally:
        for rid in (src_id, dst_id):
            client.unregister(rid)
        client.close()
        src.close()
        dst.close()


def _fragmented(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(GEO.n_slots)[:n], rng.permutation(GEO.n_slots)[:n]


def test_copy_job_is_bit_exact_against_reference(pools):
    client, src, src_id, dst, dst_id = pools
    s, d = _fragmented(50, 3)
    expected = dst.storage.clone()
    reference.copy_rows(src.storage, torch.from_numpy(s), expected, torch.from_numpy(d))
    reply = client.copy(11, src_id, s, dst_id, d, FAR, capability=CAP)
    assert reply.method == "host"
    assert reply.bytes == 50 * GEO.bytes_for(1)
    assert torch.equal(dst.storage.view(torch.int16), expected.view(torch.int16))


def test_verify_returns_checksums_of_both_regions(pools):
    client, src, src_id, dst, dst_id = pools
    s, d = _fragmented(9, 4)
    reply = client.copy(12, src_id, s, dst_id, d, FAR, verify=True, capability=CAP)
    from pdunit.engine.kv.checksum import kv_checksum

    assert reply.src_checksum == kv_checksum(src.storage, s)
    assert reply.dst_checksum == reply.src_checksum


@pytest.mark.parametrize("case", ["unknown_dst", "unknown_src", "dst_out_of_range", "src_negative",
                                  "length_mismatch", "duplicate_dst", "deadline_passed"])
def test_refused_job_copies_nothing(pools, case):
    client, src, src_id, dst, dst_id = pools
    s, d = _fragmented(10, 5)
    deadline, sid, did = FAR, src_id, dst_id
    want = {"unknown_dst": "NOT_FOUND", "unknown_src": "NOT_FOUND", "dst_out_of_range": "OUT_OF_RANGE",
            "src_negative": "OUT_OF_RANGE", "length_mismatch": "INVALID_ARGUMENT",
            "duplicate_dst": "INVALID_ARGUMENT", "deadline_passed": "DEADLINE_EXCEEDED"}[case]
    if case == "unknown_dst":
        did = "r-doesnotexist"
    elif case == "unknown_src":
        sid = "r-doesnotexist"
    elif case == "dst_out_of_range":
        d = d.copy()
        d[-1] = GEO.n_slots  # one past the end: every other row is valid
    elif case == "src_negative":
        s = s.copy()
        s[0] = -1
    elif case == "length_mismatch":
        d = d[:-1]
    elif case == "duplicate_dst":
        d = d.copy()
        d[1] = d[0]
    elif case == "deadline_passed":
        deadline = int(time.time() * 1000) - 10
    before = dst.storage.clone()
    with pytest.raises(TransferError) as err:
        client.copy(13, sid, s, did, d, deadline, capability=CAP)
    assert want in str(err.value)
    assert torch.equal(dst.storage.view(torch.int16), before.view(torch.int16))


def test_layout_mismatch_is_refused(proxy_socket, pools):
    client, src, src_id, dst, dst_id = pools
    other = PoolGeometry(3, 2, 4, torch.bfloat16, 128, 1)
    rx = _pool(9, other)
    try:
        oid = client.register_host("odd", rx.name, other)
        before = dst.storage.clone()
        with pytest.raises(TransferError, match="INVALID_ARGUMENT.*layout"):
            client.copy(14, oid, np.arange(3), dst_id, np.arange(3), FAR, capability=CAP)
        assert torch.equal(dst.storage.view(torch.int16), before.view(torch.int16))
        client.unregister(oid)
    finally:
        rx.close()


def test_registration_of_missing_segment_is_refused(proxy_socket):
    client = ProxyClient(proxy_socket)
    with pytest.raises(TransferError, match="NOT_FOUND.*does not exist"):
        client.register_host("ghost", "pdunit-no-such-segment", GEO)
    client.close()


def test_call_without_session_token_is_denied_and_copies_nothing(proxy_socket, pools):
    client, src, src_id, dst, dst_id = pools
    s, d = _fragmented(5, 6)
    before = dst.storage.clone()
    stub = pb_grpc.NvlinkProxyStub(grpc.insecure_channel(f"unix:{proxy_socket}"))
    req = pb.CopyRequest(request_id=15, src_region=src_id, dst_region=dst_id,
                         src_slots=s.astype("<i8").tobytes(), dst_slots=d.astype("<i8").tobytes())
    with pytest.raises(grpc.RpcError) as err:
        stub.Copy(req, metadata=(("x-pdunit-session", "forged-token"),), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert torch.equal(dst.storage.view(torch.int16), before.view(torch.int16))


def test_peer_not_on_allow_list_is_refused(tmp_path):
    proc, sock = start_proxy(tmp_path, "--allow-uids", str(os.getuid() + 4242))
    try:
        with pytest.raises(TransferError, match="not on the allow-list"):
            ProxyClient(sock)
    finally:
        stop(proc)


def test_quiesce_cancels_later_jobs_of_the_request(pools):
    client, src, src_id, dst, dst_id = pools
    rid = 21 if client.copy_lane else 121  # one proxy serves both params: cancelled ids persist
    s, d = _fragmented(8, 7)
    client.copy(rid, src_id, s, dst_id, d, FAR, capability=CAP)
    quiesced, running = client.quiesce([rid, rid + 1], cancel=True)
    assert quiesced and running == []
    before = dst.storage.clone()
    with pytest.raises(TransferError, match="FAILED_PRECONDITION.*cancelled"):
        client.copy(rid + 1, src_id, s[::-1].copy(), dst_id, d, FAR, capability=CAP)
    assert torch.equal(dst.storage.view(torch.int16), before.view(torch.int16))
    client.copy(rid + 2, src_id, s, dst_id, d, FAR, capability=CAP)  # other requests are unaffected
    assert client.in_flight() == []


def test_sigterm_stops_the_proxy_and_removes_its_sockets(tmp_path):
    port = free_port()
    proc, sock = start_proxy(tmp_path, "--metrics-port", str(port))
    try:
        client = ProxyClient(sock)
        rx = _pool(3)
        region = client.register_host("d", rx.name, GEO)
        client.grant(region, 1, CAP, np.arange(4, 8), 0)
        client.copy(1, region, np.arange(4), region, np.arange(4, 8), FAR, capability=CAP)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'pdunit_proxy_jobs_total{method="host",outcome="ok"} 1.0' in metrics
        assert "pdunit_proxy_regions 1.0" in metrics
        client.close()
        rx.close()
    finally:
        rc = stop(proc)
    assert rc == 0
    assert not any(os.path.exists(sock + ext) for ext in ("", ".auth", ".copy"))
    log = (tmp_path / "proxy.log").read_text()
    assert '"msg": "resolved config"' in log and '"msg": "proxy stopped"' in log
