"""The model's GPU path and its CUDA-graph decode runner: same logits and KV as the
torch reference / eager path, padding rows that never touch the pool, graphs reused as
contexts grow, eager fallback for what no graph covers."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pdunit.engine.model.config import CONFIGS
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.transformer import ForwardBatch, TTSModel
from tests.kernels.paging import gpu

C = CONFIGS["tiny"].n_codebooks


def rows(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 1024, (n, C)).astype(np.int64)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def test_graph_runner_refuses_a_model_off_the_gpu_path_naming_the_fix() -> None:
    from pdunit.engine.model.cuda_graphs import DecodeGraphRunner

    m = load_model("random:tiny:0")
    with pytest.raises(ValueError, match="a CUDA model in bfloat16 or float16"):
        DecodeGraphRunner(m, m.new_kv_storage(16))


INTERPRETED_MODEL = textwrap.dedent(
    """
    import numpy as np, torch
    torch.set_num_threads(1)
    from pdunit.engine.model.loader import load_model
    from pdunit.engine.model.transformer import ForwardBatch
    m = load_model("random:tiny:0", dtype="float16")
    m._sm_count = 132  # no GPU to ask
    rng = np.random.default_rng(0)
    rows = lambda n: rng.integers(0, 1024, (n, 11)).astype(np.int64)
    perm = rng.permutation(400)
    kv_ref, kv_gpu = m.new_kv_storage(400), m.new_kv_storage(400)
    a, b, c = perm[:40], perm[40:100], perm[100:130]
    steps = [
        ForwardBatch.from_sequences([rows(40), rows(60)], [a, b]),          # prefill
        ForwardBatch.from_sequences([rows(1), rows(30), rows(1)],            # mixed
                                    [np.append(a, perm[300]), c, np.append(b, perm[301])]),
        ForwardBatch.from_sequences([rows(1), rows(1)],                      # decode
                                    [np.append(a, perm[[300, 302]]), np.append(b, perm[[301, 303]])]),
    ]
    for i, batch in enumerate(steps):
        ref = m(batch, kv_ref)          # CPU: the torch reference
        got = m._forward_gpu(batch, kv_gpu)
        err = float((got.double() - ref.double()).norm() / ref.double().norm())
        kv_err = float((kv_gpu.double() - kv_ref.double()).norm() / kv_ref.double().norm())
        same = float((got.argmax(-1) == ref.argmax(-1)).double().mean())
        print(i, err, kv_err, same)
        assert err < 5e-3 and kv_err < 5e-3 and same > 0.9, (i, err, kv_err, same)
    """
)


def test_gpu_forward_equals_the_reference_under_tritons_cpu_interpreter(tmp_path: Path) -> None:
    """The GPU path's plan, fused kernels and attention kernels, run by Triton's
    interpreter on an fp16 tiny model: prefill, a mixed chunk + decodes batch, decode."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETED_MODEL], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------ GPU


def gpu_model(name: str = "tiny", layers: int | None = None) -> TTSModel:
    """A bf16 model on the GPU with random weights drawn there (no CPU init)."""
    cfg = dataclasses.replace(CONFIGS[name], dtype="bfloat16")
    if layers:
        cfg = dataclasses.replace(cfg, n_layers=layers)
    m = TTSModel(cfg, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.8, 1.2, generator=g)
            else:
                bound = (3.0 / p.shape[1]) ** 0.5 if pname != "embed.weight" else 0.3
                p.uniform_(-bound, bound, generator=g)
    return m.eval()


def decode_batch(ctx: list[np.ndarray], rng: np.random.Generator) -> ForwardBatch:
    return ForwardBatch.from_sequences([rows(1, rng) for _ in ctx], ctx)


@gpu
@pytest.mark.parametrize("gemm", ["bf16", "fp8"])
@pytest.mark.parametrize("name,layers", [("tiny", None), ("qwen3-4b-shape", 2)])
def test_gpu_path_matches_the_torch_reference_for_prefill_mixed_and_decode(name, layers, gemm) -> None:
    m = gpu_model(name, layers)
    m.set_prefill_gemm(gemm)  # fp8: both paths quantise the GEMMs of forwards with prompt rows
    m.set_decode_gemm(gemm)  # and of the decode-only step
    rng = np.random.default_rng(1)
    kv_fast = m.new_kv_storage(4096, device="cuda")
    kv_ref = kv_fast.clone()
    perm = rng.permutation(4096)
    a, b, c = perm[:300], perm[300:1000], perm[1000:1100]
    steps = [
        ForwardBatch.from_sequences([rows(300, rng), rows(700, rng)], [a, b]),
        ForwardBatch.from_sequences(
            [rows(1, rng), rows(100, rng), rows(1, rng)],
            [np.append(a, perm[2000]), c, np.append(b, perm[2001])],
        ),
        decode_batch([np.append(a, perm[[2000, 2002]]), np.append(b, perm[[2001, 2003]])], rng),
    ]
    for i, batch in enumerate(steps):
        m.attention_backend = "reference"
        want = m(batch, kv_ref)
        m.attention_backend = "triton"
        assert m.gpu_path
        got = m(batch, kv_fast)
        # fp8: each path quantises its own bf16 activations, which differ by bf16
        # roundings, so some e4m3 roundings (steps of 1/16) fall the other way
        tol, agree = (3e-2, 0.8) if gemm == "bf16" else (8e-2, 0.6)
        assert rel(got, want) < tol, (i, rel(got, want))
        assert rel(kv_fast, kv_ref) < tol, i
        assert float((got.argmax(-1) == want.argmax(-1)).double().mean()) > agree, i


@gpu
def test_fp8_prefill_on_the_gpu_path_stays_close_to_bf16() -> None:
    m = gpu_model("qwen3-4b-shape", 2)
    rng = np.random.default_rng(3)
    perm = rng.permutation(4096)
    batch = ForwardBatch.from_sequences([rows(1500, rng), rows(900, rng)], [perm[:1500], perm[1500:2400]])
    kv_bf16 = m.new_kv_storage(4096, device="cuda")
    kv_fp8 = kv_bf16.clone()
    want = m(batch, kv_bf16)
    m.set_prefill_gemm("fp8")
    got = m(batch, kv_fp8)
    assert not torch.equal(got, want)
    assert rel(got, want) < 0.1 and rel(kv_fp8, kv_bf16) < 0.1, (rel(got, want), rel(kv_fp8, kv_bf16))
    assert float((got.argmax(-1) == want.argmax(-1)).double().mean()) > 0.5


def fresh_contexts(n: int, length: int, n_slots: int, rng: np.random.Generator) -> list[np.ndarray]:
    perm = rng.permutation(n_slots)
    return [perm[i * length : (i + 1) * length] for i in range(n)]


@gpu
def test_graph_replay_matches_the_eager_gpu_path_and_writes_the_same_kv() -> None:
    from pdunit.engine.model.cuda_graphs import DecodeGraphRunner

    m = gpu_model()
    rng = np.random.default_rng(2)
    kv = m.new_kv_storage(8192, device="cuda")
    kv.normal_()
    kv_eager = kv.clone()
    runner = DecodeGraphRunner(m, kv, buckets=(4, 8), max_context=1024)
    batch = decode_batch(fresh_contexts(8, 500, 8192, rng), rng)
    got = runner.run(batch)
    want = m(batch, kv_eager)
    assert runner.stats == {"replays": 1, "eager": 0}
    assert got.shape == want.shape
    assert rel(got, want) < 1e-2
    torch.testing.assert_close(kv, kv_eager)


@gpu
def test_fp8_decode_graphs_replay_the_eager_fp8_step_and_refuse_a_changed_mode() -> None:
    from pdunit.engine.model.cuda_graphs import DecodeGraphRunner

    m = gpu_model("qwen3-4b-shape", 2)
    rng = np.random.default_rng(4)
    kv = m.new_kv_storage(8192, device="cuda")
    kv.normal_()
    batch = decode_batch(fresh_contexts(8, 500, 8192, rng), rng)
    want_bf16 = m(batch, kv.clone())
    m.set_decode_gemm("fp8")
    kv_eager = kv.clone()
    runner = DecodeGraphRunner(m, kv, buckets=(4, 8), max_context=1024)
    got = runner.run(batch)
    want = m(batch, kv_eager)
    assert runner.stats == {"replays": 1, "eager": 0}
    assert rel(got, want) < 1e-2
    torch.testing.assert_close(kv, kv_eager)
    assert not torch.equal(want, want_bf16) and rel(want, want_bf16) < 0.1, rel(want, want_bf16)
    m.set_decode_gemm("bf16")
    with pytest.raises(ValueError, match="graphs recorded 'fp8' GEMMs"):
        runner.run(batch)


@gpu
def test_padding_rows_of_a_bucket_never_write_the_pool() -> None:
    from pdunit.engine.model.cuda_graphs import DecodeGraphRunner

    m = gpu_model()
    rng = np.random.default_rng(3)
    kv = m.new_kv_storage(8192, device="cuda")
    kv.normal_()
    runner = DecodeGraphRunner(m, kv, buckets=(8,), max_context=1024)
    ctx = fresh_contexts(5, 300, 8192, rng)
    before = kv.clone()
    out = runner.run(decode_batch(ctx, rng))
    assert out.shape[0] == 5
    written = torch.zeros(8192, dtype=torch.bool, device="cuda")
    written[torch.tensor([c[-1] for c in ctx], device="cuda")] = True
    changed = (kv != before).flatten(3).any(-1).any(0).any(0)  # [n_slots]
    assert torch.equal(changed, written)


@gpu
def test_contexts_grow_across_steps_on_one_graph_and_match_eager_each_step() -> None:
    from pdunit.engine.model.cuda_graphs import DecodeGraphRunner

    m = gpu_model()
    rng = np.random.default_rng(4)
    kv = m.new_kv_storage(16384, device="cuda")
    kv.normal_()
    kv_eager = kv.clone()
    runner = DecodeGraphRunner(m, kv, buckets=(2, 4), max_context=2048)
    perm = rng.permutation(16384)
    lengths = [100, 700, 1500]
    ctx = [perm[i * 2048 : i * 2048 + n] for i, n in enumerate(lengths)]
    for step in range(3):
        ctx = [perm[i * 2048 : i * 2048 + n + step] for i, n in enumerate(lengths)]
        batch = decode_batch(ctx, rng)
        got, want = runner.run(batch), m(batch, kv_eager)
        assert rel(got, want) < 1e-2, step
    assert runner.stats == {"replays": 3, "eager": 0}


@gpu
def test_prefill_rows_oversized_batches_and_long_contexts_run_eagerly() -> None:
    from pdunit.engine.model.cuda_graphs import DecodeGraphRunner

    m = gpu_model()
    rng = np.random.default_rng(5)
    kv = m.new_kv_storage(8192, device="cuda")
    runner = DecodeGraphRunner(m, kv, buckets=(2,), max_context=256)
    perm = rng.permutation(8192)
    prefill = ForwardBatch.from_sequences([rows(10, rng)], [perm[:10]])
    too_many = decode_batch([perm[i * 10 : i * 10 + 5] for i in range(3)], rng)
    too_long = decode_batch([perm[:300]], rng)
    for batch in (prefill, too_many, too_long):
        assert runner.run(batch).shape[0] == len(batch.query_lens)
    assert runner.stats == {"replays": 0, "eager": 3}


@gpu
def test_a_batch_whose_write_slot_is_not_its_last_context_slot_is_rejected() -> None:
    from pdunit.engine.model.cuda_graphs import DecodeGraphRunner

    m = gpu_model()
    rng = np.random.default_rng(6)
    kv = m.new_kv_storage(1024, device="cuda")
    runner = DecodeGraphRunner(m, kv, buckets=(2,), max_context=64)
    batch = decode_batch([np.arange(10), np.arange(10, 30)], rng)
    batch.write_slots = torch.tensor([9, 3])
    with pytest.raises(ValueError, match="write_slots must equal each sequence's last context slot"):
        runner.run(batch)
    far = decode_batch([np.array([5, 1024])], rng)
    with pytest.raises(ValueError, match=r"outside the pool \[0, 1024\)"):
        runner.run(far)


@gpu
def test_eager_forwards_after_the_warm_up_and_the_graph_capture_compile_no_kernel() -> None:
    """What an engine compiles at start (P's and the monolith's warm-up, D's and the
    monolith's decode graphs) covers its eager forwards too: a decode batch past the
    graphs and the chunked monolith's mixed batch (a continuing chunk beside decode rows),
    at context lengths of any divisibility. A compile there stalls every stream of the
    engine (engine/kernel_compiles.py counts them; kernels/paged_attention.TABLE_ALIGN is
    why the slot tables' widths keep to one class)."""
    from pdunit.engine import kernel_compiles as kc
    from pdunit.engine.model.cuda_graphs import DecodeGraphRunner
    from pdunit.engine.prefill.runner import warm_up

    def serving_compiles() -> float:
        return next(s.value for s in kc.COMPILES.collect()[0].samples
                    if s.name.endswith("_total") and s.labels["phase"] == "serving")

    assert kc.watch_kernel_compiles()
    m = gpu_model()
    rng = np.random.default_rng(5)
    kv = m.new_kv_storage(8192, device="cuda")
    warm_up(m, kv, None, largest=512)  # slots [0, 512)
    DecodeGraphRunner(m, kv)  # the default buckets, as D captures them
    kc.serving_started()
    try:
        before = serving_compiles()
        perm = 512 + rng.permutation(8192 - 512)
        lengths = (37, 501, 1001, 77)
        ctx, at = [], 0
        for n in lengths:
            ctx.append(perm[at:at + n])
            at += n
        m(decode_batch(ctx, rng), kv)  # eager: the runner is not asked
        chunk = perm[at:at + 300 + 217]  # 217 rows already in the pool, 300 new ones
        mixed = ForwardBatch.from_sequences([rows(1, rng), rows(300, rng), rows(1, rng)],
                                            [np.append(ctx[0], perm[-1]), chunk, np.append(ctx[1], perm[-2])])
        m(mixed, kv)
        torch.cuda.synchronize()
        assert serving_compiles() == before
    finally:
        kc._phase = "startup"
