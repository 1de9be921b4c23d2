"""The decode attention kernel's launch settings: their defaults, the values each may
take, and `--decode-kernel`'s KEY=VALUE text form.

Torch-free (engine configs check `--decode-kernel` where torch is never imported: the
operator, `bench compare`'s flag check); kernels/paged_attention.py reads the live
settings (its DECODE_CONFIG) at every launch.

What each setting does:
- `block_n`: context tokens per tile (64 x 256 B rows = 16 KiB of K, and as much V, per
  load); `num_warps`, `num_stages`: warps and pipeline depth.
- `head_major` 1 launches the kv heads of one (sequence, split) next to each other
  (else sequences vary fastest); `programs_per_sm`: how many programs the split
  heuristic aims for per SM.
- `kv_as_a` 1 computes S^T = K Q^T and O^T = V^T P^T, so the widened K/V tile is the
  dots' first operand, which Hopper's tensor cores take from registers (the second must
  sit in shared memory: a tile widened in registers goes back there before each dot); 0
  the plain S = Q K^T, O = P V; -1 picks 1 for an fp8 pool, 0 otherwise, as `--tune`
  found on one H200 (bench/results/step-20261130-h200-kv-fp8-kva.md: fp8 2.33 against
  2.09 TB/s, bf16 3.54 against 3.91).
- `fp8_dots` (fp8 pools only; ignored otherwise): 0 widens K and V to fp16 for every
  dot; 1 runs Q K^T on fp8 tensor cores, the query quantised to e4m3 per head row
  (scaled by its largest |value| / 448, the scale undone on the scores: what vLLM's
  FlashAttention-3 path does with an fp8 cache), P V widened as in 0. Faster by 5% and
  18% in two calls on one H200 (64 x 2k, one layer, one sample each:
  step-20261130-h200-fp8-dots.md, step-20261130-h200-kpp.md) and worth three levels to
  1P1D's D (19 -> >= 22 per GPU, capacity-20261130-h200x2-60s-q8b.md): the default. 0
  keeps K and the query exact (the GPU tests' exact-widening checks pin it). P V in fp8
  (P scaled into e4m3) was slower in all three forms tried and is gone.

The default won on one H200 (2026-11-29, 64 streams x 2k, one layer, launches back to
back): 0.141 ms = 3.81 TB/s of K/V against a 4.22 TB/s copy
(bench/results/step-20261129-h200.json lists every candidate's time).
"""

from __future__ import annotations

from collections.abc import Mapping

DECODE_DEFAULT: dict[str, int] = {
    "block_n": 64, "num_warps": 4, "num_stages": 3, "head_major": 0, "programs_per_sm": 4, "kv_as_a": -1,
    "fp8_dots": 1,
}

# Values the kernel is built for (powers of two where Triton's tiles need them); the GPU
# tests run every `--tune` candidate against the reference.
ALLOWED: dict[str, tuple[int, ...]] = {
    "block_n": (16, 32, 64, 128),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3, 4, 5),
    "head_major": (0, 1),
    "programs_per_sm": tuple(range(1, 17)),
    "kv_as_a": (-1, 0, 1),
    "fp8_dots": (0, 1),
}


def checked(changes: Mapping[str, int], source: str = "decode kernel settings") -> dict[str, int]:
    """`changes` as ints, once every key is a setting and every value one it may take;
    a ValueError names the first that is not (with `source`, the flag it came from)."""
    out: dict[str, int] = {}
    for key, value in changes.items():
        if key not in ALLOWED:
            raise ValueError(f"{source}: unknown setting {key!r} (known: {', '.join(ALLOWED)})")
        if isinstance(value, bool) or int(value) != value or int(value) not in ALLOWED[key]:
            raise ValueError(f"{source}: {key}={value!r} is not one of {list(ALLOWED[key])}")
        out[key] = int(value)
    return out


def parse(text: str, source: str = "--decode-kernel") -> dict[str, int]:
    """`KEY=VALUE,...` (empty: no change) as the settings it changes."""
    changes: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{source}: {part!r} is not KEY=VALUE")
        if key in changes:
            raise ValueError(f"{source}: {key!r} is given twice")
        try:
            changes[key] = int(value.strip())
        except ValueError:
            raise ValueError(f"{source}: {key}={value.strip()!r} is not an integer") from None
    return checked(changes, source)


def render(settings: Mapping[str, int]) -> str:
    """The `--decode-kernel` text of the settings that differ from the default
    (`parse(render(s))` applied to the default gives `s`)."""
    return ",".join(f"{k}={int(v)}" for k, v in settings.items() if k in DECODE_DEFAULT and DECODE_DEFAULT[k] != v)
