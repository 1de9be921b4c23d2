"""Overlap scheduling in D (engine/decode/overlap.py): the same frames as the plain step
loop, published one iteration later, with the exact number of frames per stream, and
pages that return to the pool only after the last queued step that writes them.

Driven directly on DecodeBatcher + OverlapScheduler (the code D runs), on the CPU; the
GPU test at the end checks the same identity through CUDA graphs on a real device."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

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
                 dtype: str | None = None) -> None:
        self.model = load_model("random:tiny:0", device=device, dtype=dtype)
        if eos_id is not None:
            self.model.config = dataclasses.replace(self.model.config, eos_id=eos_id)
        self.pool = PagePool(POOL_TOKENS // PAGE, PAGE)
        self.storage = self.model.new_kv_storage(POOL_TOKENS, device=device)
        self.batcher = DecodeBatcher(self.model, self.pool, self.storage, max_batch=8)
        self.forward = StepForward(self.model, self.storage, use_graphs=True, max_batch=8)
        self.overlap = OverlapScheduler(self.model, self.batcher, self.forward) if overlap else None
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


UNIT_REQUESTS = [
    (random_prompt(90, seed=21), dict(max_frames=16, min_frames=16)),
    (random_prompt(150, seed=22), dict(max_frames=12, min_frames=0, temperature=1.0, seed=5)),
    (random_prompt(60, seed=23), dict(max_frames=20, min_frames=4, temperature=0.8, top_k=40, seed=9)),
]


def test_pd_unit_with_overlap_streams_the_plain_loops_frames_and_frees_everything() -> None:
    from pdunit.engine.local import LocalConfig, LocalUnit

    reference = Harness(False)
    reqs = []
    for i, (p, params) in enumerate(UNIT_REQUESTS):
        reference.prompts[i] = np.array(p, dtype=np.int64)
        reqs.append(Req(i, len(p), SamplingParams(**params)))
    expected = reference.run(reqs)
    cfg = LocalConfig(mode="pd", pool_tokens=8192, cache_tokens=8192, lb_port=0, guard=False,
                      log_level="warning", extra_decode_args=["--overlap"])
    with LocalUnit(cfg) as unit:
        before = load(unit.url)
        with ThreadPoolExecutor(len(UNIT_REQUESTS)) as pool:
            got = list(pool.map(lambda r: stream(unit.url, r[0], **r[1]), UNIT_REQUESTS))
        for i, (frames, last) in enumerate(got):
            assert last.get("done"), last
            assert frames == expected.frames[i], f"request {i}"
        wait_for(lambda: load(unit.url).free_pages == before.free_pages, what="every page back in D's pool")


@pytest.mark.gpu
def test_overlap_frames_identical_on_cuda_with_graphs() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    reqs = MIXED + [Req(7, 50, SamplingParams(max_frames=40, temperature=1.1, top_k=30, seed=99), join=1)]

    def cuda_run(overlap: bool) -> Run:
        h = Harness(overlap, device="cuda", dtype="bfloat16")
        assert h.forward.graphs is not None, "the bf16 CUDA model must take the graph path"
        if not overlap:
            h.iterate = lambda: _plain_graph_iteration(h)  # type: ignore[method-assign]
        return h.run(reqs)

    plain, over = cuda_run(False), cuda_run(True)
    for r in reqs:
        assert over.frames[r.rid] == plain.frames[r.rid], f"stream {r.rid}"
        assert over.codes[r.rid] == plain.codes[r.rid], f"stream {r.rid}"


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
