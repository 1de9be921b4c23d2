"""csm's depth decoder under `--decode-gemm fp8` (`TTSModel.set_decode_gemm`, engine/model/
family_csm.py `DepthDecoder.quantise_gemms`): one set of e4m3 weights that the torch
form and the fused pass (engine/model/depth_fused.py) both multiply, so under Triton's
CPU interpreter (fp16 csm-tiny) every pass's logits and K/V agree tightly, its greedy
and sampled frames are equal, and the e4m3 passes are near the model dtype's but not
equal; the frame graphs refuse a stale mode; the device's refusal names the depth
decoder. On CUDA (gpu marker): the two forms close in bf16, and the frame graphs
captured with fp8 depth GEMMs replay their eager `frames_static` bit for bit."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pdunit.engine.model.loader import load_model
from tests.kernels.csm_depth_script import HEADER, header_scope
from tests.kernels.paging import gpu, run_interpreted

INTERPRETED = HEADER + textwrap.dedent(
    """
    torch.set_num_threads(1)
    from pdunit.engine.model.family_csm import greedy_frames, set_depth_kernels
    from pdunit.engine.model.loader import load_model

    m = load_model("random:csm-tiny:0", dtype="float16")
    fg = m.frame_generator
    set_depth_kernels(m, "fused")
    m.set_decode_gemm("fp8")
    c = fg.cfg
    # one set of e4m3 weights: the torch form's Linears read row views of the fused pass's
    g = fg.fp8_gemms[1]
    assert fg.layers[1].attn.k_proj.fp8.q.data_ptr() == g.qkv.q[c.n_heads * c.head_dim:].data_ptr()
    assert fg.layers[1].mlp.up_proj.fp8.q.data_ptr() == g.gate_up.q[c.ffn_hidden:].data_ptr()
    assert fg.layers[1].mlp.down_proj.fp8 is g.down

    gen = torch.Generator().manual_seed(0)
    out, w_t, w_f = passes(m, 3, 8, gen, fp8=True)  # 3 rows in work buffers of 8
    for j, (t8, f8, tb) in enumerate(out, 1):
        assert f8.shape == t8.shape == (3, 1, fg.vocab_size) and f8.dtype == torch.float32, (j, f8.shape)
        assert rel(f8, t8) < 1e-3, (j, rel(f8, t8))  # the same weights and quantised rows
        assert 1e-2 < rel(t8, tb) < 0.35, (j, rel(t8, tb))  # e4m3 ran: near fp16's, not equal
    assert rel(w_f, w_t) < 1e-3, rel(w_f, w_t)
    print("passes ok", max(rel(f, t) for t, f, _ in out), min(rel(t, b) for t, _, b in out))

    hidden = (torch.randn(4, m.config.hidden, generator=gen) * 0.5).to(torch.float16)
    got = frames_both(m, hidden, INDEXES, 8)  # 4 rows in a work buffer of 8
    (s_t, d_t), (s_f, d_f) = got["torch"], got["fused"]
    assert torch.equal(s_f, s_t) and torch.equal(d_f, d_t) and torch.equal(d_f, s_f), (s_f, s_t)
    m.set_decode_gemm("bf16")  # the same inputs through the model dtype's passes: other codes
    sb = sampling_batch(PARAMS, INDEXES, m.config.n_codebooks, m.device)
    with torch.inference_mode():
        wide = fg.frames_device(m, hidden, sb)
    assert not torch.equal(wide, d_f), wide
    print("frames ok")

    # greedy generation (the backbone's decode steps in e4m3 too), each form of the depth decoder
    m.set_decode_gemm("fp8")
    text = np.concatenate([np.full((4, 4), 31), np.array([[5], [7], [9], [11]])], 1)
    audio = np.concatenate([np.random.default_rng(5).integers(0, 30, (3, 4)), np.full((3, 1), 62)], 1)
    fused = fg.fused
    fg.fused = None
    want = greedy_frames(m, [text, audio], 3)
    fg.fused = fused
    got = greedy_frames(m, [text, audio], 3)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), (got, want)
    print("greedy ok", [len(f) for f in got])
    """
)


def test_fp8_depth_passes_and_frames_agree_between_the_torch_form_and_the_fused_pass_interpreted(
    tmp_path: Path,
) -> None:
    """fp16 csm-tiny with --depth-kernels fused and --decode-gemm fp8: the torch form's
    Linears read row views of the fused pass's e4m3 weights; every pass's logits and K/V
    agree within 1e-3 (relative), and both are 1-35% from the fp16 passes; frames_static
    and frames_device give the same greedy, seeded, depth-param and EOS-suppressed frames
    in both forms, other frames than the fp16 passes; greedy generation is equal."""
    out = run_interpreted(INTERPRETED, tmp_path)
    for done in ("passes ok", "frames ok", "greedy ok"):
        assert done in out, out


def test_fp8_decode_gemm_quantises_the_depth_layers_once_and_the_torch_form_runs_them() -> None:
    """CPU, float64 csm-tiny: set_decode_gemm("fp8") builds the depth layers' e4m3 weights
    (1 byte a weight and a float32 scale a row, against 8), once; frames_device's passes
    then run them, and their logits differ from the model dtype's, within e4m3 error."""
    from pdunit.engine.model.family_csm import DepthDecoder

    m = load_model("random:csm-tiny:0")
    fg = m.frame_generator
    assert isinstance(fg, DepthDecoder) and fg.fp8_gemms is None and not fg.fp8_passes(m)
    m.set_decode_gemm("fp8")
    gemms = fg.fp8_gemms
    assert gemms is not None and len(gemms) == len(fg.layers) and fg.fp8_passes(m)
    weights = fg.gemm_weight_bytes(False) // 8
    rows = sum(p.shape[0] for n, p in fg.named_parameters() if n.startswith("layers.") and n.endswith("_proj.weight"))
    assert fg.gemm_weight_bytes(True) == weights + 4 * rows
    m.set_decode_gemm("fp8")
    assert fg.fp8_gemms is gemms  # built once
    x = torch.randn(3, 2, fg.embed.weight.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        e4m3 = fg._extend(x, 0, [[] for _ in fg.layers], fg.fp8_passes(m))
        wide = fg._extend(x, 0, [[] for _ in fg.layers])
    err = float((e4m3 - wide).norm() / wide.norm())
    assert 1e-3 < err < 0.35, err


def test_an_fp8_depth_decoder_the_device_cannot_run_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the depth decoder's GEMMs cannot run in e4m3 (here: a device whose check
    refuses its dimensions), set_decode_gemm raises naming the mode, the depth decoder and
    the reason, and the model keeps its mode."""
    from pdunit.kernels import fp8_gemm

    def refuse_depth(device: torch.device, dims: dict[str, int]) -> str | None:
        return "dims not multiples of 16 (test)" if "depth hidden" in dims else None

    monkeypatch.setattr(fp8_gemm, "fp8_unsupported", refuse_depth)
    m = load_model("random:csm-tiny:0")
    with pytest.raises(ValueError, match=r"decode_gemm fp8 \(the depth decoder's GEMMs\): dims not multiples"):
        m.set_decode_gemm("fp8")
    assert m.decode_gemm == "bf16" and m.frame_generator.fp8_gemms is None


def test_frame_graphs_built_before_the_decode_gemm_changed_refuse_to_run() -> None:
    """The frame graphs record the depth decoder's GEMMs live at capture: a runner built
    under bf16 refuses once the model is fp8 (naming set_decode_gemm); one built after
    stages the fp8 frames (capture=False: what its graphs replay)."""
    from pdunit.engine.model.frame_graphs import FrameGraphRunner
    from pdunit.engine.model.sampling import SamplingParams, sampling_batch

    m = load_model("random:csm-tiny:0")
    stale = FrameGraphRunner(m, (4,), capture=False)
    m.set_decode_gemm("fp8")
    hidden = torch.randn(3, m.config.hidden, dtype=m.dtype, generator=torch.Generator().manual_seed(2))
    sb = sampling_batch([SamplingParams()] * 3, [0] * 3, m.config.n_codebooks, m.device)
    with pytest.raises(ValueError, match="decode_gemm is 'fp8', the frame graphs recorded 'bf16'.*set_decode_gemm"):
        stale.run(hidden, sb)
    fresh = FrameGraphRunner(m, (4,), capture=False)
    got = fresh.run(hidden, sb)
    assert got is not None
    assert np.array_equal(got.numpy(), m.frame_generator.frames_device(m, hidden, sb).numpy())


# ------------------------------------------------------------------ GPU


@gpu
@pytest.mark.parametrize("shape,layers", [("csm-tiny", None), ("csm-1b-shape", 2)])
def test_fp8_depth_passes_agree_between_the_forms_on_cuda_bf16(shape: str, layers: int | None) -> None:
    """bf16 on CUDA, e4m3 depth GEMMs (torch._scaled_mm): every pass's logits and K/V of
    the fused pass close to the torch form's (the same quantised weights), both near the
    bf16 passes."""
    from pdunit.engine.model.family_csm import set_depth_kernels
    from tests.kernels.test_csm_gpu_path import csm_gpu_model

    s = header_scope()
    m = csm_gpu_model(shape, layers)
    set_depth_kernels(m, "fused")
    m.set_decode_gemm("fp8")
    out, w_t, w_f = s["passes"](m, 24, 32, torch.Generator().manual_seed(0), fp8=True)
    for j, (t8, f8, tb) in enumerate(out, 1):
        assert s["rel"](f8, t8) < 3e-2, (j, s["rel"](f8, t8))
        assert s["rel"](t8, tb) < 0.35, (j, s["rel"](t8, tb))
    assert s["rel"](w_f, w_t) < 3e-2


@gpu
@pytest.mark.parametrize("shape", ["csm-tiny", "csm-1b-shape"])
def test_frame_graphs_with_fp8_depth_gemms_replay_their_eager_frames_bit_for_bit(shape: str) -> None:
    """--depth-kernels fused and --decode-gemm fp8, then the frame graphs: each replay
    (rows of every top-k cap) equals `frames_static` run eagerly on its padded inputs at
    the cap it took."""
    from pdunit.engine.model.family_csm import set_depth_kernels
    from pdunit.engine.model.frame_graphs import TOP_K_CAPS, FrameGraphRunner
    from pdunit.engine.model.sampling import SamplingParams, sampling_batch
    from tests.kernels.test_csm_gpu_path import csm_gpu_model

    m = csm_gpu_model(shape, 2)
    set_depth_kernels(m, "fused")
    m.set_decode_gemm("fp8")
    fg = m.frame_generator
    assert fg is not None and fg.fp8_passes(m)
    runner = FrameGraphRunner(m, (4, 8))
    hidden = torch.randn(5, m.config.hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    hidden = hidden.to(m.dtype)
    greedy = SamplingParams()
    sets = {0: [greedy, SamplingParams(temperature=1.0, seed=9, min_frames=50), greedy,
                SamplingParams(temperature=0.7, seed=4), greedy],
            64: [greedy, SamplingParams(temperature=0.9, top_k=8, seed=5), greedy, SamplingParams(top_k=3),
                 SamplingParams(temperature=1.2, top_k=64, seed=6, depth_decoder_temperature=0.5)],
            None: [SamplingParams(temperature=0.9, top_k=100, seed=7), greedy, greedy, greedy, greedy]}
    work = fg.static_work(8, m.device)
    assert set(sets) == set(TOP_K_CAPS)
    for cap, params in sets.items():
        for index in (0, 60):
            sb = sampling_batch(params, [index] * 5, m.config.n_codebooks, m.device)
            got = runner.run(hidden, sb)
            assert got is not None
            with torch.inference_mode():  # at the cap the replay took
                want = fg.frames_static(m, runner._hidden[:8], runner._rows[:8], work, runner.cap_for(sb))
            assert torch.equal(got, want[:5]), (cap, index)
    assert runner.stats == {"replays": 6, "eager": 0}
