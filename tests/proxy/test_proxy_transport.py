"""The `proxy` transport (ProxyReceiver in D, ProxySender in P) against a real proxy."""

from __future__ import annotations

import time

import numpy as np
import torch

from pdunit.engine.kv.checksum import kv_checksum
from pdunit.engine.transfer.base import PoolGeometry, TransferError
from pdunit.engine.transfer.factory import make_receiver, make_sender

GEO = PoolGeometry(n_layers=2, n_kv_heads=2, head_dim=4, dtype=torch.float16, n_slots=96, page_size=4)


def _deadline(ms: int = 10_000) -> int:
    return int(time.time() * 1000) + ms


def test_paged_write_lands_bit_exact_and_nothing_else_changes(proxy_socket):
    rx = make_receiver("proxy", GEO, "cpu", {"proxy_socket": proxy_socket})
    tx = make_sender(rx.descriptors(), GEO, "cpu", {"proxy_socket": proxy_socket})
    try:
        rx.storage.fill_(-7)
        src = torch.randn(GEO.shape()).to(GEO.dtype)
        pages = np.array([20, 3, 11])  # page size 4: three scattered pages
        dst = (pages[:, None] * 4 + np.arange(4)).reshape(-1)
        src_slots = np.arange(12, 24)
        tx.write(5, src, src_slots, dst, _deadline(), capability=rx.grant(5, dst, _deadline()))
        assert torch.equal(rx.storage[:, :, dst], src[:, :, src_slots])
        untouched = np.setdiff1d(np.arange(GEO.n_slots), dst)
        assert bool((rx.storage[:, :, untouched] == -7).all())
        assert kv_checksum(rx.storage, dst) == kv_checksum(src, src_slots)
    finally:
        tx.close()
        rx.close()


def test_quiesced_request_cannot_write_again(proxy_socket):
    rx = make_receiver("proxy", GEO, "cpu", {"proxy_socket": proxy_socket})
    tx = make_sender(rx.descriptors(), GEO, "cpu", {"proxy_socket": proxy_socket})
    try:
        src = torch.randn(GEO.shape()).to(GEO.dtype)
        cap = rx.grant(6, np.arange(4), _deadline())
        tx.write(6, src, np.arange(4), np.arange(4), _deadline(), capability=cap)
        assert tx.quiesce(6) is True
        before = rx.storage.clone()
        try:
            tx.write(6, src, np.arange(4, 8), np.arange(4), _deadline(), capability=cap)
            raise AssertionError("a write after quiesce must be refused")
        except TransferError as e:
            assert "cancelled" in str(e)
        assert torch.equal(rx.storage, before)
        assert tx.in_flight() == []
    finally:
        tx.close()
        rx.close()


def test_quiesce_without_a_reachable_proxy_is_not_proof(tmp_path):
    from tests.proxy.conftest import start_proxy, stop

    proc, sock = start_proxy(tmp_path)
    rx = make_receiver("proxy", GEO, "cpu", {"proxy_socket": sock})
    tx = make_sender(rx.descriptors(), GEO, "cpu", {"proxy_socket": sock})
    stop(proc)
    try:
        assert tx.quiesce(9) is False
    finally:
        tx.close()
        rx.close()
