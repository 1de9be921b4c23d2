"""Which cuBLAS kernel serves a depth pass's codebook head on ONE GPU (issue 23): the
product [B, hidden] x [hidden, V] in bf16 as einsum's batched product of one position,
as `codebook_logits`' plain mm, and as an mm whose head and output rows are padded to a
multiple of 8 ids (16-byte rows: what Hopper's TMA kernels need; csm's 2051 ids are
not), each timed (back-to-back launches between two events) with its kernel names.
Diagnostics only, no results file of its own. Needs CUDA.
  python3 bench/gpu/head_gemm.py [HIDDEN] [VOCABS] [BATCHES]  (defaults 1024 2051,4096 64,128,256,512)"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from pdunit.engine.model.depth_fused import codebook_logits


def timed(fn: Callable[[], torch.Tensor], iters: int = 50) -> tuple[float, list[str]]:
    """(ms a call, the CUDA kernels of one call)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name[:70] for e in prof.events() if e.device_type.name == "CUDA"]
    return start.elapsed_time(end) / iters, names


def forms(x: torch.Tensor, heads: torch.Tensor, wide: torch.Tensor, vocab: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The three forms of the head product of x [B, 1, hidden]."""
    return {
        "einsum": lambda: torch.einsum("bph,phv->bpv", x, heads).float(),
        "mm": lambda: codebook_logits(x, heads),
        f"mm ld {wide.shape[1]}": lambda: torch.mm(x[:, 0], wide).float()[:, :vocab],
    }


def main(hidden: int, vocabs: list[int], batches: list[int]) -> None:
    for vocab in vocabs:
        padded = -(-vocab // 8) * 8
        wide = torch.randn(hidden, padded, device="cuda", dtype=torch.bfloat16) / hidden**0.5
        heads = wide[:, :vocab].contiguous()[None]  # [1, hidden, V] as the parameter stores it
        for b in batches:
            x = torch.randn(b, 2, hidden, device="cuda", dtype=torch.bfloat16)[:, 1:]  # a pass's last position
            products = forms(x, heads, wide, vocab)
            want = products["einsum"]().squeeze(1)
            for name, fn in products.items():
                ms, names = timed(fn)
                err = float((fn().reshape(b, vocab) - want).abs().max())
                print(f"V={vocab} B={b} {name:12s} {ms * 1000:7.1f} us  max|diff| {err:.2e}  {'; '.join(names)}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 1024, [int(v) for v in (args[1] if len(args) > 1 else "2051,4096").split(",")],
         [int(b) for b in (args[2] if len(args) > 2 else "64,128,256,512").split(",")])
