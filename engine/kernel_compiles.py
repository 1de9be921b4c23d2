"""Triton kernels compiled inside an engine process (P, D, the monolith), timed, and
named when one compiles while the engine serves: serving should compile nothing (the
engines warm up and capture their graphs first), and a compile while serving holds the
step that needs it, which every stream of that engine sees as a freeze.

Owns Triton's two JIT hooks (`triton.knobs.runtime.jit_cache_hook`, called before a
compile, and `jit_post_compile_hook`, after); a hook installed before ours is still
called. Without Triton, or with one that has no such hooks, nothing is installed.
Exports `pdunit_kernel_compiles_total{phase}` / `pdunit_kernel_compile_seconds_total{phase}`
and a WARNING naming the kernel for a compile while serving.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from prometheus_client import Counter

from pdunit.engine.metrics import ROLES, role_metric

# Triton compiles a kernel the first time it runs with a new specialization: a new
# constexpr, or an integer argument whose divisibility by 16 (or value 1) differs from
# every earlier call. A compile while serving takes hundreds of ms for a cold cache.
# phase is `startup` or `serving`; `pdunit bench compare` shows the serving seconds per
# level.
COMPILES = role_metric(Counter(
    "pdunit_kernel_compiles_total", "Triton kernel compiles in this process, at start-up or while serving",
    ["phase"], registry=None), *ROLES)
COMPILE_SECONDS = role_metric(Counter(
    "pdunit_kernel_compile_seconds_total",
    "Seconds spent compiling Triton kernels, at start-up or while serving (a serving compile stalls its step)",
    ["phase"], registry=None), *ROLES)

for _metric in (COMPILES, COMPILE_SECONDS):  # both phases exported from the start, 0 until one happens
    for _p in ("startup", "serving"):
        _metric.labels(phase=_p)

log = logging.getLogger("pdunit.kernels")
_lock = threading.Lock()
_phase = "startup"
_started: dict[tuple[int, str], float] = {}  # (thread, kernel key) -> perf_counter() at the cache miss
_installed = False


def serving_started() -> None:
    """From now on a compile is a serving compile (counted as such, and logged)."""
    global _phase
    _phase = "serving"


def watch_kernel_compiles() -> bool:
    """Installs the hooks (idempotent); False where this Triton has none."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
        return False
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def cache_hook(**kwargs: Any) -> Any:
        compile_starting(kwargs.get("key"))
        return before(**kwargs) if before else None

    def post_hook(**kwargs: Any) -> Any:
        compile_finished(kwargs.get("key"), kernel_name(kwargs))
        return after(**kwargs) if after else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = cache_hook, post_hook
    _installed = True
    return True


def kernel_name(hook_kwargs: dict[str, Any]) -> str:
    """`module.function` of the kernel a hook call is about (its `repr` when the hook
    gives no function)."""
    fn = hook_kwargs.get("fn")
    if fn is not None and getattr(fn, "name", None):
        return f"{getattr(fn, 'module', '')}.{fn.name}".lstrip(".")
    return str(hook_kwargs.get("repr", "?")).split("[", 1)[0]


def compile_starting(key: Any) -> None:
    with _lock:
        _started[(threading.get_ident(), str(key))] = time.perf_counter()


def compile_finished(key: Any, name: str) -> float:
    """Counts one compile; returns its seconds (0 when its start was not seen)."""
    now = time.perf_counter()
    with _lock:
        t0 = _started.pop((threading.get_ident(), str(key)), None)
        phase = _phase
    seconds = now - t0 if t0 is not None else 0.0
    COMPILES.labels(phase=phase).inc()
    COMPILE_SECONDS.labels(phase=phase).inc(seconds)
    if phase == "serving":
        log.warning("kernel compiled while serving: the step that needed it waited for the compile",
                    extra={"kernel": name, "seconds": round(seconds, 3)})
    return seconds
