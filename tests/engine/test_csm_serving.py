"""CSM served (issue 23): P's first frame, D's steps (plain and overlapped) and whole
units (PD, monolith) make the frames transformers' `CsmForConditionalGeneration.generate`
makes, greedy, frame for frame; a stream ends at CSM's EOS frame; seeded sampling
repeats. The in-process tests drive the code D runs (run_prefill, DecodeBatcher,
OverlapScheduler); the unit tests start real processes with `pdunit local`'s LocalUnit.
A tiny random CsmConfig is built with transformers and saved locally (no downloads)."""

from __future__ import annotations

import copy
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

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
from pdunit.engine.kv.pool import PagePool
from pdunit.engine.lb.load import LoadDocument
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.model.transformer import TTSModel
from pdunit.engine.prefill.runner import PrefillChunk, run_prefill
from tests.engine.test_csm_family import AUDIO_TOKEN, K, oracle_embeds, rows, saved, tiny_csm

# text only, text then audio frames, audio frames only (Sesame's rows: K codes + text id)
PROMPTS = [rows(1, 6, 0), rows(2, 3, 4), rows(3, 0, 5)]
GREEDY_FRAMES = 8
EOS_PROMPT = rows(10, 3, 2)
SMALL = dict(pool_tokens=4096, cache_tokens=4096, lb_port=0, guard=False, log_level="warning", dtype="float64")


def generate(oracle: Any, prompt: np.ndarray, frames: int) -> np.ndarray:
    """transformers' greedy frames [n, K] for one prompt (its rows embedded by its own modules)."""
    with torch.no_grad():
        out = oracle.generate(inputs_embeds=oracle_embeds(oracle, [prompt]), max_new_tokens=frames, do_sample=False)
    return out[0].numpy()


def eos_model() -> Any:
    """A tiny CSM that ends EOS_PROMPT's greedy stream at a frame i >= 2: its depth heads
    for codebooks 1..K-2 are zero (all logits tie, argmax takes id 0), and codebook 0's
    head row for id 0 becomes that of the id that first wins at frame i, so id 0 ties it
    there and wins, making frame i CSM's EOS frame (codebooks 0..K-2 all 0, the
    codebook_eos_token_id); earlier frames, whose winners beat that id, are unchanged."""
    model = tiny_csm()
    with torch.no_grad():
        model.depth_decoder.codebooks_head.weight[: K - 2] = 0
        c0 = generate(copy.deepcopy(model).double(), EOS_PROMPT, 16)[:, 0].tolist()
        i = next(i for i in range(2, 16) if c0[i] not in c0[:i] and 0 not in c0[: i + 1])
        model.lm_head.weight[0] = model.lm_head.weight[c0[i]]
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The saved checkpoint (float32) and its oracle in float64 (the engines run float64)."""
    model = tiny_csm()
    return saved(model, tmp_path_factory.mktemp("csm")), model.double()


@pytest.fixture(scope="module")
def eos_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    model = eos_model()
    return saved(model, tmp_path_factory.mktemp("csm-eos")), model.double()


class D:
    """One D in process: a pool, the model, the plain step loop or the overlap one;
    `frame_graphs`: the depth decoder through FrameGraphRunner's staged buffers
    (capture=False on the CPU: what its CUDA graphs replay)."""

    def __init__(self, model: TTSModel, overlap: bool, frame_graphs: bool = False) -> None:
        self.model = model
        if frame_graphs:
            from pdunit.engine.model.frame_graphs import FrameGraphRunner

            model.frame_graphs = FrameGraphRunner(model, buckets=(1, 2, 4, 8), capture=False)
        self.pool = PagePool(512, 4)
        self.storage = model.new_kv_storage(2048, device=model.device)
        self.batcher = DecodeBatcher(model, self.pool, self.storage, max_batch=8)
        # D's step forward: decode graphs where the model takes the GPU path, else eager
        self.forward = StepForward(model, self.storage, use_graphs=True, max_batch=8)
        self.overlap = OverlapScheduler(model, self.batcher, self.forward) if overlap else None

    def run(self, prompts: list[np.ndarray], params: list[SamplingParams]) -> tuple[list[np.ndarray], list[int]]:
        """Every prompt's frame rows [n, K+1] and its last finish code; all prompts join at once."""
        for rid, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            slots = self.pool.reserve(rid, len(p), len(p) + sp.max_frames)
            first = run_prefill(self.model, self.storage, [PrefillChunk(p, slots, 0, len(p), sp)])[0]
            assert first is not None
            self.pool.mark_filled(rid)
            self.pool.start_decoding(rid)
            self.batcher.admit(Stream(rid, len(p), sp, first.astype(np.int32)))
        frames: list[list[list[int]]] = [[] for _ in prompts]
        codes = [RUNNING] * len(prompts)
        for _ in range(200):
            out = self._iterate()
            if out is not None:
                for rid, frame, code in zip(out.request_ids.tolist(), out.frames.tolist(), out.finished.tolist(),
                                            strict=True):
                    frames[rid].append(frame)
                    codes[rid] = code
            if not len(self.batcher) and (self.overlap is None or not self.overlap.in_flight):
                assert self.pool.free_pages == self.pool.n_pages
                return [np.array(f) for f in frames], codes
        raise AssertionError("streams still running after 200 iterations")

    def _iterate(self) -> Any:
        if self.overlap is not None:
            return self.overlap.step_once()[1]
        b = self.batcher
        new = b.take_incoming()
        streams, entries = b.decode_entries()
        if not streams and not new:
            return None
        return b.apply(streams, self.forward(entries) if entries else None, new)


def csm(directory: Path) -> TTSModel:
    return load_model(str(directory), dtype="float64")


@pytest.mark.parametrize("overlap,graphs", [(False, False), (True, False), (True, True)],
                         ids=["plain", "overlap", "overlap-frame-graphs"])
def test_p_and_d_make_the_greedy_frames_of_transformers_generate(
        checkpoint: tuple[Path, Any], overlap: bool, graphs: bool) -> None:
    directory, oracle = checkpoint
    d = D(csm(directory), overlap, graphs)
    frames, codes = d.run(PROMPTS, [SamplingParams(max_frames=GREEDY_FRAMES)] * 3)
    if graphs:
        assert d.model.frame_graphs is not None and d.model.frame_graphs.stats["eager"] == 0
    for got, prompt, code in zip(frames, PROMPTS, codes, strict=True):
        want = generate(oracle, prompt, GREEDY_FRAMES)
        assert want.shape == (GREEDY_FRAMES, K)  # no EOS frame within these frames
        assert got.shape == (GREEDY_FRAMES, K + 1) and code == FINISHED_LENGTH
        assert np.array_equal(got[:, :K], want)
        assert (got[:, K] == AUDIO_TOKEN).all()  # a frame is an audio-frame row: the next input as it is
    assert len({f[:, :K].tobytes() for f in frames}) == 3  # not degenerate


@pytest.mark.parametrize("overlap,graphs", [(False, False), (True, False), (False, True)],
                         ids=["plain", "overlap", "plain-frame-graphs"])
def test_a_stream_ends_at_csms_eos_frame_as_transformers_generate_does(
        eos_checkpoint: tuple[Path, Any], overlap: bool, graphs: bool) -> None:
    directory, oracle = eos_checkpoint
    want = generate(oracle, EOS_PROMPT, 16)
    assert 1 < len(want) < 16 and (want[-1, : K - 1] == 0).all()  # transformers stopped at its EOS frame
    params = [SamplingParams(max_frames=16), SamplingParams(max_frames=16, min_frames=8)]
    frames, codes = D(csm(directory), overlap, graphs).run([EOS_PROMPT, EOS_PROMPT], params)
    assert np.array_equal(frames[0][:, :K], want) and codes[0] == FINISHED_EOS
    # min_frames suppresses codebook 0's EOS id: no EOS frame before frame 8
    assert len(frames[1]) >= 9 and not (frames[1][:8, : K - 1] == 0).all(axis=1).any()


def test_seeded_sampling_repeats_and_follows_the_seed(checkpoint: tuple[Path, Any]) -> None:
    model = csm(checkpoint[0])
    sampled = [SamplingParams(max_frames=10, temperature=1.0, seed=7),
               SamplingParams(max_frames=10, temperature=0.8, top_k=5, seed=7)]
    first, _ = D(model, False).run(PROMPTS[:2], sampled)
    again, _ = D(model, True).run(PROMPTS[:2], sampled)  # overlapped: the device sampler, same draws
    other, _ = D(model, False).run(PROMPTS[:2], [dataclasses.replace(p, seed=8) for p in sampled])
    staged, _ = D(csm(checkpoint[0]), True, frame_graphs=True).run(PROMPTS[:2], sampled)  # the static sampler
    for a, b, c, s in zip(first, again, other, staged, strict=True):
        assert np.array_equal(a, b) and np.array_equal(a, s)
        assert not np.array_equal(a, c)
    greedy, _ = D(model, False).run(PROMPTS[:2], [SamplingParams(max_frames=10)] * 2)
    assert not np.array_equal(first[0], greedy[0])  # sampling really samples


@pytest.mark.gpu
def test_csm_on_cuda_makes_the_cpus_frames_plain_and_overlapped() -> None:
    """On CUDA in float64 (the reference path) the frames equal the CPU's, greedy and
    seeded; in bf16 (the Triton backbone, D's decode graphs, the depth decoder's graphs
    after each replay) the overlap scheduler's frames equal the plain loop's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts = [np.concatenate([np.full((n, 4), 31), np.arange(n)[:, None] % 60], axis=1) for n in (9, 23)]
    params = [SamplingParams(max_frames=12), SamplingParams(max_frames=12, temperature=0.9, top_k=8, seed=3)]
    cpu, _ = D(load_model("random:csm-tiny:0"), False).run(prompts, params)
    for overlap in (False, True):
        gpu, _ = D(load_model("random:csm-tiny:0", device="cuda"), overlap).run(prompts, params)
        assert all(np.array_equal(a, b) for a, b in zip(cpu, gpu, strict=True)), f"overlap={overlap}"
    units = [D(load_model("random:csm-tiny:0", device="cuda", dtype="bfloat16"), o) for o in (False, True)]
    assert all(u.model.gpu_path and u.forward.graphs is not None and u.model.frame_graphs is not None
               for u in units)
    plain, over = (u.run(prompts, params)[0] for u in units)
    assert all(np.array_equal(a, b) for a, b in zip(plain, over, strict=True))
    for u in units:  # every step's frames (P's first frames included) came from a replay
        assert u.model.frame_graphs is not None
        assert u.model.frame_graphs.stats["eager"] == 0 and u.model.frame_graphs.stats["replays"] > 10


def test_random_csm_tiny_builds_in_process_and_streams_audio_frame_rows() -> None:
    model = load_model("random:csm-tiny:0")
    assert model.frame_generator is not None and model.config.n_codebooks == 5
    again = load_model("random:csm-tiny:0")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(),
                                                strict=True))
    prompt = np.concatenate([np.full((6, 4), 31), np.arange(6)[:, None] + 3], axis=1)  # text rows
    frames, codes = D(model, False).run([prompt], [SamplingParams(max_frames=6)])
    assert frames[0].shape == (6, 5) and (frames[0][:, 4] == 62).all() and (frames[0][:, :4] < 32).all()
    assert len({tuple(f) for f in frames[0].tolist()}) > 1


def test_csm_takes_the_graphs_on_the_gpu_path_and_is_refused_them_only_off_it() -> None:
    """csm shares the backbone's GPU path and graphs (tests/kernels/test_csm_gpu_path.py);
    on the CPU (float64) `--cuda-graphs` and the prefill graphs are refused for the device,
    naming the flag, as for any family."""
    from pdunit.engine.decode.step_forward import resolve_decode_graphs
    from pdunit.engine.model.prefill_graphs import PrefillGraphRunner

    model = load_model("random:csm-tiny:0")
    assert not model.gpu_path and not resolve_decode_graphs(None, model)
    with pytest.raises(ValueError, match=r"--cuda-graphs.*need the model's GPU path"):
        resolve_decode_graphs(True, model)
    with pytest.raises(ValueError, match="PrefillGraphRunner needs the model's GPU path"):
        PrefillGraphRunner(model, model.new_kv_storage(64), capture=False)


def test_a_model_whose_head_lacks_columns_and_has_no_frame_generator_is_refused(tmp_path: Path) -> None:
    from pdunit.engine.model.config import get_config
    from pdunit.engine.model.loader import save_model

    save_model(TTSModel(dataclasses.replace(get_config("tiny"), head_codebooks=1)), str(tmp_path))
    with pytest.raises(ValueError, match="no frame generator gives the rest; set head_codebooks to null"):
        load_model(str(tmp_path))


# ---------------------------------------------------------------- whole units (processes)


def stream(url: str, prompt: list[list[int]], **params: Any) -> tuple[list[list[int]], dict]:
    # the LB's stack (unit_client), imported only by the unit tests: not needed in process
    from tests.engine.unit_client import stream as unit_stream

    return unit_stream(url, prompt, **params)


def load(url: str) -> LoadDocument:
    from tests.engine.unit_client import load as unit_load

    return unit_load(url)


def run_prompts(url: str, prompts: list[np.ndarray], **params: Any) -> list[tuple[np.ndarray, dict]]:
    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrently: streams share steps and batches
        out = list(pool.map(lambda p: stream(url, p.tolist(), **params), prompts))
    return [(np.array(f), last) for f, last in out]


@pytest.fixture(scope="module")
def csm_units(checkpoint: tuple[Path, Any]) -> Any:
    from pdunit.engine.local import LocalConfig  # the LB's stack: not needed in process
    from tests.engine.unit_client import units_side_by_side

    model = str(checkpoint[0])
    # the third: a monolith whose steps mix prompt chunks (6 rows) with decode rows, overlapped
    mixed = LocalConfig(mode="monolith", model=model, policy="chunked", chunk_tokens=6,
                        extra_monolith_args=["--overlap"], **SMALL)
    # the four units' eleven processes import and load side by side
    with units_side_by_side(LocalConfig(mode="pd", model=model, **SMALL), LocalConfig(mode="monolith", model=model, **SMALL),
                            mixed, LocalConfig(mode="1p2d", model=model, **SMALL)) as units:
        yield units


def test_pd_and_monolith_units_stream_the_greedy_frames_of_transformers_generate(
        checkpoint: tuple[Path, Any], csm_units: Any) -> None:
    oracle = checkpoint[1]
    want = [generate(oracle, p, GREEDY_FRAMES) for p in PROMPTS]
    for unit in csm_units:
        for (frames, last), ref in zip(run_prompts(unit.url, PROMPTS, max_frames=GREEDY_FRAMES), want, strict=True):
            assert last.get("done"), last
            assert np.array_equal(frames[:, :K], ref) and (frames[:, K] == AUDIO_TOKEN).all()
    info = load(csm_units[0].url)
    assert info.kv_checks_total >= len(PROMPTS) and info.kv_mismatch_total == 0


@pytest.mark.parametrize("depth", [{}, dict(depth_decoder_temperature=0.6, depth_decoder_top_k=3),
                                   dict(depth_decoder_temperature=0.0)], ids=["main", "depth", "greedy-depth"])
def test_seeded_sampling_gives_the_same_frames_in_pd_1p2d_and_the_monoliths(csm_units: Any, depth: Any) -> None:
    """The same seeded frames in PD, the monoliths and 1P2D (its two D's), with and
    without the depth decoder's own params; those change codebooks 1.. only."""
    params = dict(max_frames=12, temperature=0.9, top_k=6, seed=21)
    pd, *others = (run_prompts(u.url, PROMPTS * 2 if u is csm_units[3] else PROMPTS, **params, **depth)
                   for u in csm_units)
    for other in others:
        for (a, la), (b, lb) in zip(pd * 2, other, strict=False):
            assert la.get("done") and lb.get("done"), (la, lb)
            assert a.shape == (12, K + 1) and np.array_equal(a, b)
    if depth:
        main = run_prompts(csm_units[0].url, PROMPTS[:1], **params)[0][0]
        assert np.array_equal(main[0, 0], pd[0][0][0, 0]) and not np.array_equal(main[:, 1:K], pd[0][0][:, 1:K])


def test_a_reused_voice_hits_the_prefix_cache_and_keeps_transformers_frames(
        checkpoint: tuple[Path, Any], csm_units: Any) -> None:
    """A voice (36 audio frames) before two texts: the second request computes only its
    own rows in P and in the monolith, and both stay generate's frames."""
    oracle = checkpoint[1]
    voice = rows(40, 0, 36)
    texts = [np.concatenate([voice, rows(41 + i, 4, 0)]) for i in range(2)]
    want = [generate(oracle, p, GREEDY_FRAMES) for p in texts]
    for unit in csm_units[:2]:
        for i, (prompt, ref) in enumerate(zip(texts, want, strict=True)):
            frames, last = stream(unit.url, prompt.tolist(), max_frames=GREEDY_FRAMES)
            assert last.get("done"), last
            assert np.array_equal(np.array(frames)[:, :K], ref)
            if i:
                assert last["cached_tokens"] >= 36 - 16 and last["prefill_tokens"] == 40 - last["cached_tokens"]
