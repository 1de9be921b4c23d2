"""The proxy's copy lane (SO_PEERCRED-checked socket, protobuf frames) and the per-job
stage timing: a refused peer copies nothing, a bad frame is answered and cut off, and
every job says where its time went, in the reply and in Prometheus."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch

from pdunit.engine.ports import free_port
from pdunit.engine.proto import proxy_pb2 as pb
from pdunit.engine.transfer.base import PoolGeometry
from pdunit.engine.transfer.factory import make_receiver, make_sender
from pdunit.engine.transfer.host import HostReceiver
from pdunit.engine.transfer.proxy import layout_pb
from pdunit.sidecars.nvlink_proxy.backend_host import HostBackend
from pdunit.sidecars.nvlink_proxy.regions import AllowList, PeerCreds
from pdunit.sidecars.nvlink_proxy.server import CopyLane, ProxyService
from tests.proxy.conftest import start_proxy, stop

GEO = PoolGeometry(n_layers=2, n_kv_heads=2, head_dim=8, dtype=torch.bfloat16, n_slots=64, page_size=1)
FAR = 2**62


def _pool(seed: int) -> HostReceiver:
    rx = HostReceiver(GEO)
    rx.storage.copy_(torch.randn(GEO.shape(), generator=torch.Generator().manual_seed(seed)).to(GEO.dtype))
    return rx


def _frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def _read_frame(conn: socket.socket) -> bytes:
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + struct.unpack("<I", buf[:4])[0]:
        chunk = conn.recv(65536)
        assert chunk, f"the lane closed after {len(buf)} bytes, before a whole frame"
        buf += chunk
    return buf[4:4 + struct.unpack("<I", buf[:4])[0]]


def _hung_up(conn: socket.socket) -> bool:
    """The proxy closed the connection (a reset when our unread frame was discarded)."""
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def in_process_service(tmp_path):
    """A ProxyService with two registered host pools, served only by a copy lane, whose
    allow-list does NOT contain this process's uid."""
    service = ProxyService({"host": HostBackend()}, AllowList(uids=frozenset({os.getuid() + 4242})), 60.0)
    me = service.sessions.issue(PeerCreds(os.getpid(), os.getuid(), os.getgid()))
    src, dst = _pool(1), _pool(2)
    regions = []
    for name, rx in (("p-pool", src), ("d-pool", dst)):
        region = service.regions.add(pb.RegisterRequest(
            name=name, kind=pb.HOST_SHM, layout=layout_pb(GEO), shm_name=rx.name,
            size_bytes=GEO.bytes_for(GEO.n_slots)), me)
        service.backends["host"].prepare(region)
        regions.append(region)
    lane = CopyLane(str(tmp_path / "proxy.sock.copy"), service)
    lane.start()
    try:
        yield service, lane, regions, dst
    finally:
        lane.stop(1.0)
        src.close()
        dst.close()


def test_copy_lane_refuses_a_peer_not_on_the_allow_list_and_copies_nothing(in_process_service):
    service, lane, (src_region, dst_region), dst = in_process_service
    before = dst.storage.clone()
    job = pb.CopyRequest(request_id=7, src_region=src_region.region_id, dst_region=dst_region.region_id,
                         src_slots=np.arange(4, dtype="<i8").tobytes(),
                         dst_slots=np.arange(8, 12, dtype="<i8").tobytes())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(lane.path)
        try:
            conn.sendall(_frame(job.SerializeToString()))
        except OSError:
            pass  # the proxy may already have hung up: the refusal frame is still readable
        answer = pb.LaneReply.FromString(_read_frame(conn))
        assert answer.code == "PERMISSION_DENIED"
        assert "not on the allow-list" in answer.message
        assert not answer.HasField("reply")
        assert _hung_up(conn)  # no job of this peer is ever read
    assert torch.equal(dst.storage.view(torch.int16), before.view(torch.int16))
    assert service.jobs.running() == []


def test_copy_lane_answers_a_frame_that_is_not_a_copy_request_and_hangs_up(proxy_socket):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(proxy_socket + ".copy")
        conn.sendall(_frame(b"\xff\xff\xff not protobuf"))
        answer = pb.LaneReply.FromString(_read_frame(conn))
        assert answer.code == "INVALID_ARGUMENT"
        assert "not a CopyRequest" in answer.message
        assert _hung_up(conn)


def test_a_write_says_where_its_time_went_without_double_counting(tmp_path):
    port = free_port()
    proc, sock = start_proxy(tmp_path, "--metrics-port", str(port))
    rx = tx = None
    try:
        rx = make_receiver("proxy", GEO, "cpu", {"proxy_socket": sock})
        tx = make_sender(rx.descriptors(), GEO, "cpu", {"proxy_socket": sock})
        src = torch.randn(GEO.shape()).to(GEO.dtype)
        t0 = time.perf_counter()
        deadline = int(time.time() * 1000) + 10_000
        cap = rx.grant(3, np.arange(30, 40), deadline)
        tx.write(3, src, np.arange(10, 20), np.arange(30, 40), deadline, capability=cap)
        wall = time.perf_counter() - t0
        stages = tx.last_stages
        inside = ("recv", "validate", "admit", "copy", "reply")
        assert set(inside) | {"prepare", "return", "total"} <= set(stages)
        assert all(v >= 0 for v in stages.values())
        # the stages are disjoint intervals of one write: together at most its total
        parts = sum(stages[k] for k in inside) + stages["prepare"] + stages["return"]
        assert parts <= stages["total"] + 1e-4 and stages["total"] <= wall
        assert dict(tx.last_reply.stage_seconds).keys() == set(inside)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for stage in inside:
            assert f'pdunit_proxy_job_stage_seconds_count{{stage="{stage}"}} 1.0' in metrics
    finally:
        for part in (tx, rx):
            if part is not None:
                part.close()
        stop(proc)


@pytest.mark.parametrize("flag, value, field", [("--copy-threads", "100", "copy_threads"),
                                                ("--copy-device", "sideways", "copy_device"),
                                                ("--copy-hint", "nt", "copy_hint")])
def test_a_bad_copy_kernel_flag_stops_the_proxy_naming_the_field(tmp_path, flag, value, field):
    out = subprocess.run([sys.executable, "-m", "pdunit.engine.cli", "proxy", "--socket",
                          str(tmp_path / "p.sock"), "--cuda", "off", flag, value],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 2
    # a value outside a field's choices is argparse's (it lists them), a bound the config's
    assert (f"invalid {field} (from {flag})" in out.stderr
            or f"argument {flag}: invalid choice: '{value}' (choose from" in out.stderr), out.stderr
    assert "Traceback" not in out.stderr
    assert not os.path.exists(tmp_path / "p.sock")
