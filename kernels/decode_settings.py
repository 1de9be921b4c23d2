"""The decode attention kernel's launch settings: their defaults, the values each may
take, and `--decode-kernel`'s KEY=VALUE text form.

Torch-free (engine configs check `--decode-kernel` where torch is never imported: the
operator, `bench compare`'s flag check); kernels/paged_attention.py reads the live
settings (its DECODE_CONFIG) at every launch: tile and pipeline, grid order and split,
operand order, fp8 dots, and for fp8 pools the widening from words, the query rows per
dot and the lazy softmax. What each does and the measurements behind each default:
docs/performance.md, "Kernel notes". Must never launch anything: it only checks and
renders values.
"""

from __future__ import annotations

from collections.abc import Mapping

DECODE_DEFAULT: dict[str, int] = {
    "block_n": 64, "num_warps": 4, "num_stages": 3, "head_major": 0, "programs_per_sm": 4, "kv_as_a": -1,
    "fp8_dots": 1, "kv_words": 0, "block_g": 16, "lazy_softmax": 0,
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
    "kv_words": (0, 1),
    "block_g": (8, 16),
    "lazy_softmax": (0, 1),
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
