"""The prefill CUDA-graph runner (engine/model/prefill_graphs.py): a forward padded to a
row bucket and to `max_seqs` sequences gives the logits and K/V of the unpadded forward
and writes nothing else into the pool; what no bucket covers runs eagerly.

Without a GPU the runner stages and runs the padded step eagerly (`capture=False`)
under Triton's interpreter: the inputs a graph would replay. On a GPU the captured
graphs are checked against the eager GPU path."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from pdunit.engine.model.loader import load_model
from tests.kernels.paging import gpu, run_interpreted

CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    from pdunit.engine.model.prefill_graphs import PrefillGraphRunner
    from pdunit.engine.model.transformer import ForwardBatch


    def check(m, device, capture, buckets, fp8=False, tol=2e-2):
        rng = np.random.default_rng(0)
        rows = lambda n: rng.integers(0, 1024, (n, 11)).astype(np.int64)
        n_slots = 2048
        kv_fast = m.new_kv_storage(n_slots, device=device)
        kv_fast[:] = 0.5  # a slot the runner wrongly wrote would change from this
        kv_want = kv_fast.clone()
        if fp8:
            m.set_prefill_gemm("fp8", 0)
        runner = PrefillGraphRunner(m, kv_fast, buckets=buckets, max_seqs=4, capture=capture)
        perm = rng.permutation(n_slots)
        a, b, c, d = perm[:70], perm[70:100], perm[100:300], perm[300:380]
        batches = [
            ForwardBatch.from_sequences([rows(70)], [a]),                          # one prompt, 70 of 128 rows
            ForwardBatch.from_sequences([rows(20), rows(30)], [d[:20], b]),         # two prompts
            ForwardBatch.from_sequences([rows(10), rows(25), rows(15)], [d[20:30], d[30:55], d[55:70]]),
            ForwardBatch.from_sequences([rows(50)], [np.concatenate([a, c[:50]])]),  # after a cached prefix
            ForwardBatch.from_sequences([rows(2)] * 5, [c[50 + i * 2:52 + i * 2] for i in range(5)]),  # 5 > max_seqs
            ForwardBatch.from_sequences([rows(200)], [c]),                         # 200 > the largest bucket
        ]
        for i, batch in enumerate(batches):
            replays = runner.stats["replays"]
            got = runner.run(batch)
            want = m.forward(batch, kv_want)
            err = float((got.double() - want.double()).norm() / want.double().norm())
            kv_err = float((kv_fast.double() - kv_want.double()).norm() / kv_want.double().norm())
            assert got.shape == want.shape, (i, got.shape, want.shape)
            assert err < tol and kv_err < tol, (i, err, kv_err)
            replayed = runner.stats["replays"] > replays
            assert replayed == (i < 4), (i, runner.stats)
        # padding rows wrote no K/V: every slot no sequence owns still holds 0.5
        owned = np.concatenate([a, b, c, d[:70]])
        free = np.setdiff1d(np.arange(n_slots), owned)
        assert bool((kv_fast[:, :, torch.from_numpy(free)] == 0.5).all())
        print("ok", capture, fp8, runner.stats)
    """
)


def test_padded_prefill_equals_the_forward_under_tritons_interpreter(tmp_path: Path) -> None:
    script = CHECK + textwrap.dedent(
        """
        torch.set_num_threads(1)
        from pdunit.engine.model.loader import load_model
        m = load_model("random:tiny:0", dtype="float16")
        m._sm_count = 132  # no GPU to ask
        check(m, "cpu", False, (64, 128))
        """
    )
    out = run_interpreted(script, tmp_path, timeout=600)
    assert out.count("ok") == 1, out


def test_a_forward_replays_only_a_bucket_of_its_own_gemm_precision(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import numpy as np, torch
        from pdunit.engine.model.loader import load_model
        from pdunit.engine.model.prefill_graphs import PrefillGraphRunner
        from pdunit.engine.model.transformer import ForwardBatch
        m = load_model("random:tiny:0", dtype="float16")
        m.set_prefill_gemm("fp8", 100)
        r = PrefillGraphRunner(m, m.new_kv_storage(4096), buckets=(64, 128, 256), max_seqs=2, capture=False)
        batch = lambda *n: ForwardBatch.from_sequences(
            [np.zeros((k, 11), np.int64) for k in n], [np.arange(i * 300, i * 300 + k) for i, k in enumerate(n)])
        # 64: bf16 bucket; 128 and 256: fp8 buckets (>= 100 rows)
        assert r.bucket_for(batch(60)) == 64 and r.bucket_for(batch(30, 30)) == 64
        assert r.bucket_for(batch(90)) is None        # bf16 forward, and the next bucket is fp8
        assert r.bucket_for(batch(100)) == 128 and r.bucket_for(batch(200)) == 256
        assert r.bucket_for(batch(257)) is None and r.bucket_for(batch(10, 10, 10)) is None
        m.set_prefill_gemm("bf16")                      # not the captured precision any more
        assert r.bucket_for(batch(60)) is None
        print("ok")
        """
    )
    assert "ok" in run_interpreted(script, tmp_path)


def test_the_runner_refuses_a_model_off_the_gpu_path() -> None:
    from pdunit.engine.model.prefill_graphs import PrefillGraphRunner

    m = load_model("random:tiny:0")
    with pytest.raises(ValueError, match="a CUDA model in bfloat16 or float16"):
        PrefillGraphRunner(m, m.new_kv_storage(16))


@gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_captured_prefill_graphs_replay_the_eager_gpu_forward(fp8: bool) -> None:
    scope: dict = {}
    exec(CHECK, scope)  # noqa: S102 - the interpreted test's check, in-process
    m = load_model("random:tiny:0", device="cuda", dtype="bfloat16")
    scope["check"](m, "cuda", True, (64, 128), fp8=fp8, tol=3e-2 if not fp8 else 8e-2)
    torch.cuda.synchronize()


@gpu
def test_a_large_bucket_replays_a_large_forward_as_the_eager_gpu_forward() -> None:
    """`--prefill-graph-rows` beyond 2048: a 3000-row forward of two prompts replays the
    4096-row bucket (its 1096 padding rows computed and written nowhere) and gives the
    eager forward's logits and K/V."""
    import numpy as np

    from pdunit.engine.model.prefill_graphs import PrefillGraphRunner
    from pdunit.engine.model.transformer import ForwardBatch

    m = load_model("random:tiny:0", device="cuda", dtype="bfloat16")
    rng = np.random.default_rng(1)
    kv = m.new_kv_storage(8192, device="cuda")
    kv_want = kv.clone()
    runner = PrefillGraphRunner(m, kv, buckets=(2048, 4096), max_seqs=4)
    slots = rng.permutation(8192)
    batch = ForwardBatch.from_sequences([rng.integers(0, 1024, (n, 11)).astype(np.int64) for n in (1800, 1200)],
                                        [slots[:1800], slots[1800:3000]])
    assert runner.bucket_for(batch) == 4096
    got = runner.run(batch)
    want = m.forward(batch, kv_want)
    assert runner.stats == {"replays": 1, "eager": 0}
    assert float((got.double() - want.double()).norm() / want.double().norm()) < 3e-2
    assert float((kv.double() - kv_want.double()).norm() / kv_want.double().norm()) < 3e-2
