"""The attack of issue 32 against D's tcp KV listener, and each of its variants: a peer
without the unit's secret, with a wrong one, too slow; an authenticated peer with no or
a wrong capability, with foreign slots, after COMMIT or revoke; a probe aimed at the
pool. Each is refused, D's pool keeps its bytes, and the refusal is a security event
(PROTOCOL.md 3.1 and 6). A legit transfer still works beside them."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from pdunit.engine.transfer import tcp
from pdunit.engine.transfer.base import PoolGeometry, TransferError, WriteGrants
from pdunit.engine.transfer.factory import make_receiver, make_sender
from pdunit.engine.transfer.options import unit_secret_option
from tests.transfer.test_tcp import GEO, SECRET, SECRET_OPTS, RawPeer, _deadline, _rows

ALL_SLOTS = np.arange(GEO.n_slots)


def events(what: str) -> float:
    return REGISTRY.get_sample_value("pdunit_security_events_total", {"what": what}) or 0.0


@pytest.fixture
def receiver():
    rx = make_receiver("tcp", GEO, "cpu", {"tcp_host": "127.0.0.1", "tcp_port": "0", **SECRET_OPTS})
    rx.storage.fill_(3)
    try:
        yield rx
    finally:
        rx.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    """Reads until the receiver closes the connection; True when it did."""
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def _begin_frame(rid: int, dst: np.ndarray, capability: bytes = b"") -> bytes:
    payload = capability + np.asarray(dst, dtype="<i8").tobytes()
    return tcp.HEADER.pack(tcp.MAGIC, tcp.VERSION, tcp.BEGIN, 0, rid, len(dst), 0, _deadline(), 0,
                           len(payload)) + payload


# ------------------------------------------------------------------ authentication
def test_the_issue_32_attack_is_cut_off_before_any_frame(receiver):
    """The attack as found: BEGIN for a request id D never reserved, with slots over the
    whole pool, then a chunk, on a connection that never authenticated."""
    before, failed = receiver.storage.clone(), events("tcp_auth_failed")
    sock = socket.create_connection(("127.0.0.1", receiver.port))
    try:
        rows = _rows(GEO.n_slots, 1).contiguous().view(torch.uint8).numpy().tobytes()
        sock.sendall(_begin_frame(87, ALL_SLOTS))
        try:
            sock.sendall(tcp.HEADER.pack(tcp.MAGIC, tcp.VERSION, tcp.CHUNK, 0, 87, 0, GEO.n_slots, 5000, 0,
                                         len(rows)) + rows)
        except (BrokenPipeError, ConnectionResetError):
            pass  # D already cut the connection
        assert _closed_by_peer(sock)
    finally:
        sock.close()
    assert events("tcp_auth_failed") == failed + 1
    assert receiver.auth_failures == 1
    assert receiver.state(87) == "unknown" and receiver.applied_chunks == 0
    assert torch.equal(receiver.storage, before)


def test_a_peer_with_a_wrong_secret_is_refused(receiver):
    failed = events("tcp_auth_failed")
    with pytest.raises(TransferError, match="do not share the unit's secret"):
        RawPeer(receiver, secret=b"another-units-secret-0123456789")
    deadline = time.monotonic() + 10
    while receiver.auth_failures < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events("tcp_auth_failed") == failed + 1
    with pytest.raises(TransferError, match="do not share the unit's secret"):
        make_sender(receiver.descriptors(), GEO, "cpu",
                    {"unit_secret": unit_secret_option(b"another-units-secret-0123456789")})


@pytest.mark.parametrize("trickle", [False, True])
def test_a_slow_handshake_is_cut_off(receiver, monkeypatch, trickle: bool):
    """Silent, or sending its proof a byte at a time: the handshake has one deadline."""
    monkeypatch.setattr(tcp, "AUTH_TIMEOUT_S", 0.3)
    failed = events("tcp_auth_failed")
    sock = socket.create_connection(("127.0.0.1", receiver.port))
    try:
        if trickle:
            proof = tcp.HEADER.pack(tcp.MAGIC, tcp.VERSION, tcp.PROOF, 0, 0, 0, 0, 0, 0, 64) + bytes(64)
            try:
                for byte in proof:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.05)
            except (BrokenPipeError, ConnectionResetError):
                pass
        assert _closed_by_peer(sock)
    finally:
        sock.close()
    assert events("tcp_auth_failed") == failed + 1


def test_p_refuses_a_receiver_that_does_not_hold_the_secret():
    """Both directions: a listener that takes any proof but cannot answer with the
    secret's MAC is not P's D."""
    server = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(tcp.HEADER.pack(tcp.MAGIC, tcp.VERSION, tcp.CHALLENGE, 0, 0, 0, 0, 0, 0, 32)
                         + bytes(32))
            tcp._recv_exact(conn, memoryview(bytearray(tcp.HEADER.size + 64)))
            conn.sendall(tcp.HEADER.pack(tcp.MAGIC, tcp.VERSION, tcp.WELCOME, 0, 0, 0, 0, 0, 0, 32) + bytes(32))
            conn.recv(1)

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    try:
        sock = socket.create_connection(server.getsockname())
        with sock, pytest.raises(TransferError, match="does not hold the unit's secret"):
            tcp.client_handshake(sock, SECRET, "impostor")
    finally:
        server.close()


def test_a_listener_without_a_secret_cannot_be_built():
    with pytest.raises(TransferError, match="--unit-secret-file"):
        tcp.TcpReceiver(GEO, "cpu", secret=b"")


# ------------------------------------------------------------------ capabilities
def test_begin_for_a_request_never_reserved_is_refused(receiver):
    """Authenticated, but no reservation: the pool-wide BEGIN of the attack."""
    before, refused = receiver.storage.clone(), events("tcp_write_refused")
    peer = RawPeer(receiver, capability=bytes(32))
    try:
        assert peer.begin(87, ALL_SLOTS) == tcp.ABORTED
        peer.chunk(87, 0, _rows(4, 2))
        assert peer.reply()[0] == tcp.ABORTED
    finally:
        peer.close()
    assert events("tcp_write_refused") == refused + 2
    assert receiver.state(87) == "unknown" and receiver.applied_chunks == 0
    assert torch.equal(receiver.storage, before)


@pytest.mark.parametrize("capability", [b"", bytes(32), b"\x01" * 32], ids=["none", "zeros", "guessed"])
def test_begin_without_the_reservations_capability_is_refused(receiver, capability: bytes):
    dst = np.array([4, 8, 15, 16])
    own = receiver.grant(5, dst, _deadline())
    before, refused = receiver.storage.clone(), events("tcp_write_refused")
    peer = RawPeer(receiver, capability=capability)
    try:
        assert peer.begin(5, dst) == tcp.ABORTED
    finally:
        peer.close()
    assert events("tcp_write_refused") == refused + 1
    assert receiver.state(5) == "unknown"  # the forgery did not touch the request either
    assert torch.equal(receiver.storage, before)
    # the reservation's own writer still gets through
    tx = make_sender(receiver.descriptors(), GEO, "cpu", SECRET_OPTS)
    try:
        src = torch.randn(GEO.shape()).to(GEO.dtype)
        tx.write(5, src, np.arange(4), dst, _deadline(), capability=own)
        assert torch.equal(receiver.storage[:, :, dst], src[:, :, :4])
        assert receiver.state(5) == "completed"
    finally:
        tx.close()


@pytest.mark.parametrize("dst", [[20, 21, 22, 23], [4, 8, 15], [4, 8, 15, 16, 23], [4, 8, 15, 99]],
                         ids=["anothers", "subset", "superset", "one_foreign"])
def test_the_right_capability_with_foreign_slots_is_refused(receiver, dst: list[int]):
    own = receiver.grant(6, np.array([4, 8, 15, 16]), _deadline())
    receiver.grant(7, np.array([20, 21, 22, 23]), _deadline())  # another request's pages
    before, refused = receiver.storage.clone(), events("tcp_write_refused")
    peer = RawPeer(receiver, capability=own)
    try:
        assert peer.begin(6, dst) == tcp.ABORTED
    finally:
        peer.close()
    assert events("tcp_write_refused") == refused + 1
    assert torch.equal(receiver.storage, before)


def test_a_chunk_with_a_wrong_capability_leaves_a_live_transfer_intact(receiver):
    dst = [30, 31, 32, 33]
    legit = RawPeer(receiver, capability=receiver.grant(8, np.array(dst), _deadline()))
    attacker = RawPeer(receiver, capability=bytes(32))
    try:
        assert legit.begin(8, dst) == tcp.BEGIN_OK
        refused = events("tcp_write_refused")
        attacker.chunk(8, 0, _rows(4, 66))
        assert attacker.reply()[0] == tcp.ABORTED
        assert events("tcp_write_refused") == refused + 1
        assert receiver.state(8) == "receiving" and receiver.applied_chunks == 0
        rows = _rows(4, 7)
        legit.chunk(8, 0, rows)
        assert legit.reply()[0] == tcp.COMPLETED
        assert torch.equal(receiver.storage[:, :, dst], rows)
    finally:
        legit.close()
        attacker.close()


def test_a_write_after_commit_is_refused(receiver):
    """D revokes at COMMIT: a replay of the finished transfer, even with its own
    capability, lands nowhere (the pages now decode)."""
    dst = np.array([40, 41, 42])
    own = receiver.grant(9, dst, _deadline())
    tx = make_sender(receiver.descriptors(), GEO, "cpu", SECRET_OPTS)
    try:
        src = torch.randn(GEO.shape()).to(GEO.dtype)
        tx.write(9, src, np.arange(3), dst, _deadline(), capability=own)
    finally:
        tx.close()
    receiver.revoke(9)  # DecodeEngine.commit
    before, refused = receiver.storage.clone(), events("tcp_write_refused")
    replay = RawPeer(receiver, capability=own)
    try:
        assert replay.begin(9, dst) == tcp.ABORTED
        replay.chunk(9, 0, _rows(3, 8))
        assert replay.reply()[0] == tcp.COMPLETED  # its terminal state, nothing applied
    finally:
        replay.close()
    assert events("tcp_write_refused") == refused + 2
    assert torch.equal(receiver.storage, before)


def test_a_revoke_ends_a_transfer_still_receiving(receiver):
    """D holds the pages (revoke at held): the stalled writer's next chunk is dropped
    as late, not an attack; a stranger's is both dropped and a security event."""
    dst = [50, 51, 52, 53]
    own = receiver.grant(10, np.array(dst), _deadline())
    peer = RawPeer(receiver, capability=own)
    try:
        assert peer.begin(10, dst) == tcp.BEGIN_OK
        peer.chunk(10, 0, _rows(2, 9))
        deadline = time.monotonic() + 10
        while receiver.applied_chunks < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        receiver.revoke(10)  # DecodeEngine.fail_transfer
        assert receiver.state(10) == "aborted"
        before, refused = receiver.storage.clone(), events("tcp_write_refused")
        peer.chunk(10, 2, _rows(2, 10))
        assert peer.reply()[0] == tcp.ABORTED
        assert receiver.dropped["aborted"] == 1
        assert events("tcp_write_refused") == refused
        stranger = RawPeer(receiver, capability=b"\x02" * 32)
        try:
            assert stranger.begin(10, dst) == tcp.ABORTED
        finally:
            stranger.close()
        assert events("tcp_write_refused") == refused + 1
        assert torch.equal(receiver.storage, before)
    finally:
        peer.close()


def test_a_probe_cannot_reach_the_pool(receiver):
    """Probe writes go under a probe grant into the probe region; neither a probe grant
    nor a probe BEGIN opens a pool slot."""
    peer = RawPeer(receiver)
    before = receiver.storage.clone()
    try:
        peer.send(tcp.PROBE_GRANT, 11, a=4)
        typ, probe_capability = peer.reply()
        assert typ == tcp.PROBE_GRANTED and len(probe_capability) == 32
        refused = events("tcp_write_refused")
        peer.capability = probe_capability
        assert peer.begin(11, [100, 101, 102, 103]) == tcp.ABORTED                      # the pool: no grant there
        assert peer.begin(11, [0, 1, 2, tcp.PROBE_SLOTS], flags=tcp.FLAG_PROBE) == tcp.ABORTED  # past the region
        assert events("tcp_write_refused") == refused + 2
        assert peer.begin(11, [0, 1, 2, 3], flags=tcp.FLAG_PROBE) == tcp.BEGIN_OK
        rows = _rows(4, 12)
        peer.chunk(11, 0, rows)
        assert peer.reply()[0] == tcp.COMPLETED
        assert torch.equal(receiver.probe_storage[:, :, :4], rows)
        peer.send(tcp.PROBE_GRANT, 12, a=tcp.PROBE_SLOTS + 1)
        assert peer.reply()[0] == tcp.ABORTED
    finally:
        peer.close()
    assert torch.equal(receiver.storage, before)


# ------------------------------------------------------------------ the grant rules tcp relies on
def test_grants_tell_a_late_writer_from_a_stranger():
    grants = WriteGrants(memory=2)
    own = grants.grant(1, np.array([3, 4]), int(time.time() * 1000) + 60_000)
    assert grants.check(1, own, np.array([4, 3]), exact=True) == ""
    assert "declare all" in grants.check(1, own, np.array([3]), exact=True)
    assert grants.check(1, own, np.array([3])) == ""
    assert not grants.late(1, own)  # live and on time: not late
    grants.revoke(1)
    assert "no live reservation" in grants.check(1, own, np.array([3, 4]))
    assert grants.late(1, own) and not grants.late(1, bytes(32))
    expired = grants.grant(2, np.array([5]), 1)  # its deadline long past
    assert "deadline passed" in grants.check(2, expired, np.array([5]))
    assert grants.late(2, expired) and not grants.late(2, bytes(32))
    for rid in (3, 4):  # only the latest `memory` ended capabilities are remembered
        grants.grant(rid, np.array([rid]), 0)
        grants.revoke(rid)
    assert not grants.late(1, own)


def test_shared_grants_give_one_capability_to_every_part():
    geo = PoolGeometry(n_layers=1, n_kv_heads=1, head_dim=4, dtype=torch.float32, n_slots=8, page_size=1)
    rx = make_receiver("auto", geo, "cpu", {"proxy_socket": "/nonexistent/proxy.sock", **SECRET_OPTS})
    try:
        cap = rx.grant(1, np.array([2, 3]), _deadline())
        assert rx.tcp.grants is rx.grants and rx.tcp.grants.check(1, cap, np.array([2, 3]), exact=True) == ""
        rx.revoke(1)
        assert 1 not in rx.tcp.grants
    finally:
        rx.close()
