"""`pdunit bench attention`: the fused prefill attention kernel's launch shapes, side by side.

Owns one measurement: `kernels/prefill_attention.paged_prefill_attention` alone over a
batch like P's (K/V at fragmented pool slots), once per `PrefillTile` in `--tiles`, and
torch's SDPA on the same shapes with contiguous K/V as a yardstick; per point the device
time, TFLOP/s and the error against a float64 reference (columns: docs/performance.md,
"What each benchmark measures"), so the default tile is picked from a measurement.
GPU only: on a CPU the kernel runs only under Triton's interpreter (the tests do that).
It launches the kernel as P does and never changes it.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, Field

from pdunit.bench import report
from pdunit.bench.cuda_timing import event_times_ms
from pdunit.engine.loadgen.summary import Column, machine_info, text_table
from pdunit.engine.model.config import CONFIGS
from pdunit.engine.settings import parse_config
from pdunit.kernels.kv_dtype import kv_storage_dtype, to_kv
from pdunit.kernels.kv_dtype_names import KvCacheDtype
from pdunit.kernels.prefill_attention import (
    DEFAULT_TILE,
    PrefillPlan,
    PrefillTile,
    paged_prefill_attention,
    prefill_plan,
    reference_prefill_attention,
)

BENCH = "attention"
CHECK_ROWS = 128
COLUMNS = [
    Column("point", "point", "{}"),
    Column("kernel", "kernel", "{}"),
    Column("ms", "ms", "{:.3f}"),
    Column("tflops", "TFLOP/s", "{:.1f}"),
    Column("err", "rel err", "{:.1e}"),
]


class AttentionBenchConfig(BaseModel):
    model: str = Field("qwen3-4b-shape", description="model config whose heads and head_dim are used")
    dtype: str = Field("bfloat16", description="bfloat16 | float16")
    points: str = Field("4x1500,1x6000,16x512,2x512+1500",
                        description="PROMPTSxROWS[+PREFIX] batches, comma list")
    tiles: str = Field("64x64w4s2,128x64w4s2,128x64w8s2,128x64w8s3,128x32w4s3,128x128w8s2,256x64w8s2",
                       description="PrefillTile shapes BLOCK_MxBLOCK_NwWARPSsSTAGES, comma list")
    page_size: int = Field(1, ge=1, description="KV page size of the fragmented pool")
    iters: int = Field(20, gt=0)
    warmup: int = Field(3, ge=0)
    sdpa: bool = Field(True, description="also time torch SDPA on contiguous K/V (equal-length points only)")
    library: bool = Field(True, description="also time torch's varlen flash attention (torch.nn.attention.varlen, "
                          "and the aten op under it, which takes GQA) on the same pool: through its block table, "
                          "and on K/V gathered first")
    kv_cache_dtype: KvCacheDtype = Field(
        "auto", description="the pool's element type: auto (--dtype) or fp8_e4m3 (as P's with --kv-cache-dtype "
        "fp8_e4m3: the kernel widens it; the library rows widen it in their gather)")
    seed: int = Field(0, ge=0)
    out: str = Field("", description="results JSON path or folder ('' = print only)")


def parse_points(text: str) -> list[tuple[int, int, int]]:
    points = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        head, _, prefix = part.partition("+")
        a, sep, b = head.lower().partition("x")
        try:
            prompts, rows, cached = int(a), int(b), int(prefix or 0)
        except ValueError:
            raise ValueError(f"--points: {part!r} is not PROMPTSxROWS[+PREFIX]") from None
        if not sep or prompts < 1 or rows < 1 or cached < 0:
            raise ValueError(f"--points: {part!r} needs >= 1 prompt of >= 1 row and a prefix >= 0")
        points.append((prompts, rows, cached))
    if not points:
        raise ValueError("--points is empty")
    return points


def attention_flops(heads: int, head_dim: int, prompts: int, rows: int, cached: int) -> float:
    """QK^T and PV over the entries each new row sees (causal, after the prefix)."""
    visible = rows * cached + rows * (rows + 1) / 2
    return 4.0 * heads * head_dim * visible * prompts


def time_launches(fn: Any, iters: int, warmup: int) -> float:
    """Median ms per launch from CUDA events."""
    return statistics.median(event_times_ms(fn, iters, warmup))


def pool_case(prompts: int, rows: int, cached: int, page: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Context slots per prompt: whole pages taken from a shuffled pool, so tokens are
    contiguous only inside a page (as in P's pool after some churn)."""
    length = rows + cached
    per = -(-length // page)
    pages = rng.permutation(per * prompts)
    return [(pages[i * per:(i + 1) * per, None] * page + np.arange(page)).reshape(-1)[:length].astype(np.int64)
            for i in range(prompts)]


def run_point(cfg: AttentionBenchConfig, point: tuple[int, int, int], tiles: list[PrefillTile],
              rng: np.random.Generator) -> list[dict[str, Any]]:
    prompts, rows, cached = point
    mc = CONFIGS[cfg.model]
    hq, hkv, d = mc.n_heads, mc.n_kv_heads, mc.head_dim
    dtype = getattr(torch, cfg.dtype)
    dev = torch.device("cuda")
    ctx = pool_case(prompts, rows, cached, cfg.page_size, rng)
    n_slots = max(int(c.max()) for c in ctx) + 1
    dp = prefill_plan([rows] * prompts, ctx, [i * rows for i in range(prompts)], device=dev)
    g = torch.Generator(device=dev).manual_seed(cfg.seed)
    q = torch.randn(prompts * rows, hq, d, device=dev, generator=g).to(dtype)
    kv = to_kv(torch.randn(2, n_slots, hkv, d, device=dev, generator=g), kv_storage_dtype(cfg.kv_cache_dtype, dtype))
    out = torch.empty_like(q)
    name = f"{prompts}x{rows}" + (f"+{cached}" if cached else "")
    flops = attention_flops(hq, d, prompts, rows, cached)
    # the check: each prompt's last CHECK_ROWS new rows against the float64 reference
    n_chk = min(CHECK_ROWS, rows)
    chk_rows = torch.cat([torch.arange((i + 1) * rows - n_chk, (i + 1) * rows) for i in range(prompts)]).to(dev)
    chk = prefill_plan([n_chk] * prompts, ctx, [i * n_chk for i in range(prompts)], device=dev)
    want = reference_prefill_attention(
        q[chk_rows].double(), kv.double(), chk["table"], chk["ctx_len"], chk["q_len"], chk["q_start"])
    out_rows = []
    for tile in tiles:
        def launch(tile: PrefillTile = tile) -> None:
            paged_prefill_attention(q, kv, dp["table"], dp["ctx_len"], dp["q_len"], dp["q_start"], dp["max_q_len"],
                                    out, tile=tile)

        out.fill_(float("nan"))
        launch()
        err = float((out[chk_rows].double() - want).norm() / want.norm())
        ms = time_launches(launch, cfg.iters, cfg.warmup)
        label = f"{tile}" + (" (default)" if tile == DEFAULT_TILE else "")
        out_rows.append({"point": name, "kernel": label, "tile": str(tile), "ms": round(ms, 4),
                         "tflops": round(flops / (ms * 1e-3) / 1e12, 1), "err": err})
        print(f"{name} {label}: {ms:.3f} ms, {out_rows[-1]['tflops']} TFLOP/s, err {err:.1e}", flush=True)
    if cfg.library:
        out_rows += library_rows(cfg, name, flops, q, kv, dp, ctx, chk_rows, want)
    if cfg.sdpa and cached == 0:
        # torch's SDPA (its flash kernel on Hopper) on contiguous [B, H, L, D] K/V
        qs = q.view(prompts, rows, hq, d).transpose(1, 2)
        ks = torch.randn(prompts, hkv, rows, d, device=dev, generator=g).to(dtype)
        vs = torch.randn_like(ks)

        def sdpa() -> None:
            torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

        ms = time_launches(sdpa, cfg.iters, cfg.warmup)
        out_rows.append({"point": name, "kernel": "torch sdpa (contiguous K/V)", "tile": None, "ms": round(ms, 4),
                         "tflops": round(flops / (ms * 1e-3) / 1e12, 1), "err": None})
        print(f"{name} torch sdpa: {ms:.3f} ms, {out_rows[-1]['tflops']} TFLOP/s", flush=True)
    return out_rows


def sdpa_per_prompt(q: torch.Tensor, kv: torch.Tensor, q_rows: list[tuple[int, int]], slots: list[torch.Tensor],
                    out: torch.Tensor) -> torch.Tensor:
    """What an engine could do with torch alone: gather each prompt's K/V from the pool
    and run SDPA per prompt, causal aligned bottom-right (a cached prefix is visible to
    every new row). q_rows: (first row, new rows) per prompt; slots: its context slots."""
    from torch.nn.attention.bias import causal_lower_right

    for (a, n), idx in zip(q_rows, slots, strict=True):
        qs = q[a:a + n].transpose(0, 1).unsqueeze(0)
        ks, vs = (kv[i][idx].to(q.dtype).transpose(0, 1).unsqueeze(0) for i in (0, 1))  # an fp8 pool widened
        mask = causal_lower_right(n, idx.numel()) if idx.numel() > n else None
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                                             enable_gqa=True)
        out[a:a + n] = o[0].transpose(0, 1)
    return out


def library_rows(cfg: AttentionBenchConfig, name: str, flops: float, q: torch.Tensor, kv: torch.Tensor,
                 dp: PrefillPlan, ctx: list[np.ndarray], chk_rows: torch.Tensor,
                 want: torch.Tensor) -> list[dict[str, Any]]:
    """torch's varlen attention on the same batch, when this torch has it: a library
    kernel is worth taking if it beats ours (ARCHITECTURE: kernels). Rows say why not
    when it cannot run here."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        return [{"point": name, "kernel": f"torch varlen: unavailable ({exc})", "tile": None, "ms": None,
                 "tflops": None, "err": None}]
    dev = q.device
    q_lens = dp["q_len"].long()
    cu_q = torch.zeros(len(ctx) + 1, dtype=torch.int32, device=dev)
    cu_q[1:] = torch.cumsum(q_lens, 0)
    ctx_lens = dp["ctx_len"]
    cu_k = torch.zeros_like(cu_q)
    cu_k[1:] = torch.cumsum(ctx_lens.long(), 0)
    flat = torch.from_numpy(np.concatenate(ctx)).to(dev)
    max_k = int(ctx_lens.max())

    def gather(i: int) -> torch.Tensor:  # [total context, Hkv, D] in q's dtype (an fp8 pool widened exactly)
        return kv[i][flat].to(q.dtype)

    import inspect

    params = inspect.signature(varlen_attn).parameters
    # torch 2.11 (the H200 image) says causal with is_causal; later ones with window_size
    causal: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    group = q.shape[1] // kv.shape[2]

    def paged() -> Any:  # the pool as pages of one token, our slot table as its block table
        return varlen_attn(q, kv[0].unsqueeze(1), kv[1].unsqueeze(1), cu_q, None, dp["max_q_len"], max_k,
                           seqused_k=ctx_lens, block_table=dp["table"], enable_gqa=True, **causal)

    def gathered() -> Any:
        return varlen_attn(q, gather(0), gather(1), cu_q, cu_k, dp["max_q_len"], max_k, enable_gqa=True, **causal)

    def repeated() -> Any:  # a torch without GQA in varlen: K/V heads repeated to the query heads
        k = gather(0).repeat_interleave(group, dim=1)
        v = gather(1).repeat_interleave(group, dim=1)
        return varlen_attn(q, k, v, cu_q, cu_k, dp["max_q_len"], max_k, **causal)

    def aten_flash() -> Any:  # the flash kernel under varlen_attn: it takes fewer K/V heads than query heads
        # causal with fewer query than key rows aligns bottom-right (a cached prefix seen by every new row)
        return torch.ops.aten._flash_attention_forward(q, gather(0), gather(1), cu_q, cu_k, dp["max_q_len"], max_k,
                                                       0.0, True, False)[0]

    q_rows = [(int(a), int(n)) for a, n in zip(dp["q_start"].tolist(), dp["q_len"].tolist(), strict=True)]
    slots = [torch.from_numpy(c).to(dev) for c in ctx]
    out = torch.empty_like(q)

    def per_prompt() -> Any:
        return sdpa_per_prompt(q, kv, q_rows, slots, out)

    rows: list[dict[str, Any]] = []
    for label, fn in (("torch varlen, paged (page 1)", paged), ("torch varlen, K/V gathered first", gathered),
                      ("torch varlen, K/V gathered, heads repeated", repeated),
                      ("aten flash varlen (GQA), K/V gathered first", aten_flash),
                      ("torch sdpa per prompt, K/V gathered first", per_prompt)):
        try:
            got = fn()
            err = float((got[chk_rows].double() - want).norm() / want.norm())
            ms = time_launches(fn, cfg.iters, cfg.warmup)
        except (RuntimeError, ValueError, TypeError) as exc:  # a backend or torch version that cannot: the row says why
            rows.append({"point": name, "kernel": f"{label}: {str(exc).splitlines()[0][:120]}", "tile": None,
                         "ms": None, "tflops": None, "err": None})
            print(f"{name} {label}: {exc}", flush=True)
            continue
        rows.append({"point": name, "kernel": label, "tile": None, "ms": round(ms, 4),
                     "tflops": round(flops / (ms * 1e-3) / 1e12, 1), "err": err})
        print(f"{name} {label}: {ms:.3f} ms, {rows[-1]['tflops']} TFLOP/s, err {err:.1e}", flush=True)
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per tile, the geometric mean over points of its speed relative to the point's best
    tile; the best tile is the one closest to 1 (no tile with an error above 1e-2 counts)."""
    points = sorted({r["point"] for r in rows})
    ok = [r for r in rows if r["tile"] and r["err"] is not None and r["err"] < 1e-2]
    rel: dict[str, list[float]] = {}
    for p in points:
        here = [r for r in ok if r["point"] == p]
        best = min((r["ms"] for r in here), default=None)
        for r in here:
            rel.setdefault(r["tile"], []).append(best / r["ms"] if best else 0.0)
    score = {t: float(np.exp(np.mean(np.log(v)))) for t, v in rel.items() if len(v) == len(points)}
    best_tile = max(score, key=score.__getitem__) if score else None
    bad = sorted({r["tile"] for r in rows if r["tile"] and (r["err"] is None or r["err"] >= 1e-2)})
    return {"tile_score": {t: round(s, 3) for t, s in score.items()}, "best_tile": best_tile,
            "default_tile": str(DEFAULT_TILE), "tiles_with_errors": bad}


def run_attention_bench(cfg: AttentionBenchConfig, command: str) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("pdunit bench attention: needs a CUDA GPU (the CPU runs this kernel only under "
                         "Triton's interpreter: see tests/kernels/test_prefill_attention.py)")
    if cfg.model not in CONFIGS:
        raise SystemExit(f"pdunit bench attention: --model {cfg.model!r} unknown; known: {sorted(CONFIGS)}")
    tiles = [PrefillTile.parse(t) for t in cfg.tiles.split(",") if t.strip()]
    if DEFAULT_TILE not in tiles:
        tiles.append(DEFAULT_TILE)
    rng = np.random.default_rng(cfg.seed)
    rows = [r for point in parse_points(cfg.points) for r in run_point(cfg, point, tiles, rng)]
    return report.Results(BENCH, machine_info(), command, cfg.model_dump(), rows, summarize(rows)).document()


def main(argv: list[str]) -> int:
    cfg = parse_config(AttentionBenchConfig, argv, "pdunit bench attention")
    doc = run_attention_bench(cfg, report.command_line(argv, prog="pdunit bench attention"))
    print(text_table(doc["rows"], COLUMNS))
    report.print_and_write(doc, cfg.out, COLUMNS, "Prefill attention kernel: launch shapes side by side")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
