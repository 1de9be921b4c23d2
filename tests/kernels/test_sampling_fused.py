"""The fused frame sampler (kernels/sampling_fused.py, issue 23): one launch gives the
torch form's frames (`sample_frames_static_torch`) for greedy rows, temperature, top-k
below, at and past the cap and the vocabulary, EOS suppressed in column 0 only, the depth
decoder's columns, ties at the k-th value and -inf ids, padding rows; `sample_frames_static`
takes it where it runs (Triton's CPU interpreter here, a subprocess), never on a plain CPU.
On CUDA (gpu marker): csm-1b's and dual-AR's vocabularies at 256 rows, one launch a call,
a CUDA graph's replay, and `frames_static` / `frames_device` sampling once a codebook."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from pdunit.engine.model.sampling import SamplingParams, sampling_batch
from pdunit.kernels import sampling_fused
from tests.kernels.paging import gpu, run_interpreted

# Shared by the interpreted script and the GPU tests.
COMMON = textwrap.dedent(
    """
    import numpy as np, torch
    from pdunit.engine.model.sampling import (
        ROW_DEPTH_TEMPERATURE, ROW_DEPTH_TOP_K, ROW_SUPPRESS, ROW_TEMPERATURE, ROW_TOP_K, ROW_UNIFORMS,
        SamplingParams, sample_frames, sample_frames_static_torch, sampling_batch)
    from pdunit.kernels.sampling_fused import sample_rows

    EOS = 0

    def params_for(vocab, n):
        # greedy (EOS suppressed or not), temperature only, top-k of 1, under, at and over
        # the cap of 64, vocab - 1, vocab and more (no filter), EOS suppressed with top-k,
        # and the depth decoder's own temperature / top-k (greedy under a sampled one too)
        ks = [1, 2, 7, 63, 64, vocab - 1, vocab, vocab + 9]
        out = []
        for i in range(n):
            kind = i % 4
            if kind == 0:
                out.append(SamplingParams(min_frames=50 * (i % 8 == 0)))
            elif kind == 1:
                out.append(SamplingParams(temperature=[0.6, 1.0, 1.7][i % 3], seed=i, min_frames=50 * (i % 3 == 0)))
            elif kind == 2:
                out.append(SamplingParams(temperature=[0.8, 1.3, 40.0][i % 3], top_k=ks[i % len(ks)], seed=i,
                                          min_frames=50 * (i % 5 == 0)))
            else:
                out.append(SamplingParams(temperature=0.9, top_k=ks[(i + 3) % len(ks)], seed=i,
                                          depth_decoder_temperature=[0.0, 0.7, 1.1][i % 3],
                                          depth_decoder_top_k=ks[i % len(ks)]))
        return out

    def logits_for(n, c, vocab, gen, device="cpu"):
        # bf16-rounded logits (the heads' output: many ties), some rows in whole numbers
        # (ties everywhere, the k-th value among them), EOS favoured in column 0, a row
        # with a padded (-inf) vocabulary tail and one with signed zeros
        x = (torch.randn(n, c, vocab, generator=gen) * 3).to(torch.bfloat16).float()
        x[::5] = x[::5].round()
        x[:, 0, EOS] += 6.0
        x[3, :, vocab // 2:] = float("-inf")
        x[7] = torch.where(torch.arange(vocab) % 2 == 0, 0.0, -0.0).float()
        x[7, :, 1] = 1.0
        return x.to(device)

    def fused(logits, rows, first, cap, depth):
        return sample_rows(logits, rows, EOS, temperature_col=ROW_DEPTH_TEMPERATURE if depth else ROW_TEMPERATURE,
                           top_k_col=ROW_DEPTH_TOP_K if depth else ROW_TOP_K,
                           suppress_col=ROW_SUPPRESS if first == 0 else None, uniform_col=ROW_UNIFORMS + first,
                           top_k_cap=cap)

    def compare(vocab, n, gen, device="cpu"):
        # every cap, the frame's first column (EOS suppressed) and a later one, main and
        # depth params: the kernel == the torch form; whole frames == the host sampler's
        c = 3
        params = params_for(vocab, n)
        logits = logits_for(n, c, vocab, gen, device)
        checked = 0
        for index in (0, 60):
            sb = sampling_batch(params, [index] * n, c, torch.device(device))
            rows = torch.from_numpy(sb.packed).to(device)
            for depth in (False, True):
                for cap in (0, 64, None):
                    for first in (0, 2):
                        part = logits[:, first:]
                        want = sample_frames_static_torch(part, rows, EOS, first, cap, depth)
                        got = fused(part, rows, first, cap, depth)
                        assert got.dtype == torch.int32 and torch.equal(got, want), (
                            vocab, index, depth, cap, first, (got != want).nonzero().tolist())
                        checked += got.numel()
            host = sample_frames(logits.cpu(), params, [index] * n, EOS)
            assert np.array_equal(fused(logits, rows, 0, None, False).cpu().numpy(), host), (vocab, index)
        return checked
    """
)

INTERPRETED = COMMON + textwrap.dedent(
    """
    torch.set_num_threads(1)
    from pdunit.engine.model import sampling
    from pdunit.kernels import sampling_fused

    gen = torch.Generator().manual_seed(0)
    for vocab, n in ((37, 24), (2051, 12)):
        print(vocab, "compared", compare(vocab, n, gen))

    # ties at the k-th value are kept: values 5 5 4 4 4 3 ..., top-3 keeps the five ids of
    # 4 and 5; a flat draw (temperature 1e6) with u close to 1 takes the last kept id
    vocab = 12
    x = torch.tensor([3.0, 5, 4, 1, 4, 5, 2, 4, 0, 3, 1, 2])[None, None, :]
    rows = torch.zeros(1, ROW_UNIFORMS + 1, dtype=torch.float64)
    rows[0, ROW_TEMPERATURE], rows[0, ROW_TOP_K], rows[0, ROW_UNIFORMS] = 1e6, 3, 1 - 1e-9
    for cap in (3, 64, None):
        assert fused(x, rows, 0, cap, False).item() == 7 == sample_frames_static_torch(x, rows, EOS, 0, cap).item()
    rows[0, ROW_TOP_K] = 2  # the top-2 are the two 5s
    assert fused(x, rows, 0, 64, False).item() == 5
    rows[0, ROW_UNIFORMS] = 0.0
    assert fused(x, rows, 0, 64, False).item() == 1
    print("ties ok")

    # padding rows (zero sampling) are greedy and touch no other row
    gen = torch.Generator().manual_seed(1)
    params = params_for(37, 8)
    sb = sampling_batch(params, [0] * 8, 3, torch.device("cpu"))
    rows = torch.from_numpy(sb.packed)
    logits = logits_for(8, 3, 37, gen)
    alone = fused(logits, rows, 0, None, False)
    pad = torch.cat([logits, torch.randn(4, 3, 37, generator=gen)])
    got = fused(pad, torch.cat([rows, torch.zeros(4, rows.shape[1], dtype=torch.float64)]), 0, None, False)
    assert torch.equal(got[:8], alone) and torch.equal(got[8:], pad[8:].argmax(-1).to(torch.int32))
    print("padding ok")

    # sample_frames_static takes the kernel where it runs
    calls = []
    real = sampling_fused.sample_rows
    sampling_fused.sample_rows = lambda *a, **k: calls.append(1) or real(*a, **k)
    assert torch.equal(sampling.sample_frames_static(logits, rows, EOS, 0, 64), fused(logits, rows, 0, 64, False))
    assert calls == [1]
    print("dispatch ok")
    """
)


def test_fused_sampler_gives_the_torch_forms_frames_under_tritons_cpu_interpreter(tmp_path: Path) -> None:
    """Vocabularies of 37 and 2051 (csm's), every rule, every cap, column 0 and a later
    one, main and depth params, frames 0 and 60 (EOS suppression): the kernel equals
    `sample_frames_static_torch`, and whole frames equal the host sampler's; ties at the
    k-th value are kept; padding rows are greedy; `sample_frames_static` calls the kernel."""
    out = run_interpreted(INTERPRETED, tmp_path, timeout=600)
    for done in ("37 compared", "2051 compared", "ties ok", "padding ok", "dispatch ok"):
        assert done in out, out


def test_the_kernel_refuses_a_plain_cpu_and_an_oversized_vocabulary() -> None:
    """No silent fallback: off CUDA (and the interpreter) the kernel names the device,
    `sample_frames_static` takes the torch form there; a vocabulary past MAX_VOCAB names
    the limit."""
    assert not sampling_fused.available(torch.device("cpu"))
    sb = sampling_batch([SamplingParams()] * 2, [0, 0], 3, torch.device("cpu"))
    rows = torch.from_numpy(sb.packed)
    with pytest.raises(ValueError, match="CUDA device"):
        sampling_fused.sample_rows(torch.zeros(2, 3, 8), rows, 0, temperature_col=0, top_k_col=1, suppress_col=2,
                                   uniform_col=5, top_k_cap=None)
    with pytest.raises(ValueError, match=f"holds 1..{sampling_fused.MAX_VOCAB}"):
        sampling_fused.sample_rows(torch.zeros(2, 1, sampling_fused.MAX_VOCAB + 1), rows, 0, temperature_col=0,
                                   top_k_col=1, suppress_col=2, uniform_col=5, top_k_cap=None)


# ------------------------------------------------------------------ GPU


def scope() -> dict:
    out: dict = {}
    exec(COMMON, out)  # noqa: S102 - the interpreted test's helpers, in-process
    return out


def cuda_kernels(fn) -> list[str]:  # noqa: ANN001 - a callable
    """The names of the CUDA kernels `fn()` launches."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@gpu
@pytest.mark.parametrize("vocab", [2051, 4096])
def test_fused_sampler_on_cuda_gives_the_torch_forms_frames_at_256_rows(vocab: int) -> None:
    """csm-1b's and dual-AR's vocabularies, 256 rows of every rule, bf16-rounded logits:
    the kernel == the torch form on the same CUDA tensors for every cap, column and param
    set (a frame could differ only where a cumulative sum rounds differently at the
    uniform's CDF boundary), whole frames == the host sampler's."""
    s = scope()
    assert s["compare"](vocab, 256, torch.Generator().manual_seed(vocab), "cuda") > 0


@gpu
def test_fused_sampler_is_one_launch_and_replays_in_a_cuda_graph() -> None:
    s = scope()
    gen = torch.Generator().manual_seed(3)
    params = s["params_for"](2051, 256)
    sb = sampling_batch(params, [0] * 256, 3, torch.device("cuda"))
    rows = torch.from_numpy(sb.packed).cuda()
    logits = s["logits_for"](256, 1, 2051, gen, "cuda")
    from pdunit.engine.model.sampling import sample_frames_static

    eager = sample_frames_static(logits, rows, 0, 0, 64)
    names = cuda_kernels(lambda: sample_frames_static(logits, rows, 0, 0, 64))
    assert names == ["_sample_kernel"], names
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample_frames_static(logits, rows, 0, 0, 64)
    logits.copy_(s["logits_for"](256, 1, 2051, gen, "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, sample_frames_static(logits, rows, 0, 0, 64)) and not torch.equal(out, eager)


@gpu
def test_csm_frames_static_and_frames_device_sample_once_a_codebook_on_cuda() -> None:
    """csm-1b-shape (2 backbone layers): the frame step launches the fused sampler once a
    codebook and none of the torch form's float64 kernels (cumsum, topk), on both paths
    (their frames are compared by tests/kernels/test_csm_gpu_path.py)."""
    from tests.kernels.test_csm_gpu_path import csm_gpu_model

    m = csm_gpu_model("csm-1b-shape", 2)
    fg = m.frame_generator
    k = m.config.n_codebooks
    params = [SamplingParams(temperature=0.9, top_k=50, seed=i) if i % 2 else SamplingParams() for i in range(16)]
    sb = sampling_batch(params, [0] * 16, k, m.device)
    rows = torch.from_numpy(sb.packed).cuda()
    hidden = torch.randn(16, m.config.hidden, device="cuda").to(m.dtype)
    work = fg.static_work(16, m.device)
    with torch.inference_mode():
        for run in (lambda: fg.frames_static(m, hidden, rows, work, 64), lambda: fg.frames_device(m, hidden, sb)):
            run()  # compiles
            names = cuda_kernels(run)
            assert names.count("_sample_kernel") == fg.n_codebooks, names
            assert not [n for n in names if "scan" in n or "topk" in n or "sort" in n.lower()], names
