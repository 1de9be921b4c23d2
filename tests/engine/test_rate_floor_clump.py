"""Issue 24: a clump's prompts are judged with the stall their prefills will cause the
streams already held (engine/decode/admission.py `life_judge`, the prefill-first monolith's
`_held_with_stalls`): the prefill-only steps of every prompt admitted and not yet
prefilled, and the new one's, are charged once to each held stream that will wait for
them, against its rate over its whole life (frames after the first over the time since
it, the loadgen's rate), so a stream that ran fast has banked slack and one that just
started has none.

The step model is the synthetic pad of the CPU overload (60 + 7.5 x streams + 0.375 x
prompt rows ms), fixed, against a floor of 8 frames/s at no margin: a 125-ms budget a
frame. Every held set below is one the worst-step projection alone admits."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdunit.bench.capacity import run_capacity
from pdunit.engine.decode.admission import AdmissionControl, RateFloorAdmission
from pdunit.engine.decode.hub import FrameHub
from pdunit.engine.decode.step_model import StepCoefficients, StepModel
from pdunit.engine.decode.stream_lives import HeldStream, PendingPrefills, life_ms
from pdunit.engine.kv.pool import PagePool
from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.monolith import worker
from pdunit.engine.monolith.worker import MonolithEngine
from pdunit.engine.prefill.scheduler import PrefillJob
from pdunit.engine.proto import pdunit_pb2 as pb
from tests.engine.test_rate_floor_overload import sent_rate
from tests.engine.unit_client import wait_empty

PAD = StepCoefficients(base_ms=60.0, per_stream_ms=7.5, per_token_ms=0.0, per_row_ms=0.375)
FLOOR = 8.0  # frames/s: 125 ms a frame
CLUMP_ROWS = 448  # a prompt's prefill: 168 ms of rows (+ 60 for a step of its own)


def control(coef: StepCoefficients = PAD, typical: HeldStream | None = None) -> AdmissionControl:
    return AdmissionControl(RateFloorAdmission(StepModel(coef, fixed=True), FLOOR, margin=0.0),
                            typical or HeldStream(16, 40))


def test_each_streams_life_is_the_sum_of_its_projected_steps() -> None:
    rng = np.random.default_rng(24)
    coef = StepCoefficients(3.0, 0.5, 0.01, 0.2, 0.7)
    for _ in range(50):
        streams = [HeldStream(int(rng.integers(1, 400)), int(rng.integers(0, 60)), bool(rng.integers(0, 2)))
                   for _ in range(int(rng.integers(1, 12)))]
        got = life_ms(coef, streams, prefill_rows=16)
        for s, life in zip(streams, got, strict=True):
            want = 0.0
            for k in range(s.frames_left):  # step k: the streams with more than k frames left
                alive = [t for t in streams if t.frames_left > k]
                want += coef.ms(len(alive), sum(t.context + k for t in alive), 16, sum(t.audio for t in alive))
            assert life == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_a_stall_that_breaks_a_fresh_streams_life_is_refused_where_the_worst_step_admits() -> None:
    """One stream just started (its first frame out, 39 to go) beside a new one: 75-ms
    steps, well inside 125. Its life allows 39 x 125 = 4,875 ms: 39 x 75 = 2,925 of
    steps leaves 1,950 ms for prefills it waits for."""
    ctl = control()
    fresh = HeldStream(17, 39, frames_out=1, elapsed_ms=0.0)
    assert ctl.judge([fresh], 16, 40).admit
    assert ctl.judge([HeldStream(17, 39, frames_out=1, stall_ms=1900.0, new_stall_share=1.0)], 16, 40,
                     new_stall_ms=40.0).admit
    v = ctl.judge([HeldStream(17, 39, frames_out=1, stall_ms=1900.0, new_stall_share=1.0)], 16, 40,
                  new_stall_ms=60.0)
    assert not v.admit and v.life_fps == pytest.approx(39 / (2925 + 1960) * 1000, rel=1e-6)
    assert v.stall_ms == pytest.approx(1960.0) and "1960 ms" in v.reason()
    # the same stall on a stream that the new prompt does not stall: admitted
    assert ctl.judge([HeldStream(17, 39, frames_out=1, stall_ms=1900.0)], 16, 40, new_stall_ms=60.0).admit
    # the worst step alone admits it (75 ms): without the charge it goes in
    assert ctl.admission.judge([fresh], HeldStream(16, 40)).admit


def test_a_stream_with_banked_slack_lets_in_a_prompt_a_fresh_one_would_not() -> None:
    """20 frames to go and 1,100 ms of prefills to wait for: a stream that just started
    would end at 20 / (20 x 75 + 1,100) = 7.7 frames/s; one that delivered its first 21
    frames at 12.5 frames/s ends at 40 / (1,600 + 1,500 + 1,100) = 9.5."""
    ctl = control()
    fresh = HeldStream(21, 20, frames_out=1, stall_ms=1040.0, new_stall_share=1.0)
    banked = HeldStream(41, 20, frames_out=21, elapsed_ms=1600.0, stall_ms=1040.0, new_stall_share=1.0)
    assert not ctl.judge([fresh], 16, 20, new_stall_ms=60.0).admit
    assert ctl.judge([banked], 16, 20, new_stall_ms=60.0).admit
    # one that ran behind the floor (20 frames in 2.6 s, 7.7 frames/s) but would catch up
    # alone (2,600 + 20 x 67.5 = 3,950 ms for 40 frames) is not let fall under it
    behind = HeldStream(41, 20, frames_out=21, elapsed_ms=2600.0, stall_ms=1040.0, new_stall_share=1.0)
    assert not ctl.judge([behind], 16, 20, new_stall_ms=60.0).admit
    # one already lost whatever comes (4 s for its first 21 frames: 4,000 + 1,350 + 1,040 >
    # 5,000 even alone) does not hold every new stream back for the rest of its life
    lost = HeldStream(41, 20, frames_out=21, elapsed_ms=4000.0, stall_ms=1040.0, new_stall_share=1.0)
    assert ctl.judge([lost], 16, 20, new_stall_ms=60.0).admit


def test_a_life_is_charged_the_larger_of_the_steady_states_refills_and_the_prefills_known_never_both() -> None:
    """The recent stall per stream-step (20 ms: a closed loop's refills) over a fresh
    stream's 39 steps beside the new one, 39 x 2 x 20 = 1,560 ms, already counts arrivals
    like the new prompt: its 400-ms prefill on top (1,960 > the 1,950 ms of slack that 39
    steps of 75 ms leave) refused a stream the steady state has room for. A clump known
    now (1,900 ms queued + 60) still outweighs the steady state and is refused."""
    ctl = control()
    ctl.observe_stall(40.0, 2)
    assert ctl.charge_ms_per_stream() == 20.0
    fresh = HeldStream(17, 39, frames_out=1, new_stall_share=1.0)
    assert ctl.admission.judge([fresh], HeldStream(16, 40), charge_ms_per_stream=20.0).admit  # 60 + 2 x 27.5
    assert ctl.judge([fresh], 16, 40, new_stall_ms=400.0).admit
    v = ctl.judge([HeldStream(17, 39, frames_out=1, stall_ms=1900.0, new_stall_share=1.0)], 16, 40,
                  new_stall_ms=60.0)
    assert not v.admit and v.life_fps == pytest.approx(39 / (2925 + 1960) * 1000, rel=1e-6)
    assert v.stall_ms == pytest.approx(1960.0)  # the wait it was charged: the known one, the larger
    # a known stall under the steady state's costs nothing more, one over it what it adds
    assert ctl.judge([HeldStream(17, 39, frames_out=1, stall_ms=1500.0, new_stall_share=1.0)], 16, 40,
                     new_stall_ms=40.0).admit
    assert not ctl.judge([HeldStream(17, 39, frames_out=1, stall_ms=1900.0, new_stall_share=1.0)], 16, 40,
                         new_stall_ms=51.0).admit
    # a stream that ran at the floor (21 frames in 2.6 s) has 900 ms of slack beside the new one
    # (5,000 - 2,600 - 20 x 75): 24 ms a stream-step of refills (960) break it where its 100 ms
    # known would not, and the refusal names the wait it charged (the worst step: 60 + 2 x 31.5)
    ctl = control()
    ctl.observe_stall(48.0, 2)
    behind = HeldStream(41, 20, frames_out=21, elapsed_ms=2600.0, stall_ms=100.0, new_stall_share=1.0)
    v = ctl.judge([behind], 16, 40)
    assert not v.admit and v.stall_ms == pytest.approx(960.0) and "960 ms" in v.reason()


def test_without_lives_or_stalls_the_verdicts_are_the_worst_steps() -> None:
    """D's held streams (plain tuples: no life so far, no prefill of its own to wait for)
    are judged as before."""
    ctl = control()
    held = [(100, 40)] * 8  # 60 + 7.5 x 9 = 127.5 ms > 125
    assert not ctl.judge(held, 16, 40).admit and ctl.judge(held[:7], 16, 40).admit
    assert ctl.judge(held[:7], 16, 40).life_fps == 0.0


def queued(n: int) -> PendingPrefills:
    """`n` prompts like the clump's queued, nothing decoding, one prompt a prefill step."""
    return PendingPrefills((), (), (HeldStream(CLUMP_ROWS, 40),) * n, 0, n * CLUMP_ROWS, CLUMP_ROWS)


def test_a_queued_prompt_is_charged_the_prefills_queued_after_it() -> None:
    """Several prompts admitted and not yet prefilled, a new one arrives. Five 448-row
    prompts queued (448-row steps: one a step, 60 + 168 ms), none decoding yet. Where a
    prompt's first frame goes out as its own prefill step ends (the overlap pipeline;
    `PendingPrefills`' default) the first one then waits for the steps of the four
    queued after it and the sixth's: with six streams of 105-ms steps its life is
    39 x 105 + 5 x 228 = 5,235 ms against the 4,875 its 39 frames are allowed (7.45
    frames/s): the sixth is refused. With five, 39 x 97.5 + 4 x 228 = 4,715: admitted.
    Charged only the step the new prompt opens (228 ms), the sixth and seventh went in
    (the worst step alone admits eight: 60 + 7.5 x 8 = 120 ms)."""
    typical = HeldStream(CLUMP_ROWS, 40)
    ctl = control(typical=typical)
    held, stall = queued(4).held(PAD, CLUMP_ROWS)
    assert ctl.verdict(held, typical, 0.0, stall).admit
    held, stall = queued(5).held(PAD, CLUMP_ROWS)
    v = ctl.verdict(held, typical, 0.0, stall)
    assert not v.admit and v.life_fps == pytest.approx(39 / 5235 * 1000, rel=1e-6), v
    assert v.stall_ms == pytest.approx(5 * 228.0)
    assert ctl.headroom(queued(0)) == 5 and ctl.headroom(queued(4)) == 1 and ctl.headroom(queued(5)) == 0


def one_after_another(ctl: AdmissionControl, pending: PendingPrefills, typical: HeldStream) -> int:
    """Headroom by its definition: typical prompts judged one after another, each admitted
    one queued (unplanned) before the next is judged."""
    for k in range(1, 4097):
        held, stall = pending.held(ctl.model.coefficients, typical.context, [typical] * (k - 1))
        if not ctl.verdict(held, typical, 0.0, stall).admit:
            return k - 1
    return 4096


def test_headroom_with_pending_prefills_is_what_the_verdicts_would_admit_one_after_another() -> None:
    """Random held sets of decoding streams (some ahead of the floor, some behind, some
    lost), prompts in a prefill step now and unplanned ones, random step sizes, either
    loop: the O(log k) search equals judging typical prompts one by one, whatever count
    its search starts from."""
    rng = np.random.default_rng(21)
    nonzero = 0
    for _ in range(300):
        coef = StepCoefficients(float(rng.uniform(5, 60)), float(rng.uniform(0.5, 8)), float(rng.uniform(0, 0.01)),
                                float(rng.uniform(0, 0.5)))
        typical = HeldStream(int(rng.integers(16, 600)), int(rng.integers(2, 60)))
        ctl = control(coef, typical)

        def decoding() -> HeldStream:
            out, left = int(rng.integers(1, 60)), int(rng.integers(0, 60))
            return HeldStream(int(rng.integers(16, 600)) + out, left, frames_out=out,
                              elapsed_ms=float(out * rng.uniform(20, 200)))

        def prompt() -> HeldStream:
            return HeldStream(int(rng.integers(16, 600)), int(rng.integers(2, 60)))

        in_step = tuple(prompt() for _ in range(int(rng.integers(0, 3))))
        unplanned = tuple(prompt() for _ in range(int(rng.integers(0, 4))))
        pending = PendingPrefills(tuple(decoding() for _ in range(int(rng.integers(0, 8)))), in_step, unplanned,
                                  sum(p.context for p in in_step), sum(p.context for p in unplanned),
                                  int(rng.integers(64, 2048)), first_frames_after_queue=bool(rng.integers(0, 2)))
        want = max(one_after_another(ctl, pending, typical), 1 if not len(pending) else 0)
        assert ctl.headroom(pending) == want, (coef, typical, pending)
        ctl._lives_hint = int(rng.integers(1, 200))  # a count left by another held set
        assert ctl.headroom(pending) == want, (coef, typical, pending, ctl._lives_hint)
        nonzero += want > 0
    assert nonzero > 50  # not all trivially full


def test_headroom_counts_the_pending_prefills_the_verdict_refuses_for(engine: MonolithEngine) -> None:
    """The clump above: stream 1 just started, 448-row prompts admitted until the 5th is
    refused for the prefills stream 1 would wait for. With the first of them admitted the
    headroom is the 3 more that the verdicts admit; after the 4th it is 0, where the worst
    step alone, as headroom used to count, still sees room for 3 (60 + 7.5 x 8 = 120 ms)."""
    engine.admission = ctl = control(typical=HeldStream(CLUMP_ROWS, 40))
    replies: dict[int, pb.SubmitReply] = {}
    first_stream_decoding(engine, replies)
    assert submit(engine, 2, CLUMP_ROWS, 40, replies)
    assert ctl.typical() == HeldStream(CLUMP_ROWS, 40) and engine.headroom() == 3
    admitted = [rid for rid in range(3, 12) if submit(engine, rid, CLUMP_ROWS, 40, replies)]
    assert admitted == [3, 4, 5] and replies[6].status == pb.RATE_FLOOR
    worst_step_room = ctl.admission.headroom([HeldStream(*h) for h in engine.batcher.lifetimes(audio=True)]
                                             + [HeldStream(*h) for h in engine._admitted.values()], ctl.typical())
    assert worst_step_room == 3
    assert engine.headroom() == 0


def make_engine(loop: asyncio.AbstractEventLoop, overlap: bool = False, max_batch_rows: int = 4096,
                admission: AdmissionControl | None = None) -> MonolithEngine:
    """A prefill-first monolith of the tiny model on CPU, stepped by the test: the plain
    loop, or the overlap pipeline (the GPU default)."""
    model = load_model("random:tiny:0", device="cpu")
    return MonolithEngine(model, "random:tiny:0", PagePool(16384, 1), model.new_kv_storage(16384),
                          FrameHub(loop), "prefill-first", chunk_tokens=256, max_batch=16,
                          max_batch_rows=max_batch_rows, admission=admission or control(), overlap=overlap)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def engine(loop: asyncio.AbstractEventLoop) -> MonolithEngine:
    return make_engine(loop)


def submit(engine: MonolithEngine, rid: int, rows: int, frames: int, replies: dict[int, pb.SubmitReply]) -> bool:
    """Submits a prompt; True while it is admitted (no answer yet, or OK)."""
    prompt = np.random.default_rng(rid).integers(0, 100, size=(rows, 11), dtype=np.int64)  # tiny: 11 codebooks
    engine.submit(PrefillJob(rid, prompt, SamplingParams(max_frames=frames, min_frames=frames),
                             int(time.time() * 1000) + 60_000, {},
                             done=lambda reply: replies.__setitem__(rid, reply)))
    return rid not in replies or replies[rid].status == pb.STATUS_OK


def first_stream_decoding(engine: MonolithEngine, replies: dict[int, pb.SubmitReply]) -> None:
    """Stream 1 (16 rows, 40 frames) prefilled and its first frame out."""
    assert submit(engine, 1, 16, 40, replies)
    while not engine.batcher.running or "first_frame_step" not in engine.batcher.running[1].stamps:
        assert engine._step_once()


def test_a_clump_admitted_before_any_prefill_is_charged_its_prefills(engine: MonolithEngine) -> None:
    """Stream 1 just started (39 frames to go, 4,875 ms allowed) when a clump of 448-row
    prompts arrives. Each joins one prefill step (60 + 168 ms a prompt), which stream 1
    waits for: with k of them its life is 39 x (67.5 + 7.5 k) + 60 + 168 k ms, inside
    4,875 for k <= 4. The worst step alone admits 7 (60 + 7.5 x 8 = 120 ms)."""
    replies: dict[int, pb.SubmitReply] = {}
    first_stream_decoding(engine, replies)
    admitted = [rid for rid in range(2, 12) if submit(engine, rid, CLUMP_ROWS, 40, replies)]
    assert admitted == [2, 3, 4, 5], replies
    refused = replies[6]
    assert refused.status == pb.RATE_FLOOR and "prefills it waits for" in refused.message, refused
    # nothing refused holds anything; the admitted ones are queued for one prefill step
    assert set(engine._admitted) == {2, 3, 4, 5} and set(engine._unprefilled) == {2, 3, 4, 5}


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_which_prefills_a_prompt_in_a_step_now_and_a_queued_one_wait_for(
        loop: asyncio.AbstractEventLoop, overlap: bool) -> None:
    """Prompt 2's prefill step is under way, prompt 3 is queued for the next step and a
    new prompt would join that step (its rows alone) or, too long to share it, open one
    more. Stream 1 decoding waits for both steps and the new prompt's. On the overlap
    pipeline prompt 2 waits for the next step and the new prompt's, and prompt 3 only
    for the step the long one opens after its own (448 of its rows and the base); on the
    plain loop neither waits for any."""
    engine = make_engine(loop, overlap=overlap)
    replies: dict[int, pb.SubmitReply] = {}
    first_stream_decoding(engine, replies)
    assert submit(engine, 2, CLUMP_ROWS, 40, replies)
    engine._admit_waiting()
    assert engine._plan_chunks(4096)  # prompt 2's step is under way
    assert submit(engine, 3, CLUMP_ROWS, 40, replies)
    step = 60 + 0.375 * CLUMP_ROWS
    with engine._admitted_lock:
        (running, in_step, queued), new_stall = engine._held_with_stalls(CLUMP_ROWS)
    assert new_stall == pytest.approx(0.375 * CLUMP_ROWS)  # joins prompt 3's step: its rows only
    assert isinstance(running, HeldStream) and running.frames_out == 1
    assert running.stall_ms == pytest.approx(2 * step) and running.new_stall_share == 1.0
    assert isinstance(in_step, HeldStream) and isinstance(queued, HeldStream)
    assert (in_step.stall_ms, in_step.new_stall_share) == ((pytest.approx(step), 1.0) if overlap else (0.0, 0.0))
    assert (queued.stall_ms, queued.new_stall_share) == (0.0, 0.0)
    with engine._admitted_lock:
        (running, in_step, queued), new_stall = engine._held_with_stalls(4096)
    assert new_stall == pytest.approx(60 + 0.375 * 4096)  # fills the next step, opens one more
    assert isinstance(running, HeldStream) and running.new_stall_share == 1.0
    assert isinstance(in_step, HeldStream) and in_step.new_stall_share == (1.0 if overlap else 0.0)
    assert isinstance(queued, HeldStream)
    assert queued.new_stall_share * new_stall == (pytest.approx(step) if overlap else 0.0)


# A price of 1,000 ms a prefill-only step and 1 ms a row: a stream's charge counts the
# steps and rows it is charged for.
PRICE = StepCoefficients(base_ms=1000.0, per_stream_ms=0.0, per_token_ms=0.0, per_row_ms=1.0)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_each_stream_is_charged_the_prefill_steps_its_life_waits_for(
        loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    """The whole-life check's charges against the monolith's own loop: stream 1 decoding,
    prompts 2-6 queued (448 rows, one a prefill step) and prompt 7 judged. Each held
    stream is charged the prefill steps that the loop then runs between the stream's
    first and last frames (those launched in the iteration that publishes its first
    frame, or later, and before the one that publishes its last): stream 1 all six. The
    plain loop publishes the queued prompts' first frames with the first decode step
    after all of them are prefilled: none. The overlap pipeline publishes each as the
    step after its own ends, and decodes between prefill steps: each waits for the
    prompts queued after it."""
    engine = make_engine(loop, overlap=overlap, max_batch_rows=CLUMP_ROWS, admission=AdmissionControl(
        RateFloorAdmission(StepModel(PRICE, fixed=True), 1e-3, margin=0.0), HeldStream(CLUMP_ROWS, 40)))
    replies: dict[int, pb.SubmitReply] = {}
    first_stream_decoding(engine, replies)
    for rid in range(2, 7):
        assert submit(engine, rid, CLUMP_ROWS, 40, replies)
    with engine._admitted_lock:
        held, new_stall = engine._pending_prefills().held(PRICE, CLUMP_ROWS)
    charged = [h.stall_ms + new_stall * h.new_stall_share for h in held]
    assert submit(engine, 7, CLUMP_ROWS, 40, replies)

    iteration, prefills, published = 0, [], []
    publish_step = worker.publish_step

    def publish(hub: FrameHub, step: int, out: Any, codec: Any = None) -> Any:
        published.append((iteration, {int(i) for i in out.request_ids}))
        return publish_step(hub, step, out, codec)

    plan_chunks = engine._plan_chunks

    def plan(budget: int) -> Any:
        chunks = plan_chunks(budget)
        if chunks:
            prefills.append((iteration, sum(c.end - c.start for _, c in chunks)))
        return chunks

    monkeypatch.setattr(worker, "publish_step", publish)
    monkeypatch.setattr(engine, "_plan_chunks", plan)
    while len(engine.batcher) or engine.prefilling or len(engine.waiting):
        iteration += 1
        assert iteration < 400
        engine._step_once()
    assert [rows for _, rows in prefills] == [CLUMP_ROWS] * 6

    def waited_for(rid: int) -> float:
        frames = [i for i, ids in published if rid in ids]
        first = 0 if rid == 1 else frames[0]
        return sum(PRICE.base_ms + rows * PRICE.per_row_ms for i, rows in prefills if first <= i < frames[-1])

    assert [waited_for(rid) for rid in range(1, 7)] == pytest.approx(charged)
    assert waited_for(1) == pytest.approx(6 * 1448.0) and waited_for(7) == 0.0


# The open-loop repro (docs/admission.md "Open-loop clumps"): a real monolith unit padded to
# the model above (its exact fit as --step-model, refit on), Poisson 8 arrivals/s with 80%
# of them in clumps of 10, 300-600-row prompts, 40-frame streams, one 10-s level, a 2%
# margin (the real steps exceed the pad by the tiny model's CPU time now and then). Before
# the whole-life check its first stream, admitted alone, ran under the floor (7.5-7.8
# frames/s): a clump's 7 prompts were admitted at once, before any prefill was seen, and
# stalled it 1.2 s. About 16 s.
CLUMP_LOAD = dict(rate=[8.0], burst_share=0.8, burst_size=10, duration=10.0, prompt_rows=(300, 600),
                  frames=(40, 40), voices=4, progress=False, min_rate=FLOOR, fps=FLOOR / 2, ttfa_p95_ms=60_000,
                  mode_label="monolith", gpus=0, drain_timeout=60)


def clump_level(tmp_path: Path) -> dict[str, Any]:
    """The repro's level on a fresh unit: its capacity row with each stream's rate as the
    unit's LB sent it."""
    fit = tmp_path / "pad.fit.json"
    fit.write_text(PAD.to_json())
    args = ["--synthetic-step-ms", "60,7.5,0.375", "--step-model", str(fit), "--floor-margin", "0.02",
            "--floor-error-quantile", "0.5"]
    with LocalUnit(LocalConfig(mode="monolith", model="random:tiny:0", rate_floor=FLOOR, extra_monolith_args=args,
                               pool_tokens=32768, cache_tokens=16384, lb_port=0, guard=False,
                               log_level="warning")) as unit:
        doc = run_capacity(dict(url=unit.url, **CLUMP_LOAD), keep_streams=True)
        wait_empty(unit.url, timeout=60, what="the unit empty")
    streams = [{**st, "sent_rate": sent_rate(st)} for st in doc["streams"]]
    sent = sorted(st["sent_rate"] for st in streams if st["sent_rate"] is not None)
    row = {**doc["rows"][0], "sent_min_rate": sent[0] if sent else None,
           "goodput": sum(st["frames"] for st in streams if st["sent_rate"] is not None) / CLUMP_LOAD["duration"]}
    print("clump level: " + ", ".join(f"{k}={row[k]}" for k in (
        "ok", "refused", "errors", "error_kinds", "stutter_share", "sent_min_rate", "min_rate", "p50_rate",
        "goodput", "ttfa_p95_ms")), flush=True)
    return row


def test_an_open_loop_clump_leaves_every_admitted_stream_at_the_floor(tmp_path: Path) -> None:
    row = clump_level(tmp_path)
    assert row["ok"] > 0 and row["errors"] == 0, row
    assert row["refused"] > 0, row  # the clumps are more than the floor holds
    assert row["sent_min_rate"] >= FLOOR, row
