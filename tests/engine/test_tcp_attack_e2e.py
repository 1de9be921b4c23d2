"""Issue 32, finding 1, end to end: a unit on `--transfer tcp` (LB + P + D as `pdunit
local` runs them) streams greedy frames while an attacker, once without the unit's
secret and once with it (an insider), sends D's tcp KV listener a BEGIN for a request
id D never reserved over the whole pool, then rows of garbage for every slot. Before
the fix this overwrote the live stream's KV (713 of 800 frames wrong, no error); now
every attempt is refused and counted, and the stream's frames equal a run without
the attack."""

from __future__ import annotations

import socket
import threading

import grpc
import numpy as np
import pytest
import torch

from pdunit.bench.report import scrape_metrics
from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.model.config import torch_dtype
from pdunit.engine.ports import free_port
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.security import read_secret_file
from pdunit.engine.transfer import tcp
from pdunit.engine.transfer.base import CAPABILITY_BYTES, PoolGeometry
from tests.engine.unit_client import load, random_prompt, stream

POOL_TOKENS = 2048  # the tiny model's whole pool is 4 MiB: one forged chunk covers it
PROMPT = random_prompt(150, seed=32)
PARAMS = dict(max_frames=240, min_frames=240)


@pytest.fixture(scope="module")
def tcp_unit():
    d_metrics = free_port()
    cfg = LocalConfig(mode="pd", transfer="tcp", pool_tokens=POOL_TOKENS, cache_tokens=4096, lb_port=0,
                      guard=False, log_level="error", extra_decode_args=["--metrics-port", str(d_metrics)])
    with LocalUnit(cfg) as unit:
        unit.d_metrics_port = d_metrics
        yield unit


def _forge(host: str, port: int, geometry: PoolGeometry, secret: bytes | None, rid: int) -> None:
    """The attack as found: BEGIN for a request id D never reserved, with slots over
    the whole pool, then every slot's rows, with a made-up capability."""
    slots = np.arange(geometry.n_slots, dtype="<i8")
    rows = torch.full((geometry.n_layers, 2, geometry.n_slots, geometry.n_kv_heads, geometry.head_dim), 7.0,
                      dtype=geometry.dtype).view(torch.uint8).numpy().tobytes()
    capability = b"\x5a" * CAPABILITY_BYTES
    lock = threading.Lock()
    with socket.create_connection((host, port), timeout=10) as s:
        try:
            if secret is not None:
                tcp.client_handshake(s, secret, "attacker")
            tcp._send(s, lock, tcp.BEGIN, rid, a=slots.size, c=2**62, payload=slots.tobytes(),
                      capability=capability)
            tcp._send(s, lock, tcp.CHUNK, rid, a=0, b=slots.size, c=60_000, payload=rows, capability=capability)
            if secret is not None:  # an authenticated peer stays connected: read D's two answers
                for _ in range(2):
                    head = bytearray(tcp.HEADER.size)
                    tcp._recv_exact(s, memoryview(head))
                    typ, plen = tcp.HEADER.unpack(head)[2], tcp.HEADER.unpack(head)[-1]
                    tcp._recv_exact(s, memoryview(bytearray(plen)))
                    assert typ == tcp.ABORTED
                return
            while s.recv(1 << 16):  # D cuts a peer without the secret off
                pass
        except (BrokenPipeError, ConnectionResetError):
            assert secret is None, "D cut off the peer that holds the unit's secret"


def test_a_forged_begin_during_a_live_stream_changes_nothing(tcp_unit):
    baseline, base_last = stream(tcp_unit.url, PROMPT, **PARAMS)
    assert base_last.get("done") and len(baseline) == PARAMS["max_frames"]

    d = pbg.DecodeStub(grpc.insecure_channel(f"unix:{tcp_unit.sock('decode')}"))
    hello = d.Hello(pb.HelloRequest(), timeout=5)
    g = hello.geometry
    geometry = PoolGeometry(g.n_layers, g.n_kv_heads, g.head_dim, torch_dtype(g.dtype, pool=True), g.n_slots,
                            g.page_size)
    desc = next(t for t in hello.transports if t.mode == "tcp")
    secret = read_secret_file(tcp_unit.unit_secret_file)
    before = scrape_metrics(tcp_unit.d_metrics_port)

    result: dict = {}
    streaming = threading.Thread(target=lambda: result.update(out=stream(tcp_unit.url, PROMPT, **PARAMS)))
    streaming.start()
    attempts = 0
    while streaming.is_alive() or attempts < 2:
        for who in (None, secret):
            _forge(desc.params["host"], int(desc.params["port"]), geometry, who, rid=(1 << 62) + attempts)
            attempts += 1
    streaming.join()

    frames, last = result["out"]
    assert last.get("done"), last
    assert frames == baseline  # greedy: any landed row would change them
    after = scrape_metrics(tcp_unit.d_metrics_port)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta('pdunit_security_events_total{what="tcp_auth_failed"}') >= attempts // 2
    assert delta('pdunit_security_events_total{what="tcp_write_refused"}') >= attempts // 2
    info = load(tcp_unit.url)
    assert info.kv_mismatch_total == 0 and info.transfer_mode == "tcp"
