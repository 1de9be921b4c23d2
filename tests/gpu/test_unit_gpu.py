"""A whole unit on GPUs, through real processes: P on cuda:0, D on cuda:1 (the layout of
`pdunit bench compare`'s 1p1d), and a monolith on cuda:1. The first 1P1D capacity run on
two H200s stalled in D because its step thread launched kernels on device 0; these
tests fail on that bug and on anything else that stops a GPU unit from streaming.

Needs two GPUs (the device tool's nvidia-h200-x2); skipped otherwise."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdunit.bench.report import scrape_metrics
from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.ports import free_port
from pdunit.engine.step_loop import StepLoop
from tests.engine.unit_client import load, random_prompt, stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

# tiny in bfloat16 takes the GPU path: Triton attention, CUDA graphs, overlap in D
BASE = dict(model="random:tiny:0", dtype="bfloat16", pool_tokens=32768, cache_tokens=16384, lb_port=0,
            guard=False, log_level="warning")
FRAMES = 40


def test_step_loop_thread_runs_on_the_engines_device():
    seen: list[int] = []
    done = threading.Event()

    def step_once() -> bool:
        seen.append(torch.cuda.current_device())
        done.set()
        return False

    loop = StepLoop("test", step_once, torch.device("cuda:1"))
    loop.start()
    assert done.wait(10)
    loop.stop()
    assert seen[0] == 1


def _run_streams(url: str, n: int) -> list[tuple[list, dict]]:
    prompts = [random_prompt(300 + 40 * i, seed=i) for i in range(n)]
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda p: stream(url, p, max_frames=FRAMES, min_frames=FRAMES, timeout=120), prompts))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("transfer", ["ipc", "proxy"])
def test_pd_unit_on_two_gpus_streams_every_frame(transfer, kv_cache_dtype, tmp_path):
    """fp8_e4m3: P's fused store writes e4m3 rows, the transport moves 1-byte rows (the
    proxy's copy kernel picks its vector width from the row bytes), both sides checksum
    them, D's graphs decode from them."""
    cfg = LocalConfig(mode="pd", transfer=transfer, run_dir=str(tmp_path), device="cuda:0",
                      decode_devices="cuda:1", kv_cache_dtype=kv_cache_dtype, **BASE)
    with LocalUnit(cfg) as unit:
        results = _run_streams(unit.url, 12)
        info = load(unit.url)
    for frames, last in results:
        assert last.get("done"), last
        assert len(frames) == FRAMES
    assert info.kv_checks_total == 12 and info.kv_mismatch_total == 0, info


def _streams_and_metrics(tmp_path, n: int, metrics_of: str, **cfg) -> dict[str, float]:
    """Streams n prompts through a unit whose `metrics_of` process serves Prometheus;
    checks every stream is whole and returns that process's metrics."""
    port = free_port()
    extra = {f"extra_{metrics_of}_args": ["--metrics-port", str(port)]}
    with LocalUnit(LocalConfig(run_dir=str(tmp_path), **extra, **cfg, **BASE)) as unit:
        results = _run_streams(unit.url, n)
        metrics = scrape_metrics(port)
    for frames, last in results:
        assert last.get("done"), last
        assert len(frames) == FRAMES
    return metrics


@pytest.mark.parametrize("graphs", [None, False])
def test_pd_unit_replays_prefill_graphs_by_default_on_cuda(tmp_path, graphs):
    """P on CUDA captures prefill graphs unless --no-prefill-graphs: every prompt here fits
    a bucket, so its forwards replay graphs (their logits against the eager path:
    tests/kernels/test_prefill_graphs.py) or, with the flag, none do. Four prompts of
    300-420 rows: even packed into one forward they fit the 2048-row bucket."""
    metrics = _streams_and_metrics(tmp_path, 4, "prefill", mode="pd", transfer="ipc", device="cuda:0",
                                   decode_devices="cuda:1", prefill_graphs=graphs)
    replayed = metrics.get('pdunit_prefill_forwards_total{path="graph"}', 0)
    eager = metrics.get('pdunit_prefill_forwards_total{path="eager"}', 0)
    assert (replayed >= 1 and eager == 0) if graphs is None else (replayed == 0 and eager >= 1), metrics


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_monolith_on_the_second_gpu_streams_every_frame(tmp_path, kv_cache_dtype):
    metrics = _streams_and_metrics(tmp_path, 8, "monolith", mode="monolith", device="cuda:1",
                                   kv_cache_dtype=kv_cache_dtype)
    # its GPU busy account (CUDA events around each step), read by `bench compare`
    # (device time within the loop's own wall time: decode steps plus prefill-first forwards)
    busy = metrics["pdunit_decode_gpu_busy_seconds_total"]
    wall = metrics["pdunit_decode_step_seconds_sum"] + metrics["pdunit_prefill_forward_seconds_sum"]
    assert 0 < busy <= 1.1 * wall + 0.05, (busy, wall)


def test_monolith_prefix_cache_hits_on_cuda_and_streams_whole(tmp_path):
    """The monolith's prefix cache on CUDA: a warm voice's second request computes only
    its uncached rows (the cache region and the device copy into its pool pages), and
    every stream comes back whole. Frames are compared with P + D on the CPU
    (tests/engine/test_unit_e2e.py); on the GPU a forward's rounding depends on its shape."""
    voice = random_prompt(640, seed=77)
    cfg = LocalConfig(mode="monolith", device="cuda:1", run_dir=str(tmp_path), **BASE)
    with LocalUnit(cfg) as unit:
        replies = [stream(unit.url, voice + random_prompt(60, seed=78 + i), max_frames=FRAMES, min_frames=FRAMES,
                          timeout=120) for i in range(3)]
    for frames, last in replies:
        assert last.get("done"), last
        assert len(frames) == FRAMES
    assert replies[0][1]["cached_tokens"] == 0
    for _, last in replies[1:]:
        assert last["cached_tokens"] >= 640 - 16 and last["prefill_tokens"] == 700 - last["cached_tokens"]


def test_chunked_monolith_compiles_no_kernel_while_serving(tmp_path):
    """The chunked monolith's forwards mix decode rows with a chunk of a prompt (a
    continuing one attends to its earlier rows), eagerly, at whatever context lengths
    the streams have: its warm-up and decode graphs must have compiled every kernel
    variant they need, or each new one stalls every stream while it compiles (its
    slowest streams on the H200s started right after the warm-up:
    bench/results/capacity-20261130-h200x2-60s-bf16.md)."""
    metrics = _streams_and_metrics(tmp_path, 8, "monolith", mode="monolith", policy="chunked", chunk_tokens=256,
                                   device="cuda:1")
    assert metrics['pdunit_kernel_compiles_total{phase="startup"}'] > 0  # the counter works here
    assert metrics['pdunit_kernel_compiles_total{phase="serving"}'] == 0, \
        {k: v for k, v in metrics.items() if "kernel_compile" in k}
