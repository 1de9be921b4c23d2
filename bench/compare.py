"""`pdunit bench compare`: PD against the monolith, side by side in ONE run (BENCHMARKS.md 1).

Each variant (`1p1d`, `1p2d`, `monolith-prefill-first`, `monolith-chunked` per `--chunks`
size; `VARIANT+LABEL` a copy with LABEL's `--variant-args`, an A/B of one knob) is started
as a local unit with the same model, workload and sweep, then stopped; one results file
holds every row, each variant's capacity per GPU and the ratios of the headline claims.
On a CPU (the default) it is a plumbing check with the tiny model; on a GPU machine pass
`--device cuda` and the model shape. It never judges a variant on a run it cut short
without marking it partial.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import httpx
from pydantic import BaseModel, Field

from pdunit.bench import report, waterfall
from pdunit.bench.capacity import (
    CapacityConfig,
    plot_capacity,
    print_report,
    rows_level_key,
    run_capacity,
    short_levels_warning,
    summarize_run,
)
from pdunit.bench.gpu_clocks import GpuSampler
from pdunit.engine.decode.step_model import TERMS
from pdunit.engine.loadgen.driver import COLUMNS
from pdunit.engine.loadgen.summary import machine_info, text_table
from pdunit.engine.loadgen.workload import parse_list, parse_range
from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.ports import free_port
from pdunit.engine.settings import parse_config, to_argv
from pdunit.kernels.kv_dtype_names import KvCacheDtype

BENCH = "capacity"


class CompareConfig(BaseModel):
    """Capacity of PD and monolith variants measured side by side in one run."""

    model: str = Field("random:tiny:0", description="model spec every variant runs")
    device: str = Field("cpu", description="cpu | cuda (P/monolith on device --gpu-base, D on the next; 1p2d: "
                        "D's on the next two)")
    transfer: str = Field("host", description="1p1d KV transport (host on CPU; ipc/proxy/auto on GPUs)")
    variants: str = Field("1p1d,monolith-prefill-first,monolith-chunked", description="which variants (1p1d, "
                          "1p2d, monolith-prefill-first, monolith-chunked); VARIANT+LABEL adds a copy of a variant "
                          "whose engine gets LABEL's flags from --variant-args")
    chunks: str = Field("8192", description="monolith-chunked chunk sizes (comma list)")
    concurrency: str = Field("2,4", description="closed-loop levels")
    variant_concurrency: str = Field("", description="per-variant levels overriding --concurrency, e.g. "
                                     "'1p1d=64,128;monolith-prefill-first=16,32;monolith-chunked=64,96' "
                                     "(monolith-chunked covers every chunk size)")
    rate: str = Field("", description="Poisson levels (arrivals/s, comma list): replaces the closed-loop levels")
    variant_rate: str = Field("", description="per-variant Poisson levels overriding --rate, e.g. "
                              "'1p1d=16,24;monolith-chunked=8,12'")
    burst_share: float = Field(0.0, ge=0, lt=1, description="Poisson levels: share of requests arriving in clumps")
    burst_size: int = Field(5, ge=1, description="Poisson levels: requests per clump")
    overload_rate: float = Field(0.0, ge=0, description="after its sweep, every variant runs one overload level: "
                                 "Poisson arrivals at this rate (arrivals/s; BENCHMARKS.md: 2x the monolith's "
                                 "capacity rate) with clumps (--burst-share, 0.2 when 0); not a capacity level: "
                                 "the summary's `overload` gives each variant's goodput, refused share, stutter and "
                                 "TTFA p95 there, and a labelled copy's against its variant's (admission on vs "
                                 "off: `--variants 1p1d,1p1d+floor --variant-decode-args 'floor=--rate-floor=42'`)")
    client_procs: int = Field(0, ge=0, description="processes sending each Poisson level's requests (0: 4 with a "
                              "GPU device, 1 on cpu): one Python process reading every stream is late by itself")
    stop_at_failure: bool = Field(True, description="end a variant's sweep at its first failing level (the "
                                  "levels above cannot raise its capacity); --no-stop-at-failure sweeps them all "
                                  "for the plot")
    repeat: int = Field(1, ge=1, description="runs of every level, each with its own workload seed (seed + run): "
                        "a level counts as passed only when every run passes")
    bracket: int = Field(0, ge=0, description="levels a variant may add to its listed ones to close its capacity "
                         "bracket: above its highest when every listed level passed (until one fails), below its "
                         "lowest when that one failed (until one passes); each costs a level's time. A device "
                         "call then brackets every variant even when its edge moved since the last run")
    bracket_step: float = Field(0.0, ge=0, description="--bracket: the spacing of the added levels (0: the spacing "
                                "of the variant's two highest listed levels above, its two lowest below; a variant "
                                "with one listed level needs it)")
    duration: float = Field(60.0, gt=0, description="seconds of arrivals per level: at least 3 lifetimes of the "
                            "longest stream at the rate floor (shorter levels end before the steady state and say so)")
    ramp: float = Field(3.0, ge=0, description="closed-loop workers start spread over this many seconds; streams "
                        "started during the ramp load the unit but are not counted (steady state only)")
    prompt_rows: str = Field("1000-2000", description="prompt rows")
    frames: str = Field("", description="frames per stream, LOW-HIGH ('': BENCHMARKS.md's 105-630, 5-30 s of "
                        "audio, with a GPU device; 105-210 on cpu, where a run checks the plumbing)")
    voice_reuse: float = Field(0.5, ge=0, le=1, description="share of requests reusing a warm voice")
    api: Literal["frames", "speech"] = Field("frames", description="what the load drives: frames (POST "
                                             "/v1/tts/stream) or speech (POST /v1/audio/speech: text + an uploaded "
                                             "voice, PCM out; needs --codec and a CSM --model; rows then report TTFA "
                                             "at the first audio byte and audio-level stutter beside frame-level)")
    codec: str = Field("", description="every variant's codec (D's or the monolith's --codec, e.g. "
                       "random:mimi-tiny:0 with --model random:csm-tiny:0): the LB then serves /v1/audio/speech")
    voice_source: Literal["pcm", "codes"] = Field("pcm", description="--api speech: voices uploaded as synthetic "
                                                  "PCM clips or as codec codes (the load driver's --voice-source)")
    prefill_gemm: Literal["bf16", "fp8"] = Field("bf16", description="GEMM precision of every variant's forwards "
                                                 "with prompt rows (P's and the monolith's --prefill-gemm)")
    kv_cache_dtype: KvCacheDtype = Field("auto", description="KV pool precision of every variant's "
                                                       "engines (their --kv-cache-dtype)")
    prefill_graphs: bool | None = Field(None, description="every variant's P or monolith replays prefill CUDA "
                                        "graphs (--prefill-graphs; default: the engines' own, on where the model takes the GPU path; "
                                        "the engines table's P graph share says how many forwards replayed one)")
    prefill_args: str = Field("", description="more flags for every variant's P (1p1d, 1p2d), e.g. "
                              "'--max-batch-rows=2048'; checked against P's flags before anything starts")
    monolith_args: str = Field("", description="more flags for every monolith variant, checked likewise")
    decode_args: str = Field("", description="more flags for every variant's D, checked likewise, e.g. "
                             "'--pool-tokens=0' (D's pool sized to its GPU)")
    variant_args: str = Field("", description="flags of the labelled copies in --variants, 'LABEL=FLAGS;...': "
                              "`--variants 1p1d,1p1d+b2048 --variant-args 'b2048=--max-batch-rows=2048'` runs 1P1D "
                              "twice in one run, the copy's P with those flags (a monolith copy's monolith), after "
                              "--prefill-args/--monolith-args. A copy takes its own levels (--variant-rate "
                              "1p1d+b2048=...) or its variant's; it gets no headline ratio, the summary gives it "
                              "over its variant (variant_over_base), and the copies of one label the headline "
                              "ratios among themselves (label_ratios)")
    variant_decode_args: str = Field("", description="flags of the labelled copies' D, 'LABEL=FLAGS;...', after "
                                     "--decode-args: `--variants 1p1d,1p1d+b128 --variant-decode-args "
                                     "'b128=--max-batch=128'` runs 1P1D twice, the copy's D with 128-stream steps. A "
                                     "label may have flags here, in --variant-args, or in both; a monolith may carry "
                                     "a label with both (one label for a family: `fp8` in P, D and the monolith), "
                                     "not one with D's flags alone")
    pool_tokens: int = Field(65536, gt=0, description="D's (and the monolith's) KV pool rows")
    cache_tokens: int = Field(65536, gt=0, description="prefix-cache rows of P and of the monoliths")
    ready_timeout_s: float = Field(600.0, gt=0, description="unit start (model load, graph capture)")
    run_dir: str = Field("", description="keep each variant's sockets and process logs under <run_dir>/<variant>")
    parallel_gpus: int = Field(1, ge=1, description="GPUs this run may use at once: variants are packed in the "
                               "listed order into waves whose GPU counts fit (1p1d 2, 1p2d 3, a monolith 1); the "
                               "variants of a wave run at once, each in a process of its own on disjoint GPUs. "
                               "1 = one variant at a time")
    gpu_base: int = Field(0, ge=0, description="first CUDA device index of this run's variants (set by "
                          "--parallel-gpus for its child runs)")
    out: str = Field("", description="results JSON path or folder")
    plot: str = Field("", description="PNG: stutter share and p1 rate vs concurrency, all variants")


Unit = tuple[str, int, LocalConfig]  # a variant's name, its GPU count, its unit


def variant_units(cfg: CompareConfig) -> list[Unit]:
    gpu = cfg.device != "cpu"
    if cfg.api == "speech" and not cfg.codec:
        raise SystemExit("pdunit bench compare: --api speech needs --codec (the codec D turns frames into audio "
                         "with, e.g. --model random:csm-tiny:0 --codec random:mimi-tiny:0)")

    def device(offset: int) -> str:
        return f"{cfg.device}:{cfg.gpu_base + offset}"

    first = device(0) if gpu else "cpu"
    base = dict(model=cfg.model, pool_tokens=cfg.pool_tokens, cache_tokens=cfg.cache_tokens, lb_port=0,
                prefill_gemm=cfg.prefill_gemm, prefill_graphs=cfg.prefill_graphs, kv_cache_dtype=cfg.kv_cache_dtype,
                log_level="warning", ready_timeout_s=cfg.ready_timeout_s, device=first, codec=cfg.codec)
    labels, decode_labels = variant_labels(cfg)
    decode_args = checked_argv(cfg.decode_args, "--decode-args", "D", first)
    out: list[Unit] = []
    for spec in [v.strip() for v in cfg.variants.split(",") if v.strip()]:
        family, label = split_variant(spec)
        suffix = f"+{label}" if label else ""
        args = engine_argv(cfg, family, label, labels, first)
        own_decode: list[str] = []
        if label in decode_labels:
            if family.startswith("monolith"):
                # a label of a whole family (P, D and the monolith: `fp8` on each) is fine;
                # one whose only flags are D's would run the monolith as it is
                if label not in labels:
                    raise SystemExit(f"pdunit bench compare: --variant-decode-args {label}: {spec} is a monolith, "
                                     "it has no D (its flags go in --variant-args)")
            else:
                own_decode = checked_argv(decode_labels[label], f"--variant-decode-args {label}", "D", first)
        pd = dict(base, transfer=cfg.transfer, extra_prefill_args=args, extra_decode_args=decode_args + own_decode)
        mono = dict(base, mode="monolith", extra_monolith_args=args)
        name = family + suffix  # the spec without stray spaces: results are keyed by it
        if family == "1p1d":
            out.append((name, 2, LocalConfig(mode="pd", decode_devices=device(1) if gpu else "", **pd)))
        elif family == "1p2d":
            devices = f"{device(1)},{device(2)}" if gpu else ""
            out.append((name, 3, LocalConfig(mode="1p2d", decode_devices=devices, **pd)))
        elif family == "monolith-prefill-first":
            out.append((name, 1, LocalConfig(policy="prefill-first", **mono)))
        else:  # monolith-chunked: one unit per chunk size
            for chunk in parse_list(cfg.chunks, "chunks", int):
                out.append((f"monolith-chunked-{chunk}{suffix}", 1,
                            LocalConfig(policy="chunked", chunk_tokens=chunk, **mono)))
    names = [name for name, _, _ in out]
    if len(set(names)) != len(names):  # a variant's results (and its child's files) are keyed by its name
        raise SystemExit(f"pdunit bench compare: --variants {cfg.variants!r} with --chunks {cfg.chunks!r} names "
                         f"{sorted({n for n in names if names.count(n) > 1})} more than once")
    return out


FAMILIES = ("1p1d", "1p2d", "monolith-prefill-first", "monolith-chunked")


def split_variant(spec: str) -> tuple[str, str]:
    """'1p1d+b2048' -> ('1p1d', 'b2048'); '1p1d' -> ('1p1d', ''). SystemExit naming the
    variant when its family is unknown or its label empty."""
    family, sep, label = (x.strip() for x in spec.partition("+"))
    if family not in FAMILIES:
        raise SystemExit(f"pdunit bench compare: unknown variant {spec!r} ({', '.join(FAMILIES)}, each "
                         "optionally +LABEL)")
    if sep and not label:
        raise SystemExit(f"pdunit bench compare: variant {spec!r} has an empty label after '+'")
    return family, label


def label_flags(text: str, flag: str) -> dict[str, str]:
    """'LABEL=FLAGS;...' as LABEL -> flags; SystemExit naming `flag` when malformed."""
    labels: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        label, sep, flags = (x.strip() for x in part.partition("="))
        if not sep or not label or not flags:
            raise SystemExit(f"pdunit bench compare: {flag}: {part!r} is not LABEL=FLAGS")
        if label in labels:
            raise SystemExit(f"pdunit bench compare: {flag} defines {label!r} twice")
        labels[label] = flags
    return labels


def variant_labels(cfg: CompareConfig) -> tuple[dict[str, str], dict[str, str]]:
    """--variant-args and --variant-decode-args as LABEL -> flags; every label --variants
    uses must be defined in one of them and every defined one used (a misspelt label
    would otherwise run a copy without flags)."""
    labels = label_flags(cfg.variant_args, "--variant-args")
    decode = label_flags(cfg.variant_decode_args, "--variant-decode-args")
    used = {split_variant(v)[1] for v in cfg.variants.split(",") if v.strip()} - {""}
    if used - set(labels) - set(decode):
        raise SystemExit(f"pdunit bench compare: --variants uses labels {sorted(used - set(labels) - set(decode))} "
                         "that neither --variant-args nor --variant-decode-args defines")
    for flag, defined in (("--variant-args", labels), ("--variant-decode-args", decode)):
        if set(defined) - used:
            raise SystemExit(f"pdunit bench compare: {flag} defines labels {sorted(set(defined) - used)} that "
                             "no variant in --variants uses")
    return labels, decode


def engine_argv(cfg: CompareConfig, family: str, label: str, labels: dict[str, str], device: str) -> list[str]:
    """The extra flags of a variant's prefilling engine (P, or the monolith):
    --prefill-args or --monolith-args, then its label's. Each set is parsed by that
    engine's own config first, so a misspelt flag or a bad value stops the run here,
    named, not as a unit that fails to start minutes later."""
    monolith = family.startswith("monolith")
    field = "--monolith-args" if monolith else "--prefill-args"
    sources = [(field, getattr(cfg, field[2:].replace("-", "_")))]
    if label in labels:
        sources.append((f"--variant-args {label}", labels[label]))
    return [a for source, text in sources
            for a in checked_argv(text, source, "monolith" if monolith else "P", device)]


def checked_argv(text: str, source: str, engine: str, device: str) -> list[str]:
    """`text` split into flags, once `engine`'s (P, D or monolith) own config accepts
    them on `device`."""
    from pdunit.engine.decode.main import DecodeConfig
    from pdunit.engine.monolith.main import MonolithConfig
    from pdunit.engine.prefill.main import PrefillConfig

    configs: dict[str, type[BaseModel]] = {"P": PrefillConfig, "D": DecodeConfig, "monolith": MonolithConfig}
    config = configs[engine]
    argv = shlex.split(text)
    try:
        parse_config(config, ["--device", device, *argv], f"pdunit bench compare {source}", env={})
    except SystemExit as exc:  # ConfigError or argparse's (an unknown flag); the message is printed
        raise SystemExit(f"pdunit bench compare: {source} {text!r} is not a valid set of flags for "
                         f"{'the monolith' if engine == 'monolith' else engine}") from exc
    return argv


def ratios(per_gpu: dict[str, float | None],
           bounds: dict[str, list[float | None]] | None = None) -> dict[str, Any]:
    """The headline ratios of capacity per GPU, and with `bounds` (each variant's
    capacity interval, capacity.summarize_run's `capacity_bounds_per_gpu`) the
    range the level spacing allows for each (`ratio_bounds`, [low, high]; None where the
    sweep left it unbounded)."""
    def over(a: str | None, b: str | None) -> float | None:
        x, y = per_gpu.get(a or ""), per_gpu.get(b or "")
        return round(x / y, 3) if x and y else None

    # the headline ratios are of the variants as they are; labelled copies (NAME+LABEL)
    # are reported over their own variant, and the copies of one label among themselves
    # (`label_ratios`: a run of `1p1d+fp8,monolith-prefill-first+fp8` compares a family)
    pairs, best = headline_pairs(per_gpu, "")
    out: dict[str, Any] = {key: over(a, b) for key, (a, b) in pairs.items()}
    out["best_chunked"] = best
    copies = {k: (k, k.partition("+")[0]) for k in per_gpu if "+" in k}
    families: dict[str, dict[str, tuple[str, str]]] = {}  # label -> its pairs that both ran
    for label in dict.fromkeys(k.partition("+")[2] for k in copies):
        fam = {key: ab for key, ab in headline_pairs(per_gpu, label)[0].items()
               if ab[0] in per_gpu and ab[1] in per_gpu}
        if fam:
            families[label] = fam
    if copies:
        out["variant_over_base"] = {k: over(a, b) for k, (a, b) in copies.items()}
    if families:
        out["label_ratios"] = {label: {key: over(a, b) for key, (a, b) in fam.items()}
                               for label, fam in families.items()}
    if bounds is not None:
        spans = {key: ratio_span(bounds, a, b) for key, (a, b) in {**pairs, **copies}.items()
                 if a in bounds and b in bounds}
        out["ratio_bounds"] = {key: span for key, span in spans.items() if key in pairs}
        if copies:
            out["ratio_bounds"]["variant_over_base"] = {k: v for k, v in spans.items() if k in copies}
        if families:
            out["ratio_bounds"]["label_ratios"] = {
                label: {key: ratio_span(bounds, a, b) for key, (a, b) in fam.items() if a in bounds and b in bounds}
                for label, fam in families.items()}
    return out


def headline_pairs(per_gpu: dict[str, float | None], label: str) -> tuple[dict[str, tuple[str, str]], str | None]:
    """The headline ratios' (numerator, denominator) variant names among the variants
    with `label` ("" for those as they are), and the best chunked monolith among them."""
    tag = f"+{label}" if label else ""
    chunked = {k: v for k, v in per_gpu.items()
               if k.startswith("monolith-chunked") and k.partition("+")[2] == label}
    best = max(chunked, key=lambda k: chunked[k] or 0) if chunked else None
    pairs = {
        "pd_over_prefill_first": ("1p1d" + tag, "monolith-prefill-first" + tag),
        "pd_over_chunk_8192": ("1p1d" + tag, "monolith-chunked-8192" + tag),
        "pd_over_best_chunked": ("1p1d" + tag, best or ""),
        "1p2d_over_prefill_first": ("1p2d" + tag, "monolith-prefill-first" + tag),
        "1p2d_over_1p1d": ("1p2d" + tag, "1p1d" + tag),
    }
    return pairs, best


def ratio_span(bounds: dict[str, list[float | None]], a: str, b: str) -> list[float | None]:
    """[low, high] of capacity(a) / capacity(b) over their intervals."""
    (lo_a, hi_a), (lo_b, hi_b) = bounds[a], bounds[b]
    low = round((lo_a or 0.0) / hi_b, 3) if hi_b else 0.0
    high = round(hi_a / lo_b, 3) if hi_a is not None and lo_b else None
    return [low, high]


def level_key(cfg: CompareConfig) -> str:
    """"rate" when Poisson levels were given (--rate / --variant-rate), else "concurrency"."""
    return "rate" if cfg.rate or cfg.variant_rate else "concurrency"


def variant_level_overrides(flag: str, spec: str) -> dict[str, str]:
    """'VARIANT=LEVELS;...' (a --variant-rate or --variant-concurrency value) -> VARIANT
    -> LEVELS text; ValueError naming `flag` for a part that is not VARIANT=LEVELS."""
    overrides: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, sep, levels = part.partition("=")
        if not sep or not levels.strip():
            raise ValueError(f"{flag}: {part!r} is not VARIANT=LEVELS")
        overrides["+".join(x.strip() for x in name.split("+"))] = levels
    return overrides


def levels_for(cfg: CompareConfig, variant: str) -> list[float]:
    """One variant's levels: its entry in --variant-rate / --variant-concurrency (the
    chunked monoliths share `monolith-chunked`; a labelled copy takes its own entry, else
    its variant's), else --rate / --concurrency."""
    rate = level_key(cfg) == "rate"
    flag, spec = ("--variant-rate", cfg.variant_rate) if rate else ("--variant-concurrency", cfg.variant_concurrency)
    overrides = variant_level_overrides(flag, spec)
    known = set(FAMILIES) | {"+".join(split_variant(v)) for v in cfg.variants.split(",") if "+" in v}
    if set(overrides) - known:
        raise ValueError(f"{flag}: unknown variants {sorted(set(overrides) - known)}; known: {sorted(known)}")
    base, plus, label = variant.partition("+")
    family = "monolith-chunked" if base.startswith("monolith-chunked") else base
    # a labelled copy: its own entry, else its variant's
    chosen = overrides.get(family + plus + label) or overrides.get(family)
    if rate:
        return parse_list(chosen or cfg.rate, "rate", float)
    return parse_list(chosen or cfg.concurrency, "concurrency", int)


def attach_waterfall(row: dict[str, Any], streams: list[dict[str, Any]]) -> None:
    """The level's per-stage waterfall (BENCHMARKS.md section 5) from the stamps in every
    completed stream's final record: where the time of a request went at this load."""
    try:
        stages, check = waterfall.analyze(streams)
    except ValueError as exc:  # no completed stream carried stamps (every one failed)
        row["waterfall"], row["waterfall_check"] = [], {"error": str(exc)}
        return
    row["waterfall"] = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in st.items()} for st in stages]
    row["waterfall_check"] = check


def print_waterfall_at(rows: list[dict[str, Any]], capacity: float | None) -> None:
    """Prints the waterfall at the capacity point, or at the lowest level when none passed
    (that is where the failure starts)."""
    if not rows:
        return
    key = rows_level_key(rows)
    at = next((r for r in rows if r[key] == capacity), rows[0])
    label = "capacity point" if at[key] == capacity else "lowest level (no level passed)"
    print(f"\nwaterfall of {at['mode']} at {key} {at[key]:g} ({label}):")
    print(waterfall_text(at))


def waterfall_text(row: dict[str, Any]) -> str:
    if not row.get("waterfall"):
        return f"(no waterfall: {row.get('waterfall_check', {}).get('error', 'no stamps')})"
    check = row["waterfall_check"]
    return (text_table(row["waterfall"], waterfall.COLUMNS) +
            f"\nstamped/client p50 {check['stamped_over_client_p50']:.3f}, unexplained p95 "
            f"{100 * check['unexplained_p95']:.1f}% ({'adds up' if check['adds_up'] else 'does NOT add up'})")


RATIO_NAMES = {
    "pd_over_prefill_first": "1P1D / prefill-first",
    "pd_over_chunk_8192": "1P1D / chunked-8192",
    "pd_over_best_chunked": "1P1D / best chunk size",
    "1p2d_over_prefill_first": "1P2D / prefill-first",
    "1p2d_over_1p1d": "1P2D / 1P1D",
}


def ratios_markdown(summary: dict[str, Any]) -> str:
    """The headline ratios that could be computed, each with the range its level spacing
    allows (`ratio_bounds`), and every capacity with its interval: what a reader quotes."""
    def span(b: list[float | None] | None) -> str:
        if b is None:
            return "-"
        return f"{b[0]:g} - {'open' if b[1] is None else format(b[1], 'g')}"

    bounds = summary.get("ratio_bounds", {})
    out = ["", "## Capacity per GPU and ratios, with the range the levels allow", "",
           "| variant | capacity per GPU | lies in |", "|---|---:|---:|"]
    for name, (lo, hi) in summary.get("capacity_bounds_per_gpu", {}).items():
        cap = summary["capacity_per_gpu"].get(name)
        top = "open" if hi is None else format(hi, "g")
        out.append(f"| {name} | {'-' if cap is None else format(cap, 'g')} | [{lo:g}, {top}) |")
    out += ["", "| ratio | value | bounds |", "|---|---:|---:|"]
    for key, label in RATIO_NAMES.items():
        if key in bounds:
            value = summary.get(key)
            out.append(f"| {label} | {'-' if value is None else value} | {span(bounds[key])} |")
    for name, b in bounds.get("variant_over_base", {}).items():
        value = summary.get("variant_over_base", {}).get(name)
        out.append(f"| {name} / {name.partition('+')[0]} | {'-' if value is None else value} | {span(b)} |")
    for label, fam in bounds.get("label_ratios", {}).items():
        for key, b in fam.items():
            value = summary.get("label_ratios", {}).get(label, {}).get(key)
            out.append(f"| {RATIO_NAMES[key]}, both +{label} | {'-' if value is None else value} | {span(b)} |")
    return "\n".join(out) + "\n"


def _error_cell(level: dict[str, Any]) -> str:
    """An overload level's errors and their kinds ("652 (http_429:no_capacity 652)")."""
    kinds = level.get("error_kinds") or {}
    detail = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
    return f"{level.get('errors') or 0}" + (f" ({detail})" if detail else "")


def overload_markdown(overload: dict[str, Any] | None) -> str:
    """The overload level of each variant: goodput (frames/s of the streams that met the
    floor), refused share, and a labelled copy's goodput over its variant's."""
    if not overload:
        return ""
    out = ["", "## Overload level (--overload-rate)", "",
           "| variant | goodput fps | refused | stutter | min fps | TTFA p95 ms | refusal p99 ms | errors | admitted kept floor |",
           "|---|---:|---:|---:|---:|---:|---:|---|---|"]

    def cell(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for name, lv in overload["levels"].items():
        out.append(f"| {name} | {cell(lv['goodput_fps'], '.0f')} | {cell(lv['refused_share'], '.1%')} | "
                   f"{cell(lv['stutter_share'], '.1%')} | {cell(lv['min_rate'], '.1f')} | "
                   f"{cell(lv['ttfa_p95_ms'], '.0f')} | {cell(lv['refusal_p99_ms'], '.0f')} | "
                   f"{_error_cell(lv)} | {lv['admitted_kept_floor']} |")
    for name, a in overload.get("against_base", {}).items():
        out.append(f"\n{name} / {name.partition('+')[0]}: goodput x{cell(a['goodput_over_base'], 'g')}, refused "
                   f"{cell(a['refused_share'], '.1%')} vs {cell(a['base_refused_share'], '.1%')}")
    return "\n".join(out) + "\n"


def waterfalls_markdown(rows: list[dict[str, Any]], per_gpu: dict[str, float | None]) -> str:
    """Per variant: the waterfall at its capacity point (else its lowest level)."""
    out = ["", "## Engines per level (from P's, D's and the LB's own metrics; client lag from the load generator)",
           "",
           f"| mode | {rows_level_key(rows)} | D step ms | D batch | steps > 256 | D wait > 50 ms | graph share "
           "| D GPU busy | D GC ms/s | P forward ms | P busy | P graph share | P cached rows | P reserve ms | P gap ms "
           "| LB lag ms | LB lag > 20 ms | LB GC ms/s | compiles s | host CPU busy | host CPU stolen | GPU MHz min "
           "| GPU W | GPU C max | client lag p99 ms |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        e = r.get("engine") or {}
        if e:
            cells = [e.get(k, "-") for k in ("d_step_ms", "d_batch", "d_batch_over_256", "d_admit_wait_over_50ms",
                                              "d_graph_share", "d_gpu_busy", "d_gc_ms_per_s",
                                              "p_forward_ms", "p_busy", "p_graph_share", "p_cached_share",
                                              "p_reserve_ms", "p_gap_ms",
                                              "lb_lag_mean_ms", "lb_lag_over_20ms", "lb_gc_ms_per_s", "compile_s",
                                              "host_busy", "host_steal", "gpu_sm_mhz_min", "gpu_power_w_mean",
                                              "gpu_temp_c_max")]
            cells.append(r.get("client_lag_p99_ms", "-"))
            out.append(f"| {r['mode']} | {r[rows_level_key(rows)]:g} | " + " | ".join(str(c) for c in cells) + " |")
    out += admission_markdown(rows)
    out += ["", "## Waterfalls (per-stage p50/p99 ms; BENCHMARKS.md section 5)", ""]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        cap = per_gpu.get(mode)
        key = rows_level_key(mine)
        at = next((r for r in mine if cap and abs(r[key] - cap * r["gpus"]) < 1e-6), mine[0])
        out += [f"### {mode} at {key} {at[key]:g}", "", "```", waterfall_text(at), "```", ""]
    return "\n".join(out)


ADMISSION_COLUMNS = (("refused", "d_refusals"), ("of them whole-life", "d_life_refusals"),
                     ("headroom", "adm_headroom"), ("under-prediction", "adm_under_prediction"),
                     ("feedback", "adm_feedback"), ("base ms", "adm_base_ms"), ("per stream ms", "adm_per_stream_ms"),
                     ("per token ms", "adm_per_token_ms"), ("per row ms", "adm_per_row_ms"),
                     ("stall per stream ms", "adm_stall_per_stream_ms"), ("prefill base ms", "adm_prefill_base_ms"),
                     ("prefill per row ms", "adm_prefill_per_row_ms"))


def admission_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The rate-floor admission's state at each level's end (rows whose engine exports
    it): what it refused and the step model and budget factors it judged with."""
    mine = [r for r in rows if any(k.startswith("adm_") for k in r.get("engine") or {})]
    if not mine:
        return []
    key = rows_level_key(rows)
    out = ["", "## Admission at each level's end (D's or the monolith's gauges; refusals over the window)", "",
           f"| mode | {key} | " + " | ".join(c for c, _ in ADMISSION_COLUMNS) + " |",
           "|---|---:|" + "---:|" * len(ADMISSION_COLUMNS)]
    for r in mine:
        e = r["engine"]
        out.append(f"| {r['mode']} | {r[key]:g} | " + " | ".join(str(e.get(k, 0 if k.startswith('d_') else '-'))
                                                                  for _, k in ADMISSION_COLUMNS) + " |")
    return out


# Engine series read around each level: D's (or the monolith's) step time, batch,
# graph/eager replays and GPU-busy account (CUDA events), P's (or the monolith's
# prefill) forward time.
_SERIES = {
    "d_steps": "pdunit_decode_step_seconds_count", "d_step_s": "pdunit_decode_step_seconds_sum",
    "d_batch_sum": "pdunit_decode_step_batch_sum", "d_gpu_busy_s": "pdunit_decode_gpu_busy_seconds_total",
    # steps with more streams than the old 256-stream --max-batch; streams that waited for room in the batch
    "d_batch_le_256": 'pdunit_decode_step_batch_bucket{le="256.0"}',
    "d_waits": "pdunit_decode_admit_wait_seconds_count", "d_wait_s": "pdunit_decode_admit_wait_seconds_sum",
    "d_waits_le_50ms": 'pdunit_decode_admit_wait_seconds_bucket{le="0.05"}',
    "d_graph": 'pdunit_decode_graph_steps_total{path="graph"}',
    "d_refusals": "pdunit_rate_floor_refusals_total", "d_life_refusals": "pdunit_rate_floor_life_refusals_total",
    "d_eager": 'pdunit_decode_graph_steps_total{path="eager"}',
    "p_forwards": "pdunit_prefill_forward_seconds_count", "p_forward_s": "pdunit_prefill_forward_seconds_sum",
    "p_reserves": 'pdunit_prefill_stage_seconds_count{stage="reserve"}',
    "p_reserve_s": 'pdunit_prefill_stage_seconds_sum{stage="reserve"}',
    "p_gaps": "pdunit_prefill_forward_gap_seconds_count", "p_gap_s": "pdunit_prefill_forward_gap_seconds_sum",
    "p_graph": 'pdunit_prefill_forwards_total{path="graph"}',
    # prompt rows served from the prefix cache and computed (P, or the monolith's prefills)
    "p_cached_rows": 'pdunit_prefill_tokens_total{source="cached"}',
    "p_computed_rows": 'pdunit_prefill_tokens_total{source="computed"}',
    "p_eager": 'pdunit_prefill_forwards_total{path="eager"}',
    "lb_lag_n": "pdunit_lb_loop_lag_seconds_count", "lb_lag_s": "pdunit_lb_loop_lag_seconds_sum",
    "lb_lag_le_20ms": 'pdunit_lb_loop_lag_seconds_bucket{le="0.02"}',
    # garbage-collection pauses (every thread of the process waits), per generation
    **{f"{role}_gc{g}_s": f'pdunit_gc_pause_seconds_sum{{generation="{g}"}}' for role in ("d", "lb") for g in "012"},
    # Triton compiles while serving (engine/kernel_compiles.py), each engine process its own:
    # the monolith's one process exports it once, so these keys are per process, not per prefix
    **{f"{role}_compile_s": 'pdunit_kernel_compile_seconds_total{phase="serving"}'
       for role in ("decode", "prefill", "monolith")},
}


# Rate-floor admission at a window's end (gauges of D or the monolith, not deltas): the
# step model's terms, how much it under-predicts, the delivered-rate feedback and the
# headroom; with the refusals counted in `_SERIES`, why a level refused what it did.
_ADMISSION = {
    "adm_headroom": "pdunit_rate_floor_headroom_streams",
    "adm_under_prediction": "pdunit_step_model_under_prediction",
    "adm_feedback": "pdunit_rate_floor_feedback_factor",
    "adm_delivered_q": "pdunit_rate_floor_delivered_quantile",
    **{f"adm_{term}": f'pdunit_step_model_coefficient_ms{{term="{term}"}}'
       for term in (*TERMS, "stall_per_stream_ms", "prompt_rows_per_stream_ms", "prefill_base_ms",
                    "prefill_per_row_ms")},
}


def engine_ports(unit_cfg: LocalConfig) -> dict[str, int]:
    """Gives P and D of a PD unit, or the monolith, a metrics port (added to their
    commands in place)."""
    if unit_cfg.mode == "monolith":
        ports = {"monolith": free_port()}
        unit_cfg.extra_monolith_args.extend(["--metrics-port", str(ports["monolith"])])
        return ports
    ports = {"decode": free_port(), "prefill": free_port()}
    unit_cfg.extra_decode_args.extend(["--metrics-port", str(ports["decode"])])
    unit_cfg.extra_prefill_args.extend(["--metrics-port", str(ports["prefill"])])
    return ports


def _scrape_all(ports: dict[str, int]) -> dict[str, float]:
    """The `_SERIES` of each role from its own process (each exports its role's series
    only, engine/metrics.py), keyed by `_SERIES` key: a series every process exports
    (the GC pauses) is one key per role."""
    out: dict[str, float] = {}
    for role, port in ports.items():
        try:
            values = report.scrape_metrics(port)
        except httpx.HTTPError:
            continue  # a process that went away: its level shows errors anyway
        # the monolith's one loop exports both: decode steps and the prefill parts of them
        prefixes = {"decode": ("d_",), "prefill": ("p_",), "monolith": ("d_", "p_"), "lb": ("lb_",)}[role]
        out.update({key: values.get(name, 0.0) for key, name in _SERIES.items()
                    if key.startswith(prefixes) or key.startswith(f"{role}_")})
        if role in ("decode", "monolith"):
            out.update({key: values[name] for key, name in _ADMISSION.items() if name in values})
    out.update(host_cpu_ticks())
    return out


# /proc/stat's aggregate "cpu" line: user nice system idle iowait irq softirq steal ...
_IDLE_FIELDS, _STEAL_FIELD = (3, 4), 7


def host_cpu_ticks(stat: str = "/proc/stat") -> dict[str, float]:
    """The host's CPU time so far, in clock ticks over all CPUs: total, busy (neither
    idle nor waiting for I/O) and stolen by the hypervisor (a VM's CPUs running another
    guest). Empty where there is no /proc/stat. The engines table shows the shares per
    level: the monoliths' steps moved 20-45% between calls on the same code
    (bench/results/capacity-20261130-h200x2-60s-s1.md), and a busy or stolen host is
    one cause a level can show."""
    try:
        with open(stat) as f:
            first = f.readline().split()
    except OSError:
        return {}
    if not first or first[0] != "cpu":
        return {}
    ticks = [float(x) for x in first[1:9]]
    total = sum(ticks)
    idle = sum(ticks[i] for i in _IDLE_FIELDS)
    return {"host_total": total, "host_busy": total - idle - ticks[_STEAL_FIELD], "host_steal": ticks[_STEAL_FIELD]}


def engine_deltas(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """What the engines did during one level: mean D step and batch, the share of steps
    over 256 streams, D's admission wait (mean; share over 50 ms: streams that waited
    for room in a full batch), the share of steps replayed from a CUDA graph, D's GPU
    busy share; P's mean forward, busy share, share of forwards replayed from a prefill
    graph, share of prompt rows served from the prefix cache and mean reserve stage
    (RESERVE round trip); the seconds the unit's engines spent compiling Triton kernels
    while serving; D's and the LB's GC pauses per second; how late the LB's event loop
    ran (mean, and the share of wake-ups > 20 ms late); the host's CPU busy and stolen
    shares."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (*_SERIES, "host_total", "host_busy", "host_steal")}
    out: dict[str, float] = {}
    if d["host_total"] > 0:  # every CPU of the host, whatever ran on it (both units of a wave)
        out["host_busy"] = round(d["host_busy"] / d["host_total"], 4)
        out["host_steal"] = round(d["host_steal"] / d["host_total"], 4)
    if d["d_steps"] > 0:
        out["d_step_ms"] = round(1000 * d["d_step_s"] / d["d_steps"], 3)
        out["d_batch"] = round(d["d_batch_sum"] / d["d_steps"], 1)
        out["d_batch_over_256"] = round(1 - d["d_batch_le_256"] / d["d_steps"], 4)
    if d["d_refusals"] > 0:  # rate-floor refusals, and of them the whole-life check's
        out["d_refusals"] = d["d_refusals"]
        out["d_life_refusals"] = d["d_life_refusals"]
    # admission's state at the window's end (present where D or the monolith exports it)
    out.update({k: float(f"{v:.4g}") for k, v in after.items() if k in _ADMISSION})  # per-token terms are ~1e-5
    if d["d_waits"] > 0:  # admission to the first step with room; > 50 ms: the batch was full
        out["d_admit_wait_ms"] = round(1000 * d["d_wait_s"] / d["d_waits"], 3)
        out["d_admit_wait_over_50ms"] = round(1 - d["d_waits_le_50ms"] / d["d_waits"], 4)
    if d["d_graph"] + d["d_eager"] > 0:
        out["d_graph_share"] = round(d["d_graph"] / (d["d_graph"] + d["d_eager"]), 4)
    if d["d_gpu_busy_s"] > 0 and seconds > 0:
        out["d_gpu_busy"] = round(d["d_gpu_busy_s"] / seconds, 4)
    if d["p_forwards"] > 0 and seconds > 0:
        out["p_forward_ms"] = round(1000 * d["p_forward_s"] / d["p_forwards"], 3)
        out["p_busy"] = round(d["p_forward_s"] / seconds, 4)
    if d["p_reserves"] > 0:  # prefix lease + RESERVE round trip to D, queueing excluded
        out["p_reserve_ms"] = round(1000 * d["p_reserve_s"] / d["p_reserves"], 3)
    if d["p_gaps"] > 0:  # from a forward's end to the next's start, the next batch already reserved
        out["p_gap_ms"] = round(1000 * d["p_gap_s"] / d["p_gaps"], 3)
    if d["p_cached_rows"] + d["p_computed_rows"] > 0:
        out["p_cached_share"] = round(d["p_cached_rows"] / (d["p_cached_rows"] + d["p_computed_rows"]), 4)
    if d["p_graph"] + d["p_eager"] > 0:
        out["p_graph_share"] = round(d["p_graph"] / (d["p_graph"] + d["p_eager"]), 4)
    # seconds the unit's engines spent compiling kernels during the level (each a stall)
    out["compile_s"] = round(sum(d[f"{role}_compile_s"] for role in ("decode", "prefill", "monolith")), 3)
    if seconds > 0:  # ms per second of the level spent in GC pauses
        for role in ("d", "lb"):
            out[f"{role}_gc_ms_per_s"] = round(1000 * sum(d[f"{role}_gc{g}_s"] for g in "012") / seconds, 3)
    if d["lb_lag_n"] > 0:
        out["lb_lag_mean_ms"] = round(1000 * d["lb_lag_s"] / d["lb_lag_n"], 3)
        out["lb_lag_over_20ms"] = round(1 - d["lb_lag_le_20ms"] / d["lb_lag_n"], 4)
    return out


def stream_frames(cfg: CompareConfig) -> str:
    """--frames, or its default for the device."""
    return cfg.frames or ("105-630" if cfg.device != "cpu" else "105-210")


def client_processes(cfg: CompareConfig) -> int:
    """--client-procs, or its default for the device."""
    return cfg.client_procs or (4 if cfg.device != "cpu" else 1)


def resolved_config(cfg: CompareConfig) -> dict[str, Any]:
    """The config as the run used it: the device-dependent defaults filled in."""
    return {**cfg.model_dump(), "frames": stream_frames(cfg), "client_procs": client_processes(cfg)}


def run_levels(cfg: CompareConfig, name: str, gpus: int, url: str, ports: dict[str, int],
               command: str) -> dict[str, Any]:
    """The variant's levels one at a time, reading the engines' metrics around each."""
    key = level_key(cfg)
    levels = levels_for(cfg, name)
    base = CapacityConfig(
        url=url, concurrency=levels if key == "concurrency" else [], rate=levels if key == "rate" else [],
        burst_share=cfg.burst_share, burst_size=cfg.burst_size, duration=cfg.duration, ramp=cfg.ramp,
        warmup=cfg.ramp,
        prompt_rows=parse_range(cfg.prompt_rows, "prompt_rows"), frames=parse_range(stream_frames(cfg), "frames"),
        voice_reuse=cfg.voice_reuse, mode_label=name, gpus=gpus, progress=False, api=cfg.api,
        voice_source=cfg.voice_source,
        client_procs=client_processes(cfg) if key == "rate" else 1)
    rows: list[dict[str, Any]] = []
    overload_rows: list[dict[str, Any]] = []
    doc: dict[str, Any] = {}
    sample_gpus = cfg.device != "cpu" and GpuSampler.available()

    def run_level(level: float, overload: bool = False) -> bool:
        """Every run of one level, appended to `rows` (an overload level's to
        `overload_rows`); whether all passed."""
        nonlocal doc
        for run in range(cfg.repeat):
            marks: dict[str, tuple[float, dict[str, float]]] = {}

            def window(name: str, marks: dict[str, tuple[float, dict[str, float]]] = marks) -> None:
                marks[name] = (time.monotonic(), _scrape_all(ports))

            before = (time.monotonic(), _scrape_all(ports))
            sampler = GpuSampler(range(cfg.gpu_base, cfg.gpu_base + gpus)).start() if sample_gpus else None
            update: dict[str, Any] = {key: [level], "seed": base.seed + run}
            if overload:  # Poisson with clumps, whatever the sweep's levels are
                update = {"rate": [level], "concurrency": [], "seed": base.seed + run,
                          "burst_share": cfg.burst_share or 0.2}
            doc = run_capacity(base.model_copy(update=update), command=command,
                               keep_streams=True, window=window if ports else None)
            clocks = sampler.stop() if sampler is not None else {}
            row = doc["rows"][0]
            row["repeat"] = run
            # the steady window (ramp and drain left out) when the level had one
            (t_a, a), (t_b, b) = (marks["start"], marks["end"]) if "end" in marks else \
                (before, (time.monotonic(), _scrape_all(ports)))
            row["engine"] = engine_deltas(a, b, t_b - t_a)
            row["engine"]["window"] = "steady" if "end" in marks else "level"
            row["engine"].update(clocks)  # the variant's GPUs over the whole level (bench/gpu_clocks.py)
            row["gpu_busy"] = row["engine"].get("d_gpu_busy")
            attach_waterfall(row, doc["streams"])  # this run's streams only
            row["slowest_streams"] = slowest_streams(doc["streams"])
            if overload:
                row["overload"] = True
                overload_rows.append(row)
            else:
                rows.append(row)
        return all(r["passed"] for r in rows if r[key] == level)

    passed: dict[float, bool] = {}
    for level in levels:
        passed[level] = run_level(level)
        if cfg.stop_at_failure and not passed[level]:
            if level != levels[-1]:
                print(f"{name}: level {level:g} failed; the levels above it are skipped (--no-stop-at-failure "
                      "runs them)", flush=True)
            break
    for level in bracket_levels(cfg, name, levels, passed):
        print(f"{name}: bracketing its capacity: level {level:g}", flush=True)
        passed[level] = run_level(level)
        if passed[level] != (level > max(levels)):  # the first failure above, or the first pass below
            break
    if cfg.overload_rate:
        print(f"{name}: overload level at {cfg.overload_rate:g} arrivals/s", flush=True)
        run_level(cfg.overload_rate, overload=True)
    # summarize_run: a level whose any run failed ends the capacity below it; its criteria
    # are the rates the rows were judged at (resolved from the unit: 25 frames/s for CSM)
    judged = base.model_copy(update={k: doc["config"][k] for k in ("fps", "min_rate") if k in doc.get("config", {})})
    return {**doc, "config": {**doc.get("config", {}), key: sorted(passed), "repeat": cfg.repeat}, "rows": rows,
            "overload_rows": overload_rows, "summary": summarize_run(rows, judged)}


OVERLOAD_FIELDS = ("goodput_fps", "refused_share", "stutter_share", "min_rate", "ttfa_p95_ms", "refusal_p99_ms",
                   "errors", "error_kinds", "admitted_kept_floor")


def overload_summary(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each variant's overload level (its first run; BENCHMARKS.md: 0 stutter among the
    admitted streams and TTFA p95 <= 500 ms with admission on), and each labelled copy's
    goodput over its variant's with its and its variant's refused share (admission on
    vs off when the label turns it on)."""
    levels: dict[str, dict[str, Any]] = {}
    for name, doc in docs.items():
        if doc.get("overload_rows"):
            levels[name] = {k: doc["overload_rows"][0].get(k) for k in OVERLOAD_FIELDS}
        elif name in doc["summary"].get("overload", {}).get("levels", {}):  # a wave's child: its results file
            levels[name] = doc["summary"]["overload"]["levels"][name]
    out: dict[str, Any] = {"levels": levels}
    against = {}
    for name, level in levels.items():
        base = levels.get(name.partition("+")[0]) if "+" in name else None
        if base is None:
            continue
        ratio = (round(level["goodput_fps"] / base["goodput_fps"], 3)
                 if level["goodput_fps"] is not None and base["goodput_fps"] else None)
        against[name] = {"goodput_over_base": ratio, "refused_share": level["refused_share"],
                         "base_refused_share": base["refused_share"]}
    if against:
        out["against_base"] = against
    return out


def bracket_levels(cfg: CompareConfig, name: str, levels: list[float], passed: dict[float, bool]) -> list[float]:
    """The levels --bracket adds, in the order to run them (the caller stops at the first
    that closes the bracket): above the highest listed level when every listed level
    passed, below the lowest when it failed, none when the listed levels already bracket
    the capacity."""
    if not cfg.bracket or not passed:
        return []
    top, bottom = max(levels), min(levels)
    if passed.get(top) and all(passed.values()):  # a failed level below would cap the capacity already
        step = bracket_step(cfg, name, levels, up=True)
        return [top + step * (i + 1) for i in range(cfg.bracket)]
    if passed.get(bottom) is False:
        step = bracket_step(cfg, name, levels, up=False)
        return [x for x in (bottom - step * (i + 1) for i in range(cfg.bracket)) if x > 0]
    return []


def bracket_step(cfg: CompareConfig, name: str, levels: list[float], up: bool) -> float:
    """--bracket-step, else the spacing of the two listed levels nearest the side it
    extends; integral for closed-loop levels."""
    ordered = sorted(levels)
    if cfg.bracket_step:
        step = cfg.bracket_step
    elif len(ordered) >= 2:
        step = ordered[-1] - ordered[-2] if up else ordered[1] - ordered[0]
    else:
        raise SystemExit(f"pdunit bench compare: --bracket: {name} has one level ({ordered[0]:g}); give "
                         "--bracket-step")
    if level_key(cfg) == "concurrency" and step != int(step):
        raise SystemExit(f"pdunit bench compare: --bracket-step {step:g}: closed-loop levels are whole streams")
    return int(step) if level_key(cfg) == "concurrency" else step


def slowest_streams(streams: list[dict[str, Any]], n: int = 5) -> list[dict[str, Any]]:
    """The level's `n` slowest served streams (by frames/s), with when they started and
    how long they were: slow streams that started together point at a stall the unit
    had (a pause of D or the LB), long ones at the batch's peak."""
    served = sorted((s for s in streams if s.get("error") is None and s.get("rate") is not None),
                    key=lambda s: s["rate"])
    return [{"index": s["index"], "started_s": round(s["started_s"], 2), "frames": s["frames"],
             "prompt_rows": s["prompt_rows"], "rate": round(s["rate"], 1), "worst_window": s["worst_window"],
             "ttfa_ms": None if s["ttfa_s"] is None else round(s["ttfa_s"] * 1000, 1)} for s in served[:n]]


def waves(units: list[Unit], parallel_gpus: int) -> list[list[Unit]]:
    """Variants packed in order into waves of at most `parallel_gpus` GPUs; a variant
    that needs more gets a wave of its own."""
    out: list[list[Unit]] = []
    used = 0
    for unit in units:
        if not out or used + unit[1] > parallel_gpus:
            out.append([])
            used = 0
        out[-1].append(unit)
        used += unit[1]
    return out


def run_variant(cfg: CompareConfig, name: str, gpus: int, unit_cfg: LocalConfig, command: str) -> dict[str, Any]:
    """One variant in this process: its unit started, its levels swept, the unit stopped.
    The variant's doc: rows (with `gpus`) and summary."""
    print(f"== {name}: starting the unit", flush=True)
    if cfg.run_dir:
        unit_cfg = unit_cfg.model_copy(update={"run_dir": f"{cfg.run_dir}/{name}"})
    ports = engine_ports(unit_cfg)
    with LocalUnit(unit_cfg) as unit:
        ports["lb"] = int(urlparse(unit.url).port or 0)  # the LB serves /metrics on its own port
        doc = run_levels(cfg, name, gpus, unit.url, ports, command)
    print_report(doc)
    for row in doc["rows"]:
        row["gpus"] = gpus
        if row.get("engine"):
            print(f"engines at {row[rows_level_key(doc['rows'])]:g} (run {row['repeat']}): {row['engine']}")
    print_waterfall_at(doc["rows"], doc["summary"].get("capacity", doc["summary"].get("capacity_rate")))
    return doc


def child_config(cfg: CompareConfig, name: str, gpu_base: int, out: Path) -> CompareConfig:
    """The config of a child run of one variant (`monolith-chunked-<c>[+LABEL]`: the
    family with `--chunks c`); its run_dir stays, the child adds /<name> itself."""
    base, sep, label = name.partition("+")
    chunk = base.removeprefix("monolith-chunked-")
    variant = {"variants": name} if chunk == base else {"variants": "monolith-chunked" + sep + label, "chunks": chunk}
    # the child defines only the label it runs (none for a variant as it is)
    for field, defined in zip(("variant_args", "variant_decode_args"), variant_labels(cfg), strict=True):
        variant[field] = f"{label}={defined[label]}" if label in defined else ""
    # and only its own levels: the other entries of --variant-rate/--variant-concurrency name
    # variants it does not run (its check would refuse them)
    variant.update({level_key(cfg): ",".join(f"{x:g}" for x in levels_for(cfg, name)),
                    "variant_rate": "", "variant_concurrency": ""})
    return cfg.model_copy(update={**variant, "parallel_gpus": 1, "gpu_base": gpu_base, "out": str(out),
                                  "plot": ""})


@dataclass
class ChildRun:
    name: str
    proc: subprocess.Popen
    log: Path
    out: Path


def gpu_label(cfg: CompareConfig, first: int, gpus: int) -> str:
    if cfg.device == "cpu":
        return "cpu"
    return ("GPU " if gpus == 1 else "GPUs ") + ",".join(str(first + i) for i in range(gpus))


def run_wave(cfg: CompareConfig, wave: list[Unit], tmp: Path) -> dict[str, dict[str, Any]]:
    """The variants of one wave at once, each a `python -m pdunit.bench.compare` process
    (its load generator has a GIL of its own) on GPUs of its own. Their results documents
    by name; a failing child ends the wave and raises SystemExit."""
    children: list[ChildRun] = []
    first = cfg.gpu_base
    try:
        for name, gpus, _ in wave:
            others = ", ".join(n for n, _, _ in wave if n != name)
            print(f"== {name} (running alongside {others} on {gpu_label(cfg, first, gpus)})", flush=True)
            argv = to_argv(child_config(cfg, name, first, tmp / f"{name}.json"))
            log = tmp / f"{name}.log"
            with log.open("wb") as f:  # the child keeps its own copy of the descriptor
                proc = subprocess.Popen([sys.executable, "-m", "pdunit.bench.compare", *argv], stdin=subprocess.DEVNULL,
                                        stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
            children.append(ChildRun(name, proc, log, tmp / f"{name}.json"))
            first += gpus
        failed = wait_children(children)
    finally:
        stop_children(children)
    for child in children:
        print(f"\n== {child.name}: output of its process\n{child.log.read_text(errors='replace')}", flush=True)
    if failed:
        tail = "\n".join(failed.log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"pdunit bench compare: variant {failed.name} failed (exit code {failed.proc.returncode}); "
                         f"the rest of its wave was stopped. The end of its log:\n{tail}")
    return {child.name: json.loads(child.out.read_text()) for child in children}


def wait_children(children: list[ChildRun]) -> ChildRun | None:
    """Waits for every child; the first to exit non-zero is returned at once (the run
    fails, so the others' device time would be spent for nothing)."""
    while True:
        codes = [c.proc.poll() for c in children]
        failed = next((c for c, code in zip(children, codes, strict=True) if code), None)
        if failed or all(code == 0 for code in codes):
            return failed
        time.sleep(0.2)


def stop_children(children: list[ChildRun], timeout_s: float = 30.0) -> None:
    """SIGINT the children still running (each stops its unit on KeyboardInterrupt), then
    SIGKILL those that outlast `timeout_s`."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


def run_compare(cfg: CompareConfig, command: str) -> dict[str, Any]:
    units = variant_units(cfg)
    for name, _, _ in units:  # a bad --variant-rate/--variant-concurrency stops the run before any unit starts
        levels = levels_for(cfg, name)
        if cfg.bracket:  # and a --bracket that cannot find its step
            bracket_step(cfg, name, levels, up=True)
    plan = waves(units, cfg.parallel_gpus)
    print("waves: " + " ".join("[" + " | ".join(name for name, _, _ in wave) + "]" for wave in plan), flush=True)
    docs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pdu-compare-") as tmp:
        for i, wave in enumerate(plan):
            if len(wave) == 1:
                name, gpus, unit_cfg = wave[0]
                docs[name] = run_variant(cfg, name, gpus, unit_cfg, command)
            else:
                docs.update(run_wave(cfg, wave, Path(tmp)))
            if i + 1 < len(plan):
                # after every wave but the last: a run cut short (a device call's time
                # limit) keeps the variants it finished, marked partial
                write_results(cfg, docs, plan, command, partial=True)
    out = write_results(cfg, docs, plan, command, partial=False)
    if cfg.plot:
        plot_capacity(out["rows"], cfg.plot, CapacityConfig())
        out.setdefault("files", []).append(cfg.plot)
    return out


def write_results(cfg: CompareConfig, docs: dict[str, dict[str, Any]], plan: list[list[Unit]], command: str,
                  partial: bool) -> dict[str, Any]:
    """The results document of the variants run so far (written to --out when given)."""
    rows = [row for doc in docs.values() for row in doc["rows"]]
    per_gpu = {name: doc["summary"]["capacity_per_gpu"].get(name) for name, doc in docs.items()}
    realtime = {name: doc["summary"]["realtime_streams_per_gpu"].get(name) for name, doc in docs.items()
                if "realtime_streams_per_gpu" in doc["summary"]}
    # capacity_per_gpu: concurrent streams per GPU (closed loop) or arrivals/s per GPU
    # (Poisson, where realtime_streams_per_gpu gives it in listeners)
    bounds = {name: doc["summary"]["capacity_bounds_per_gpu"][name] for name, doc in docs.items()
              if name in doc["summary"].get("capacity_bounds_per_gpu", {})}
    summary: dict[str, Any] = {"levels": level_key(cfg), "capacity_per_gpu": per_gpu,
                               "capacity_bounds_per_gpu": bounds, **ratios(per_gpu, bounds)}
    # variants that passed their highest level: their capacity is at least what is shown,
    # so a ratio over one of them is an upper bound, a ratio of one over another a lower
    summary["capacity_lower_bound_only"] = {
        name: bool(doc["summary"].get("capacity_lower_bound_only", {}).get(name)) for name, doc in docs.items()}
    summary["levels_too_short"] = {name: bool(doc["summary"].get("levels_too_short", {}).get(name))
                                   for name, doc in docs.items()}
    summary["steady_state_s"] = max((doc["summary"].get("steady_state_s", 0.0) for doc in docs.values()), default=0.0)
    if realtime:
        summary["realtime_streams_per_gpu"] = realtime
    overload = overload_summary(docs)
    if overload["levels"]:
        summary["overload"] = overload
    summary["waves"] = [[name for name, _, _ in wave] for wave in plan]
    if partial:
        summary["partial"] = f"{len(docs)} of {sum(len(w) for w in plan)} variants run so far"
    results = report.Results(BENCH, machine_info(), command, resolved_config(cfg), rows, summary)
    out = results.document()
    if cfg.out:
        path = report.resolve_out(cfg.out, BENCH, results.machine)
        json_path, md_path = results.write(path, COLUMNS, "Capacity: PD vs monolith")
        with md_path.open("a") as md:
            md.write(ratios_markdown(summary))
            md.write(overload_markdown(summary.get("overload")))
            md.write(waterfalls_markdown(rows, per_gpu))
        out["files"] = [str(json_path), str(md_path)]
    return out


def main(argv: list[str]) -> int:
    cfg = parse_config(CompareConfig, argv, "pdunit bench compare")
    doc = run_compare(cfg, report.command_line(argv, prog="pdunit bench compare"))
    print("\nsummary:", doc["summary"])
    for name in (n for n, only in doc["summary"]["capacity_lower_bound_only"].items() if only):
        print(f"WARNING: {name} passed its highest level: its capacity is at least "
              f"{doc['summary']['capacity_per_gpu'][name]} per GPU, not that; ratios over it are upper bounds. "
              "Give it higher levels.", file=sys.stderr)
    for name, short in doc["summary"]["levels_too_short"].items():
        if short:
            print(short_levels_warning(name, cfg.duration, doc["summary"]["steady_state_s"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
