"""CUDA-event timing of a GPU call: each call's span on the device stream, host launch
gaps included (what the GPU is kept from doing), after `warmup` untimed calls.
Only for CUDA; the benches that use it refuse to run without a GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def event_times_ms(fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times
