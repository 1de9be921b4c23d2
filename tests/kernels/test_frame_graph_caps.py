"""The frame graphs' top-k caps under the fused sampler (engine/model/frame_graphs.py,
kernels/sampling_fused.py): the cap is a launch argument of one cost, so a runner whose
`sample_frames_static` runs the fused sampler records each bucket once, at the cap that
covers every row, and its frames equal those of the torch form's three caps for greedy,
temperature, top-k (under, at and past 64) and depth-decoder rows. Under Triton's CPU
interpreter (a subprocess); tests/kernels/test_csm_gpu_path.py captures on CUDA."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.kernels.paging import run_interpreted

INTERPRETED = textwrap.dedent(
    """
    import torch
    from pdunit.engine.model import frame_graphs
    from pdunit.engine.model.frame_graphs import TOP_K_CAPS, FrameGraphRunner
    from pdunit.engine.model.loader import load_model
    from pdunit.engine.model.sampling import SamplingParams, sampling_batch
    from pdunit.kernels import sampling_fused

    m = load_model("random:csm-tiny:0")
    fg = m.frame_generator
    cpu = torch.device("cpu")
    assert sampling_fused.available(cpu) and frame_graphs.captured_caps(cpu) == (None,)
    fused = FrameGraphRunner(m, (2, 4, 8), capture=False)
    assert fused.caps == (None,) and fused.keys == [(8, None), (4, None), (2, None)], fused.keys
    greedy, suppressed = SamplingParams(), SamplingParams(temperature=1.0, seed=9, min_frames=50)
    sets = {  # the torch form's cap for each set
        0: [greedy, suppressed, SamplingParams(temperature=0.7, seed=4), greedy, SamplingParams(min_frames=50)],
        64: [greedy, SamplingParams(temperature=0.9, top_k=8, seed=5), suppressed,
             SamplingParams(temperature=1.2, top_k=64, seed=6, min_frames=50), SamplingParams(top_k=3),
             SamplingParams(temperature=1.2, seed=2, depth_decoder_temperature=0.6, depth_decoder_top_k=5)],
        None: [SamplingParams(temperature=0.9, top_k=100, seed=7), greedy, suppressed,
               SamplingParams(temperature=0.8, top_k=3, seed=8, depth_decoder_top_k=20),
               SamplingParams(temperature=1.1, top_k=10**6, seed=2)],
    }
    gen = torch.Generator().manual_seed(0)
    compared = 0
    for cap, params in sets.items():
        n = len(params)
        hidden = torch.randn(n, m.config.hidden, dtype=m.dtype, generator=gen) * 3
        # rows at frames 0 and 60 in turn: min_frames rows suppressed at 0, not at 60
        sb = sampling_batch(params, [60 * (i % 2) for i in range(n)], m.config.n_codebooks, cpu)
        assert fused.cap_for(sb) is None
        got = fused.run(hidden, sb)  # what the bucket's one graph replays: the fused sampler, cap None
        assert got is not None
        size = fused.bucket_for(n)
        staged_hidden, staged_rows = fused._hidden[:size].clone(), fused._rows[:size].clone()
        real = sampling_fused.available
        sampling_fused.available = lambda device: False  # the torch form, at the set's own cap
        try:
            torch_form = FrameGraphRunner(m, (2, 4, 8), capture=False)
            assert torch_form.caps == TOP_K_CAPS and torch_form.cap_for(sb) == cap
            want = fg.frames_static(m, staged_hidden, staged_rows, fg.static_work(size, cpu), cap)
            assert torch.equal(torch_form.run(hidden, sb), want[:n]), cap
        finally:
            sampling_fused.available = real
        assert torch.equal(got, want[:n]), (cap, got, want[:n])
        compared += 1
    assert fused.stats == {"replays": 3, "eager": 0}, fused.stats
    print(compared, "sets compared")
    """
)


def test_the_fused_sampler_records_each_bucket_once_with_the_torch_forms_frames(tmp_path: Path) -> None:
    out = run_interpreted(INTERPRETED, tmp_path, timeout=600)
    assert "3 sets compared" in out, out
