"""`pdunit bench step`: decode step time vs batch and context against the HBM roofline
(BENCHMARKS.md section 3).

Owns one GPU measurement: a model of the given shape with random weights drawn on the
GPU, a paged KV pool filled with random values, contexts laid out as fragmented pages,
and, per (batch, context) point, the decode step through the CUDA-graph runner
(engine/model/cuda_graphs.py) timed three ways:
- `step_ms`: wall time of what a decode loop without overlap does per step: build the
  batch's slot table on the host, stage and copy it, replay, and bring the greedy frames
  back to the host (the sync D's sampler does);
- `gpu_ms`: device time of the graph replay alone (CUDA events);
- `attn_gbps`: one layer's decode attention kernel alone (launched back to back), in
  bytes of K/V read per second.
`roofline_ms` = (weight bytes + K/V bytes read) / the HBM bandwidth measured in the same
run (a large device-to-device copy, bytes read + written). `fraction_of_roofline` is
roofline over `step_ms`; `gpu_fraction_of_roofline` is roofline over `gpu_ms`, the bound
overlap scheduling can reach. `overlap` is false: D has no overlap scheduling yet.
`gpu_busy` = gpu_ms / step_ms (the GPU's busy share of a non-overlapped step).

Must never be run for a claim without writing its results file (bench/report.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import math
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdunit.bench import report
from pdunit.engine.model.config import get_config
from pdunit.engine.model.transformer import ForwardBatch, TTSModel

COLUMNS = [
    report.Column("batch", "batch"),
    report.Column("context", "context"),
    report.Column("step_ms", "step ms", "{:.3f}"),
    report.Column("gpu_ms", "gpu ms", "{:.3f}"),
    report.Column("host_ms", "host ms", "{:.3f}"),
    report.Column("roofline_ms", "roofline ms", "{:.3f}"),
    report.Column("fraction_of_roofline", "of roofline", "{:.1%}"),
    report.Column("gpu_fraction_of_roofline", "gpu of roofline", "{:.1%}"),
    report.Column("gpu_busy", "gpu busy", "{:.1%}"),
    report.Column("attn_gbps", "attn GB/s", "{:.0f}"),
    report.Column("overlap", "overlap"),
    report.Column("skipped", "skipped"),
]


@dataclasses.dataclass
class StepConfig:
    model: str = "qwen3-4b-shape"
    batches: list[int] = dataclasses.field(default_factory=lambda: [1, 8, 16, 32, 64, 128, 256])
    contexts: list[int] = dataclasses.field(default_factory=lambda: [1024, 2048, 4096])
    page_size: int = 16
    iters: int = 20
    warmup: int = 3
    seed: int = 0
    copy_gib: float = 4.0
    reserve_gib: float = 14.0  # left free for activations, graph pools, scratch
    compare: list[str] = dataclasses.field(default_factory=lambda: ["64x2048"])
    tune: bool = False
    out: str = "bench/results"
    machine_tag: str | None = None
    command: str = ""


# ------------------------------------------------------------------ measurements


def _events_ms(fn, iters: int, warmup: int) -> list[float]:  # noqa: ANN001 - a thunk
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def _kernel_ms(fn, reps: int = 20, rounds: int = 5) -> float:  # noqa: ANN001 - a thunk
    """Device time of one call of a short kernel: `reps` launches back to back between
    two events (the queue stays ahead of the GPU, so host launch cost is hidden), the
    median over `rounds`."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


def measure_copy_gbps(gib: float, iters: int = 10) -> float:
    """HBM bandwidth of a large device-to-device copy, counting bytes read + written."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = statistics.median(_events_ms(lambda: dst.copy_(src), iters, 3))
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def random_model(name: str, seed: int) -> TTSModel:
    """The config's shape with weights drawn on the GPU (the loader's scales: uniform with
    std 1/sqrt(fan_in), norms 1): seconds instead of a CPU init of 4B parameters."""
    cfg = get_config(name)
    m = TTSModel(cfg, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = 1.0 / math.sqrt(cfg.n_codebooks if pname == "embed.weight" else p.shape[1])
            bound = std * math.sqrt(3.0)
            p.uniform_(-bound, bound, generator=g)
    return m.eval()


def weight_bytes(m: TTSModel) -> int:
    """Bytes of weights one decode step reads: every matrix but the embedding table,
    of which only the batch's rows are read (added per point)."""
    return sum(p.numel() * p.element_size() for n, p in m.named_parameters() if n != "embed.weight")


def paged_contexts(
    batch: int, context: int, page_size: int, n_slots: int, rng: np.random.Generator
) -> list[np.ndarray]:
    pages_each = math.ceil(context / page_size)
    pages = rng.permutation(n_slots // page_size)[: batch * pages_each].reshape(batch, pages_each)
    slots = (pages[:, :, None] * page_size + np.arange(page_size)).reshape(batch, -1)[:, :context]
    return [s.astype(np.int64) for s in slots]


def _tune_decode(m: TTSModel, kv: torch.Tensor, rng: np.random.Generator, cfg: StepConfig) -> list[dict[str, Any]]:
    """Time the split kernel's launch configurations at 64 x 2k on one layer; apply the
    fastest to the module (it is what the sweep then runs)."""
    from pdunit.kernels import paged_attention as pa

    c = m.config
    b, ctx = 64, 2048
    table, lengths = pa.build_slot_table(paged_contexts(b, ctx, cfg.page_size, kv.shape[2], rng))
    table, lengths = table.cuda(), lengths.cuda()
    q = torch.randn(b, c.n_heads, c.head_dim, device="cuda").to(m.dtype)
    kv_bytes = b * ctx * 2 * c.n_kv_heads * c.head_dim * kv.element_size()
    results = []
    best = None
    for cand in pa.DECODE_CANDIDATES:
        pa.DECODE_CONFIG.update(cand)
        splits = pa.choose_splits(b, c.n_kv_heads, m.sm_count(), ctx)
        row: dict[str, Any] = {**cand, "splits": splits}
        try:
            ms = _kernel_ms(lambda s=splits: pa.paged_decode_attention(q, kv[0], table, lengths, s))
            row.update(ms=ms, gbps=kv_bytes / (ms * 1e-3) / 1e9)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is a data point
            row["error"] = repr(exc)[:300]
        results.append(row)
        print("tune", row, flush=True)
        if "ms" in row and (best is None or row["ms"] < best["ms"]):
            best = row
    assert best is not None, "no decode kernel configuration ran"
    pa.DECODE_CONFIG.update({k: best[k] for k in pa.DECODE_CONFIG})
    return results


def run_step(config: StepConfig) -> dict[str, Any]:
    """Measure every point; return the results document (BENCHMARKS.md section 6)."""
    if not torch.cuda.is_available():
        raise SystemExit("pdunit bench step: needs a CUDA GPU (none visible)")
    from pdunit.engine.model.cuda_graphs import DecodeGraphRunner
    from pdunit.kernels import paged_attention as pa

    rng = np.random.default_rng(config.seed)
    gbps = measure_copy_gbps(config.copy_gib)
    print(f"HBM copy bandwidth: {gbps:.0f} GB/s (read + write)", flush=True)
    m = random_model(config.model, config.seed)
    c = m.config
    kv_token = c.kv_bytes_per_token(m.dtype)
    w_bytes = weight_bytes(m)
    points = [(b, ctx) for ctx in config.contexts for b in config.batches]
    free, _ = torch.cuda.mem_get_info()
    budget = free - int(config.reserve_gib * 2**30)
    need = max(b * ctx for b, ctx in points)
    page = config.page_size
    n_slots = min(need, budget // kv_token) // page * page
    if n_slots < page:
        raise SystemExit(f"pdunit bench step: {free / 2**30:.1f} GiB free leaves no room for a KV pool")
    kv = torch.empty((c.n_layers, 2, n_slots, c.n_kv_heads, c.head_dim), dtype=m.dtype, device="cuda")
    for layer in kv:  # random K/V (never zeros: zeros run faster than data)
        layer.normal_()
    print(f"pool: {n_slots} slots, {n_slots * kv_token / 2**30:.1f} GiB; weights {w_bytes / 2**30:.2f} GiB", flush=True)
    tuning = _tune_decode(m, kv, rng, config) if config.tune else []
    buckets = sorted(set(config.batches))
    t0 = time.perf_counter()
    runner = DecodeGraphRunner(m, kv, buckets=buckets, max_context=max(config.contexts))
    capture_s = time.perf_counter() - t0
    print(f"captured {len(buckets)} graphs in {capture_s:.1f}s", flush=True)
    rows: list[dict[str, Any]] = []
    compare: dict[str, Any] = {}
    for b, ctx in points:
        row: dict[str, Any] = {"batch": b, "context": ctx, "overlap": False}
        if b * ctx > n_slots:
            row["skipped"] = f"needs {b * ctx * kv_token / 2**30:.0f} GiB of KV; pool holds {n_slots * kv_token / 2**30:.0f}"
            rows.append(row)
            print(row, flush=True)
            continue
        ctx_slots = paged_contexts(b, ctx, page, n_slots, rng)
        tokens = [rng.integers(0, c.vocab_max, (1, c.n_codebooks)).astype(np.int64) for _ in range(b)]
        batch = ForwardBatch.from_sequences(tokens, ctx_slots)
        for _ in range(config.warmup):
            runner.run(batch).argmax(-1).cpu()
        step, host = [], []
        for _ in range(config.iters):
            s0 = time.perf_counter()
            logits = runner.run(batch)
            s1 = time.perf_counter()
            logits.argmax(-1).cpu()
            s2 = time.perf_counter()
            step.append((s2 - s0) * 1e3)
            host.append((s1 - s0) * 1e3)
        graph = runner._graphs[runner.bucket_for(b)]  # inputs of this point are staged
        gpu = _events_ms(graph.graph.replay, config.iters, 1)
        # one layer's attention alone, on the staged table
        q = torch.randn(b, c.n_heads, c.head_dim, device="cuda").to(m.dtype)
        table, lengths = runner._table[:b], runner._lengths[:b]
        splits = pa.choose_splits(b, c.n_kv_heads, m.sm_count(), runner.max_context)
        attn_ms = _kernel_ms(
            lambda q=q, t=table, n=lengths, s=splits: pa.paged_decode_attention(q, kv[0], t, n, s)
        )
        kv_bytes = b * ctx * kv_token
        embed_bytes = b * c.n_codebooks * c.hidden * kv.element_size()
        roof = (w_bytes + embed_bytes + kv_bytes) / (gbps * 1e9) * 1e3
        row.update(
            step_ms=statistics.median(step),
            host_ms=statistics.median(host),
            gpu_ms=statistics.median(gpu),
            roofline_ms=roof,
            kv_gb=kv_bytes / 1e9,
            attn_gbps=(kv_bytes / c.n_layers) / (attn_ms * 1e-3) / 1e9,
        )
        row["fraction_of_roofline"] = roof / row["step_ms"]
        row["gpu_fraction_of_roofline"] = roof / row["gpu_ms"]
        row["gpu_busy"] = row["gpu_ms"] / row["step_ms"]
        key = f"{b}x{ctx}"
        if key in config.compare:
            compare[key] = _compare(m, runner, kv, batch, logits)
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    measured = [r for r in rows if "step_ms" in r]
    target = [r for r in measured if r["batch"] >= 64 and r["context"] == 2048]
    summary = {
        "hbm_copy_gbps": gbps,
        "weight_gib": w_bytes / 2**30,
        "kv_bytes_per_token": kv_token,
        "pool_slots": n_slots,
        "capture_s": capture_s,
        "decode_kernel_config": dict(pa.DECODE_CONFIG),
        "tuning": tuning,
        "overlap": False,
        "fraction_of_roofline_ge64_2k": {f"{r['batch']}x2048": r["fraction_of_roofline"] for r in target},
        "gpu_fraction_of_roofline_ge64_2k": {f"{r['batch']}x2048": r["gpu_fraction_of_roofline"] for r in target},
        "target_0_8_met_wall": bool(target) and all(r["fraction_of_roofline"] >= 0.8 for r in target),
        "target_0_8_met_gpu": bool(target) and all(r["gpu_fraction_of_roofline"] >= 0.8 for r in target),
        "compare": compare,
        "eager_fallbacks": runner.stats["eager"],
        "gpu_used": torch.cuda.get_device_name(),
        "visible_gpus": torch.cuda.device_count(),
    }
    machine = report.machine_info()
    res = report.Results(
        bench="step",
        machine=machine,
        command=config.command,
        config={k: v for k, v in dataclasses.asdict(config).items() if k not in ("command", "out")},
        rows=rows,
        summary=summary,
    )
    return res.document()


def _compare(m: TTSModel, runner: Any, kv: torch.Tensor, batch: ForwardBatch, graph_logits: torch.Tensor) -> dict[str, Any]:
    """At one point: eager GPU path and the torch reference path (the pre-kernel code),
    their step times, and how far their logits are from the graph's."""
    out: dict[str, Any] = {}

    def timed(n: int) -> tuple[float, torch.Tensor]:
        times, logits = [], None
        for i in range(n + 1):
            s0 = time.perf_counter()
            with torch.inference_mode():
                logits = m.forward(batch, kv)
            logits.argmax(-1).cpu()
            if i:  # the first run compiles / warms up
                times.append((time.perf_counter() - s0) * 1e3)
        assert logits is not None
        return statistics.median(times), logits

    eager_ms, eager = timed(5)
    out["eager_step_ms"] = eager_ms
    out["graph_vs_eager_max_abs"] = float((graph_logits - eager).abs().max())
    out["graph_vs_eager_greedy_agree"] = float((graph_logits.argmax(-1) == eager.argmax(-1)).double().mean())
    m.attention_backend = "reference"
    try:
        ref_ms, ref = timed(2)
        out["reference_step_ms"] = ref_ms
        out["graph_vs_reference_rel"] = float((graph_logits - ref).norm() / ref.norm())
        out["graph_vs_reference_greedy_agree"] = float((graph_logits.argmax(-1) == ref.argmax(-1)).double().mean())
    except torch.OutOfMemoryError as exc:
        out["reference_error"] = repr(exc)[:200]
    finally:
        m.attention_backend = "triton"
    print("compare", out, flush=True)
    return out


# ------------------------------------------------------------------ CLI


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    d = StepConfig()
    p = argparse.ArgumentParser(prog="pdunit bench step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model, help="model config name (random weights)")
    p.add_argument("--batches", type=_ints, default=d.batches, help="comma-separated batch sizes")
    p.add_argument("--contexts", type=_ints, default=d.contexts, help="comma-separated context lengths")
    p.add_argument("--page-size", type=int, default=d.page_size, help="slots per page of the fragmented layout")
    p.add_argument("--iters", type=int, default=d.iters)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--copy-gib", type=float, default=d.copy_gib, help="size of the bandwidth copy")
    p.add_argument("--reserve-gib", type=float, default=d.reserve_gib, help="GPU memory kept out of the KV pool")
    p.add_argument("--compare", default=",".join(d.compare),
                   help="points (BxCTX) where eager and the torch reference are timed too; '' for none")
    p.add_argument("--tune", action="store_true", help="time decode kernel launch configs first, use the best")
    p.add_argument("--out", default=d.out, help="folder for step-<date>-<tag>.json/.md")
    p.add_argument("--machine-tag", default=d.machine_tag, help="file-name tag (default: from the GPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    cfg = StepConfig(
        model=a.model, batches=a.batches, contexts=a.contexts, page_size=a.page_size,
        iters=a.iters, warmup=a.warmup, seed=a.seed, copy_gib=a.copy_gib, reserve_gib=a.reserve_gib,
        compare=[x for x in a.compare.split(",") if x], tune=a.tune, out=a.out,
        machine_tag=a.machine_tag,
        command="pdunit bench step " + " ".join(shlex.quote(x) for x in argv),
    )
    doc = run_step(cfg)
    tag = cfg.machine_tag or report.machine_slug(doc["machine"]).lower()
    path = Path(cfg.out) / f"step-{dt.date.today().strftime('%Y%m%d')}-{tag}.json"
    res = report.Results(doc["bench"], doc["machine"], doc["command"], doc["config"], doc["rows"], doc["summary"])
    res.write(path, COLUMNS, title="Decode step vs the HBM roofline")
    print(report.text_table(doc["rows"], COLUMNS))
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
