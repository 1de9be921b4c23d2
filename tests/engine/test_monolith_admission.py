"""Rate-floor admission in the monolith (engine/monolith/worker.py): a prompt is judged
at submit over every stream the monolith holds (decoding, and admitted but still
queued, prefilling or waiting for its first step) plus itself; a refused one is
answered at once and holds nothing; a cancelled or failed one gives its room back;
every step feeds the step model, prompt rows included.

The step model is a seed that never refits (the verdicts must not depend on this
machine's speed): 80 ms per stream + 0.04 ms per context token against a 4.2 frames/s
floor (budget 238 ms less 10% = 214 ms) admits two streams of 64 rows x 40 frames
(168 ms at their end; three: 248 ms) and no stream of 4000 frames even alone (242 ms
at its end). The end-to-end test runs a real monolith unit with a 42 frames/s floor
and the seed scaled to it (the verdicts come before its first refit)."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from pdunit.engine.decode.admission import AdmissionControl, RateFloorAdmission
from pdunit.engine.decode.hub import FrameHub
from pdunit.engine.decode.step_model import StepCoefficients, StepModel
from pdunit.engine.decode.stream_lives import HeldStream
from pdunit.engine.kv.pool import PagePool
from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.monolith.worker import MonolithEngine
from pdunit.engine.prefill.scheduler import PrefillJob
from pdunit.engine.proto import pdunit_pb2 as pb
from tests.engine.unit_client import load, random_prompt, wait_empty

POOL = 4096
ROWS, FRAMES = 64, 40


class RecordingModel(StepModel):
    """The seed, never refitted; every observed step kept."""

    def __init__(self) -> None:
        super().__init__(StepCoefficients(base_ms=0.0, per_stream_ms=80.0, per_token_ms=0.04),
                         refit_every=1 << 30)
        self.seen: list[tuple[int, int, float, int]] = []

    def observe(self, streams: int, context_tokens: int, ms: float, prefill_rows: int = 0) -> None:
        self.seen.append((streams, context_tokens, ms, prefill_rows))
        super().observe(streams, context_tokens, ms, prefill_rows)


def make_engine(policy: str, loop: asyncio.AbstractEventLoop) -> tuple[MonolithEngine, RecordingModel]:
    model = load_model("random:tiny:0", device="cpu")
    steps = RecordingModel()
    admission = AdmissionControl(RateFloorAdmission(steps, floor_fps=4.2), HeldStream(ROWS, FRAMES))
    engine = MonolithEngine(model, "random:tiny:0", PagePool(POOL, 1), model.new_kv_storage(POOL),
                            FrameHub(loop), policy, chunk_tokens=256, max_batch=8,
                            max_batch_rows=4096, admission=admission)
    return engine, steps


@pytest.fixture(params=["prefill-first", "chunked"])
def engine(request: pytest.FixtureRequest):
    loop = asyncio.new_event_loop()
    yield make_engine(request.param, loop)
    loop.close()


def job(rid: int, replies: dict[int, pb.SubmitReply], frames: int = FRAMES) -> PrefillJob:
    prompt = np.random.default_rng(rid).integers(0, 100, size=(ROWS, 11), dtype=np.int64)  # tiny: 11 codebooks
    return PrefillJob(rid, prompt, SamplingParams(max_frames=frames, min_frames=frames),
                      int(time.time() * 1000) + 60_000, {}, done=lambda reply: replies.__setitem__(rid, reply))


def holds(e: MonolithEngine) -> set[int]:
    with e._lock:
        prefilling = {p.job.request_id for p in e.prefilling}
    return set(e.waiting.request_ids()) | prefilling | set(e.batcher.request_ids())


def test_a_prompt_that_would_break_the_floor_is_refused_at_submit_holding_nothing(engine):
    e, _ = engine
    replies: dict[int, pb.SubmitReply] = {}
    assert e.info().headroom_streams == 2
    e.submit(job(1, replies))
    e.submit(job(2, replies))
    assert replies == {} and e.info().headroom_streams == 0  # queued prompts count as held streams
    e.submit(job(3, replies))
    assert replies[3].status == pb.RATE_FLOOR, replies[3]
    assert "rate_floor" in replies[3].message and "budget of 214.3 ms" in replies[3].message
    assert holds(e) == {1, 2} and e.pool.free_pages == POOL  # neither queued nor holding a page
    # a stream that alone would break the floor: INVALID (a 4xx, not a retry elsewhere)
    e.submit(job(4, replies, frames=4000))
    assert replies[4].status == pb.INVALID and "even alone" in replies[4].message, replies[4]
    assert holds(e) == {1, 2}


def test_admitted_prompts_count_on_every_step_from_queue_to_decoding(engine):
    """While the two admitted prompts move from the queue through prefill into the batch
    and decode, a third is refused at every step; once both have ended, it is admitted."""
    e, _ = engine
    replies: dict[int, pb.SubmitReply] = {}
    e.submit(job(1, replies))
    e.submit(job(2, replies))
    rid = 100
    for _ in range(10 * FRAMES):
        if not holds(e):
            break
        e.submit(job(rid, replies))
        assert replies[rid].status == pb.RATE_FLOOR, (rid, replies[rid], holds(e))
        e._step_once()
        rid += 1
    assert not holds(e) and replies[1].status == replies[2].status == pb.STATUS_OK
    assert e.pool.free_pages == POOL and e._admitted == {}
    e.submit(job(rid, replies))
    assert rid not in replies and holds(e) == {rid}


def test_a_cancelled_or_failed_prompt_gives_its_room_back(engine):
    e, _ = engine
    replies: dict[int, pb.SubmitReply] = {}
    e.submit(job(1, replies))
    e.submit(job(2, replies))
    assert e.cancel(1) and replies[1].status == pb.CANCELLED  # cancelled while queued
    assert e.info().headroom_streams == 1
    e.submit(job(3, replies))
    assert 3 not in replies  # admitted in 1's place
    while 2 not in replies or 3 not in replies:  # both prefilled: in the batcher now
        e._step_once()
    assert e.cancel(2)
    e._step_once()  # the batcher drops it
    assert e.info().headroom_streams == 1
    assert e.cancel(3)
    e._step_once()
    assert e.info().headroom_streams == 2 and e.pool.free_pages == POOL
    # a prompt whose deadline passed while queued fails, and frees its room too
    late = job(5, replies)
    late.deadline_unix_ms = 1
    e.submit(late)
    assert e.info().headroom_streams == 1
    e._step_once()
    assert replies[5].status == pb.DEADLINE_EXCEEDED and e.info().headroom_streams == 2


def test_every_step_is_observed_with_its_streams_context_and_prompt_rows(engine):
    e, steps = engine
    replies: dict[int, pb.SubmitReply] = {}
    e.submit(job(1, replies))
    while 1 not in replies:
        e._step_once()
    for _ in range(3):
        e._step_once()
    prefills = [s for s in steps.seen if s[3]]
    assert prefills and sum(s[3] for s in prefills) == ROWS  # the prompt's rows, each once
    decodes = [s for s in steps.seen if s[0]]
    assert decodes and all(s[0] == 1 and s[1] >= ROWS + 1 for s in decodes)
    assert all(s[2] > 0 for s in steps.seen)


def test_without_a_fit_file_it_holds_only_what_its_widest_step_vouches_for() -> None:
    """No --step-model: the seed is zeros (everything fits), so the monolith holds its
    cold-start limit, then twice the most streams one observed step decoded: a burst is
    never judged by a fit of smaller batches all at once."""
    loop = asyncio.new_event_loop()
    try:
        e, _ = make_engine("prefill-first", loop)
        assert e.admission is not None
        e.admission.seeded, e.admission.cold_streams = False, 2
        replies: dict[int, pb.SubmitReply] = {}
        for rid in (1, 2, 3):
            e.submit(job(rid, replies))
        assert set(replies) == {3} and replies[3].status == pb.RATE_FLOOR
        assert "at most 2" in replies[3].message, replies[3]
        e.admission.widest_step = 2  # a fit, from steps of two streams: four may be held
        e.admission.model.fits = 1
        e.admission.model.coefficients = StepCoefficients(0.0, 0.0, 0.0)  # a fit by which anything fits
        for rid in (4, 5, 6):
            e.submit(job(rid, replies))
        assert 4 not in replies and 5 not in replies and replies[6].status == pb.RATE_FLOOR
    finally:
        loop.close()


def test_a_stream_refused_only_by_the_shrunk_budget_is_a_retry_not_a_4xx(engine) -> None:
    """The model under-predicted lately (observed 3x its prediction): the budget shrinks
    to a third, and even one stream does not fit it; that is RATE_FLOOR (try again), not
    INVALID, which says the stream can never be served. (The first stream of an idle
    engine is admitted whatever the budget: test_admission's liveness rule.)"""
    e, steps = engine
    for _ in range(32):
        steps.observe(1, 100, 3 * steps.predict(1, 100))
    replies: dict[int, pb.SubmitReply] = {}
    e.submit(job(1, replies, frames=2000))  # idle: admitted against the projection
    assert replies == {}
    e.submit(job(2, replies, frames=2000))  # 80 + 0.04 x 2064 = 163 ms at its end: within 214, not 71
    assert replies[2].status == pb.RATE_FLOOR, replies[2]


def test_the_projection_carries_the_prompt_load_each_step_has_seen_lately(engine) -> None:
    """Chunked: prompt rows cost 0.5 ms each, and with 50 rows per decoding stream per
    step lately (25 ms more per stream and step) two streams no longer fit where without
    them they did. Prefill-first: its prompts run in steps of their own that the decoding
    streams wait for, 25 ms per decoding stream per decode step lately (the prefill steps'
    whole time, base and rows): the same two streams no longer fit."""
    e, steps = engine
    steps.coefficients = StepCoefficients(0.0, 80.0, 0.04, per_row_ms=0.5)
    replies: dict[int, pb.SubmitReply] = {}
    e.submit(job(1, replies))
    e.submit(job(2, replies))
    assert replies == {}
    assert e.cancel(2)
    if e.policy == "chunked":
        for _ in range(8):
            e._observe(2, 130, 0.08, rows=100)
        assert e.admission.charge_ms_per_stream() == 25.0
    else:
        assert e.prefill_rows_per_step() == 0.0  # the rows are in the stall
        for _ in range(8):
            e.admission.observe_stall(50.0, 2)
        assert e.admission.stall_ms_per_stream == 25.0
    e.submit(job(3, replies))
    assert replies[3].status == pb.RATE_FLOOR, replies[3]


def test_prefill_first_measures_the_prefill_steps_its_decoding_streams_wait_for(engine) -> None:
    """A prefill step while nothing decodes stalls nobody, nor one whose only stream is its
    own prompt's; two prefill-only steps (30 and 20 ms) begun while a stream decodes, then
    a decode step of 2 streams: 50 ms waited over the 4 stream-steps of the three decode
    steps since the stall window began (1 + 1 + 2)."""
    e, _ = engine
    if e.policy != "prefill-first":
        pytest.skip("chunked steps carry their prompt rows: no stall")
    e._observe(0, 0, 0.5, rows=64)  # nothing decoding: nobody waits
    e._observe(1, 65, 0.08, rows=0)
    assert e.admission.stall_ms_per_stream == 0.0
    e._observe(0, 0, 0.5, rows=64, waiting=0)  # its own prompt's stream waits for its first frame, not its rate
    e._observe(1, 65, 0.08, rows=0)
    assert e.admission.stall_ms_per_stream == 0.0
    e._observe(0, 0, 0.030, rows=64, waiting=1)  # one stream decoding when each began
    e._observe(0, 0, 0.020, rows=64, waiting=1)
    e._observe(2, 130, 0.08, rows=0)
    assert e.admission.stall_ms_per_stream == pytest.approx(50 / 4)  # 50 ms over 1 + 1 + 2 stream-steps


def test_chunked_charges_each_projected_stream_the_prompt_rows_one_stream_brings() -> None:
    """Chunked: every stream of a closed loop brings its refill's prompt rows into the
    steps the others decode in, so the rows a step carries grow with its streams. Lately
    one decoding stream per step beside 50 prompt rows (0.5 ms each): admitting a second
    stream is judged with 2 x 50 rows a step (2 x (80 + 25) + 8.2 = 218.2 ms, over 214.3),
    not with the 50 of the steps seen (193 ms). Rows in a step with no decoding stream
    stall no one and are not counted (a lone stream's own prompt)."""
    loop = asyncio.new_event_loop()
    e, steps = make_engine("chunked", loop)
    assert e.admission is not None
    steps.coefficients = StepCoefficients(0.0, 80.0, 0.04, per_row_ms=0.5)
    e._observe(0, 0, 0.5, rows=64)  # nothing decoding
    assert e.admission.charge_ms_per_stream() == 0.0
    for _ in range(8):
        e._observe(1, 65, 0.08, rows=50)
    assert e.admission.rows_per_stream == 50.0 and e.admission.charge_ms_per_stream() == 25.0
    assert e.prefill_rows_per_step() == 0.0  # nothing charged per step whatever its streams
    replies: dict[int, pb.SubmitReply] = {}
    e.submit(job(1, replies))  # alone: 80 + 25 + 0.04 x 103 = 109 ms
    assert replies == {} and e.info().headroom_streams == 0
    e.submit(job(2, replies))
    assert replies[2].status == pb.RATE_FLOOR, replies[2]
    assert "218.2 ms" in replies[2].message, replies[2].message
    loop.close()


def post(url: str, prompt: list[list[int]], frames: int) -> tuple[int, str | None, dict]:
    """(HTTP status, Retry-After, the final record or the error body) of one stream."""
    body = {"prompt": prompt, "max_frames": frames, "min_frames": frames}
    with httpx.stream("POST", f"{url}/v1/tts/stream", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.headers.get("retry-after"), r.json()
        lines = [json.loads(line) for line in r.iter_lines() if line]
    return 200, None, {**lines[-1], "frames_received": sum("frame" in x for x in lines)}


def test_the_monolith_unit_answers_503_rate_floor_with_retry_after_and_holds_nothing(tmp_path: Path) -> None:
    """Through the LB (rate floor 42, 8 ms per stream + 0.004 ms per token): two of five
    concurrent 64-row x 400-frame streams are served, three refused at submit."""
    fit = tmp_path / "step.fit.json"
    fit.write_text(StepCoefficients(base_ms=0.0, per_stream_ms=8.0, per_token_ms=0.004).to_json())
    cfg = LocalConfig(mode="monolith", rate_floor=42, step_model=str(fit), pool_tokens=16384, cache_tokens=16384,
                      lb_port=0, guard=False, log_level="warning", extra_monolith_args=["--headroom-stream", "64:400", "--no-step-model-refit"])
    with LocalUnit(cfg) as unit:
        url = unit.url
        assert load(url).headroom_streams == 2
        # the fit is kept as it is (--no-step-model-refit): on a loaded machine the monolith's
        # own steps would move a refitted model, and with it how many of the five it admits
        status, _, doc = post(url, random_prompt(64, seed=9), 4000)
        assert status == 422 and "even alone" in doc["error"]["message"], doc
        prompts = [random_prompt(64, seed=i) for i in range(5)]
        with ThreadPoolExecutor(5) as pool:
            results = list(pool.map(lambda p: post(url, p, 400), prompts))
        served = [doc for status, _, doc in results if status == 200]
        refused = [(retry, doc) for status, retry, doc in results if status == 503]
        assert len(served) == 2 and all(d["frames_received"] == 400 for d in served), results
        assert len(refused) == 3, results
        for retry, doc in refused:
            assert retry is not None and doc["error"]["code"] == "rate_floor", doc
            assert "rate_floor" in doc["error"]["message"]
        wait_empty(url, what="the unit empty")
        assert load(url).held_pages == 0
