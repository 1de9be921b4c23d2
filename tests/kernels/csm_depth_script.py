"""The csm depth-decoder kernel tests' shared script header (test_csm_depth_fused.py,
test_csm_depth_fp8.py): imports, `rel`, the sampling rows and the two comparisons, as
source that their Triton-interpreted scripts start with and their GPU tests exec
in-process. It must never import Triton or set TRITON_INTERPRET: the interpreter is
chosen when Triton is first imported, in the script's own process."""

from __future__ import annotations

import textwrap

HEADER = textwrap.dedent(
    """
    import numpy as np, torch
    from pdunit.engine.model.family_csm import _StaticKV
    from pdunit.engine.model.sampling import SamplingParams, sampling_batch

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    # greedy, seeded sampling with top-k (the depth decoder's own params too), EOS suppression
    PARAMS = [SamplingParams(), SamplingParams(temperature=0.9, top_k=8, seed=5),
              SamplingParams(temperature=1.0, seed=9, min_frames=50),
              SamplingParams(temperature=0.8, seed=3, depth_decoder_temperature=0.7, depth_decoder_top_k=4)]
    # one row of each at frames 0 and 60 in turn: the third's EOS suppressed (min_frames 50)
    INDEXES = [0, 60, 0, 60]

    def passes(m, b, size, gen, fp8=False):
        # every pass of a frame over the same inputs (hidden, codes 0..K-2): [(torch form,
        # fused pass, torch form in the model dtype if fp8 else None) logits] per pass, the
        # GEMMs in e4m3 if fp8; the first two's K/V (work buffers of `size`, b rows used)
        fg = m.frame_generator
        k, dt, dev = fg.n_codebooks, fg.embed.weight.dtype, m.device
        hidden = (torch.randn(b, m.config.hidden, generator=gen) * 0.5).to(dev, dt)
        codes = torch.randint(0, fg.vocab_size, (b, k - 1), generator=gen).to(dev)
        w_t, w_f, w_b = (fg.static_work(size, dev) for _ in range(3))
        out = []
        with torch.inference_mode():
            for j in range(1, k):
                if j == 1:
                    x = torch.cat([hidden[:, None], fg.embed(codes[:, :1])], dim=1)
                else:
                    x = fg.embed(codes[:, j - 1 : j] + (j - 1) * fg.vocab_size)
                start = 0 if j == 1 else j
                caches = [[_StaticKV(w[i, 0, :b], w[i, 1, :b], start) for i in range(len(fg.layers))]
                          for w in (w_t, w_b)]
                wide = fg._extend(x, start, caches[1], False) if fp8 else None
                out.append((fg._extend(x, start, caches[0], fp8), fg.fused.extend(x, start, w_f, fp8), wide))
        return out, w_t[:, :, :b], w_f[:, :, :b]

    def frames_both(m, hidden, indexes, size):
        # {form: (frames_static with a work buffer of `size`, frames_device)} of PARAMS' rows
        # in turn at frames `indexes` (one a row), under the model's decode_gemm
        fg, fused = m.frame_generator, m.frame_generator.fused
        n = hidden.shape[0]
        sb = sampling_batch([PARAMS[i % len(PARAMS)] for i in range(n)], indexes, m.config.n_codebooks,
                            hidden.device)
        rows = torch.from_numpy(sb.packed).to(hidden.device)
        got = {}
        with torch.inference_mode():
            for name, path in (("torch", None), ("fused", fused)):
                fg.fused = path
                got[name] = (fg.frames_static(m, hidden, rows, fg.static_work(size, hidden.device), None),
                             fg.frames_device(m, hidden, sb))
        fg.fused = fused
        return got
    """
)


def header_scope() -> dict:
    """HEADER's names, in-process (the GPU tests)."""
    out: dict = {}
    exec(HEADER, out)  # noqa: S102 - the interpreted scripts' helpers
    return out
