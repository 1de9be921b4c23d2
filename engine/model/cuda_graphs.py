"""CUDA graphs for the decode step: one captured `TTSModel.decode_step` per batch bucket.

Owns the static device buffers each graph reads (tokens, positions, write slots, the
slot table and lengths), the pinned host staging that fills them, the capture, and the
replay; a capture-safe frame generator's graphs (engine/model/frame_graphs.py) for the
same buckets are captured with them, attached as `model.frame_graphs`. Must never
allocate or free pool slots or sample (frames come after the replay); the pool tensor
and the weights must stay where they were at capture (a graph holds their addresses):
build a new runner after reallocating either, or after changing `decode_gemm`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pdunit.engine.model.transformer import ForwardBatch, TTSModel

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class _Graph:
    """One bucket: its graph, its static inputs, and its output."""

    def __init__(self, size: int, n_codebooks: int, device: torch.device) -> None:
        self.size = size
        c = n_codebooks
        # tokens [size, C] | positions [size] | write_slots [size]: one int64 buffer,
        # filled by one host-to-device copy per step.
        self.ints = torch.zeros(size * c + 2 * size, dtype=torch.int64, device=device)
        self.tokens = self.ints[: size * c].view(size, c)
        self.positions = self.ints[size * c : size * c + size]
        self.write_slots = self.ints[size * c + size :]
        self.write_slots.fill_(-1)
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None


def decode_graphs_refusal(model: TTSModel) -> str | None:
    """Why decode CUDA graphs cannot be captured for `model` (naming `--cuda-graphs`, the
    engines' flag), None when they can: its device and dtype (every family's backbone
    takes the GPU path; a frame generator runs after the replay, in its own graph when
    it has a capture-safe form)."""
    if not model.gpu_path:
        return ("decode CUDA graphs (--cuda-graphs) need the model's GPU path: a CUDA model in bfloat16 or float16 "
                f"with attention_backend 'triton' (got device {model.device}, dtype {model.dtype}, backend "
                f"{model.attention_backend!r}): drop --cuda-graphs")
    return None


# A batch of n decodes runs in the smallest bucket >= n: rows n.. are padding (write
# slot -1, so their K/V is never stored; length 1; their logits are dropped). Contexts
# grow without recapture: the table is `max_context` wide and the attention kernel's grid
# depends only on the bucket (kernels/paged_attention.py). Anything a graph does not
# cover (a prefill row in the batch, more sequences than the largest bucket, a context
# longer than `max_context`) runs eagerly through `model.forward`, counted in
# `stats["eager"]` so a caller can export it.
class DecodeGraphRunner:
    """`run(batch) -> logits` with the semantics of `model.forward(batch, kv)`."""

    def __init__(
        self,
        model: TTSModel,
        kv: torch.Tensor,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        max_context: int | None = None,
        frame_graphs: bool = True,
    ) -> None:
        from pdunit.engine.model.frame_graphs import FrameGraphRunner, frame_graphs_supported
        from pdunit.kernels.paged_attention import choose_splits

        refusal = decode_graphs_refusal(model)
        if refusal is not None:
            raise ValueError(refusal)
        if kv.device != model.device:
            raise ValueError(f"kv is on {kv.device}, the model on {model.device}: put both on one GPU")
        sizes = sorted({int(b) for b in buckets})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {list(buckets)}")
        self.model, self.kv = model, kv
        self.max_context = int(max_context or model.config.max_positions)
        if self.max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {self.max_context}")
        self.sizes = sizes
        self.stats = {"replays": 0, "eager": 0}
        self.decode_gemm = model.decode_gemm  # the GEMMs the graphs record
        dev = model.device
        c = model.config
        big = sizes[-1]
        w = self.max_context
        # Shared by every bucket: bucket b reads rows [:b].
        self._table = torch.zeros((big, w), dtype=torch.int32, device=dev)
        self._lengths = torch.ones(big, dtype=torch.int32, device=dev)
        self._table_stage = torch.empty(big * w, dtype=torch.int32, device=dev)
        # Pinned staging: host writes, one async copy each. `_staged` orders the next
        # step's host writes after this step's copies have read the buffers.
        self._h_ints = torch.zeros(big * c.n_codebooks + 2 * big, dtype=torch.int64, pin_memory=True)
        self._h_lengths = torch.ones(big, dtype=torch.int32, pin_memory=True)
        self._h_table = torch.zeros(big * w, dtype=torch.int32, pin_memory=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        self._graphs: dict[int, _Graph] = {}
        model.fused_weights()  # fuse before capture: a graph must not record the fusion
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(sizes):  # largest first: the others reuse its memory
                g = _Graph(size, c.n_codebooks, dev)
                splits = choose_splits(size, c.n_kv_heads, model.sm_count(), w)
                args = (g.tokens, g.positions, g.write_slots, self._table[:size], self._lengths[:size], kv, splits)
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    model.decode_step(*args)  # compiles kernels, creates cuBLAS handles
                torch.cuda.current_stream(dev).wait_stream(side)
                with torch.cuda.graph(g.graph, pool=pool):
                    g.logits = model.decode_step(*args)
                self._graphs[size] = g
        torch.cuda.synchronize(dev)
        # The frame generator's steps after each replay (csm's depth decoder and its
        # sampling: K-1 dependent steps), as a second graph per bucket; `frame_graphs`
        # False leaves them eager.
        model.frame_graphs = FrameGraphRunner(model, sizes) if frame_graphs and frame_graphs_supported(model) else None

    def replay_staged(self, size: int) -> None:
        """Replays bucket `size` on the inputs the last step staged (benchmarks time the
        forward alone this way; it rewrites that step's K/V rows with the same values)."""
        self._graphs[size].graph.replay()

    def staged_table(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device slot table [n, max_context] and lengths [n] the last step staged."""
        return self._table[:n], self._lengths[:n]

    def bucket_for(self, n: int) -> int | None:
        """The smallest captured batch size >= n, or None when n is too large."""
        for size in self.sizes:
            if size >= n:
                return size
        return None

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """`model.forward`'s output (a fresh tensor: logits [n_seqs, C, V_max] float32, or
        a frame generator's hidden states [n_seqs, hidden]) of `batch`, replaying a
        graph when every sequence has one new token and it fits a bucket and
        max_context, else `model.forward`. Batch tensors may live on the CPU."""
        n = len(batch.query_lens)
        size = self.bucket_for(n)
        longest = max((int(x.numel()) for x in batch.context_slots), default=0)
        if size is None or longest > self.max_context or any(q != 1 for q in batch.query_lens):
            self.stats["eager"] += 1
            with torch.inference_mode():
                return self.model.forward(batch, self.kv)
        return self._replay(size, batch.positions.cpu().numpy(), batch.write_slots.cpu().numpy(),
                            batch.context_slots, host_tokens=batch.tokens.cpu().numpy())

    def run_device_tokens(
        self,
        tokens: torch.Tensor,
        positions: np.ndarray,
        write_slots: np.ndarray,
        context_slots: Sequence[np.ndarray],
        started: torch.cuda.Event | None = None,
    ) -> torch.Tensor | None:
        """`run` for a decode batch whose tokens [n, C] int64 are already on the device
        (D's overlap scheduler: the previous step's sampled frames). They go into the
        graph's input by a device-to-device copy queued before the replay: no host sync.
        `started`, if given, is recorded right before the replay. None when the batch
        fits no graph (counted as eager; the caller runs it eagerly)."""
        n = len(positions)
        size = self.bucket_for(n)
        longest = max((len(c) for c in context_slots), default=0)
        if size is None or longest > self.max_context:
            self.stats["eager"] += 1
            return None
        return self._replay(size, positions, write_slots, context_slots, device_tokens=tokens, started=started)

    def _replay(
        self,
        size: int,
        positions: np.ndarray,
        write_slots: np.ndarray,
        context_slots: Sequence[torch.Tensor | np.ndarray],
        host_tokens: np.ndarray | None = None,
        device_tokens: torch.Tensor | None = None,
        started: torch.cuda.Event | None = None,
    ) -> torch.Tensor:
        """Stages one decode step into bucket `size`'s static inputs and replays it. The
        tokens come from the host (`host_tokens`) or the device (`device_tokens`)."""
        from pdunit.kernels.paged_attention import build_slot_table

        n = len(positions)
        g = self._graphs[size]
        c = self.model.config.n_codebooks
        self._staged.synchronize()  # the previous step's staging copies have read the buffers
        table, lengths = build_slot_table(context_slots, out=self._h_table.numpy(), align=1)
        tokens = host_tokens if host_tokens is not None else np.zeros((n, c), np.int64)
        self._validate(tokens, positions, write_slots, table.numpy(), lengths.numpy())
        # Host staging: the real rows, then the padding rows' harmless values (device
        # tokens overwrite rows [:n] on the device below).
        ints = self._h_ints.numpy()
        ints[: n * c] = tokens.reshape(-1)
        ints[n * c : size * c] = 0
        ints[size * c : size * c + n] = positions
        ints[size * c + n : size * c + size] = 0
        ints[size * c + size : size * c + size + n] = write_slots
        ints[size * c + size + n : size * c + 2 * size] = -1
        width = int(table.shape[1])
        h_len = self._h_lengths.numpy()
        h_len[:n] = lengths.numpy()
        h_len[n:size] = 1
        with torch.inference_mode():
            g.ints.copy_(self._h_ints[: size * c + 2 * size], non_blocking=True)
            self._lengths[:size].copy_(self._h_lengths[:size], non_blocking=True)
            stage = self._table_stage[: n * width]
            stage.copy_(self._h_table[: n * width], non_blocking=True)
            self._staged.record()
            self._table[:n, :width].copy_(stage.view(n, width))
            if device_tokens is not None:
                g.tokens[:n].copy_(device_tokens)
            if started is not None:
                started.record()
            g.graph.replay()
            self.stats["replays"] += 1
            assert g.logits is not None
            return g.logits[:n].clone()

    def _validate(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        write_slots: np.ndarray,
        table: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        """What `TTSModel._check` checks, for a decode batch, in O(batch) numpy work plus
        one pass over the table: a bad slot would make the replay read or write outside
        the pool."""
        n = table.shape[0]
        c = self.model.config.n_codebooks
        problems = []
        if tokens.shape != (n, c):
            problems.append(f"tokens has shape {tokens.shape}, expected [{n}, {c}]")
        if positions.shape != (n,) or write_slots.shape != (n,):
            problems.append(
                f"positions/write_slots have shapes {positions.shape}/{write_slots.shape}, expected [{n}]"
            )
        elif not np.array_equal(positions, lengths - 1):
            problems.append("positions must be each sequence's last context entry (context length - 1)")
        elif not np.array_equal(write_slots, table[np.arange(n), lengths - 1]):
            problems.append("write_slots must equal each sequence's last context slot")
        if int(table.max()) >= self.kv.shape[2]:
            problems.append(f"a context slot is outside the pool [0, {self.kv.shape[2]})")
        if self.model.decode_gemm != self.decode_gemm:
            problems.append(f"the model's decode_gemm is {self.model.decode_gemm!r}, the graphs recorded "
                            f"{self.decode_gemm!r} GEMMs: build a new runner after set_decode_gemm")
        if problems:
            raise ValueError("invalid forward batch: " + "; ".join(problems))
