"""The monolith's frames do not depend on its schedule: every policy (prefill-first,
chunked, budget), with and without overlap (engine/decode/overlap.py driving the
monolith's decode-only, mixed and prefill-only steps), publishes the same frames and end
codes for the same seeded requests, every page returns to the pool, and a prompt
cancelled while a queued step still writes its rows keeps its pages until that step
completed.

Driven on MonolithEngine._step_once directly (no thread), on the CPU with random:tiny;
the last test runs real units through `pdunit local` (--overlap, --policy budget)."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
import torch

from pdunit.engine.decode.admission import AdmissionControl, RateFloorAdmission
from pdunit.engine.decode.batcher import FINISHED_EOS, RUNNING
from pdunit.engine.decode.step_model import StepCoefficients, StepModel
from pdunit.engine.decode.stream_lives import HeldStream
from pdunit.engine.kv.pool import PagePool
from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.monolith.worker import POLICIES, MonolithEngine
from pdunit.engine.packing import unpack
from pdunit.engine.prefill.scheduler import PrefillJob
from pdunit.engine.proto import pdunit_pb2 as pb
from tests.engine.test_unit_e2e import SMALL, run_all
from tests.engine.unit_client import load, wait_for

POOL = 8192
# priced so that the budget policy chunks: 214 ms (4.2 frames/s less 10%) leaves about
# 100 prompt rows beside a few streams, never a whole long prompt
BUDGET_MODEL = StepCoefficients(base_ms=1.0, per_stream_ms=2.0, per_token_ms=0.01, per_row_ms=2.0)


class FixedModel(StepModel):
    """The seed, never refitted and never found under-predicting: the budget stays 214 ms
    whatever this machine's step times (the plan must not depend on its speed)."""

    def __init__(self) -> None:
        super().__init__(BUDGET_MODEL, refit_every=1 << 30)

    def under_prediction(self, quantile: float = 0.9) -> float:
        return 1.0


@dataclasses.dataclass
class Req:
    rid: int
    rows: int
    params: SamplingParams
    join: int = 0  # iteration at which it is submitted


REQS = [
    Req(1, 150, SamplingParams(max_frames=14, min_frames=14)),
    Req(2, 40, SamplingParams(max_frames=12, temperature=0.9, seed=7)),
    Req(3, 230, SamplingParams(max_frames=10, min_frames=3, temperature=1.3, top_k=40, seed=11), join=2),
    Req(4, 31, SamplingParams(max_frames=1), join=3),  # ends with its first frame
    Req(5, 90, SamplingParams(max_frames=16), join=4),  # greedy, min_frames 0: may end at EOS
    Req(6, 64, SamplingParams(max_frames=8, temperature=0.7, seed=5), join=9),  # joins as others leave
    Req(7, 300, SamplingParams(max_frames=6, temperature=1.0, top_k=20, seed=3), join=10),
]


class Frames:
    """A FrameHub stand-in that keeps every message."""

    def __init__(self) -> None:
        self.messages: list[pb.StepFrames] = []

    def publish(self, message: pb.StepFrames) -> None:
        self.messages.append(message)


@dataclasses.dataclass
class Run:
    frames: dict[int, list[list[int]]]
    codes: dict[int, list[int]]
    replies: dict[int, pb.SubmitReply]
    engine: MonolithEngine
    steps: list[tuple[int, int]]  # overlap: (decode streams, prompt rows) of every completed step


def make_engine(policy: str, overlap: bool, eos_id: int | None = None, device: str = "cpu",
                dtype: str | None = None) -> MonolithEngine:
    model = load_model("random:tiny:0", device=device, dtype=dtype)
    if eos_id is not None:
        model.config = dataclasses.replace(model.config, eos_id=eos_id)
    admission = None
    if policy == "budget":
        admission = AdmissionControl(RateFloorAdmission(FixedModel(), 4.2), HeldStream(100, 10))
    return MonolithEngine(model, "random:tiny:0", PagePool(POOL, 4), model.new_kv_storage(POOL, device=device),
                          Frames(), policy, chunk_tokens=64, max_batch=8, max_batch_rows=256,  # type: ignore[arg-type]
                          admission=admission, overlap=overlap, min_chunk_rows=16)


def job(r: Req, replies: dict[int, pb.SubmitReply]) -> PrefillJob:
    prompt = np.random.default_rng(r.rid).integers(0, 1000, size=(r.rows, 11), dtype=np.int64)  # tiny: 11 codebooks
    return PrefillJob(r.rid, prompt, r.params, int(time.time() * 1000) + 600_000, {},
                      done=lambda reply: replies.__setitem__(r.rid, reply))


def run(policy: str, overlap: bool, reqs: list[Req], eos_id: int | None = None, device: str = "cpu",
        dtype: str | None = None, strict_launch: bool = False) -> Run:
    e = make_engine(policy, overlap, eos_id, device, dtype)
    if strict_launch:  # CUDA: a synchronizing call while a step is queued raises
        assert e.overlap is not None
        launch = e.overlap._launch

        def strict(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return launch(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        e.overlap._launch = strict  # type: ignore[method-assign]
    replies: dict[int, pb.SubmitReply] = {}
    frames: dict[int, list[list[int]]] = {r.rid: [] for r in reqs}
    codes: dict[int, list[int]] = {r.rid: [] for r in reqs}
    steps: list[tuple[int, int]] = []
    hub: Frames = e.hub  # type: ignore[assignment]
    cols = e.model.config.n_codebooks
    for it in range(3000):
        for r in reqs:
            if r.join == it:
                e.submit(job(r, replies))
        e._step_once()
        if e.overlap is not None and e.overlap.completed is not None:
            done = e.overlap.completed
            steps.append((len(done.streams), done.prompts.rows if done.prompts is not None else 0))
        for msg in hub.messages:
            ids = unpack(msg.request_ids, "u8")
            for rid, frame, code in zip(ids, unpack(msg.frames, "i4", cols), unpack(msg.finished, "u1"), strict=True):
                frames[int(rid)].append(frame.tolist())
                codes[int(rid)].append(int(code))
        hub.messages.clear()
        if it > max(r.join for r in reqs) and all(c and c[-1] != RUNNING for c in codes.values()):
            break
    else:
        pytest.fail(f"{policy} overlap={overlap}: streams still running after 3000 iterations")
    e._step_once()  # the iteration after the last frames: nothing left in flight
    return Run(frames, codes, replies, e, steps)


def eos_that_occurs() -> int:
    """An EOS id the greedy tiny model really emits mid-stream: column 0 of stream 5's
    sixth frame, so an EOS-ended stream is exercised, not hoped for."""
    return run("prefill-first", False, [dataclasses.replace(REQS[4], join=0)]).frames[5][5][0]


@pytest.fixture(scope="module")
def reference() -> tuple[Run, int]:
    eos = eos_that_occurs()
    return run("prefill-first", False, REQS, eos), eos


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_with_and_without_overlap_publishes_the_same_frames(policy, overlap, reference) -> None:
    ref, eos = reference
    assert any(c[-1] == FINISHED_EOS for c in ref.codes.values()), "the chosen EOS id must end a stream"
    got = run(policy, overlap, REQS, eos)
    for r in REQS:
        assert got.frames[r.rid] == ref.frames[r.rid], f"stream {r.rid}"
        assert got.codes[r.rid] == ref.codes[r.rid], f"stream {r.rid}"
        assert got.replies[r.rid].status == pb.STATUS_OK, got.replies[r.rid]
        assert RUNNING not in got.codes[r.rid][-1:] and set(got.codes[r.rid][:-1]) <= {RUNNING}
    e = got.engine
    assert e.pool.free_pages == e.pool.n_pages and not e.prefilling and len(e.batcher) == 0
    if overlap:
        assert e.overlap is not None and not e.overlap.in_flight
        mixed = [s for s in got.steps if s[0] and s[1]]
        prompt_only = [s for s in got.steps if not s[0] and s[1]]
        decode_only = [s for s in got.steps if s[0] and not s[1]]
        # each policy's kind of steps really went through the pipeline
        assert decode_only and prompt_only
        assert bool(mixed) == (policy != "prefill-first")
    if policy == "budget" and overlap:  # every mixed step's rows fit the budget beside its streams
        assert e.admission is not None
        budget = e.admission.admission.budget_ms()
        assert all(BUDGET_MODEL.ms(streams, 0, rows) <= budget for streams, rows in mixed), (budget, mixed)
        assert max(rows for _, rows in mixed) > 16  # more than the minimum chunk where it fits


def test_a_prompt_cancelled_while_its_rows_are_in_flight_keeps_its_pages_until_that_step_completed() -> None:
    e = make_engine("chunked", overlap=True)
    replies: dict[int, pb.SubmitReply] = {}
    e.submit(job(Req(1, 200, SamplingParams(max_frames=4)), replies))
    e._step_once()  # rows 0-64 queued
    assert e.overlap is not None and e.overlap.in_flight and e.prefilling[0].in_flight
    held = e.pool.free_pages
    assert held < e.pool.n_pages
    assert e.cancel(1)
    e._step_once()  # the queued step completes; nothing new is planned for the cancelled prompt
    assert not e.overlap.in_flight and 1 not in replies
    assert e.pool.free_pages == held  # dropped only now that no queued step writes its pages
    e._step_once()
    assert replies[1].status == pb.CANCELLED and not e.prefilling
    assert e.pool.free_pages == e.pool.n_pages


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_overlap_frames_identical_on_cuda(policy) -> None:
    """On the GPU path (bf16, decode graphs): the overlapped monolith's frames are the
    plain loop's, and queueing a mixed or prefill-only step never waits for the device."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    plain = run(policy, False, REQS, device="cuda", dtype="bfloat16")
    over = run(policy, True, REQS, device="cuda", dtype="bfloat16", strict_launch=True)
    assert over.engine.step_forward.graphs is not None
    for r in REQS:
        assert over.frames[r.rid] == plain.frames[r.rid], f"stream {r.rid}"
        assert over.codes[r.rid] == plain.codes[r.rid], f"stream {r.rid}"


def test_an_overlapped_budget_monolith_unit_streams_the_plain_monoliths_frames(tmp_path) -> None:
    """Through real processes: `--overlap` and `--policy budget` (with a floor and a fit
    file pricing prompt rows) reach the monolith, and its streams are the plain
    prefill-first monolith's, every page back."""
    # slower than any CPU step here and a floor of 1 frame/s (budget 900 ms): the budget
    # never shrinks enough to refuse one of these 4 streams, and prompts still chunk
    fit = tmp_path / "fit.json"
    fit.write_text(StepCoefficients(base_ms=50.0, per_stream_ms=20.0, per_token_ms=0.02, per_row_ms=4.0).to_json())
    with LocalUnit(LocalConfig(mode="monolith", **SMALL)) as plain:
        want = run_all(plain.url)
    budget = LocalConfig(mode="monolith", policy="budget", rate_floor=1.0, step_model=str(fit),
                         extra_monolith_args=["--overlap"], **{**SMALL, "log_level": "info"},
                         run_dir=str(tmp_path / "run"))
    with LocalUnit(budget) as unit:
        before = load(unit.url)
        got = run_all(unit.url)
        wait_for(lambda: load(unit.url).free_pages == before.free_pages, what="every page back in the pool")
        ready = [json.loads(line) for line in (tmp_path / "run" / "logs" / "monolith.log").read_text().splitlines()
                 if '"monolith ready"' in line]
    assert ready and ready[0]["policy"] == "budget" and ready[0]["overlap"] is True, ready
    for (frames, last), (want_frames, _) in zip(got, want, strict=True):
        assert last.get("done"), last
        assert frames == want_frames
