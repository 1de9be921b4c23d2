"""`pdunit bench attention`: the attention kernels' variants side by side, with torch's.

Owns two measurements, each kernel alone on K/V at fragmented pool slots: P's prefill
kernel once per `PrefillTile` in `--tiles` (`--points`), and D's decode kernel once per
`--decode-kernel` text in `--decode-kernels` (`--decode-points`); torch's SDPA and varlen
kernels on the same shapes as yardsticks. Per point: device time, TFLOP/s or K/V GB/s,
and the error against a float64 reference (docs/performance.md, "What each benchmark
measures"), so defaults are picked from a measurement. GPU only (the kernels' tests run
them under Triton's interpreter). It launches the kernels as the engines do and leaves
their settings as it found them.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, Field

from pdunit.bench import report
from pdunit.bench.cuda_timing import event_times_ms, kernel_ms
from pdunit.engine.loadgen.summary import Column, machine_info, text_table
from pdunit.engine.model.config import CONFIGS
from pdunit.engine.settings import parse_config
from pdunit.kernels.kv_dtype import kv_storage_dtype, to_kv
from pdunit.kernels.kv_dtype_names import KvCacheDtype
from pdunit.kernels.paged_attention import (
    DECODE_CONFIG,
    build_slot_table,
    choose_splits,
    configure_decode,
    paged_decode_attention,
    reference_decode_attention,
)
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
    Column("gbps", "K/V GB/s", "{:.0f}"),
    Column("of_copy", "of copy", "{:.1%}"),
    Column("err", "rel err", "{:.1e}"),
]
DECODE_CHECK_STREAMS = 8  # streams of a decode point checked against the float64 reference
# The decode kernel's variants timed by default: the current settings and each fp8 knob
# (kernels/decode_settings.py) alone and together.
DECODE_VARIANTS = ("default;kv_words=1;block_g=8;lazy_softmax=1;kv_words=1,block_g=8;"
                   "kv_words=1,block_g=8,lazy_softmax=1;kv_words=1,block_g=8,lazy_softmax=1,num_stages=2;"
                   "kv_words=1,block_g=8,lazy_softmax=1,block_n=128")


class AttentionBenchConfig(BaseModel):
    model: str = Field("qwen3-4b-shape", description="model config whose heads and head_dim are used")
    dtype: str = Field("bfloat16", description="bfloat16 | float16")
    points: str = Field("4x1500,1x6000,16x512,2x512+1500",
                        description="prefill: PROMPTSxROWS[+PREFIX] batches, comma list ('' = none)")
    decode_points: str = Field("", description="decode: STREAMSxCONTEXT points, comma list ('' = none): one new "
                               "token a stream against CONTEXT pool slots, one layer")
    decode_kernels: str = Field(DECODE_VARIANTS, description="decode kernel variants, ';' list of --decode-kernel "
                                "texts ('default' = kernels/decode_settings.py's defaults)")
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


def parse_decode_points(text: str) -> list[tuple[int, int]]:
    points = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, sep, b = part.lower().partition("x")
        try:
            streams, context = int(a), int(b)
        except ValueError:
            raise ValueError(f"--decode-points: {part!r} is not STREAMSxCONTEXT") from None
        if not sep or streams < 1 or context < 1:
            raise ValueError(f"--decode-points: {part!r} needs >= 1 stream and a context >= 1")
        points.append((streams, context))
    return points


def parse_decode_variants(text: str) -> list[str]:
    """The `;` list of --decode-kernel texts, each checked ('default' is the empty text);
    the default settings are always among them, first."""
    from pdunit.kernels.decode_settings import DECODE_DEFAULT, parse, render

    seen = [""]
    for part in (p.strip() for p in text.split(";")):
        norm = "" if part in ("", "default") else render({**DECODE_DEFAULT, **parse(part, "--decode-kernels")})
        if norm not in seen:
            seen.append(norm)
    return seen


def run_decode_point(cfg: AttentionBenchConfig, point: tuple[int, int], variants: list[str], copy_gbps: float,
                     rng: np.random.Generator) -> list[dict[str, Any]]:
    """One decode point: every variant of the split kernel (as D launches it: its split
    heuristic, its merge), then torch's SDPA on K/V gathered and widened in the call (what
    an engine could do with torch alone) and on contiguous K/V in q's dtype (a library
    kernel's floor at the model dtype's bytes)."""
    streams, context = point
    mc = CONFIGS[cfg.model]
    hq, hkv, d = mc.n_heads, mc.n_kv_heads, mc.head_dim
    dtype = getattr(torch, cfg.dtype)
    dev = torch.device("cuda")
    kv_dtype = kv_storage_dtype(cfg.kv_cache_dtype, dtype)
    ctx = pool_case(streams, context, 0, cfg.page_size, rng)
    n_slots = max(int(c.max()) for c in ctx) + 1
    table, lengths = (t.to(dev) for t in build_slot_table(ctx))
    g = torch.Generator(device=dev).manual_seed(cfg.seed)
    q = torch.randn(streams, hq, d, device=dev, generator=g).to(dtype)
    kv = to_kv(torch.randn(2, n_slots, hkv, d, device=dev, generator=g, dtype=dtype), kv_dtype)
    kv_bytes = streams * context * 2 * hkv * d * kv.element_size()
    n_chk = min(DECODE_CHECK_STREAMS, streams)
    want = reference_decode_attention(q[:n_chk].double(), kv, table[:n_chk], lengths[:n_chk])
    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
    reps = max(3, min(50, int(2e4 / max(1.0, kv_bytes / 1e6))))  # ~20 GB of K/V a round, 3..50 launches
    name = f"{streams}x{context}"
    out = torch.empty_like(q)
    saved = dict(DECODE_CONFIG)
    rows: list[dict[str, Any]] = []

    def row(label: str, ms: float | None, err: float | None, **extra: Any) -> dict[str, Any]:
        gbps = kv_bytes / (ms * 1e-3) / 1e9 if ms else None
        r = {"point": name, "kernel": label, "tile": None, "ms": round(ms, 4) if ms else None, "tflops": None,
             "gbps": gbps, "of_copy": gbps / copy_gbps if gbps else None, "err": err, **extra}
        print(f"{name} {label}: " + (f"{ms:.4f} ms, {gbps:.0f} GB/s, err {err:.1e}" if ms else "failed"), flush=True)
        return r

    try:
        for text in variants:
            configure_decode(text)
            splits = choose_splits(streams, hkv, sm_count, context)

            def launch(s: int = splits) -> None:
                paged_decode_attention(q, kv, table, lengths, s, out=out)

            label = "decode " + (text or "default")
            try:
                out.fill_(float("nan"))
                launch()
                err = float((out[:n_chk].double() - want).norm() / want.norm())
                ms = kernel_ms(launch, reps)
            except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is a data point
                rows.append({**row(label, None, None), "kernel": f"{label}: {str(exc).splitlines()[0][:120]}"})
                continue
            rows.append(row(label, ms, err, decode_kernel=text, splits=splits))
    finally:
        DECODE_CONFIG.clear()
        DECODE_CONFIG.update(saved)
    idx = table[:, :context].long()
    qs = q[:, :, None, :]

    def gathered() -> torch.Tensor:  # [B, Hkv, L, D] in q's dtype (an fp8 pool widened exactly)
        k = kv[0][idx].to(dtype).transpose(1, 2)
        v = kv[1][idx].to(dtype).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True)[:, :, 0]

    err = float((gathered()[:n_chk].double() - want).norm() / want.norm())
    rows.append(row("torch sdpa, K/V gathered and widened in the call", kernel_ms(gathered, reps), err))
    k_c = kv[0][idx].to(dtype).transpose(1, 2).contiguous()
    v_c = kv[1][idx].to(dtype).transpose(1, 2).contiguous()

    def contiguous() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(qs, k_c, v_c, enable_gqa=True)

    ms = kernel_ms(contiguous, reps)
    err = float((contiguous()[:n_chk, :, 0].double() - want).norm() / want.norm())
    rows.append(row(f"torch sdpa, contiguous K/V in {cfg.dtype} (reads {2 // kv.element_size()}x the bytes)", ms,
                    err))
    return rows


def summarize_decode(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per decode variant, the geometric mean over points of the default's time over its
    own (> 1: faster than the default); the best variant is the highest among those that
    ran every point within 5e-2 of the reference (fp8 dots quantise the query)."""
    ok = [r for r in rows if r.get("decode_kernel") is not None and r["ms"] and r["err"] is not None
          and r["err"] < 5e-2]
    points = sorted({r["point"] for r in rows if r.get("decode_kernel") is not None})
    base = {r["point"]: r["ms"] for r in ok if r["decode_kernel"] == ""}
    speed: dict[str, list[float]] = {}
    for r in ok:
        if r["point"] in base:
            speed.setdefault(r["decode_kernel"], []).append(base[r["point"]] / r["ms"])
    score = {k or "default": round(float(np.exp(np.mean(np.log(v)))), 3) for k, v in speed.items()
             if len(v) == len(points)}
    of_copy: dict[str, dict[str, float]] = {(r["decode_kernel"] or "default"): {} for r in ok}
    for r in ok:
        of_copy[r["decode_kernel"] or "default"][r["point"]] = round(r["of_copy"], 3)
    return {"decode_speedup_over_default": score,
            "decode_best": max(score, key=score.__getitem__) if score else None,
            "decode_of_copy": of_copy}


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
    prefill = parse_points(cfg.points) if cfg.points.strip() else []
    decode = parse_decode_points(cfg.decode_points)
    if not prefill and not decode:
        raise SystemExit("pdunit bench attention: --points and --decode-points are both empty")
    variants = parse_decode_variants(cfg.decode_kernels)
    rng = np.random.default_rng(cfg.seed)
    rows = [r for point in prefill for r in run_point(cfg, point, tiles, rng)]
    summary = summarize(rows)
    if decode:
        from pdunit.bench.step import measure_copy_gbps

        copy_gbps = measure_copy_gbps(2.0)
        print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
        decode_rows = [r for point in decode for r in run_decode_point(cfg, point, variants, copy_gbps, rng)]
        rows += decode_rows
        summary.update(summarize_decode(decode_rows), hbm_copy_gbps=copy_gbps)
    return report.Results(BENCH, machine_info(), command, cfg.model_dump(), rows, summary).document()


def main(argv: list[str]) -> int:
    cfg = parse_config(AttentionBenchConfig, argv, "pdunit bench attention")
    doc = run_attention_bench(cfg, report.command_line(argv, prog="pdunit bench attention"))
    print(text_table(doc["rows"], COLUMNS))
    report.print_and_write(doc, cfg.out, COLUMNS, "Attention kernels: variants side by side")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
