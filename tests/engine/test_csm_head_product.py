"""csm's codebook heads (engine/model/depth_fused.py `codebook_logits`, issue 23): one
position, every pass of a frame step, is one plain 2-D GEMM (cuBLAS then picks the
card's own kernels), more positions (the teacher-forced logits) one batched product;
both give the batched einsum's values, and the depth decoder's passes use it. The fused
passes multiply heads whose rows are padded to a multiple of 8 ids (16-byte rows, for
the card's own kernels), the parameter a view of them."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pdunit.engine.model.depth_fused import FusedDepthPass, codebook_logits
from pdunit.engine.model.loader import load_model


class Ops(TorchDispatchMode):
    """The aten ops run inside it: names, and (name, its tensor arguments' shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.shapes: list[tuple[str, tuple[tuple[int, ...], ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.__name__.split(".")[0]
        self.names.append(name)
        self.shapes.append((name, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_one_position_is_one_plain_gemm_with_the_batched_products_values(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 2, 32, generator=g).to(dtype)[:, 1:]  # a pass's last position: strided rows
    heads = torch.randn(4, 32, 37, generator=g).to(dtype)
    with Ops() as ops:
        got = codebook_logits(h, heads[2:3])
    assert ops.names.count("mm") == 1 and "bmm" not in ops.names, ops.names
    assert got.dtype == torch.float32 and got.shape == (6, 1, 37)
    assert torch.equal(got, torch.einsum("bph,phv->bpv", h, heads[2:3]).float())


def test_several_positions_stay_one_batched_product() -> None:
    g = torch.Generator().manual_seed(1)
    h, heads = torch.randn(5, 3, 16, generator=g), torch.randn(3, 16, 9, generator=g)
    with Ops() as ops:
        got = codebook_logits(h, heads)
    assert ops.names.count("bmm") == 1 and "mm" not in ops.names, ops.names
    for p in range(3):
        assert torch.allclose(got[:, p], h[:, p] @ heads[p], rtol=1e-6, atol=1e-6)


def test_the_depth_decoders_frame_step_takes_a_plain_gemm_a_codebook() -> None:
    """float64 csm-tiny: `frames_static`'s K - 1 depth passes each run one [B, hidden] x
    [hidden, V] mm for their head, and no batched product of a head."""
    from pdunit.engine.model.sampling import SamplingParams, sampling_batch

    m = load_model("random:csm-tiny:0")
    fg = m.frame_generator
    assert fg is not None
    sb = sampling_batch([SamplingParams()] * 3, [0] * 3, m.config.n_codebooks, m.device)
    assert sb.packed is not None
    rows = torch.from_numpy(sb.packed)
    hidden = torch.randn(3, m.config.hidden, dtype=torch.float64)
    with torch.inference_mode(), Ops() as ops:
        fg.frames_static(m, hidden, rows, fg.static_work(3, m.device))
    head = tuple(fg.heads.shape[1:])
    assert ops.shapes.count(("mm", ((3, head[0]), head))) == fg.n_codebooks - 1, ops.shapes
    assert not [s for s in ops.shapes if s[0] == "bmm" and s[1][1][1:] == head], ops.shapes


def test_the_fused_pass_multiplies_heads_padded_to_8_ids_of_which_the_parameter_is_a_view() -> None:
    """csm-tiny's heads swapped for 37 ids (csm's 2051 is not a multiple of 8 either):
    the fused pass keeps them in rows of 40 (zeros beyond 37), the parameter becomes a
    view of them holding the same values, and a pass's head is one mm over the 40
    columns whose first 37 are the unpadded product's logits, contiguous."""
    m = load_model("random:csm-tiny:0")
    fg = m.frame_generator
    assert fg is not None
    g = torch.Generator().manual_seed(2)
    k, hidden = fg.heads.shape[:2]
    fg.heads = torch.nn.Parameter(torch.randn(k, hidden, 37, generator=g, dtype=torch.float64))
    want_heads = fg.heads.detach().clone()
    fused = FusedDepthPass(fg)
    assert fused.vocab == 37 and fused.wide_heads.shape == (k, hidden, 40)
    assert fg.heads.data_ptr() == fused.wide_heads.data_ptr() and torch.equal(fg.heads, want_heads)
    assert not fused.wide_heads[..., 37:].any()
    h = torch.randn(5, 1, hidden, generator=g, dtype=torch.float64)
    with Ops() as ops:
        got = codebook_logits(h, fused.wide_heads[1:2], fused.vocab)
    assert ("mm", ((5, hidden), (hidden, 40))) in ops.shapes, ops.shapes
    assert got.shape == (5, 1, 37) and got.is_contiguous() and got.dtype == torch.float32
    assert torch.allclose(got, (h[:, 0] @ want_heads[1]).float()[:, None], rtol=1e-6, atol=1e-6)
