"""CUDA-event timing of a GPU call: each call's span on the device stream, host launch
gaps included (what the GPU is kept from doing), after `warmup` untimed calls;
`times_ms` falls back to wall time for a CPU run of a bench (its CPU reference path)."""

from __future__ import annotations

import statistics
import time
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


def times_ms(fn: Callable[[], Any], iters: int, warmup: int, cuda: bool) -> list[float]:
    """CUDA events on a GPU (`event_times_ms`), else each call's wall time."""
    if cuda:
        return event_times_ms(fn, iters, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def kernel_ms(fn: Callable[[], Any], reps: int = 20, rounds: int = 5) -> float:
    """Device time of one call of a short kernel: `reps` calls back to back between two
    events (the queue stays ahead of the GPU, so host launch cost is hidden), the median
    over `rounds`, after one untimed round."""

    def burst() -> None:
        for _ in range(reps):
            fn()

    return statistics.median(event_times_ms(burst, rounds, 1)) / reps
