"""The forward of one decode step, for D and the monolith: CUDA graph replay per batch
bucket when the model takes its GPU path (engine/model/cuda_graphs.py), else the eager
forward (CPU, or a GPU model on the reference path). Same logits either way; the choice
is counted in `pdunit_decode_graph_steps_total{path}`.

Owns the graph runner's life: captured once at start against D's pool storage, which
must never be reallocated afterwards (the graphs hold its address).
"""

from __future__ import annotations

import logging

import torch
from prometheus_client import Counter

from pdunit.engine.batching import SeqEntry, make_batch
from pdunit.engine.model.transformer import TTSModel
from pdunit.engine.prefill.runner import run_forward

log = logging.getLogger("pdunit.decode.graphs")

GRAPH_STEPS = Counter("pdunit_decode_graph_steps_total", "Decode-step forwards by path", ["path"])


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
