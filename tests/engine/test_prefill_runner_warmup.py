"""P's and the monolith's warm-up before serving (engine/prefill/runner.py: warm_up)."""

from __future__ import annotations

import torch

from pdunit.engine import metrics as m
from pdunit.engine.model.loader import load_model
from pdunit.engine.prefill.runner import warm_up
from tests.kernels.paging import gpu


def _forwards() -> float:
    return sum(m.P_PREFILL_FORWARDS.labels(path=p)._value.get() for p in ("graph", "eager"))


def test_warm_up_prefills_into_the_first_slots_only():
    model = load_model("random:tiny:0")
    storage = model.new_kv_storage(64)
    before = _forwards()
    assert warm_up(model, storage, 20, largest=8192) > 0
    assert storage[:, :, :20].abs().sum() > 0  # the forwards wrote their K/V there
    assert storage[:, :, 20:].abs().sum() == 0  # and nowhere else
    assert _forwards() == before  # the forwards metric counts served forwards only


def test_warm_up_is_off_by_default_on_the_cpu_and_bounded_by_the_storage():
    model = load_model("random:tiny:0")
    storage = model.new_kv_storage(8)
    assert warm_up(model, storage, None, largest=8192) == 0.0
    assert storage.abs().sum() == 0
    warm_up(model, storage, 10_000, largest=8192)  # more rows than slots: clipped to the storage
    assert torch.isfinite(storage).all() and storage.abs().sum() > 0


@gpu
def test_warm_up_on_cuda_defaults_to_the_engines_largest_forward():
    model = load_model("random:tiny:0", device="cuda")
    storage = model.new_kv_storage(256, device="cuda")
    assert warm_up(model, storage, None, largest=100) > 0
    assert storage[:, :, :100].abs().sum() > 0 and storage[:, :, 100:].abs().sum() == 0
