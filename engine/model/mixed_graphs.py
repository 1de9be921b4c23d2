"""CUDA graphs for mixed steps (the monolith's decode rows plus prompt-chunk rows in one
forward): one captured `TTSModel.mixed_step` per (decode rows, prompt rows) bucket pair.

Owns the static device buffers the graphs read, their pinned host staging, the capture
and the replay. Must never allocate or free pool slots, sample, or change the model; the
pool tensor and the weights must stay where they were at capture.
`capture=False` stages and runs `mixed_step` eagerly on the same padded inputs: what a
graph would replay, checkable without a GPU (Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdunit.engine.model.transformer import TTSModel

if TYPE_CHECKING:
    from pdunit.kernels.prefill_attention import PrefillPlan

# Decode rows and prompt rows per bucket (`--mixed-graph-streams`, `--mixed-graph-rows`):
# prompt rows in the budget policy's blocks (16-row prefix-cache blocks, 1 to 32 of them).
DEFAULT_STREAM_BUCKETS = (8, 16, 32, 64, 128, 256, 512)
DEFAULT_ROW_BUCKETS = (16, 32, 64, 128, 256, 512)


def mixed_graphs_refusal(model: TTSModel) -> str | None:
    """Why mixed-step graphs cannot be captured for `model` (naming `--mixed-graphs`), or
    None: they record the GPU path's kernels."""
    if not model.gpu_path:
        return ("mixed-step CUDA graphs (--mixed-graphs) need the model's GPU path: a CUDA model in bfloat16 or "
                f"float16 with attention_backend 'triton' (got device {model.device}, dtype {model.dtype}, backend "
                f"{model.attention_backend!r}): drop --mixed-graphs")
    return None


# A mixed step of n decode rows and R prompt rows in k chunks runs in the smallest pair
# (B >= n, P >= R) whose GEMM precision is the forward's own. Layout: rows [0, B) decode
# rows (rows n.. padding: token 0, write slot -1, length 1, its output dropped), rows
# [B, B + P) the chunks' rows in order (rows B + R.. padding, write slot -1, in no
# sequence); chunk sequences k.. of `max_seqs` have q_len 0. Decode splits are fixed per
# B (`choose_splits` over `max_context`, as the decode graphs), the prefill grid per P.
# Outside the pairs (no decode row or no chunk, more rows, more chunks than `max_seqs`,
# a context past `max_context`, another GEMM precision) `run` returns None, counted in
# `stats["eager"]`: the caller runs the forward eagerly.
class MixedGraphRunner:
    """`run(...) -> output of the decode rows then the chunks` or None (eager)."""

    def __init__(
        self,
        model: TTSModel,
        kv: torch.Tensor,
        stream_buckets: Sequence[int] = DEFAULT_STREAM_BUCKETS,
        row_buckets: Sequence[int] = DEFAULT_ROW_BUCKETS,
        max_seqs: int = 4,
        max_context: int | None = None,
        capture: bool = True,
    ) -> None:
        from pdunit.kernels.paged_attention import HALF_DTYPES, INTERPRET, choose_splits

        refusal = mixed_graphs_refusal(model)
        if refusal is not None and not (INTERPRET and not capture and model.dtype in HALF_DTYPES):
            raise ValueError(refusal)
        if kv.device != model.device:
            raise ValueError(f"kv is on {kv.device}, the model on {model.device}: put both on one device")
        streams = sorted({int(b) for b in stream_buckets})
        rows = sorted({int(b) for b in row_buckets})
        if not streams or not rows or streams[0] < 1 or rows[0] < 1 or max_seqs < 1:
            raise ValueError(f"buckets must be positive counts and max_seqs >= 1, got {list(stream_buckets)}, "
                             f"{list(row_buckets)}, {max_seqs}")
        self.model, self.kv, self.streams, self.rows, self.max_seqs = model, kv, streams, rows, max_seqs
        self.max_context = int(max_context or model.config.max_positions)
        self.stats = {"replays": 0, "eager": 0}
        self.mode = (model.prefill_gemm, model.fp8_min_rows)
        dev, c = model.device, model.config
        self._splits = {b: choose_splits(b, c.n_kv_heads, model.sm_count(), self.max_context) for b in streams}
        big_b, big_p, s, w = streams[-1], rows[-1], max_seqs, self.max_context
        big = big_b + big_p
        self._layout = (big, c.n_codebooks, big_b + s)
        # int64: tokens [big, C] | positions [big] | write_slots [big] | last [big_b + S]
        n_ints = big * c.n_codebooks + 2 * big + big_b + s
        self._ints = torch.zeros(n_ints, dtype=torch.int64, device=dev)
        # int32: decode lengths [big_b] | ctx_len [S] | q_len [S] | q_start [S]
        self._i32 = torch.ones(big_b + 3 * s, dtype=torch.int32, device=dev)
        self._dec_table = torch.zeros((big_b, w), dtype=torch.int32, device=dev)
        self._table = torch.zeros((s, w), dtype=torch.int32, device=dev)
        self._table_stage = torch.empty((big_b + s) * w, dtype=torch.int32, device=dev)
        pin = dev.type == "cuda"
        self._h_ints = torch.zeros(n_ints, dtype=torch.int64, pin_memory=pin)
        self._h_i32 = torch.ones(big_b + 3 * s, dtype=torch.int32, pin_memory=pin)
        self._h_table = torch.zeros((big_b + s) * w, dtype=torch.int32, pin_memory=pin)
        self._staged = torch.cuda.Event() if pin else None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._out: dict[tuple[int, int], torch.Tensor] = {}
        model.fused_weights()  # fuse before capture: a graph must not record the fusion
        if capture:
            self._capture()

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """Every (decode rows, prompt rows) bucket pair."""
        return [(b, p) for b in self.streams for p in self.rows]

    def _fp8_of(self, rows: int, max_q: int) -> bool:
        """`TTSModel._fp8_forward` for a forward of `rows` rows whose longest sequence has `max_q`."""
        m = self.model
        if max_q == 1:
            return m.decode_gemm == "fp8"
        return m.prefill_gemm == "fp8" and rows >= m.fp8_min_rows

    def _args(self, b: int, p: int) -> tuple:
        big, c, n_last = self._layout
        ints, i32, s, t = self._ints, self._i32, self.max_seqs, b + p
        big_b = self.streams[-1]
        plan: PrefillPlan = {"table": self._table, "ctx_len": i32[big_b : big_b + s],
                             "q_len": i32[big_b + s : big_b + 2 * s], "q_start": i32[big_b + 2 * s :], "max_q_len": p}
        return (ints[: t * c].view(t, c), ints[big * c : big * c + t], ints[big * c + big : big * c + big + t],
                self._dec_table[:b], i32[:b], self._splits[b], plan,
                ints[big * c + 2 * big : big * c + 2 * big + b + s], self.kv, self._fp8_of(t, p))

    def _capture(self) -> None:
        dev = self.model.device
        assert self._staged is not None
        self._staged.record()
        big, c, _ = self._layout
        self._ints[big * c + big : big * c + 2 * big].fill_(-1)  # the warm-up runs below write nothing
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for pair in sorted(self.pairs, key=lambda x: x[0] + x[1], reverse=True):  # largest first
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    self.model.mixed_step(*self._args(*pair))  # compiles kernels, picks GEMMs
                torch.cuda.current_stream(dev).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._out[pair] = self.model.mixed_step(*self._args(*pair))
                self._graphs[pair] = graph
        torch.cuda.synchronize(dev)

    def bucket_for(self, n_dec: int, chunk_lens: Sequence[int], longest: int) -> tuple[int, int] | None:
        """The pair that replays a step of `n_dec` decode rows and chunks of `chunk_lens`
        rows (contexts up to `longest`) as the eager forward computes it, or None."""
        if not n_dec or not chunk_lens or len(chunk_lens) > self.max_seqs or longest > self.max_context:
            return None
        if (self.model.prefill_gemm, self.model.fp8_min_rows) != self.mode:
            return None
        rows = sum(chunk_lens)
        b = next((x for x in self.streams if x >= n_dec), None)
        if b is None:
            return None
        fp8 = self._fp8_of(n_dec + rows, max(chunk_lens))
        p = next((x for x in self.rows if x >= rows and self._fp8_of(b + x, x) == fp8), None)
        return None if p is None else (b, p)

    def run(
        self,
        dec_tokens: torch.Tensor | np.ndarray,
        positions: np.ndarray,
        write_slots: np.ndarray,
        context: Sequence[np.ndarray],
        chunks: Sequence,
        started: torch.cuda.Event | None = None,
    ) -> torch.Tensor | None:
        """The forward's output rows (a fresh tensor, what `model.forward` returns): the
        `len(positions)` decode rows, then one row per chunk (its last row), or None when
        no pair covers the step (counted in `stats["eager"]`). Decode rows: tokens [n, C]
        int64 on the device (the previous step's frames) or the host; their positions,
        write slots and contexts on the host. `chunks`: SeqEntry-like prompt chunks
        (tokens, positions, write_slots, context_slots; host arrays). `started`, if
        given, is recorded right before the replay."""
        from pdunit.kernels.paged_attention import build_slot_table

        n, k = len(positions), len(chunks)
        q = [len(e.tokens) for e in chunks]
        ctx = list(context) + [e.context_slots for e in chunks]
        longest = max((len(x) for x in ctx), default=0)
        pair = self.bucket_for(n, q, longest)
        if pair is None:
            self.stats["eager"] += 1
            return None
        b, p = pair
        big, c, _ = self._layout
        big_b, s = self.streams[-1], self.max_seqs
        rows = sum(q)
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copies have read the staging
        table, lengths = build_slot_table(ctx, out=self._h_table.numpy(), align=1)
        tab, lens = table.numpy(), lengths.numpy()
        self._validate(positions, write_slots, chunks, tab, lens, n)
        ints = self._h_ints.numpy()
        tokens = ints[: big * c].reshape(big, c)
        tokens[:n] = dec_tokens if isinstance(dec_tokens, np.ndarray) else 0
        tokens[n:b] = 0
        tokens[b : b + rows] = np.concatenate([e.tokens for e in chunks])
        tokens[b + rows : b + p] = 0
        pos = ints[big * c : big * c + big]
        pos[:n], pos[n:b], pos[b : b + rows], pos[b + rows : b + p] = positions, 0, np.concatenate(
            [e.positions for e in chunks]), 0
        ws = ints[big * c + big : big * c + 2 * big]
        ws[:n], ws[n:b], ws[b : b + rows], ws[b + rows : b + p] = write_slots, -1, np.concatenate(
            [e.write_slots for e in chunks]), -1
        starts = b + np.concatenate([[0], np.cumsum(q)[:-1]]).astype(np.int64)
        last = ints[big * c + 2 * big :]
        last[:b] = np.arange(b)
        last[b : b + k], last[b + k : b + s] = starts + np.asarray(q) - 1, 0
        i32 = self._h_i32.numpy()
        i32[:n], i32[n:b] = lens[:n], 1
        seq = i32[big_b:]
        seq[:k], seq[k:s] = lens[n:], 0                       # ctx_len
        seq[s : s + k], seq[s + k : 2 * s] = q, 0              # q_len: padding chunks compute nothing
        seq[2 * s : 2 * s + k], seq[2 * s + k :] = starts, 0   # q_start
        width = int(table.shape[1])
        with torch.inference_mode():
            self._ints.copy_(self._h_ints, non_blocking=True)
            self._i32.copy_(self._h_i32, non_blocking=True)
            stage = self._table_stage[: (n + k) * width]
            stage.copy_(self._h_table[: (n + k) * width], non_blocking=True)
            if self._staged is not None:
                self._staged.record()
            staged = stage.view(n + k, width)
            self._dec_table[:n, :width].copy_(staged[:n])
            self._table[:k, :width].copy_(staged[n:])
            if isinstance(dec_tokens, torch.Tensor):
                self._ints[: n * c].view(n, c).copy_(dec_tokens)
            if started is not None:
                started.record()
            if pair in self._graphs:
                self._graphs[pair].replay()
                out = self._out[pair]
            else:  # capture=False: what the graph would replay
                out = self.model.mixed_step(*self._args(b, p))
        self.stats["replays"] += 1
        return torch.cat([out[:n], out[b : b + k]])

    def _validate(self, positions: np.ndarray, write_slots: np.ndarray, chunks: Sequence, table: np.ndarray,
                  lengths: np.ndarray, n: int) -> None:
        """What `TTSModel._check` checks, in numpy over the staged table: a bad slot would
        make the replay read or write outside the pool."""
        problems = []
        c = self.model.config.n_codebooks
        if positions.shape != (n,) or write_slots.shape != (n,):
            problems.append(f"decode positions/write_slots have shapes {positions.shape}/{write_slots.shape}, "
                            f"expected [{n}]")
        elif not np.array_equal(positions, lengths[:n] - 1):
            problems.append("decode positions must be each sequence's last context entry (context length - 1)")
        elif not np.array_equal(write_slots, table[np.arange(n), lengths[:n] - 1]):
            problems.append("decode write_slots must equal each sequence's last context slot")
        for i, e in enumerate(chunks):
            m, ctx = len(e.tokens), len(e.context_slots)
            if e.tokens.shape != (m, c) or m < 1 or m > ctx:
                problems.append(f"chunk {i}: tokens {e.tokens.shape} over {ctx} context slots")
            elif not (np.array_equal(e.positions, np.arange(ctx - m, ctx))
                      and np.array_equal(e.write_slots, e.context_slots[ctx - m :])):
                problems.append(f"chunk {i}: positions and write slots must be its context's last {m} entries")
        if int(table.min()) < 0 or int(table.max()) >= self.kv.shape[2]:
            problems.append(f"a context slot is outside the pool [0, {self.kv.shape[2]})")
        if problems:
            raise ValueError("invalid mixed step: " + "; ".join(problems))
