"""Turning logits into frames: greedy, or seeded sampling that is the same in every mode.

Owns the sampling rules of a request (`SamplingParams`: temperature, top-k, seed, EOS
suppression, frame bounds, a depth decoder's own temperature/top-k) and three entry points with the same rules and draws:
`sample_frames` (to numpy: P, the monolith, D without overlap), `sample_frames_device`
(on the device, no host sync: D's overlap scheduler) and `sample_frames_static` (one
static shape whatever the params: inside a frame generator's CUDA graphs).
Must never depend on which other requests share the batch, the batch order or the
device: PD and the monolith must produce identical frames for identical inputs. Its
wire form is engine/proto/sampling.py's (this package imports no protocol).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling. A stream's frames count from 0 (the first, computed by
    prefill); EOS (column 0 == eos_id) is suppressed while the frame index is below
    `min_frames`; `max_frames` bounds the frames (the first included): the worker stops
    the stream after frame `max_frames - 1`, the sampler never forces EOS.
    `depth_decoder_temperature` / `depth_decoder_top_k` (None: the main ones) sample
    codebooks 1.. of a depth decoder (csm; transformers' `depth_decoder_*` generate
    arguments); codebook 0 keeps `temperature` / `top_k`."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    max_frames: int = 210
    min_frames: int = 0
    depth_decoder_temperature: float | None = None
    depth_decoder_top_k: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if not self.temperature >= 0.0:
            problems.append(f"temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0, 0 = whole vocabulary (got {self.top_k})")
        if not 0 <= self.seed <= _MASK64:
            problems.append(f"seed must be in [0, 2**64) (got {self.seed})")
        if self.max_frames < 1:
            problems.append(f"max_frames must be >= 1 (got {self.max_frames})")
        if not 0 <= self.min_frames <= self.max_frames:
            problems.append(
                f"min_frames must be in [0, max_frames={self.max_frames}] (got {self.min_frames})"
            )
        dt, dk = self.depth_decoder_temperature, self.depth_decoder_top_k
        if dt is not None and not dt >= 0.0:
            problems.append(f"depth_decoder_temperature must be >= 0 (got {dt})")
        if dk is not None and dk < 0:
            problems.append(f"depth_decoder_top_k must be >= 0, 0 = whole vocabulary (got {dk})")
        if problems:
            raise ValueError("invalid sampling params: " + "; ".join(problems))

    @property
    def has_depth(self) -> bool:
        """True iff a depth-decoder field is set."""
        return self.depth_decoder_temperature is not None or self.depth_decoder_top_k is not None

    def for_depth_decoder(self) -> SamplingParams:
        """The params of codebooks 1..: the depth fields where set, else the main ones."""
        return SamplingParams(
            temperature=self.temperature if self.depth_decoder_temperature is None else self.depth_decoder_temperature,
            top_k=self.top_k if self.depth_decoder_top_k is None else self.depth_decoder_top_k,
            seed=self.seed, max_frames=self.max_frames, min_frames=self.min_frames,
        )


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """`_splitmix64` over a uint64 array (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def draw_uniforms(seeds: list[int], frame_index: list[int], n_columns: int) -> np.ndarray:
    """float64 [n, n_columns] in [0, 1): row i holds the uniforms of frame
    `frame_index[i]` of a stream seeded `seeds[i]`.

    A counter-based draw: key = SplitMix64(SplitMix64(seed) ^ frame_index), then
    u = (SplitMix64(key + (column + 1) * 0x9E3779B97F4A7C15) >> 11) * 2**-53. Integer
    arithmetic only, so identical on every machine and for every batch, and vectorised
    over a step's streams (a generator object per stream and step costs D too much
    host time at large batches)."""
    keys = np.array([_splitmix64(_splitmix64(s & _MASK64) ^ (f & _MASK64)) for s, f in
                     zip(seeds, frame_index, strict=True)], dtype=np.uint64)
    counters = (np.arange(1, n_columns + 1, dtype=np.uint64) * _GOLDEN)[None, :]
    with np.errstate(over="ignore"):
        bits = _splitmix64_array(keys[:, None] + counters)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample_frames(
    logits: torch.Tensor, params: list[SamplingParams], frame_index: list[int], eos_id: int
) -> np.ndarray:
    """logits [n, C, V] -> int32 frames [n, C]. Row i follows params[i] at frame_index[i].

    Greedy when temperature == 0: per column, the first index of the largest logit.
    Otherwise, per column: logits / temperature, the top-k filter (top_k == 0: the whole
    vocabulary; ties with the k-th value are kept), softmax weights in float64, then
    inverse-CDF with one uniform per column (`draw_uniforms`)."""
    if logits.dim() != 3:
        raise ValueError(f"logits has shape {tuple(logits.shape)}, expected [n, C, V]")
    n, n_cols, _ = logits.shape
    if len(params) != n or len(frame_index) != n:
        raise ValueError(
            f"{n} logit rows but {len(params)} sampling params and {len(frame_index)} frame indices"
        )
    logits = logits.float()
    suppress = [i for i in range(n) if frame_index[i] < params[i].min_frames]
    if suppress:
        logits = suppress_eos(logits, to_device(np.array(suppress, dtype=np.int64), logits.device), eos_id)
    out = np.empty((n, n_cols), dtype=np.int32)
    greedy = [i for i in range(n) if params[i].temperature == 0.0]
    if greedy:
        out[greedy] = logits[greedy].argmax(dim=-1).to(torch.int32).cpu().numpy()
    sampled = [i for i in range(n) if params[i].temperature != 0.0]
    if sampled:
        rows = logits[sampled].to("cpu", torch.float64).numpy()
        temps = np.array([params[i].temperature for i in sampled], dtype=np.float64)
        u = draw_uniforms([params[i].seed for i in sampled], [frame_index[i] for i in sampled], n_cols)
        out[sampled] = _sample_rows(rows, temps, [params[i].top_k for i in sampled], u)
    return out


def _sample_rows(
    logits: np.ndarray, temperature: np.ndarray, top_k: list[int], u: np.ndarray
) -> np.ndarray:
    """Frames from logits [m, C, V] (float64), one temperature and top-k per row and
    uniforms [m, C]. Every operation is elementwise or along the vocabulary axis of one
    (row, column), so a row's result does not depend on the other rows."""
    scaled = logits / temperature[:, None, None]
    vocab = scaled.shape[-1]
    for k in sorted(set(top_k)):
        if not 0 < k < vocab:
            continue
        rows = [r for r, kr in enumerate(top_k) if kr == k]
        part = scaled[rows]
        kth = -np.partition(-part, k - 1, axis=-1)[..., k - 1 : k]
        scaled[rows] = np.where(part < kth, -np.inf, part)
    weights = np.exp(scaled - scaled.max(axis=-1, keepdims=True))  # -inf -> 0
    cdf = np.cumsum(weights, axis=-1)
    # First index whose cumulative mass exceeds u * total: never a zero-weight id, because
    # the cdf is flat across those.
    target = u[..., None] * cdf[..., -1:]
    idx = (cdf <= target).sum(axis=-1)
    # u * total can round up to total: fall back to the last id with mass, never to a
    # padded or filtered one.
    last = vocab - 1 - np.argmax(weights[..., ::-1] > 0, axis=-1)
    return np.minimum(idx, last).astype(np.int32)


@dataclass
class SamplingBatch:
    """The logits-independent inputs of one `sample_frames_device` call, built on the
    host: which rows draw (and their temperature, top-k and uniforms) and which rows
    have EOS suppressed. Row lists are host ints, so the device work needs no sync."""

    n_rows: int
    sampled_rows: list[int]              # rows with temperature > 0
    suppress_rows: list[int]             # rows with frame_index < min_frames
    top_k_groups: list[tuple[int, list[int]]] = field(default_factory=list)  # (k, local rows), 0 < k
    # device tensors (on the logits' device), present iff sampled_rows:
    sampled_index: torch.Tensor | None = None   # int64 [m]
    temperature: torch.Tensor | None = None     # float64 [m]
    uniforms: torch.Tensor | None = None        # float64 [m, C]
    suppress_index: torch.Tensor | None = None  # int64 [s]
    group_index: list[torch.Tensor] = field(default_factory=list)  # per top_k group: int64 local rows
    # every row's sampling in one float64 array [n, ROW_UNIFORMS + C] on the host (the
    # static form `sample_frames_static` reads, once on the device): temperature (0:
    # greedy), top_k, EOS suppressed (1/0), the depth decoder's temperature and top_k
    # (the main ones where the request sets none), then the row's C uniforms (0 for a
    # row greedy in both)
    packed: np.ndarray | None = None
    # codebooks 1.. of a depth decoder, where a row sets depth_decoder_* (None: this batch)
    depth: SamplingBatch | None = None

    @property
    def max_top_k(self) -> int:
        """The largest top_k of a sampled row, the depth decoder's included (0: none filters)."""
        main = max((k for k, _ in self.top_k_groups), default=0)
        return max(main, self.depth.max_top_k) if self.depth is not None else main

    def for_depth_decoder(self) -> SamplingBatch:
        """The batch of codebooks 1.. (`depth`, else this one)."""
        return self.depth if self.depth is not None else self


# `SamplingBatch.packed`'s columns
ROW_TEMPERATURE, ROW_TOP_K, ROW_SUPPRESS, ROW_DEPTH_TEMPERATURE, ROW_DEPTH_TOP_K, ROW_UNIFORMS = 0, 1, 2, 3, 4, 5
_TOP_K_MAX = 1 << 52  # exact in float64; any k >= the vocabulary filters nothing


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without a host sync: through pinned memory and an async
    copy on CUDA (the caching host allocator keeps the pinned block until the copy ran),
    as is on the CPU."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def suppress_eos(logits: torch.Tensor, rows: torch.Tensor, eos_id: int) -> torch.Tensor:
    """A copy of logits [n, C, V] with EOS (column 0) impossible in `rows` (int64, on the
    logits' device). `index_fill_` takes the value as a scalar argument: the obvious
    `logits[rows, 0, eos_id] = float("-inf")` turns it into a CPU tensor and copies that
    to the device synchronously, which made every overlapped decode step wait for the
    step in flight (every stream with min_frames left hit it)."""
    out = logits.clone()
    out[:, 0, eos_id].index_fill_(0, rows, float("-inf"))
    return out


def sampling_batch(
    params: list[SamplingParams], frame_index: list[int], n_columns: int, device: torch.device
) -> SamplingBatch:
    """The host half of `sample_frames_device`: uniforms drawn exactly as
    `sample_frames` draws them, sent to `device` asynchronously."""
    if len(params) != len(frame_index):
        raise ValueError(f"{len(params)} sampling params but {len(frame_index)} frame indices")
    n = len(params)
    sampled = [i for i in range(n) if params[i].temperature != 0.0]
    suppress = [i for i in range(n) if frame_index[i] < params[i].min_frames]
    sb = SamplingBatch(n, sampled, suppress)
    packed = np.zeros((n, ROW_UNIFORMS + n_columns), dtype=np.float64)
    sb.packed = packed
    if any(p.has_depth for p in params):
        sb.depth = sampling_batch([p.for_depth_decoder() for p in params], frame_index, n_columns, device)
        assert sb.depth.packed is not None
        # the depth rows' temperature, top_k and uniforms (rows greedy here may draw there)
        packed[:, ROW_DEPTH_TEMPERATURE:ROW_UNIFORMS] = sb.depth.packed[:, ROW_TEMPERATURE:ROW_SUPPRESS]
        packed[:, ROW_UNIFORMS:] = sb.depth.packed[:, ROW_UNIFORMS:]
    if suppress:
        packed[suppress, ROW_SUPPRESS] = 1.0
        sb.suppress_index = to_device(np.array(suppress, dtype=np.int64), device)
    if sampled:
        sb.sampled_index = to_device(np.array(sampled, dtype=np.int64), device)
        temps = np.array([params[i].temperature for i in sampled], dtype=np.float64)
        u = draw_uniforms([params[i].seed for i in sampled], [frame_index[i] for i in sampled], n_columns)
        sb.temperature, sb.uniforms = to_device(temps, device), to_device(u, device)
        ks = [params[i].top_k for i in sampled]
        packed[sampled, ROW_TEMPERATURE] = temps
        packed[sampled, ROW_TOP_K] = [min(k, _TOP_K_MAX) for k in ks]
        packed[sampled, ROW_UNIFORMS:] = u
        for k in sorted(set(ks)):
            if k > 0:
                local = [r for r, kr in enumerate(ks) if kr == k]
                sb.top_k_groups.append((k, local))
                sb.group_index.append(to_device(np.array(local, dtype=np.int64), device))
    if sb.depth is None:
        packed[:, ROW_DEPTH_TEMPERATURE:ROW_UNIFORMS] = packed[:, ROW_TEMPERATURE:ROW_SUPPRESS]
    return sb


def sample_frames_device(logits: torch.Tensor, sb: SamplingBatch, eos_id: int) -> torch.Tensor:
    """logits [n, C, V] -> int32 frames [n, C] on the logits' device, with the frames
    `sample_frames` returns for the same params and frame indices. No host sync: every
    shape and row list is known on the host (`sampling_batch`).

    Greedy rows are the same argmax. Sampled rows run the same float64 operations in the
    same order (division, top-k threshold, exp, a cumulative sum, one comparison): a
    frame could differ only if a device's exp or cumsum rounded differently from numpy's
    AND the uniform fell within that rounding of a CDF boundary (odds far below 1e-12 a
    draw); tests/engine/test_sampling.py checks equality on CPU and on CUDA."""
    if logits.dim() != 3 or logits.shape[0] != sb.n_rows:
        raise ValueError(f"logits has shape {tuple(logits.shape)}, expected [{sb.n_rows}, C, V]")
    logits = logits.float()
    if sb.suppress_index is not None:
        logits = suppress_eos(logits, sb.suppress_index, eos_id)
    out = logits.argmax(dim=-1).to(torch.int32)
    if sb.sampled_index is None:
        return out
    assert sb.temperature is not None and sb.uniforms is not None
    scaled = logits.index_select(0, sb.sampled_index).to(torch.float64) / sb.temperature[:, None, None]
    vocab = scaled.shape[-1]
    for (k, _), local in zip(sb.top_k_groups, sb.group_index, strict=True):
        if k >= vocab:
            continue
        part = scaled.index_select(0, local)
        kth = torch.topk(part, k, dim=-1).values[..., k - 1 : k]  # the k-th largest, as np.partition
        scaled.index_copy_(0, local, torch.where(part < kth, float("-inf"), part))
    weights = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))
    cdf = torch.cumsum(weights, dim=-1)
    target = sb.uniforms[..., None] * cdf[..., -1:]
    idx = (cdf <= target).sum(dim=-1)
    last = vocab - 1 - torch.argmax(torch.flip(weights > 0, dims=[-1]).to(torch.uint8), dim=-1)
    out.index_copy_(0, sb.sampled_index, torch.minimum(idx, last).to(torch.int32))
    return out


def sample_frames_static(
    logits: torch.Tensor, rows: torch.Tensor, eos_id: int, first_column: int = 0, top_k_cap: int | None = None,
    depth: bool = False,
) -> torch.Tensor:
    """`sample_frames_device` in one static shape (capture-safe: no host sync, no shape or
    branch that depends on the params): logits [n, c, V] are frame columns
    first_column.. of rows `rows` (float64 [n, ROW_UNIFORMS + C], `SamplingBatch.packed`
    on the device) -> int32 [n, c], the same frames. EOS is suppressed in frame column 0
    only. The top-k threshold is the k-th largest value (ties counted), k clamped to
    `top_k_cap` (0: no filter; None: the whole vocabulary): every filtering row's k must
    be <= top_k_cap. `depth`: the rows' depth-decoder temperature and top_k (codebooks
    1.. of a depth decoder). On CUDA (and under Triton's interpreter) one kernel launch
    (kernels/sampling_fused.py), elsewhere `sample_frames_static_torch`: greedy frames
    equal, sampled ones too unless a cumulative sum rounds differently at the uniform's
    CDF boundary (as `sample_frames_device`'s)."""
    from pdunit.kernels import sampling_fused  # Triton is imported at the first call

    if not sampling_fused.available(logits.device):
        return sample_frames_static_torch(logits, rows, eos_id, first_column, top_k_cap, depth)
    return sampling_fused.sample_rows(
        logits, rows, eos_id, temperature_col=ROW_DEPTH_TEMPERATURE if depth else ROW_TEMPERATURE,
        top_k_col=ROW_DEPTH_TOP_K if depth else ROW_TOP_K, suppress_col=ROW_SUPPRESS if first_column == 0 else None,
        uniform_col=ROW_UNIFORMS + first_column, top_k_cap=top_k_cap)


def sample_frames_static_torch(
    logits: torch.Tensor, rows: torch.Tensor, eos_id: int, first_column: int = 0, top_k_cap: int | None = None,
    depth: bool = False,
) -> torch.Tensor:
    """`sample_frames_static` in torch operations (the CPU's form; the fused kernel's
    reference): every row runs both forms, greedy rows take the argmax; the top-k
    threshold is the k-th of `torch.topk(top_k_cap)`, the value `sample_frames_device`
    takes."""
    n, c, vocab = logits.shape
    logits = logits.float()
    if first_column == 0:
        logits = logits.clone()
        logits[:, 0, eos_id].masked_fill_(rows[:, ROW_SUPPRESS] > 0, float("-inf"))
    greedy = logits.argmax(dim=-1).to(torch.int32)
    temperature = rows[:, ROW_DEPTH_TEMPERATURE if depth else ROW_TEMPERATURE]
    sampled = temperature > 0
    scaled = logits.to(torch.float64) / temperature.masked_fill(~sampled, 1.0)[:, None, None]
    if top_k_cap != 0:
        cap = vocab if top_k_cap is None else min(top_k_cap, vocab)
        k = rows[:, ROW_DEPTH_TOP_K if depth else ROW_TOP_K].to(torch.int64)
        kth = torch.topk(scaled, cap, dim=-1).values.gather(-1, (k.clamp(1, cap) - 1)[:, None, None].expand(n, c, 1))
        filters = sampled & (k > 0) & (k < vocab)
        kth = kth.masked_fill(~filters[:, None, None], float("-inf"))  # below -inf: nothing
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    weights = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))
    cdf = torch.cumsum(weights, dim=-1)
    target = rows[:, ROW_UNIFORMS + first_column : ROW_UNIFORMS + first_column + c, None] * cdf[..., -1:]
    idx = (cdf <= target).sum(dim=-1)
    last = vocab - 1 - torch.argmax(torch.flip(weights > 0, dims=[-1]).to(torch.uint8), dim=-1)
    return torch.where(sampled[:, None], torch.minimum(idx, last).to(torch.int32), greedy)


def is_eos(frame: np.ndarray, eos_id: int) -> bool:
    """True iff the frame ends its stream (column 0 is the EOS id)."""
    return int(frame[0]) == eos_id
