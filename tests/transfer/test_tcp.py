"""TCP v3 (PROTOCOL.md 6) over loopback: bit-exact with several connections; D's
per-request state drops and counts late chunks; the deadline ends a request. Every
peer here authenticates and writes under a real grant; the refusals of peers that do
not are tests/transfer/test_tcp_security.py's."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch

from pdunit.engine.kv.checksum import kv_checksum
from pdunit.engine.transfer import tcp
from pdunit.engine.transfer.base import PoolGeometry, TransferError
from pdunit.engine.transfer.factory import make_receiver, make_sender
from pdunit.engine.transfer.options import unit_secret_option

GEO = PoolGeometry(n_layers=3, n_kv_heads=2, head_dim=8, dtype=torch.bfloat16, n_slots=256, page_size=1)
SECRET = b"test-unit-secret-0123456789abcdef"
SECRET_OPTS = {"unit_secret": unit_secret_option(SECRET)}


def _deadline(ms: int = 10_000) -> int:
    return int(time.time() * 1000) + ms


@pytest.fixture
def receiver():
    rx = make_receiver("tcp", GEO, "cpu", {"tcp_host": "127.0.0.1", "tcp_port": "0", **SECRET_OPTS})
    rx.storage.fill_(3)
    try:
        yield rx
    finally:
        rx.close()


class RawPeer:
    """Speaks the wire format directly, to send chunks a real sender never would. It
    authenticates with `secret` (None: it does not) and presents `capability`."""

    def __init__(self, rx, secret: bytes | None = SECRET, capability: bytes = b"") -> None:
        self.sock = socket.create_connection(("127.0.0.1", rx.port), timeout=10)
        self.lock = threading.Lock()
        self.capability = capability
        if secret is not None:
            tcp.client_handshake(self.sock, secret, "test")

    def send(self, typ, rid, **kw) -> None:
        tcp._send(self.sock, self.lock, typ, rid, **kw)

    def reply(self) -> tuple[int, bytes]:
        head = bytearray(tcp.HEADER.size)
        tcp._recv_exact(self.sock, memoryview(head))
        _m, _v, typ, _f, _rid, _a, _b, _c, _d, plen = tcp.HEADER.unpack(head)
        payload = bytearray(plen)
        if plen:
            tcp._recv_exact(self.sock, memoryview(payload))
        return typ, bytes(payload)

    def begin(self, rid, dst, deadline=None, flags=0) -> int:
        self.send(tcp.BEGIN, rid, a=len(dst), c=deadline or _deadline(), flags=flags,
                  payload=np.asarray(dst, dtype="<i8").tobytes(), capability=self.capability)
        return self.reply()[0]

    def chunk(self, rid, t0, rows: torch.Tensor, remaining_ms=5000) -> None:
        self.send(tcp.CHUNK, rid, a=t0, b=rows.shape[2], c=remaining_ms,
                  payload=rows.contiguous().view(torch.uint8).numpy().tobytes(), capability=self.capability)

    def close(self) -> None:
        self.sock.close()


def _wait(cond, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


def _rows(k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((GEO.n_layers, 2, k, GEO.n_kv_heads, GEO.head_dim), generator=gen).to(GEO.dtype)


def test_fragmented_transfer_over_several_connections_is_bit_exact(receiver):
    tx = make_sender(receiver.descriptors(), GEO, "cpu",
                     {"tcp_connections": "4", "tcp_chunk_tokens": "7", **SECRET_OPTS})
    try:
        src = torch.randn(GEO.shape()).to(GEO.dtype)
        rng = np.random.default_rng(0)
        s, d = rng.permutation(256)[:100], rng.permutation(256)[:100]
        tx.write(1, src, s, d, _deadline(), capability=receiver.grant(1, d, _deadline()))
        assert torch.equal(receiver.storage[:, :, d].view(torch.int16), src[:, :, s].view(torch.int16))
        rest = np.setdiff1d(np.arange(256), d)
        assert bool((receiver.storage[:, :, rest] == 3).all())
        assert receiver.state(1) == "completed"
        assert receiver.applied_chunks == 15  # ceil(100 / 7) chunks, spread over 4 connections
    finally:
        tx.close()


def test_completion_is_confirmed_with_the_receivers_checksum(receiver):
    tx = make_sender(receiver.descriptors(), GEO, "cpu", {"tcp_connections": "2", **SECRET_OPTS})
    try:
        src = torch.randn(GEO.shape()).to(GEO.dtype)
        slots = np.array([9, 1, 4])
        before = receiver.storage.clone()
        assert tx.probe(src, slots, 77) == kv_checksum(src, slots)
        assert torch.equal(receiver.probe_storage[:, :, :3], src[:, :, slots])
        assert torch.equal(receiver.storage, before)  # a probe never touches the pool
        assert 77 not in receiver.probe_grants  # its grant ended with it
    finally:
        tx.close()


def test_late_chunk_after_abort_is_dropped_and_counted(receiver):
    dst = [10, 20, 30, 40]
    peer = RawPeer(receiver, capability=receiver.grant(5, np.array(dst), _deadline()))
    try:
        assert peer.begin(5, dst) == tcp.BEGIN_OK
        peer.chunk(5, 0, _rows(2, 1))
        _wait(lambda: receiver.applied_chunks == 1)
        assert receiver.receiver_quiesced(5) is True  # D holds the pages: proof (c)
        assert receiver.state(5) == "aborted"
        before = receiver.storage.clone()
        peer.chunk(5, 2, _rows(2, 2))
        typ, payload = peer.reply()
        assert typ == tcp.ABORTED
        assert receiver.dropped["aborted"] == 1
        assert torch.equal(receiver.storage, before)
    finally:
        peer.close()


def test_chunk_for_an_unknown_request_is_dropped(receiver):
    peer = RawPeer(receiver, capability=bytes(32))
    try:
        before = receiver.storage.clone()
        peer.chunk(404, 0, _rows(1, 3))
        assert peer.reply()[0] == tcp.ABORTED
        assert receiver.dropped["unknown"] == 1
        assert torch.equal(receiver.storage, before)
    finally:
        peer.close()


def test_chunk_after_completion_is_dropped_as_late(receiver):
    peer = RawPeer(receiver, capability=receiver.grant(6, np.array([1, 2]), _deadline()))
    try:
        assert peer.begin(6, [1, 2]) == tcp.BEGIN_OK
        first = _rows(2, 4)
        peer.chunk(6, 0, first)
        assert peer.reply()[0] == tcp.COMPLETED
        peer.chunk(6, 0, _rows(2, 5))  # a replayed, stale chunk
        assert peer.reply()[0] == tcp.COMPLETED
        assert receiver.dropped["late"] == 1
        assert torch.equal(receiver.storage[:, :, [1, 2]], first)
    finally:
        peer.close()


def test_chunk_past_its_deadline_aborts_the_request(receiver):
    peer = RawPeer(receiver, capability=receiver.grant(7, np.array([50, 51]), _deadline()))
    try:
        assert peer.begin(7, [50, 51]) == tcp.BEGIN_OK
        before = receiver.storage.clone()
        peer.chunk(7, 0, _rows(2, 6), remaining_ms=-1)
        assert peer.reply()[0] == tcp.ABORTED
        assert receiver.state(7) == "aborted" and receiver.dropped["deadline"] == 1
        assert torch.equal(receiver.storage, before)
    finally:
        peer.close()


def test_abort_before_begin_refuses_the_request(receiver):
    capability = receiver.grant(8, np.arange(3), _deadline())
    receiver.abort(8)
    tx = make_sender(receiver.descriptors(), GEO, "cpu", SECRET_OPTS)
    try:
        before = receiver.storage.clone()
        with pytest.raises(TransferError, match="aborted"):
            tx.write(8, torch.randn(GEO.shape()).to(GEO.dtype), np.arange(3), np.arange(3), _deadline(),
                     capability=capability)
        assert torch.equal(receiver.storage, before)
    finally:
        tx.close()


def test_begin_with_slots_outside_the_pool_is_refused(receiver):
    peer = RawPeer(receiver, capability=receiver.grant(9, np.array([0, GEO.n_slots]), _deadline()))
    try:
        assert peer.begin(9, [0, GEO.n_slots]) == tcp.ABORTED
        assert receiver.state(9) == "unknown"
    finally:
        peer.close()


def test_sender_refuses_after_quiesce_and_after_deadline(receiver):
    tx = make_sender(receiver.descriptors(), GEO, "cpu", SECRET_OPTS)
    try:
        src = torch.randn(GEO.shape()).to(GEO.dtype)
        assert tx.quiesce(10) is True
        with pytest.raises(TransferError, match="cancelled"):
            tx.write(10, src, np.arange(2), np.arange(2), _deadline(),
                     capability=receiver.grant(10, np.arange(2), _deadline()))
        with pytest.raises(TransferError, match="deadline"):
            tx.write(11, src, np.arange(2), np.arange(2), int(time.time() * 1000) - 1,
                     capability=receiver.grant(11, np.arange(2), _deadline()))
        assert receiver.state(10) == "unknown" and receiver.state(11) == "unknown"
    finally:
        tx.close()
