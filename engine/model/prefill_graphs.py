"""CUDA graphs for small prefill forwards: one captured `TTSModel.prefill_step` per row
bucket. Small forwards are bound by their kernel launches from Python (docs/performance.md,
Kernel notes); a replay launches them all at once.

Owns the static device buffers the graphs read, the pinned host staging that fills them,
the capture and the replay. Must never allocate or free pool slots or change the model;
the pool tensor and the weights must stay where they were at capture.
`capture=False` stages and runs `prefill_step` eagerly on the same padded inputs: what
a graph would replay, checkable without a GPU (Triton's interpreter) and by the GPU
tests against the captured graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdunit.engine.model.transformer import ForwardBatch, TTSModel
from pdunit.engine.settings import PREFILL_GRAPH_ROWS as DEFAULT_ROW_BUCKETS

if TYPE_CHECKING:
    from pdunit.kernels.prefill_attention import PrefillPlan


# The buffers: tokens, positions and write slots of the largest bucket's rows; the slot
# table, lengths and row offsets of `max_seqs` sequences; each sequence's last row. A
# forward of T rows and n sequences runs in the smallest bucket >= T: rows T.. are
# padding (write slot -1: no K/V stored; they belong to no sequence and are never read),
# sequences n.. have q_len 0 (the attention kernel's programs for them exit at once). The
# attention grid is sized for the bucket, so one graph serves every split of its rows
# into prompts. Anything a graph does not cover (more rows than the largest bucket, more
# sequences than `max_seqs`, a context longer than `max_context`, a GEMM precision other
# than the one captured for the bucket) runs eagerly through `model.forward`, counted in
# `stats["eager"]`.
class PrefillGraphRunner:
    """`run(batch) -> logits` with the semantics of `model.forward(batch, kv)`."""

    def __init__(
        self,
        model: TTSModel,
        kv: torch.Tensor,
        buckets: Sequence[int] = DEFAULT_ROW_BUCKETS,
        max_seqs: int = 16,
        max_context: int | None = None,
        capture: bool = True,
    ) -> None:
        from pdunit.kernels.paged_attention import HALF_DTYPES, INTERPRET

        if model.dtype not in HALF_DTYPES or not (model.device.type == "cuda" or (INTERPRET and not capture)):
            raise ValueError(
                "PrefillGraphRunner needs the model's GPU path: a CUDA model in bfloat16 or float16 "
                f"(got device {model.device}, dtype {model.dtype})"
            )
        if kv.device != model.device:
            raise ValueError(f"kv is on {kv.device}, the model on {model.device}: put both on one device")
        sizes = sorted({int(b) for b in buckets})
        if not sizes or sizes[0] < 1 or max_seqs < 1:
            raise ValueError(f"buckets must be positive row counts and max_seqs >= 1, got {list(buckets)}, {max_seqs}")
        self.model, self.kv, self.sizes, self.max_seqs = model, kv, sizes, max_seqs
        self.max_context = int(max_context or model.config.max_positions)
        self.stats = {"replays": 0, "eager": 0}
        # The GEMM precision each bucket was captured in: the one model.forward picks for
        # a forward of that many rows. A forward of T rows replays bucket b only when
        # its own precision is b's.
        self.mode = (model.prefill_gemm, model.fp8_min_rows)
        self._fp8 = {b: model.prefill_gemm == "fp8" and b >= model.fp8_min_rows for b in sizes}
        dev, c = model.device, model.config.n_codebooks
        big, s, w = sizes[-1], max_seqs, self.max_context
        # int64: tokens [big, C] | positions [big] | write_slots [big] | last [S]
        self._ints = torch.zeros(big * c + 2 * big + s, dtype=torch.int64, device=dev)
        self._tokens = self._ints[: big * c].view(big, c)
        self._positions = self._ints[big * c : big * c + big]
        self._write_slots = self._ints[big * c + big : big * c + 2 * big]
        self._last = self._ints[big * c + 2 * big :]
        # int32: ctx_len [S] | q_len [S] | q_start [S]; the table [S, W] apart
        self._seq = torch.zeros(3 * s, dtype=torch.int32, device=dev)
        self._ctx_len, self._q_len, self._q_start = self._seq[:s], self._seq[s : 2 * s], self._seq[2 * s :]
        self._table = torch.zeros((s, w), dtype=torch.int32, device=dev)
        self._table_stage = torch.empty(s * w, dtype=torch.int32, device=dev)
        pin = model.device.type == "cuda"
        self._h_ints = torch.zeros(self._ints.numel(), dtype=torch.int64, pin_memory=pin)
        self._h_seq = torch.zeros(3 * s, dtype=torch.int32, pin_memory=pin)
        self._h_table = torch.zeros(s * w, dtype=torch.int32, pin_memory=pin)
        self._staged = torch.cuda.Event() if pin else None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        model.fused_weights()  # fuse before capture: a graph must not record the fusion
        if capture:
            self._capture()

    def _args(self, size: int) -> tuple:
        plan: PrefillPlan = {"table": self._table, "ctx_len": self._ctx_len, "q_len": self._q_len,
                             "q_start": self._q_start, "max_q_len": size}
        return (self._tokens[:size], self._positions[:size], self._write_slots[:size], plan, self._last, self.kv,
                self._fp8[size])

    def _capture(self) -> None:
        dev = self.model.device
        assert self._staged is not None
        self._staged.record()
        self._write_slots.fill_(-1)  # the warm-up runs below write nothing
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: the others reuse its memory
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    self.model.prefill_step(*self._args(size))  # compiles kernels, picks GEMMs
                torch.cuda.current_stream(dev).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._logits[size] = self.model.prefill_step(*self._args(size))
                self._graphs[size] = graph
        torch.cuda.synchronize(dev)

    def bucket_for(self, batch: ForwardBatch) -> int | None:
        """The bucket that replays `batch` exactly as `model.forward` computes it, or None."""
        q = batch.query_lens
        rows = sum(q)
        if len(q) > self.max_seqs or (self.model.prefill_gemm, self.model.fp8_min_rows) != self.mode:
            return None
        if max(int(x.numel()) for x in batch.context_slots) > self.max_context:
            return None
        fp8 = self.model.prefill_gemm == "fp8" and max(q) > 1 and rows >= self.model.fp8_min_rows
        return next((b for b in self.sizes if b >= rows and self._fp8[b] == fp8), None)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """`model.forward`'s output (a fresh tensor: logits [n_seqs, C, V_max] float32, or
        a frame generator's hidden states [n_seqs, hidden]) of `batch`: a replay when a
        bucket covers it, else `model.forward`. Batch tensors live on the CPU."""
        size = self.bucket_for(batch)
        if size is None:
            self.stats["eager"] += 1
            with torch.inference_mode():
                return self.model.forward(batch, self.kv)
        self.model._check(batch, self.kv)  # a bad slot would read or write outside the pool
        n = len(batch.query_lens)
        self._stage(size, batch)
        with torch.inference_mode():
            if size in self._graphs:
                self._graphs[size].replay()
                logits = self._logits[size]
            else:  # capture=False: what the graph would replay
                logits = self.model.prefill_step(*self._args(size))
        self.stats["replays"] += 1
        return logits[:n].clone()

    def _stage(self, size: int, batch: ForwardBatch) -> None:
        """Fills the static inputs for `batch` padded to `size` rows and `max_seqs`
        sequences: one host-to-device copy per buffer, from pinned memory."""
        from pdunit.kernels.paged_attention import build_slot_table

        c, big, s = self.model.config.n_codebooks, self.sizes[-1], self.max_seqs
        q = np.asarray(batch.query_lens, dtype=np.int64)
        n, rows = len(q), int(q.sum())
        if self._staged is not None:
            self._staged.synchronize()  # the previous forward's copies have read the staging
        table, lengths = build_slot_table(batch.context_slots, out=self._h_table.numpy(), align=1)
        width = int(table.shape[1])
        ints = self._h_ints.numpy()
        tokens = ints[: big * c].reshape(big, c)
        tokens[:rows] = batch.tokens.numpy()
        tokens[rows:size] = 0
        positions, write_slots = ints[big * c : big * c + big], ints[big * c + big : big * c + 2 * big]
        positions[:rows], positions[rows:size] = batch.positions.numpy(), 0
        write_slots[:rows], write_slots[rows:size] = batch.write_slots.numpy(), -1
        starts = np.concatenate([[0], np.cumsum(q)[:-1]])
        last = ints[big * c + 2 * big :]
        last[:n], last[n:] = starts + q - 1, 0
        seq = self._h_seq.numpy()
        seq[:n], seq[n:s] = lengths.numpy(), 0                     # ctx_len
        seq[s : s + n], seq[s + n : 2 * s] = q, 0                   # q_len: padding sequences compute nothing
        seq[2 * s : 2 * s + n], seq[2 * s + n :] = starts, 0        # q_start
        with torch.inference_mode():
            self._ints.copy_(self._h_ints, non_blocking=True)
            self._seq.copy_(self._h_seq, non_blocking=True)
            stage = self._table_stage[: n * width]
            stage.copy_(self._h_table[: n * width], non_blocking=True)
            if self._staged is not None:
                self._staged.record()
            self._table[:n, :width].copy_(stage.view(n, width))
