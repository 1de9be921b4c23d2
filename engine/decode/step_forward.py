"""The forward of one decode step, for D and the monolith: CUDA graph replay per batch
bucket when the model takes its GPU path (engine/model/cuda_graphs.py), else the eager
forward (CPU, or a GPU model on the reference path). Same logits either way; the choice
is counted in `pdunit_decode_graph_steps_total{path}`.

Owns the graph runner's life: captured once at start against D's pool storage, which
must never be reallocated afterwards (the graphs hold its address).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from prometheus_client import Counter

from pdunit.engine.batching import SeqEntry, make_batch
from pdunit.engine.metrics import role_metric
from pdunit.engine.model.sampling import to_device
from pdunit.engine.model.transformer import ForwardBatch, TTSModel
from pdunit.engine.prefill.runner import run_forward

log = logging.getLogger("pdunit.decode.graphs")

GRAPH_STEPS = role_metric(Counter("pdunit_decode_graph_steps_total", "Decode-step forwards by path", ["path"],
                                  registry=None), "decode", "monolith")


def resolve_decode_graphs(flag: bool | None, model: TTSModel) -> bool:
    """`--cuda-graphs` of D and the monolith: default (None) on where the model takes its
    GPU path (any family), silently off elsewhere (CPU, float32/64); asked for
    (True) where they cannot be captured, a ValueError naming the flag and the reason
    (engine/model/cuda_graphs.py `decode_graphs_refusal`), as `--prefill-graphs` is."""
    if flag is None:
        return model.gpu_path
    if flag:
        from pdunit.engine.model.cuda_graphs import decode_graphs_refusal

        refusal = decode_graphs_refusal(model)
        if refusal is not None:
            raise ValueError(refusal)
    return flag


class StepForward:
    def __init__(self, model: TTSModel, storage: torch.Tensor, use_graphs: bool, max_batch: int) -> None:
        self.model = model
        self.storage = storage
        self.graphs = None
        if use_graphs and model.gpu_path:
            from pdunit.engine.model.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphRunner

            buckets = sorted({b for b in DEFAULT_BUCKETS if b < max_batch} | {max_batch})
            self.graphs = DecodeGraphRunner(model, storage, buckets=buckets)
            log.info("captured decode CUDA graphs", extra={"buckets": buckets})
        self._seen = {"replays": 0, "eager": 0}

    def __call__(self, entries: list[SeqEntry]) -> torch.Tensor:
        if self.graphs is None:
            GRAPH_STEPS.labels(path="eager").inc()
            return run_forward(self.model, self.storage, entries)
        logits = self.graphs.run(make_batch(entries))
        for key, path in (("replays", "graph"), ("eager", "eager")):
            delta = self.graphs.stats[key] - self._seen[key]
            if delta:
                GRAPH_STEPS.labels(path=path).inc(delta)
                self._seen[key] = self.graphs.stats[key]
        return logits

    # The overlap scheduler's form (engine/decode/overlap.py): the decode rows' tokens are
    # already on the model's device (the previous step's sampled frames), so the step is
    # queued without a host sync and its logits stay on the device.
    def launch(
        self,
        tokens: torch.Tensor,
        positions: np.ndarray,
        write_slots: np.ndarray,
        context_slots: list[np.ndarray],
        started: torch.cuda.Event | None = None,
    ) -> torch.Tensor:
        """Queues one decode step whose tokens [n, C] int64 live on the model's device;
        returns its logits [n, C, V_max] on the device. The host never waits for the
        device here (on CUDA); everything but the tokens comes from the host. `started`,
        if given, is recorded right before the forward is queued (after host staging)."""
        if self.graphs is not None:
            logits = self.graphs.run_device_tokens(tokens, positions, write_slots, context_slots, started)
            if logits is not None:
                GRAPH_STEPS.labels(path="graph").inc()
                self._seen["replays"] = self.graphs.stats["replays"]
                return logits
        GRAPH_STEPS.labels(path="eager").inc()
        dev = tokens.device
        batch = ForwardBatch(
            tokens=tokens,
            positions=to_device(positions.astype(np.int64), dev),
            write_slots=to_device(write_slots.astype(np.int64), dev),
            query_lens=[1] * len(positions),
            # on the host: the GPU path builds its slot table there (a device copy would
            # be read back), the reference path moves it itself
            context_slots=[torch.from_numpy(c.astype(np.int64)) for c in context_slots],
        )
        if started is not None:
            started.record()
        with torch.inference_mode():
            return self.model.forward(batch, self.storage)

