"""Overlap scheduling in D (engine/decode/overlap.py): the same frames as the plain step
loop, published one iteration later, with the exact number of frames per stream, and
pages that return to the pool only after the last queued step that writes them.

Driven directly on DecodeBatcher + OverlapScheduler (the code D runs), on the CPU; the
GPU test at the end checks the same identity through CUDA graphs on a real device."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from pdunit.bench.report import scrape_metrics
from pdunit.engine.decode.batcher import (
    FINISHED_EOS,
    FINISHED_LENGTH,
    RUNNING,
    DecodeBatcher,
    Stream,
)
from pdunit.engine.decode.overlap import OverlapScheduler
from pdunit.engine.decode.step_forward import StepForward
from pdunit.engine.kv.pool import PagePool, PageState
from pdunit.engine.local import free_port
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.prefill.runner import PrefillChunk, run_forward, run_prefill
from tests.engine.unit_client import load, random_prompt, stream, wait_for

POOL_TOKENS = 4096
PAGE = 4


def prompt(rows: int, seed: int, cols: int = 11, vocab: int = 1024) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab - 1, size=(rows, cols), dtype=np.int64)


@dataclasses.dataclass
class Req:
    rid: int
    rows: int
    params: SamplingParams
    join: int = 0                 # iteration at which the stream arrives in D
    cancel_at: int | None = None  # iteration at which the client cancels


@dataclasses.dataclass
class Run:
    frames: dict[int, list[list[int]]]
    codes: dict[int, list[int]]
    pool: PagePool
    max_index: dict[int, int]     # highest token index whose slot was asked (K/V writes included)
    states_after_end: dict[int, list]  # pool state of an ended stream right after, then one iteration later


class Harness:
    """One D: a pool, the tiny model, and either the plain step loop or the overlap one."""

    def __init__(self, overlap: bool, eos_id: int | None = None, device: str = "cpu",
                 dtype: str | None = None, start_frames: int = 0) -> None:
        self.model = load_model("random:tiny:0", device=device, dtype=dtype)
        if eos_id is not None:
            self.model.config = dataclasses.replace(self.model.config, eos_id=eos_id)
        self.pool = PagePool(POOL_TOKENS // PAGE, PAGE)
        self.storage = self.model.new_kv_storage(POOL_TOKENS, device=device)
        self.batcher = DecodeBatcher(self.model, self.pool, self.storage, max_batch=8)
        self.forward = StepForward(self.model, self.storage, use_graphs=True, max_batch=8)
        self.overlap = OverlapScheduler(self.model, self.batcher, self.forward, start_frames) if overlap else None
        self.published: list[list[int]] = []   # request ids of each published message, in order
        self.max_index: dict[int, int] = {}
        self.prompts: dict[int, np.ndarray] = {}
        slot_of = self.pool.slot_of

        def spy(rid: int, index: int) -> int:
            self.max_index[rid] = max(self.max_index.get(rid, -1), index)
            return slot_of(rid, index)

        self.pool.slot_of = spy  # type: ignore[method-assign]

    def admit(self, r: Req) -> None:
        p = self.prompts[r.rid] if r.rid in self.prompts else prompt(r.rows, seed=r.rid)
        slots = self.pool.reserve(r.rid, r.rows, r.rows + r.params.max_frames)
        first = run_prefill(self.model, self.storage, [PrefillChunk(p, slots, 0, r.rows, r.params)])[0]
        self.pool.mark_filled(r.rid)
        self.pool.start_decoding(r.rid)
        self.batcher.admit(Stream(r.rid, r.rows, r.params, first.astype(np.int32)))

    def iterate(self):
        if self.overlap is not None:
            return self.overlap.step_once()[1]
        b = self.batcher
        b.take_cancelled()
        new = b.take_incoming()
        streams, entries = b.decode_entries()
        if not streams and not new:
            return None
        logits = run_forward(self.model, self.storage, entries) if entries else None
        return b.apply(streams, logits, new)

    def run(self, reqs: list[Req], max_iterations: int = 500) -> Run:
        frames: dict[int, list[list[int]]] = {r.rid: [] for r in reqs}
        codes: dict[int, list[int]] = {r.rid: [] for r in reqs}
        states: dict[int, list] = {}
        for it in range(max_iterations):
            for r in reqs:
                if r.join == it:
                    self.admit(r)
                if r.cancel_at == it:
                    assert self.batcher.cancel(r.rid)
            out = self.iterate()
            for rid in states:
                if len(states[rid]) == 1:
                    states[rid].append(self.pool.state_of(rid))
            if out is not None:
                self.published.append(out.request_ids.tolist())
                for rid, frame, code in zip(out.request_ids.tolist(), out.frames.tolist(), out.finished.tolist(),
                                            strict=True):
                    frames[rid].append(frame)
                    codes[rid].append(code)
                    if code != RUNNING:
                        states[rid] = [self.pool.state_of(rid)]
            idle = not len(self.batcher) and (self.overlap is None or not self.overlap.in_flight)
            if it > max(r.join for r in reqs) and idle:
                return Run(frames, codes, self.pool, dict(self.max_index), states)
        raise AssertionError(f"streams still running after {max_iterations} iterations")


def both(reqs: list[Req], eos_id: int | None = None) -> tuple[Run, Run]:
    return Harness(False, eos_id).run(reqs), Harness(True, eos_id).run(reqs)


MIXED = [
    Req(1, 24, SamplingParams(max_frames=14, min_frames=14)),
    Req(2, 40, SamplingParams(max_frames=9, min_frames=0, temperature=0.9, seed=7)),
    Req(3, 17, SamplingParams(max_frames=12, min_frames=3, temperature=1.3, top_k=40, seed=11), join=2),
    Req(4, 31, SamplingParams(max_frames=1), join=3),                       # ends with its first frame
    Req(5, 22, SamplingParams(max_frames=6, temperature=0.7, seed=5), join=5),  # joins as others leave
    Req(6, 28, SamplingParams(max_frames=2), join=9),
]


def eos_that_occurs() -> int:
    """An EOS id the greedy tiny model really emits mid-stream: column 0 of the fifth
    frame of a plain greedy run, so EOS-ended streams are exercised, not hoped for."""
    run = Harness(False).run([Req(1, 24, SamplingParams(max_frames=6, min_frames=6))])
    return run.frames[1][4][0]


def test_overlap_publishes_the_same_frames_for_greedy_and_seeded_streams_joining_and_leaving() -> None:
    plain, over = both(MIXED)
    for r in MIXED:
        assert over.frames[r.rid] == plain.frames[r.rid], f"stream {r.rid}"
        assert over.codes[r.rid] == plain.codes[r.rid], f"stream {r.rid}"
        # the exact count: max_frames frames, the last one flagged, none after it
        assert len(over.frames[r.rid]) == r.params.max_frames
        assert over.codes[r.rid][:-1] == [RUNNING] * (r.params.max_frames - 1)
        assert over.codes[r.rid][-1] == FINISHED_LENGTH
    assert len({tuple(map(tuple, f)) for f in plain.frames.values()}) == len(MIXED)  # not degenerate
    for run in (plain, over):
        assert run.pool.free_pages == run.pool.n_pages


def test_eos_seen_one_step_late_publishes_nothing_after_eos_and_writes_inside_the_reservation() -> None:
    eos = eos_that_occurs()
    reqs = [
        Req(1, 24, SamplingParams(max_frames=20)),                 # greedy, min_frames 0: ends at EOS
        Req(2, 24, SamplingParams(max_frames=20, min_frames=8)),   # same prompt: EOS suppressed until 8
        Req(3, 33, SamplingParams(max_frames=16, temperature=1.0, seed=3)),
        Req(4, 45, SamplingParams(max_frames=16), join=1),
    ]
    reqs[1] = dataclasses.replace(reqs[1], rid=2)
    plain, over = both(reqs, eos_id=eos)
    ended_by_eos = [r.rid for r in reqs if plain.codes[r.rid][-1] == FINISHED_EOS]
    assert ended_by_eos, "the chosen EOS id must end at least one stream"
    for r in reqs:
        assert over.frames[r.rid] == plain.frames[r.rid], f"stream {r.rid}"
        assert over.codes[r.rid] == plain.codes[r.rid], f"stream {r.rid}"
        codes = over.codes[r.rid]
        assert RUNNING not in codes[-1:] and set(codes[:-1]) <= {RUNNING}
        if codes[-1] == FINISHED_EOS:
            assert over.frames[r.rid][-1][0] == eos
            assert len(over.frames[r.rid]) >= max(1, r.params.min_frames + 1)
        # K/V rows of every step, the discarded one after EOS included, stay inside
        # prompt + max_frames - 1 (the bound of the plain loop)
        assert over.max_index[r.rid] <= r.rows + r.params.max_frames - 2
    for rid in ended_by_eos:
        # the frame after EOS was already queued: its pages wait for that step
        assert over.states_after_end[rid] == [PageState.DECODING, None]
    assert over.pool.free_pages == over.pool.n_pages


def test_cancelled_stream_stops_publishing_and_its_pages_return_after_the_queued_step() -> None:
    reqs = [
        Req(1, 30, SamplingParams(max_frames=30, temperature=0.8, seed=1), cancel_at=6),
        Req(2, 26, SamplingParams(max_frames=12)),
    ]
    plain, over = both(reqs)
    full = Harness(True).run([dataclasses.replace(reqs[0], cancel_at=None)])
    for run in (plain, over):
        got = run.frames[1]
        assert 0 < len(got) < 30
        assert got == full.frames[1][: len(got)]      # a prefix: nothing wrong, nothing after
        assert run.codes[1] == [RUNNING] * len(got)   # a cancelled stream has no finished flag
        assert run.pool.free_pages == run.pool.n_pages
    # the cancel is taken at the same iteration in both loops: the overlap's queued row
    # for the cancelled stream is discarded, not published
    assert over.frames[1] == plain.frames[1]
    assert over.frames[2] == plain.frames[2]


def test_cancel_frees_pages_only_after_the_queued_step_that_writes_them_completed() -> None:
    h = Harness(True)
    events: list[tuple] = []
    complete, finish = h.overlap._complete, h.pool.finish

    def spy_complete(step) -> None:  # waits for the step (its event on CUDA), then frees
        events.append(("completed", step.number, [s.request_id for s in step.streams]))
        complete(step)

    def spy_finish(rid: int) -> None:
        events.append(("freed", rid))
        finish(rid)

    h.overlap._complete = spy_complete  # type: ignore[method-assign]
    h.pool.finish = spy_finish  # type: ignore[method-assign]
    h.admit(Req(1, 30, SamplingParams(max_frames=30)))
    h.overlap.step_once()            # first frame out, step 1 queued
    h.overlap.step_once()            # step 2 queued, step 1's frame out
    assert h.batcher.cancel(1)
    events.clear()
    _, out = h.overlap.step_once()   # the cancel is taken while step 2 is queued
    assert out is None               # step 2's row is discarded, nothing published
    # pages go back once step 2 (which writes them) has completed, never before
    assert events == [("completed", 2, [1]), ("freed", 1)]
    assert h.pool.state_of(1) is None and not h.overlap.in_flight
    assert h.pool.free_pages == h.pool.n_pages


START_FRAMES = 5
# Old streams decoding when young ones join, one of them at the same iteration as an old
# stream leaves; greedy, seeded and top-k, one ending at its first frame.
STAGGERED = [
    Req(1, 24, SamplingParams(max_frames=30, min_frames=30)),
    Req(2, 40, SamplingParams(max_frames=26, temperature=0.9, seed=7)),
    Req(3, 17, SamplingParams(max_frames=12, min_frames=3, temperature=1.3, top_k=40, seed=11), join=6),
    Req(4, 31, SamplingParams(max_frames=1), join=7),
    Req(5, 22, SamplingParams(max_frames=9, temperature=0.7, seed=5), join=8),
    Req(6, 28, SamplingParams(max_frames=14), join=20),
]


def test_start_steps_publish_the_plain_loops_frames_and_free_everything() -> None:
    eos = eos_that_occurs()
    for eos_id in (None, eos):
        plain = Harness(False, eos_id).run(STAGGERED)
        started = Harness(True, eos_id, start_frames=START_FRAMES)
        got = started.run(STAGGERED)
        for r in STAGGERED:
            assert got.frames[r.rid] == plain.frames[r.rid], f"stream {r.rid} (eos {eos_id})"
            assert got.codes[r.rid] == plain.codes[r.rid], f"stream {r.rid} (eos {eos_id})"
            assert got.max_index.get(r.rid, -1) <= r.rows + r.params.max_frames - 2
        assert got.pool.free_pages == got.pool.n_pages


def iterations_to(run_published: list[list[int]], rid: int, n: int) -> int:
    """Published messages until stream `rid` has `n` frames."""
    seen = 0
    for i, ids in enumerate(run_published):
        seen += ids.count(rid)
        if seen >= n:
            return i + 1
    raise AssertionError(f"stream {rid} never reached {n} frames")


def test_start_steps_bring_a_joining_streams_first_audio_sooner_and_skip_no_old_stream() -> None:
    from pdunit.engine.decode.overlap import START_STEPS

    reqs = [Req(1, 24, SamplingParams(max_frames=40, min_frames=40)),
            Req(2, 30, SamplingParams(max_frames=40, min_frames=40)),
            Req(3, 20, SamplingParams(max_frames=20, min_frames=20), join=6)]
    plain = Harness(True)
    plain.run(reqs)
    started = Harness(True, start_frames=START_FRAMES)
    before = START_STEPS._value.get()
    started.run(reqs)
    # the joining stream's first audio, counted in full steps (messages with an old
    # stream, each a full step's frames): START_FRAMES - 1 of them without start steps,
    # about half with them (a start step's small batch costs about the weights' read)
    def full_steps_to_first_audio(published: list[list[int]]) -> int:
        first, audio = iterations_to(published, 3, 1), iterations_to(published, 3, START_FRAMES)
        return sum(1 in ids for ids in published[first:audio])

    assert full_steps_to_first_audio(plain.published) == START_FRAMES - 1
    assert full_steps_to_first_audio(started.published) == (START_FRAMES - 1) // 2
    # one start step after each full step while it is young: START_FRAMES - 1 frames
    # in about half as many full steps, and as many start steps as it needed
    n_start = START_STEPS._value.get() - before
    assert n_start == (START_FRAMES - 1) // 2
    # an old stream misses at most the one message of a start step in a row, never two
    for rid in (1, 2):
        gaps, run = [], 0
        for ids in started.published:
            if rid in ids:
                gaps.append(run)
                run = 0
            else:
                run += 1
        assert max(gaps) <= 1
    # no start step when every running stream is young (a full step is as fast)
    alone = Harness(True, start_frames=START_FRAMES)
    before = START_STEPS._value.get()
    alone.run([Req(9, 20, SamplingParams(max_frames=12, min_frames=12))])
    assert START_STEPS._value.get() == before


UNIT_REQUESTS = [  # the first one long: the others join it while it decodes
    (random_prompt(90, seed=21), dict(max_frames=240, min_frames=240)),
    (random_prompt(150, seed=22), dict(max_frames=12, min_frames=0, temperature=1.0, seed=5)),
    (random_prompt(60, seed=23), dict(max_frames=20, min_frames=4, temperature=0.8, top_k=40, seed=9)),
]


def test_start_frames_without_overlap_is_refused_naming_the_flag(capsys) -> None:
    from pdunit.engine.decode.main import DecodeConfig
    from pdunit.engine.settings import ConfigError, parse_config

    for argv, why in ((["--start-frames", "9"], "the default on device 'cpu'"),
                      (["--device", "cuda", "--no-overlap", "--start-frames", "9"], "--no-overlap")):
        with pytest.raises(ConfigError):
            parse_config(DecodeConfig, argv, "pdunit decode", env={})
        err = capsys.readouterr().err
        assert "invalid start_frames (from --start-frames)" in err and why in err, err
    ok = parse_config(DecodeConfig, ["--overlap", "--start-frames", "9"], "pdunit decode", env={})
    assert ok.start_frames == 9


@pytest.mark.parametrize("decode_args", [["--overlap"], ["--overlap", "--start-frames", "6"]],
                         ids=["overlap", "start-steps"])
def test_pd_unit_with_overlap_streams_the_plain_loops_frames_and_frees_everything(decode_args) -> None:
    from pdunit.engine.local import LocalConfig, LocalUnit

    reference = Harness(False)
    reqs = []
    for i, (p, params) in enumerate(UNIT_REQUESTS):
        reference.prompts[i] = np.array(p, dtype=np.int64)
        reqs.append(Req(i, len(p), SamplingParams(**params)))
    expected = reference.run(reqs)
    metrics_port = free_port()
    cfg = LocalConfig(mode="pd", pool_tokens=8192, cache_tokens=8192, lb_port=0, guard=False,
                      log_level="warning", extra_decode_args=decode_args + ["--metrics-port", str(metrics_port)])
    with LocalUnit(cfg) as unit:
        before = load(unit.url)
        decoding = threading.Event()
        with ThreadPoolExecutor(len(UNIT_REQUESTS)) as pool:
            first_p, first_params = UNIT_REQUESTS[0]
            first = pool.submit(stream, unit.url, first_p, on_frame=lambda n: n >= 12 and decoding.set(),
                                **first_params)
            assert decoding.wait(60), "the first stream never reached 12 frames"
            got = [first] + [pool.submit(stream, unit.url, p, **params) for p, params in UNIT_REQUESTS[1:]]
            got = [f.result() for f in got]
        for i, (frames, last) in enumerate(got):
            assert last.get("done"), last
            assert frames == expected.frames[i], f"request {i}"
        wait_for(lambda: load(unit.url)["free_pages"] == before["free_pages"], what="every page back in D's pool")
        start_steps = scrape_metrics(metrics_port).get("pdunit_decode_start_steps_total", 0.0)
        # the joining streams ran start steps beside the long one exactly when asked to
        assert (start_steps > 0) == ("--start-frames" in decode_args), start_steps


@pytest.mark.gpu
def test_overlap_frames_identical_on_cuda_with_graphs() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    reqs = MIXED + [Req(7, 50, SamplingParams(max_frames=40, temperature=1.1, top_k=30, seed=99), join=1)]
    reqs += [dataclasses.replace(r, rid=r.rid + 100, join=r.join + 12) for r in STAGGERED]

    def cuda_run(overlap: bool, start_frames: int = 0) -> Run:
        h = Harness(overlap, device="cuda", dtype="bfloat16", start_frames=start_frames)
        assert h.forward.graphs is not None, "the bf16 CUDA model must take the graph path"
        if not overlap:
            h.iterate = lambda: _plain_graph_iteration(h)  # type: ignore[method-assign]
        return h.run(reqs)

    plain, over, started = cuda_run(False), cuda_run(True), cuda_run(True, START_FRAMES)
    for r in reqs:
        for run in (over, started):
            assert run.frames[r.rid] == plain.frames[r.rid], f"stream {r.rid}"
            assert run.codes[r.rid] == plain.codes[r.rid], f"stream {r.rid}"


def _plain_graph_iteration(h: Harness):
    b = h.batcher
    b.take_cancelled()
    new = b.take_incoming()
    streams, entries = b.decode_entries()
    if not streams and not new:
        return None
    return b.apply(streams, h.forward(entries) if entries else None, new)


@pytest.mark.gpu
def test_overlap_launch_never_synchronizes_with_the_device() -> None:
    """Queueing step n+1 must not wait for step n: any synchronizing CUDA call inside
    `_launch` (a pageable copy, `.item()`, a stream sync) raises under torch's sync
    debug mode. Every stream here has EOS suppressed for some steps (min_frames), the
    case that once made every overlapped step wait for the one in flight."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    h = Harness(True, device="cuda", dtype="bfloat16")
    assert h.overlap is not None and h.forward.graphs is not None
    launch = h.overlap._launch
    launched = []

    def strict_launch(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = launch(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        launched.append(len(step.streams))
        return step

    h.overlap._launch = strict_launch  # type: ignore[method-assign]
    reqs = [Req(1, 24, SamplingParams(max_frames=12, min_frames=12)),
            Req(2, 30, SamplingParams(max_frames=10, min_frames=4, temperature=0.9, top_k=20, seed=3), join=1),
            Req(3, 18, SamplingParams(max_frames=8, min_frames=8, temperature=1.2, seed=5), join=2)]
    run = h.run(reqs)
    assert len(launched) >= 10 and max(launched) == 3
    for r in reqs:
        assert r.params.min_frames <= len(run.frames[r.rid]) <= r.params.max_frames
