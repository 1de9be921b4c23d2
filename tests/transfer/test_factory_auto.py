"""The factory and `auto`: verified probing in order, exact failure reasons, the metric."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pdunit.engine.transfer.auto import AutoReport, ProbeResult, log_choice
from pdunit.engine.transfer.base import Descriptor, PoolGeometry, TransferError
from pdunit.engine.transfer.factory import make_receiver, make_sender
from pdunit.engine.transfer.options import unit_secret_option
from tests.proxy.conftest import start_proxy, stop

GEO = PoolGeometry(n_layers=2, n_kv_heads=2, head_dim=4, dtype=torch.bfloat16, n_slots=64, page_size=1)
SECRET = {"unit_secret": unit_secret_option(b"factory-test-secret-0123456789")}


def test_unknown_mode_names_the_choices():
    with pytest.raises(TransferError, match="expected one of host, proxy, ipc, posix-fd, fabric, tcp, auto"):
        make_receiver("nvlink", GEO, "cpu", {})


def test_every_concrete_mode_has_a_sender_and_a_rank_in_the_probe_order():
    """The modes are listed once (settings.TransferMode): a mode added there without a
    sender, or without a place in auto's probe order, fails here, not on a unit."""
    from pdunit.engine.transfer.attach import SENDERS
    from pdunit.engine.transfer.auto import ORDER
    from pdunit.engine.transfer.base import TRANSFER_MODES

    assert "auto" not in TRANSFER_MODES
    assert set(SENDERS) == set(TRANSFER_MODES)
    assert sorted(ORDER) == sorted(TRANSFER_MODES)


def test_an_unknown_mode_in_ds_descriptor_is_refused_by_name():
    from pdunit.engine.transfer.attach import attach

    with pytest.raises(TransferError, match="unknown transfer mode 'nvlink' in D's descriptor"):
        attach(Descriptor("nvlink", {}), GEO, "cpu", {})


def test_host_mode_on_a_gpu_device_is_refused():
    with pytest.raises(TransferError, match="shared memory on the CPU"):
        make_receiver("host", GEO, "cuda:0", {})


def test_auto_without_proxy_reports_why_and_picks_a_verified_mode(tmp_path):
    rx = make_receiver("auto", GEO, "cpu", {"proxy_socket": str(tmp_path / "none.sock"), **SECRET})
    try:
        offered = rx.descriptors()
        assert [d.mode for d in offered] == ["host", "proxy", "tcp"]
        assert "unreachable" in offered[1].params["unavailable"]
        tx = make_sender(offered, GEO, "cpu", {"probe_all": "1", **SECRET})
        report = tx.auto_report.as_dict()
        assert report["chosen"] == "host"
        by_mode = {r["mode"]: r for r in report["results"]}
        assert by_mode["proxy"]["ok"] is False and "unreachable" in by_mode["proxy"]["detail"]
        assert by_mode["tcp"]["ok"] is True and "verified" in by_mode["tcp"]["detail"]
        tx.close()
    finally:
        rx.close()


def test_auto_skips_a_mode_whose_probe_fails_and_takes_the_next(tmp_path):
    proc, sock = start_proxy(tmp_path)
    rx = make_receiver("auto", GEO, "cpu", {"proxy_socket": sock, **SECRET})
    try:
        offered = [d for d in rx.descriptors() if d.mode != "host"]
        broken = Descriptor("proxy", {**offered[0].params, "probe_region": "r-gone"}, b"")
        tx = make_sender([broken, offered[1]], GEO, "cpu", {"proxy_socket": sock, **SECRET})
        assert tx.mode == "tcp"
        failed = tx.auto_report.results[0]
        assert failed.mode == "proxy" and not failed.ok and "NOT_FOUND" in failed.detail
        # the chosen sender really writes into D's pool
        src = torch.randn(GEO.shape()).to(GEO.dtype)
        deadline = int(time.time() * 1000) + 5000
        tx.write(1, src, np.array([3, 1]), np.array([60, 2]), deadline,
                 capability=rx.grant(1, np.array([60, 2]), deadline))
        assert torch.equal(rx.storage[:, :, [60, 2]], src[:, :, [3, 1]])
        tx.close()
    finally:
        rx.close()
        stop(proc)


def test_auto_with_no_working_mode_fails_with_every_reason():
    dead = [Descriptor("tcp", {"host": "127.0.0.1", "port": "1"}),
            Descriptor("fabric", {"unavailable": "FABRIC pool allocation failed: CUDA_ERROR_NOT_PERMITTED"})]
    with pytest.raises(TransferError) as err:
        make_sender(dead, GEO, "cpu", SECRET)
    assert "fabric: FABRIC pool allocation failed" in str(err.value)
    assert "tcp:" in str(err.value) and "unreachable" in str(err.value)


def test_auto_without_the_unit_secret_offers_no_tcp_and_says_why(tmp_path):
    rx = make_receiver("auto", GEO, "cpu", {"proxy_socket": str(tmp_path / "none.sock")})
    try:
        (tcp,) = [d for d in rx.descriptors() if d.mode == "tcp"]
        assert "--unit-secret-file" in tcp.params["unavailable"]
    finally:
        rx.close()


def test_tcp_without_the_unit_secret_is_refused_naming_the_flag():
    with pytest.raises(TransferError, match="--unit-secret-file"):
        make_receiver("tcp", GEO, "cpu", {})
    with pytest.raises(TransferError, match="--unit-secret-file"):
        make_sender([Descriptor("tcp", {"host": "127.0.0.1", "port": "1"})], GEO, "cpu", {})


def test_kernels_compile_for_hopper_without_a_gpu():
    pytest.importorskip("cuda.bindings.nvrtc")
    from pdunit.kernels.cuda_rows import compile_cubin

    try:
        cubin = compile_cubin("sm_90")
    except RuntimeError as e:
        if "nvrtc" in str(e).lower() and "not found" in str(e).lower():
            pytest.skip(f"NVRTC library missing: {e}")
        raise
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize(("device", "chosen", "level"),
                         [("cuda:0", "tcp", "WARNING"), ("cuda:0", "proxy", "INFO"), ("cpu", "tcp", "INFO")])
def test_auto_warns_when_gpu_pools_end_on_tcp(caplog, device: str, chosen: str, level: str):
    report = AutoReport(chosen=chosen, results=[ProbeResult("ipc", False, "CUDA_ERROR_INVALID_DEVICE")])
    with caplog.at_level("INFO", logger="pdunit.transfer.auto"):
        log_choice(report, device)
    (record,) = caplog.records
    assert record.levelname == level, record.getMessage()
