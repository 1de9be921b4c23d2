"""A stalled or restarted proxy (issue 32.4 and 32.5), with a real proxy process: D and
P register again with a restarted proxy by themselves (D's live grants too) and say
`unready` until they have; P never crashes while the proxy is stopped (SIGSTOP) or
killed mid-transfer: every write completes or fails with TransferError, and after the
restart writes land again without restarting P or D."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from pdunit.engine.transfer.base import PoolGeometry, TransferError
from pdunit.engine.transfer.proxy import ProxyReceiver, ProxySender
from tests.proxy.conftest import process_state, sigstop, start_proxy, stop

GEO = PoolGeometry(n_layers=2, n_kv_heads=2, head_dim=4, dtype=torch.float16, n_slots=512, page_size=1)
SRC = torch.randn(GEO.shape(), generator=torch.Generator().manual_seed(5)).to(GEO.dtype)


def _deadline(ms: int = 30_000) -> int:
    return int(time.time() * 1000) + ms


def _until(cond: Callable[[], object], what: str, limit_s: float = 60.0) -> None:
    """Waits for a condition (the limit only keeps a broken build from hanging)."""
    end = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


def _restart(proc, tmp: Path):
    """SIGKILL the proxy (its sockets stay behind, as after a crash) and start another."""
    proc.kill()
    proc.wait()
    for ext in ("", ".auth", ".copy"):
        Path(str(tmp / "proxy.sock") + ext).unlink(missing_ok=True)
    return start_proxy(tmp)[0]


def _write(d: ProxyReceiver, p: ProxySender, rid: int, src_slots: np.ndarray, dst: np.ndarray,
           deadline: int, capability: bytes | None = None) -> None:
    cap = capability if capability is not None else d.grant(rid, dst, deadline)
    p.write(rid, SRC, src_slots, dst, deadline, capability=cap)


@pytest.fixture
def unit(tmp_path):
    state = {"proc": start_proxy(tmp_path)[0]}
    sock = str(tmp_path / "proxy.sock")
    d = ProxyReceiver(GEO, "cpu", sock)
    p = ProxySender(d.descriptors()[0], GEO, "cpu", sock)
    try:
        yield d, p, state, tmp_path
    finally:
        p.close()
        d.close()
        os.kill(state["proc"].pid, signal.SIGCONT)
        stop(state["proc"])


def test_d_and_p_register_again_with_a_restarted_proxy_and_live_grants_still_hold(unit):
    d, p, state, tmp = unit
    _write(d, p, 1, np.arange(8), np.arange(8), _deadline())
    live_slots = np.arange(100, 110)
    live = d.grant(7, live_slots, _deadline())  # a reservation that outlives the proxy
    old_instance, old_region = d.client.proxy_instance, d.region
    state["proc"].kill()
    state["proc"].wait()
    _until(lambda: d.unready and p.unready, "D and P notice the proxy is gone")
    assert "nvlink-proxy" in d.unready and "nvlink-proxy" in p.unready
    later = d.grant(8, np.arange(200, 204), _deadline())  # granted while no proxy runs
    state["proc"] = _restart(state["proc"], tmp)
    _until(lambda: not d.unready and not p.unready, "D and P registered again")
    assert d.client.proxy_instance != old_instance and d.region != old_region
    # P never learnt D's new region id: a write names it by its capability
    _write(d, p, 7, np.arange(10), live_slots, _deadline(), capability=live)
    _write(d, p, 8, np.arange(4), np.arange(200, 204), _deadline(), capability=later)
    _write(d, p, 9, np.arange(20, 40), np.arange(300, 320), _deadline())
    assert torch.equal(d.storage[:, :, live_slots], SRC[:, :, :10])
    assert torch.equal(d.storage[:, :, 300:320], SRC[:, :, 20:40])


def test_unready_names_the_restart_until_registration_is_done(unit):
    """While D registers again, its unready says so; it empties only once done."""
    d, _, state, tmp = unit
    d.keeper.stop()  # heal by hand, so the test holds registration half-way
    gate, entered = threading.Event(), threading.Event()
    register = d.keeper._register

    def slow_register() -> None:
        entered.set()
        gate.wait()
        register()

    d.keeper._register = slow_register
    state["proc"] = _restart(state["proc"], tmp)
    healer = threading.Thread(target=lambda: _until(d.keeper.heal, "D registered again"))
    healer.start()
    try:
        assert entered.wait(60)
        assert "restarted" in d.unready and "registering again" in d.unready
    finally:
        gate.set()
        healer.join()
    assert d.unready == ""
    assert {r.region_id for r in d.client.info().regions} == {d.region, d.probe_region}


def test_a_staging_segment_a_stalled_proxy_did_not_release_is_not_released_twice(unit):
    """The crash of issue 32.5: a write that grows the staging segment while the proxy
    is stopped failed to unregister the old one; the next write removed it from the
    list again (ValueError in _host_stage) and killed P."""
    d, p, state, _ = unit
    _write(d, p, 1, np.arange(8), np.arange(8), _deadline())  # a staging segment of 64 rows
    caps = {rid: d.grant(rid, np.arange(100), _deadline()) for rid in (2, 3)}
    sigstop(state["proc"].pid)
    try:
        with pytest.raises(TransferError):
            _write(d, p, 2, np.arange(100), np.arange(100), _deadline(1500), capability=caps[2])
            pytest.fail(f"a write completed while the proxy was meant to be stopped; its state now "
                        f"{process_state(state['proc'].pid)!r} (T: stopped)")
    finally:
        os.kill(state["proc"].pid, signal.SIGCONT)
    _write(d, p, 3, np.arange(100, 200), np.arange(100), _deadline(), capability=caps[3])
    assert torch.equal(d.storage[:, :, :100], SRC[:, :, 100:200])


def test_p_survives_a_proxy_stopped_and_killed_mid_transfer_repeatedly(unit):
    """Two writers, their staging growing, against a proxy stopped four times past the
    writes' deadline (0.8 s deadlines, 1.2-s stops), then killed and started again."""
    d, p, state, tmp = unit
    stop_writing = threading.Event()
    outcomes = {"ok": 0, "transfer_error": 0}
    crashes: list[str] = []
    lock = threading.Lock()

    def writer(k: int) -> None:
        rid = (k + 1) << 32
        sizes = (8, 70, 20, 150, 40, 240)  # each writer's staging grows and is reused
        while not stop_writing.is_set():
            rid += 1
            n = sizes[rid % len(sizes)]
            dst = np.arange(n) + 256 * k
            try:
                _write(d, p, rid, np.arange(n), dst, _deadline(800))
                outcome = "ok"
            except TransferError:
                outcome = "transfer_error"
                time.sleep(0.002)  # not a busy loop of failures while the proxy is dead: its restart needs the CPU
            except Exception as e:  # what killed P: anything but a TransferError
                crashes.append(f"{type(e).__name__}: {e}")
                return
            finally:
                d.revoke(rid)
            with lock:
                outcomes[outcome] += 1

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(4):
            time.sleep(0.5)
            sigstop(state["proc"].pid)
            time.sleep(1.2)
            os.kill(state["proc"].pid, signal.SIGCONT)
        time.sleep(0.5)
        state["proc"] = _restart(state["proc"], tmp)
        time.sleep(2.0)
    finally:
        stop_writing.set()
        for t in threads:
            t.join()
    assert crashes == []
    assert outcomes["transfer_error"] > 0 and outcomes["ok"] > 0
    _until(lambda: not d.unready and not p.unready, "D and P registered again")
    for rid in range(10):
        _write(d, p, 50 + rid, np.arange(30), np.arange(30) + 30 * rid, _deadline())
    assert torch.equal(d.storage[:, :, 270:300], SRC[:, :, :30])
