"""csm's depth decoder on the fused kernels (`--depth-kernels fused`, engine/model/
depth_fused.py): its passes give the torch modules' logits and K/V, and `frames_static` /
`frames_device` the torch form's frames (Triton's CPU interpreter, fp16; csm-tiny and a
tiny dual-AR-like depth decoder of 4 q heads per KV head); the flag is refused where it
cannot run; on CUDA (gpu marker), bf16 logits close and frames mostly equal, and the
frame graphs captured on the fused path replay their eager `frames_static` bit for bit."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pdunit.engine.model.family_csm import depth_kernels_refusal, set_depth_kernels
from pdunit.engine.model.loader import load_model
from tests.kernels.csm_depth_script import HEADER, header_scope
from tests.kernels.paging import gpu, run_interpreted

INTERPRETED = HEADER + textwrap.dedent(
    """
    import dataclasses
    torch.set_num_threads(1)
    from pdunit.engine.model.family import ParsedConfig
    from pdunit.engine.model.family_csm import _CSM_TINY, CsmFamily, set_depth_kernels
    from pdunit.engine.model.loader import _fill_random, load_model

    def dualar_tiny():
        # csm-tiny with a dual-AR-like depth decoder: 4 q heads on one KV head of 32, 6 codebooks
        raw = {**_CSM_TINY, "num_codebooks": 6, "depth_decoder_config": {
            **_CSM_TINY["depth_decoder_config"], "num_codebooks": 6, "num_attention_heads": 4,
            "head_dim": 32, "max_position_embeddings": 7}}
        fam = CsmFamily()
        parsed = fam.parse_config(raw, "dualar-tiny")
        m = fam.build(ParsedConfig(dataclasses.replace(parsed.model, dtype="float16"), parsed.extras), "cpu")
        _fill_random(m, 0)
        return m.eval().requires_grad_(False)

    models = {"csm-tiny": load_model("random:csm-tiny:0", dtype="float16"), "dualar-tiny": dualar_tiny()}
    for name, m in models.items():
        fg = m.frame_generator
        before = [p.clone() for p in fg.parameters()]
        set_depth_kernels(m, "fused")
        fused = fg.fused
        assert fused is not None
        # the fused weights are the separate ones' storage: same values, the torch form reads them
        assert all(torch.equal(a, b) for a, b in zip(before, fg.parameters()))
        assert fg.layers[0].attn.k_proj.weight.data_ptr() == fused.gemms[0].qkv[fg.cfg.n_heads * fg.cfg.head_dim:].data_ptr()
        gen = torch.Generator().manual_seed(0)
        # 3 rows in a work buffer of 8 (slots b*K + p of the first 3 rows)
        out, w_ref, w_fused = passes(m, 3, 8, gen)
        for j, (want, got, _) in enumerate(out, 1):
            assert got.shape == want.shape == (3, 1, fg.vocab_size), (got.shape, want.shape)
            assert got.dtype == torch.float32 and rel(got, want) < 5e-3, (name, j, rel(got, want))
        assert rel(w_fused, w_ref) < 5e-3, (name, rel(w_fused, w_ref))
        print(name, "passes ok", max(rel(g, w) for w, g, _ in out), rel(w_fused, w_ref))

        hidden = (torch.randn(4, m.config.hidden, generator=gen) * 0.5).to(torch.float16)
        got = frames_both(m, hidden, INDEXES, 8)  # 4 rows in a work buffer of 8
        (s_ref, d_ref), (s_fused, d_fused) = got["torch"], got["fused"]
        assert torch.equal(s_fused, s_ref) and torch.equal(d_fused, d_ref), (name, s_fused, s_ref)
        assert torch.equal(d_fused, s_fused), name
        print(name, "frames ok")

    # refused after the frame graphs were captured (they hold the torch form's addresses)
    m = load_model("random:csm-tiny:1", dtype="float16")
    m.frame_graphs = object()
    try:
        set_depth_kernels(m, "fused")
        raise AssertionError("not refused")
    except ValueError as exc:
        assert "--depth-kernels fused after the frame graphs" in str(exc), exc
    assert m.frame_generator.fused is None
    print("refusal ok")
    """
)


def test_fused_depth_passes_and_frames_equal_the_torch_forms_under_tritons_cpu_interpreter(tmp_path: Path) -> None:
    """fp16 csm-tiny and a dual-AR-like depth decoder: every pass of a frame (3 rows in a
    work buffer of 8) gives the torch modules' logits and K/V within fp16 summation order;
    `frames_static` and `frames_device` give the torch form's greedy, seeded, depth-param
    and EOS-suppressed frames; the fused weights share the Linear weights' storage."""
    out = run_interpreted(INTERPRETED, tmp_path)
    for done in ("csm-tiny passes ok", "csm-tiny frames ok", "dualar-tiny passes ok", "dualar-tiny frames ok",
                 "refusal ok"):
        assert done in out, out


@pytest.mark.parametrize("spec,dtype,why", [
    ("random:tiny:0", None, "has none"),  # no depth decoder
    ("random:csm-tiny:0", None, "CUDA model in bfloat16 or float16"),  # float64
    ("random:csm-tiny:0", "float16", "CUDA model in bfloat16 or float16"),  # CPU, no interpreter
])
def test_depth_kernels_fused_is_refused_off_the_gpu_path_naming_the_flag(spec: str, dtype: str | None,
                                                                           why: str) -> None:
    m = load_model(spec, dtype=dtype)
    refusal = depth_kernels_refusal(m)
    assert refusal is not None and "--depth-kernels fused" in refusal and why in refusal, refusal
    with pytest.raises(ValueError, match="--depth-kernels fused"):
        set_depth_kernels(m, "fused")
    set_depth_kernels(m, "torch")  # always taken
    with pytest.raises(ValueError, match="expected one of auto, torch, fused"):
        set_depth_kernels(m, "triton")


# ------------------------------------------------------------------ GPU


SHAPES = [("csm-tiny", None), ("csm-1b-shape", 2), ("dualar-4b-shape", 2)]


@gpu
@pytest.mark.parametrize("shape,layers", SHAPES)
def test_fused_depth_decoder_matches_the_torch_form_on_cuda_bf16(shape: str, layers: int | None) -> None:
    """bf16 on CUDA: every pass's logits and the K/V close to the torch modules'; csm-tiny's
    frames mostly equal (the larger shapes' 10-31 dependent choices cascade through bf16
    near-ties of random weights: their contract is the closeness of every pass)."""
    from tests.kernels.test_csm_gpu_path import csm_gpu_model

    s = header_scope()
    m = csm_gpu_model(shape, layers)
    set_depth_kernels(m, "fused")
    fg = m.frame_generator
    assert fg is not None and fg.fused is not None
    gen = torch.Generator().manual_seed(0)
    passes, w_ref, w_fused = s["passes"](m, 24, 32, gen)
    for j, (want, got, _) in enumerate(passes, 1):
        assert s["rel"](got, want) < 3e-2, (j, s["rel"](got, want))
    assert s["rel"](w_fused, w_ref) < 3e-2
    if shape == "csm-tiny":
        hidden = (torch.randn(8, m.config.hidden, generator=gen) * 0.5).to("cuda", m.dtype)
        agree = total = 0
        for index in (0, 60):
            got = s["frames_both"](m, hidden, [index] * 8, 8)
            for a, b in zip(got["torch"], got["fused"], strict=True):
                agree, total = agree + int((a == b).sum()), total + a.numel()
        assert agree / total > 0.8, (agree, total)


@gpu
@pytest.mark.parametrize("shape", ["csm-tiny", "csm-1b-shape"])
def test_frame_graphs_on_the_fused_path_replay_their_eager_frames_bit_for_bit(shape: str) -> None:
    """`--depth-kernels fused` then the frame graphs: each bucket's replay (per top-k cap)
    equals `frames_static` run eagerly on the replay's own padded inputs."""
    from pdunit.engine.model.frame_graphs import TOP_K_CAPS, FrameGraphRunner
    from pdunit.engine.model.sampling import SamplingParams, sampling_batch
    from tests.kernels.test_csm_gpu_path import csm_gpu_model

    m = csm_gpu_model(shape, 2)
    set_depth_kernels(m, "fused")
    fg = m.frame_generator
    assert fg is not None and fg.fused is not None
    runner = FrameGraphRunner(m, (4, 8))
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(5, m.config.hidden, device="cuda", generator=gen).to(m.dtype)
    greedy, suppressed = SamplingParams(), SamplingParams(temperature=1.0, seed=9, min_frames=50)
    sets = {
        0: [greedy, suppressed, SamplingParams(temperature=0.7, seed=4), greedy, SamplingParams(min_frames=50)],
        64: [greedy, SamplingParams(temperature=0.9, top_k=8, seed=5), suppressed, SamplingParams(top_k=3),
             SamplingParams(temperature=1.2, top_k=64, seed=6, depth_decoder_temperature=0.5)],
        None: [SamplingParams(temperature=0.9, top_k=100, seed=7), greedy, suppressed, greedy, greedy],
    }
    work = fg.static_work(8, m.device)
    assert set(sets) == set(TOP_K_CAPS)
    for cap, params in sets.items():
        for index in (0, 60):
            sb = sampling_batch(params, [index] * 5, m.config.n_codebooks, m.device)
            got = runner.run(hidden, sb)
            assert got is not None and got.shape == (5, m.config.n_codebooks)
            with torch.inference_mode():
                want = fg.frames_static(m, runner._hidden[:8], runner._rows[:8], work, cap)
            assert torch.equal(got, want[:5]), (cap, index)
    assert runner.stats == {"replays": 6, "eager": 0}
    assert np.array_equal(got.cpu().numpy()[:, -1], np.full(5, fg.audio_token_id))
