"""Each engine process exports its own role's metrics only (engine/metrics.py): a P never
shows D's series as zeros, and `bench compare` can read each role from its process."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

# every module that declares engine metrics, so every role's list is complete
import pdunit.engine.decode.overlap  # noqa: F401
import pdunit.engine.decode.step_forward  # noqa: F401
import pdunit.engine.prefill.worker  # noqa: F401
import pdunit.engine.transfer.auto  # noqa: F401
import pdunit.engine.transfer.tcp  # noqa: F401
from pdunit.engine import metrics
from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.ports import free_port_block
from tests.engine.unit_client import random_prompt, stream


def names(role: str) -> set[str]:
    registry = CollectorRegistry()
    metrics.register_role(role, registry)
    metrics.register_role(role, registry)  # idempotent
    return {m.name for m in registry.collect()}


def test_each_role_exports_its_own_series():
    p, d, mono = names("prefill"), names("decode"), names("monolith")
    assert "pdunit_prefill_queue" in p and "pdunit_transfer_mode" in p
    assert not {n for n in p if n.startswith(("pdunit_decode_", "pdunit_kv_", "pdunit_tcp_"))}
    assert "pdunit_decode_step_seconds" in d and "pdunit_kv_mismatch" in d and "pdunit_tcp_chunks" in d
    assert not {n for n in d if n.startswith("pdunit_prefill_")}
    # the monolith: its decode steps and prefills, none of the transfer or abort machinery
    assert {"pdunit_decode_step_seconds", "pdunit_decode_gpu_busy_seconds", "pdunit_prefill_forward_seconds",
            "pdunit_decode_graph_steps"} <= mono
    assert not {n for n in mono if "abort" in n or "transfer" in n or n.startswith(("pdunit_kv_", "pdunit_tcp_"))}
    with pytest.raises(ValueError, match="unknown role"):
        metrics.register_role("lb")


def test_a_metric_declared_after_registration_is_exported_too():
    """Transports are imported when D or P picks one, after the main registered its role."""
    from prometheus_client import Counter

    registry = CollectorRegistry()
    metrics.register_role("decode", registry)
    late = metrics.role_metric(Counter("pdunit_test_late_total", "declared late", registry=None), "decode")
    late.inc()
    assert registry.get_sample_value("pdunit_test_late_total") == 1
    other = CollectorRegistry()
    metrics.register_role("prefill", other)
    assert other.get_sample_value("pdunit_test_late_total") is None


def test_running_p_and_d_serve_only_their_roles(tmp_path):
    """`pdunit local --metrics-port`: every process on its port of the block, as in a pod."""
    base = free_port_block(4)
    cfg = LocalConfig(mode="pd", model="random:tiny:0", pool_tokens=4096, cache_tokens=4096, lb_port=0,
                      log_level="warning", run_dir=str(tmp_path), metrics_port=base)
    with LocalUnit(cfg) as unit:
        frames, last = stream(unit.url, random_prompt(30, seed=3), max_frames=4, min_frames=4)
        assert last.get("done") and len(frames) == 4
        urls = unit.metrics_urls()
        text = {name: httpx.get(url, timeout=5).text for name, url in urls.items()}
    assert urls["prefill"].endswith(f":{base}/metrics") and urls["guard"].endswith(f":{base + 2}/metrics")
    assert urls["decode"].endswith(f":{base + 3}/metrics")
    assert "pdunit_prefill_requests_total" in text["prefill"] and "pdunit_decode_" not in text["prefill"]
    assert "pdunit_decode_frames_total" in text["decode"] and "pdunit_prefill_" not in text["decode"]
    assert "pdunit_guard_actions_total" in text["guard"] and "pdunit_lb_streams_in_flight" in text["lb"]
