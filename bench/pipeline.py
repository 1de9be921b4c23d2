"""`pdunit bench pipeline`: P's real pipeline timed against `bench plan`'s model of it, on a CPU.

Owns one comparison: P's own threads, scheduler, hand-offs and prefix cache
(engine/prefill/) run the requests of `bench capacity` (same seeds) in real time, while
the forward sleeps what `bench plan` prices it at and D is a stub (RESERVE takes
`--reserve-ms`, COMMIT and the write are instant). Per level and `--reserve-concurrency`:
forwards, prompts per forward, each stage's p50/p99 on both sides, and the TTFA both
predict with the model's D fed by each side's prefill ends. Needs no GPU, never uses one.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from pdunit.bench import plan, report
from pdunit.engine.kv.prefix_cache import PrefixCache
from pdunit.engine.loadgen.summary import Column, machine_info, percentiles, text_table
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.packing import pack
from pdunit.engine.prefill.runner import PrefillChunk
from pdunit.engine.prefill.scheduler import PrefillJob, PrefillScheduler
from pdunit.engine.prefill.worker import PrefillEngine
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.settings import parse_config

BENCH = "pipeline"
STAGES = (("p_reserved", "p_admitted"), ("prefill_start", "p_reserved"), ("prefill_end", "prefill_start"))


class PipelineConfig(BaseModel):
    """pdunit bench pipeline: P's pipeline against bench plan's model of it (CPU)."""

    step: str = Field(..., description="a `bench step` results JSON (bench plan needs it for its costs)")
    prefill: str = Field(..., description="a `bench prefill` results JSON: what a forward sleeps")
    rate: str = Field("16,32", description="Poisson levels (arrivals/s), comma list")
    duration: float = Field(8.0, gt=0, description="seconds of arrivals per level")
    burst_share: float = Field(0.2, ge=0, lt=1, description="share of requests arriving in clumps")
    burst_size: int = Field(10, ge=1, description="requests per clump")
    prompt_rows: str = Field("1000-2000", description="prompt rows, LOW-HIGH")
    reserve_ms: float = Field(6.5, ge=0, description="the stub D's RESERVE time (compare's P reserve ms)")
    reserve_concurrency: str = Field("1,8", description="P's --reserve-concurrency, a comma list: each value "
                                     "its own engine and model rows on the same requests (1: P before issue 31)")
    max_batch_rows: int = Field(8192, gt=0, description="P's --max-batch-rows (prompt rows per forward)")
    max_batch_prompts: int = Field(16, gt=0, description="P's --max-batch-prompts")
    pool_tokens: int = Field(1_700_000, gt=0, description="the model D's pool in tokens (bench plan's --pool-tokens)")
    seed: int = Field(0, description="workload seed")
    out: str = Field("", description="results JSON path or folder ('' = print only)")

    def plan_config(self, reserve_concurrency: int = 1) -> plan.PlanConfig:
        """bench plan's config for the same requests and P; D's hand-off and delivery at
        bench plan's defaults (they price the TTFA column only)."""
        return plan.PlanConfig(step=self.step, prefill=self.prefill, variants="1p1d", duration=self.duration, ramp=0.0,
                               burst_share=self.burst_share, burst_size=self.burst_size,
                               prompt_rows=self.prompt_rows, reserve_ms=self.reserve_ms,
                               reserve_concurrency=reserve_concurrency, max_batch_rows=self.max_batch_rows,
                               max_batch_prompts=self.max_batch_prompts, pool_tokens=self.pool_tokens,
                               seed=self.seed)


class StubDecode:
    """D's Reserve/Commit/Cancel as P's stub calls them: a RESERVE that takes `reserve_s`."""

    def __init__(self, reserve_s: float) -> None:
        self.reserve_s = reserve_s

    def Reserve(self, req: pb.ReserveRequest, timeout: float) -> pb.ReserveReply:  # noqa: N802 - gRPC's names
        time.sleep(self.reserve_s)
        return pb.ReserveReply(status=pb.STATUS_OK, dst_slots=pack(np.arange(req.n_tokens, dtype=np.int64), "i8"))

    def Commit(self, req: pb.CommitRequest, timeout: float) -> pb.CommitReply:  # noqa: N802
        return pb.CommitReply(status=pb.STATUS_OK)

    def Cancel(self, req: pb.CancelRequest, timeout: float) -> pb.CancelReply:  # noqa: N802
        return pb.CancelReply(found=True)


class InstantSender:
    mode = "stub"

    def write(self, request_id: int, src: Any, src_slots: Any, dst_slots: Any, deadline_unix_ms: int, *,
              capability: bytes) -> None:
        pass

    def quiesce(self, request_id: int) -> bool:
        return True

    def in_flight(self) -> list[int]:
        return []

    def close(self) -> None:
        pass


def _percentiles(values: list[float]) -> dict[str, float | None]:
    return {k: None if v is None else round(v, 2) for k, v in percentiles(values, (50, 99)).items()}


def run_engine(cfg: PipelineConfig, costs: plan.Costs, requests: list[plan.Request],
               reserve_concurrency: int = 1) -> dict[str, Any]:
    """The requests through a real PrefillEngine whose forward sleeps the model's price;
    each request's stamps (s since the level's start, the model's clock: shifted by its
    admission time) go into `r.stamps`."""
    model = load_model("random:tiny:0", device="cpu")  # shapes only: no forward runs
    c = model.config.n_codebooks
    rows = sum(r.rows for r in requests)
    forwards: list[int] = []

    def forward(model_: Any, storage: Any, chunks: list[PrefillChunk], graphs: Any = None) -> list[np.ndarray | None]:
        time.sleep(costs.forward_ms([(ch.end - ch.start, ch.start) for ch in chunks]) / 1e3)
        forwards.append(len(chunks))
        return [np.zeros(c, dtype=np.int32) for _ in chunks]

    engine = PrefillEngine(model, "random:tiny:0", "cpu", model.new_kv_storage(rows + 1), PrefixCache(rows + 1),
                           PrefillScheduler(cfg.max_batch_prompts, cfg.max_batch_rows), "stub.sock", "host", {},
                           forward=forward, reserve_concurrency=reserve_concurrency)
    link = engine.links[0]
    link.stub, link.sender, link.instance = StubDecode(costs.reserve_s), InstantSender(), "stub"  # type: ignore[assignment]
    link.pool_pages = link.free_pages = 1 << 40
    done: dict[int, pb.SubmitReply] = {}
    all_done = threading.Event()

    def finish(index: int, reply: pb.SubmitReply) -> None:
        done[index] = reply
        if len(done) == len(requests):
            all_done.set()

    engine.start()
    t0 = time.perf_counter() + 0.2
    t0_ns = time.time_ns() + 200_000_000  # the same instant on the stamps' clock
    for r in sorted(requests, key=lambda r: r.arrival):
        wait = t0 + r.arrival - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        # a voice's reference rows must hash alike and differ between voices: the spec's
        # own ids, folded into the stub model's vocabulary
        prompt = np.ascontiguousarray(r.spec.prompt[:, :c] % min(model.config.vocab_sizes))
        engine.submit(PrefillJob(r.index, prompt, SamplingParams(max_frames=2), int(time.time() * 1000) + 600_000,
                                 {}, done=lambda reply, i=r.index: finish(i, reply)))
    all_done.wait(60 + cfg.duration)
    engine.stop()
    stamps = [dict(done[r.index].stamps.ns) for r in requests if r.index in done]
    for r in requests:
        if r.index in done:
            r.stamps = {k: (v - t0_ns) / 1e9 + costs.admit_s for k, v in done[r.index].stamps.ns.items()}
    return {"forwards": len(forwards), "prompts_per_forward": round(float(np.mean(forwards)), 3) if forwards else None,
            "answered": len(done), "stages": {f"{a} after {b}": _percentiles([(s[a] - s[b]) / 1e6 for s in stamps])
                                              for a, b in STAGES}}


def predicted_ttfa(costs: plan.Costs, requests: list[plan.Request], cap: Any, rate: float,
                   pcfg: plan.PlanConfig) -> dict[str, Any]:
    """TTFT/TTFA p50/p95 when the model's D (bench plan's) takes each request at its
    prefill end + the hand-off: P's side from `r.stamps`, D's from the model."""
    answered = [r for r in requests if "prefill_end" in r.stamps]
    if len(answered) < len(requests):
        return {}
    for r in answered:
        r.times.clear()
        r.stamps["d_committed"] = r.stamps["prefill_end"] + costs.handoff_s
    assert costs.step is not None
    plan.simulate_decode([(r.stamps["d_committed"], r) for r in answered], costs.step, costs, overlap=True)
    plan.refuse_beyond_pool(answered, pcfg.pool_tokens, "p_reserved", costs)
    row = plan.judge(answered, cap, rate)
    return {k: row[k] for k in ("ttft_p50_ms", "ttft_p95_ms", "ttfa_p50_ms", "ttfa_p95_ms", "ttfa_p99_ms")}


def run_model(costs: plan.Costs, requests: list[plan.Request], pcfg: plan.PlanConfig) -> dict[str, Any]:
    plan.simulate_pd(requests, costs, 1, pcfg)
    per_forward = Counter(r.stamps["prefill_start"] for r in requests)
    return {"forwards": len(per_forward), "prompts_per_forward": round(float(np.mean(list(per_forward.values()))), 3),
            "answered": len(requests), "stages": {f"{a} after {b}": _percentiles([(r.stamps[a] - r.stamps[b]) * 1e3
                                                                                   for r in requests])
                                                  for a, b in STAGES}}


COLUMNS = [Column("rate", "rate/s", "{:g}"), Column("reserve_concurrency", "reserve conc"), Column("side", "side"),
           Column("forwards", "forwards"), Column("prompts_per_forward", "prompts/forward"),
           Column("ttft_p95_ms", "TTFT p95", "{:.0f}"), Column("ttfa_p50_ms", "TTFA p50", "{:.0f}"),
           Column("ttfa_p95_ms", "TTFA p95", "{:.0f}"),
           *[Column(f"{a} after {b} {q}", f"{a} after {b} {q} ms", "{:.1f}")
             for a, b in STAGES for q in ("p50", "p99")]]


def run_pipeline(cfg: PipelineConfig, command: str) -> dict[str, Any]:
    base = cfg.plan_config()
    costs, sources = plan.load_costs(base)
    variant = plan.Variant("1p1d", 2, decoders=1)
    rows = []
    for rate in plan.parse_list(cfg.rate, "rate", float):
        cap = plan.capacity_config(base, variant, [rate])
        for k in plan.parse_list(cfg.reserve_concurrency, "reserve_concurrency", int):
            pcfg = cfg.plan_config(k)
            for side in ("engine", "model"):
                requests = plan.level_requests(pcfg, cap, rate, cfg.seed)
                result = (run_engine(cfg, costs, requests, k) if side == "engine"
                          else run_model(costs, requests, pcfg))
                row = {"rate": rate, "reserve_concurrency": k, "side": side,
                       **{key: v for key, v in result.items() if key != "stages"},
                       **predicted_ttfa(costs, requests, cap, rate, pcfg)}
                for stage, p in result["stages"].items():
                    row.update({f"{stage} {q}": v for q, v in p.items()})
                rows.append(row)
                print(text_table([row], COLUMNS), flush=True)
    summary = {"sources": sources, "reserve_ms": cfg.reserve_ms, "costs": plan.describe_costs(costs)}
    return report.Results(BENCH, machine_info(), command, cfg.model_dump(), rows, summary).document()


def main(argv: list[str]) -> int:
    cfg = parse_config(PipelineConfig, argv, "pdunit bench pipeline")
    doc = run_pipeline(cfg, report.command_line(argv, prog="pdunit bench pipeline"))
    print(text_table(doc["rows"], COLUMNS))
    report.print_and_write(doc, cfg.out, COLUMNS, "P's pipeline against bench plan's model of it (CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
