"""The mixed-step CUDA-graph runner (engine/model/mixed_graphs.py, `pdunit monolith
--mixed-graphs`): decode rows plus prompt chunks padded to a (decode rows, prompt rows)
bucket pair give the unpadded forward's output and K/V and write nothing else into the
pool; what no pair holds is left to the caller (eager), counted. The monolith streams the
same frames with the runner as without it (chunked and budget, plain and overlapped).

Without a GPU the runner stages and runs the padded step eagerly (`capture=False`)
under Triton's interpreter; on a GPU (gpu marker) the captured graphs are checked."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pdunit.engine.model.loader import load_model
from tests.kernels.paging import gpu, run_interpreted

# (steps of decode rows + chunks, the pair each replays; the last three fit none)
CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    from pdunit.engine.batching import SeqEntry, make_batch, prefill_entry
    from pdunit.engine.model.mixed_graphs import MixedGraphRunner


    def check(m, device, capture, tol=2e-2):
        rng = np.random.default_rng(0)
        c, vocab = m.config.n_codebooks, min(m.config.vocab_sizes)
        rows = lambda n: rng.integers(0, vocab, (n, c)).astype(np.int64)
        n_slots = 8192
        kv_fast = m.new_kv_storage(n_slots, device=device)
        kv_fast[:] = 0.5  # a slot the runner wrongly wrote would change from this
        kv_want = kv_fast.clone()
        runner = MixedGraphRunner(m, kv_fast, stream_buckets=(2, 4), row_buckets=(16, 32), max_seqs=2,
                                  max_context=512, capture=capture)
        perm = iter(np.split(rng.permutation(n_slots)[:7000], np.cumsum([100] * 60 + [600])[:-1]))
        owned = []

        def take(n):
            s = next(perm)[:n]
            owned.append(s)
            return s

        def decode(n):  # n decode rows, contexts of 20..99 tokens (the new one last): 1 or 2 key tiles of 64
            out = []
            for _ in range(n):
                ctx = take(int(rng.integers(20, 100)))
                out.append(SeqEntry(rows(1), np.array([len(ctx) - 1]), ctx[-1:], ctx))
            return out

        def chunk(n, cached=0):
            slots = take(cached + n)
            return prefill_entry(rows(cached + n), slots, cached, cached + n)

        steps = [
            (decode(1), [chunk(10)], (2, 16)),        # padding rows in both parts
            (decode(3), [chunk(5), chunk(20, cached=70)], (4, 32)),  # keys past a whole 64-key tile of cache
            (decode(4), [chunk(27, cached=40)], (4, 32)),  # every decode row live; keys in two masked tiles
            (decode(2), [chunk(1, cached=5)], (2, 16)),
            (decode(5), [chunk(5)], None),            # more decode rows than the largest bucket
            (decode(2), [chunk(3), chunk(3), chunk(3)], None),  # more chunks than max_seqs
            (decode(2), [chunk(40)], None),           # more prompt rows than the largest bucket
        ]
        for i, (dec, chunks, pair) in enumerate(steps):
            assert runner.bucket_for(len(dec), [len(e.tokens) for e in chunks],
                                     max(len(e.context_slots) for e in dec + chunks)) == pair, i
            toks = np.concatenate([e.tokens for e in dec])
            if i % 2:  # decode tokens on the device (the overlap pipeline's), else from the host
                toks = torch.from_numpy(toks).to(device)
            replays = runner.stats["replays"]
            got = runner.run(toks, np.concatenate([e.positions for e in dec]), np.concatenate([e.write_slots for e in dec]),
                             [e.context_slots for e in dec], chunks)
            batch = make_batch(dec + chunks)
            if pair is None:
                assert got is None and runner.stats["replays"] == replays, (i, runner.stats)
                m.forward(batch, kv_fast)  # the caller's eager forward
            else:
                assert runner.stats["replays"] == replays + 1
            want = m.forward(batch, kv_want)
            if got is None:
                continue
            err = float((got.double() - want.double()).norm() / want.double().norm())
            assert got.shape == want.shape, (i, got.shape, want.shape)
            assert err < tol, (i, err)
        kv_err = float((kv_fast.double() - kv_want.double()).norm() / kv_want.double().norm())
        assert kv_err < tol, kv_err
        # padding rows wrote no K/V: every slot no sequence owns still holds 0.5
        free = np.setdiff1d(np.arange(n_slots), np.concatenate(owned))
        assert bool((kv_fast[:, :, torch.from_numpy(free).to(kv_fast.device)] == 0.5).all())
        assert runner.stats == {"replays": 4, "eager": 3}, runner.stats
        print("ok", capture, runner.stats)
    """
)

# The monolith on seeded requests (greedy, sampled, top-k), run with and without a
# runner: `force` puts every step of both runs on the Triton kernels (interpreted on the
# CPU), as on a GPU, so that the runs differ only in how mixed steps run.
MONOLITH = textwrap.dedent(
    """
    import time
    import numpy as np, torch
    from pdunit.engine.decode.admission import AdmissionControl, RateFloorAdmission
    from pdunit.engine.decode.step_model import StepCoefficients, StepModel
    from pdunit.engine.decode.stream_lives import HeldStream
    from pdunit.engine.kv.pool import PagePool
    from pdunit.engine.model.loader import load_model
    from pdunit.engine.model.mixed_graphs import MixedGraphRunner
    from pdunit.engine.model.sampling import SamplingParams
    from pdunit.engine.monolith.worker import MonolithEngine
    from pdunit.engine.packing import unpack
    from pdunit.engine.prefill.scheduler import PrefillJob
    from pdunit.engine.decode.batcher import RUNNING

    POOL = 4096
    REQS = [  # (request id, prompt rows, params, iteration it joins at)
        (1, 20, SamplingParams(max_frames=6, min_frames=6), 0),
        (2, 12, SamplingParams(max_frames=5, temperature=0.9, seed=7), 0),
        (3, 35, SamplingParams(max_frames=4, min_frames=4, temperature=1.2, top_k=20, seed=11), 2),
    ]


    class Frames:
        def __init__(self):
            self.messages = []

        def publish(self, message):
            self.messages.append(message)


    class Fixed(StepModel):
        def __init__(self):
            super().__init__(StepCoefficients(base_ms=1.0, per_stream_ms=2.0, per_token_ms=0.01, per_row_ms=4.0),
                             refit_every=1 << 30)

        def under_prediction(self, quantile=0.9):
            return 1.0


    def run(spec, policy, overlap, graphs, device="cpu", dtype="float16", force=False, capture=False):
        model = load_model(spec, device=device, dtype=dtype)
        if device == "cpu":
            model._sm_count = 1  # no GPU to ask
        if force:  # CPU: every step of both runs on the (interpreted) Triton kernels, as on a GPU
            type(model).gpu_path = property(lambda self: True)
        storage = model.new_kv_storage(POOL, device=device)
        mixed = MixedGraphRunner(model, storage, (2, 4), (8, 16), max_seqs=2, max_context=256,
                                 capture=capture) if graphs else None
        admission = AdmissionControl(RateFloorAdmission(Fixed(), 4.2), HeldStream(100, 10)) if policy == "budget" else None
        e = MonolithEngine(model, spec, PagePool(POOL, 4), storage, Frames(), policy, chunk_tokens=12, max_batch=4,
                           max_batch_rows=32, cuda_graphs=device != "cpu", admission=admission, overlap=overlap,
                           min_chunk_rows=8, mixed_graphs=mixed)
        frames = {r[0]: [] for r in REQS}
        codes = {r[0]: [] for r in REQS}
        cols = model.config.n_codebooks
        c_max = min(model.config.vocab_sizes)
        for it in range(400):
            for rid, rows, params, join in REQS:
                if join == it:
                    prompt = np.random.default_rng(rid).integers(0, c_max, size=(rows, cols), dtype=np.int64)
                    e.submit(PrefillJob(rid, prompt, params, int(time.time() * 1000) + 600_000, {}, done=lambda r: None))
            e._step_once()
            for msg in e.hub.messages:
                for rid, f, code in zip(unpack(msg.request_ids, "u8"), unpack(msg.frames, "i4", cols),
                                        unpack(msg.finished, "u1"), strict=True):
                    frames[int(rid)].append(f.tolist())
                    codes[int(rid)].append(int(code))
            e.hub.messages.clear()
            if it > 2 and all(c and c[-1] != RUNNING for c in codes.values()):
                break
        e._step_once()
        assert e.pool.free_pages == e.pool.n_pages
        return frames, codes, mixed.stats if mixed else None
    """
)

MODELS = ["random:tiny:0", "random:csm-tiny:0"]


@pytest.mark.parametrize("spec", MODELS)
def test_padded_mixed_step_equals_the_forward_under_tritons_interpreter(spec: str, tmp_path: Path) -> None:
    script = CHECK + textwrap.dedent(
        f"""
        torch.set_num_threads(1)
        from pdunit.engine.model.loader import load_model
        m = load_model("{spec}", dtype="float16")
        m._sm_count = 4  # no GPU to ask: 4 decode splits at 2 streams, 2 at 4 (132 gives 8, most of them empty)
        check(m, "cpu", False)
        """
    )
    out = run_interpreted(script, tmp_path, timeout=600)
    assert out.count("ok") == 1, out


@pytest.mark.parametrize(("spec", "policy", "overlap"), [("random:tiny:0", "chunked", True),
                                                         ("random:tiny:0", "budget", False),
                                                         ("random:csm-tiny:0", "chunked", False),
                                                         ("random:csm-tiny:0", "budget", True)])
def test_the_monolith_streams_the_same_frames_with_mixed_graphs(spec: str, policy: str, overlap: bool,
                                                               tmp_path: Path) -> None:
    script = MONOLITH + textwrap.dedent(
        f"""
        torch.set_num_threads(1)
        a = run("{spec}", "{policy}", {overlap}, False, force=True)
        b = run("{spec}", "{policy}", {overlap}, True, force=True)
        assert b[2]["replays"] >= 1, b[2]
        assert a[0] == b[0] and a[1] == b[1], (a, b)
        assert all(len(f) == r[2].max_frames or c[-1] != 0 for r, f, c in zip(REQS, a[0].values(), a[1].values()))
        print("ok", b[2])
        """
    )
    out = run_interpreted(script, tmp_path, timeout=600)
    assert "ok" in out, out


def test_the_runner_refuses_a_model_off_the_gpu_path() -> None:
    from pdunit.engine.model.mixed_graphs import MixedGraphRunner

    m = load_model("random:tiny:0")
    with pytest.raises(ValueError, match="--mixed-graphs"):
        MixedGraphRunner(m, m.new_kv_storage(16))


def test_mixed_graphs_on_a_cpu_monolith_exit_2_naming_the_flag(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pdunit.engine.cli", "monolith", "--socket", str(tmp_path / "s.sock"),
                           "--mixed-graphs"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "drop --mixed-graphs" in proc.stdout + proc.stderr


def test_the_default_buckets_follow_the_budget_policys_blocks() -> None:
    from pdunit.engine.monolith.main import MonolithConfig, mixed_graph_buckets

    cfg = MonolithConfig(max_batch=100, max_batch_rows=200, prefix_block_tokens=16)
    assert mixed_graph_buckets(cfg) == ([8, 16, 32, 64, 100], [16, 32, 64, 128])
    cfg = MonolithConfig(mixed_graph_streams=[4, 2], mixed_graph_rows=[48])
    assert mixed_graph_buckets(cfg) == ([2, 4], [48])


@gpu
@pytest.mark.parametrize("spec", MODELS)
def test_captured_mixed_graphs_replay_the_eager_gpu_forward(spec: str) -> None:
    """The captured pairs' replays against `model.forward` on CUDA (the eager GPU path's
    mixed forward: the same kernels, unpadded), and bit for bit against the same padded
    step run eagerly (capture=False)."""
    scope: dict = {}
    exec(CHECK, scope)  # noqa: S102 - the interpreted test's check, in-process
    m = load_model(spec, device="cuda", dtype="bfloat16")
    scope["check"](m, "cuda", True, tol=3e-2)
    torch.cuda.synchronize()


@gpu
def test_a_replayed_pair_equals_its_staged_eager_step_bit_for_bit() -> None:
    import numpy as np

    from pdunit.engine.batching import prefill_entry
    from pdunit.engine.model.mixed_graphs import MixedGraphRunner

    m = load_model("random:tiny:0", device="cuda", dtype="bfloat16")
    rng = np.random.default_rng(3)
    kv = m.new_kv_storage(4096, device="cuda")
    kv_eager = kv.clone()
    graphs = MixedGraphRunner(m, kv, (4, 8), (32, 64), max_seqs=2, max_context=512)
    staged = MixedGraphRunner(m, kv_eager, (4, 8), (32, 64), max_seqs=2, max_context=512, capture=False)
    slots = rng.permutation(4096)
    ctx = [slots[i * 60 : i * 60 + 30 + i] for i in range(6)]
    dec_tokens = rng.integers(0, 1024, (6, 11)).astype(np.int64)
    chunk = prefill_entry(rng.integers(0, 1024, (50, 11)).astype(np.int64), slots[1000:1050], 10, 50)
    args = (np.array([len(c) - 1 for c in ctx]), np.array([c[-1] for c in ctx]), ctx, [chunk])
    got = graphs.run(torch.from_numpy(dec_tokens).cuda(), *args)
    want = staged.run(dec_tokens, *args)
    assert got is not None and want is not None and graphs.stats["replays"] == 1
    assert torch.equal(got, want) and torch.equal(kv, kv_eager)


@gpu
@pytest.mark.parametrize(("spec", "policy", "overlap"), [("random:tiny:0", "chunked", True),
                                                         ("random:csm-tiny:0", "budget", True),
                                                         ("random:tiny:0", "budget", False)])
def test_the_gpu_monolith_streams_the_same_frames_with_mixed_graphs(spec: str, policy: str, overlap: bool) -> None:
    scope: dict = {}
    exec(MONOLITH, scope)  # noqa: S102
    a = scope["run"](spec, policy, overlap, False, device="cuda", dtype="bfloat16")
    b = scope["run"](spec, policy, overlap, True, device="cuda", dtype="bfloat16", capture=True)
    assert b[2]["replays"] >= 1, b[2]
    assert a[0] == b[0] and a[1] == b[1]
