"""Logs, metrics and shutdown conventions shared by every pdunit process.

Owns the log formats (`JsonFormatter`, `TextFormatter`, `setup_logging`), the metric
conventions (prometheus_client's default registry, `pdunit_` names with units in the
name, `serve_metrics` for processes without an HTTP server), GC pause timing
(`pdunit_gc_pause_seconds`, `settle_gc_for_serving`), and shutdown (`shutdown_event()`
set on SIGTERM/SIGINT so every server drains the same way, `set_on_signals` for threaded
processes; `die_with_parent()` ties a child of `pdunit local` to it). No business logic.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from prometheus_client import Gauge, Histogram, disable_created_metrics
from pydantic import BaseModel

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


LogLevel = Literal["debug", "info", "warning", "error"]  # every process's --log-level
LogFormat = Literal["json", "text"]


def rfc3339(created: float, timespec: str = "microseconds") -> str:
    """A record's time (`LogRecord.created`, seconds since the epoch) in RFC 3339, UTC."""
    return datetime.fromtimestamp(created, UTC).isoformat(timespec=timespec).replace("+00:00", "Z")


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _RESERVED and not k.startswith("_")}


# Logs: one JSON object per line on stderr (`ts` in RFC 3339, UTC; `level`, `component`,
# `msg`, plus any `extra=` fields such as `request_id`), or one readable text line per
# record (`log_format="text"`); with a `log_file`, every record goes there as JSON and
# only warnings reach stderr (`pdunit local`: its terminal keeps the unit's summary).
# `log_config` writes the resolved config once at start.
class JsonFormatter(logging.Formatter):
    """One JSON object per record: what tests, the fault suite and log pipelines parse."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": rfc3339(record.created),
            "level": record.levelname.lower(),
            "component": self.component,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """One line a person reads: `<RFC 3339 time> <level> <component>: <msg> key=value ...`
    (a value with spaces or structure in JSON), a traceback on the lines after it."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        parts = [rfc3339(record.created, "milliseconds"), record.levelname.lower(),
                 f"{self.component}: {record.getMessage()}"]
        for key, value in _extras(record).items():
            text = value if isinstance(value, str) and value and " " not in value else json.dumps(value, default=str)
            parts.append(f"{key}={text}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


# GC pauses: `setup_logging` times every cyclic garbage collection of the process: a
# decode step is 10-20 ms, so a long collection in D or the LB is a stall every stream
# sees, and prometheus_client's own `python_gc_*` series count collections without their
# durations. The serving processes (LB, P, D, monolith) call `settle_gc_for_serving` once
# started: start-up objects frozen, young collections less frequent.
GC_PAUSE_SECONDS = Histogram(
    "pdunit_gc_pause_seconds", "Time the process spent in one cyclic garbage collection (every thread waits)",
    ["generation"], buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0))
_gc_started = 0.0


def _time_gc(phase: str, info: dict[str, int]) -> None:
    # Runs inside the collection, GIL held: no other thread can collect at the same time.
    global _gc_started
    if phase == "start":
        _gc_started = time.perf_counter()
    elif _gc_started:
        GC_PAUSE_SECONDS.labels(generation=str(info["generation"])).observe(time.perf_counter() - _gc_started)
        _gc_started = 0.0


GC_FROZEN_OBJECTS = Gauge(
    "pdunit_gc_frozen_objects", "Objects moved out of the collector's reach at the end of start-up and "
    "still alive (read at scrape: freed ones leave the count)")
# The collector's thresholds in serving processes (Python's: 700, 10, 10). A young
# collection walks the young objects alive at that moment (frames in flight), not the
# ones already freed, so collecting the youngest generation after 10000 net allocations
# instead of 700 costs far less; the older ones follow after 2 and 2 collections instead
# of 10 and 10, so that garbage in reference cycles still goes within about as many
# seconds as before (vLLM 0.11.1 collected less often and its cyclic requests piled up
# by gigabytes, vllm-project/vllm#28726). The LB relaying ~10.4k frames/s on a 2-core
# CPU: gcprobe-20261130-cpu.md.
SERVING_GC_THRESHOLDS = (10_000, 2, 2)


def settle_gc_for_serving(logger: logging.Logger) -> None:
    """Called once a serving process has started (imports, model, config done).

    1. Collects start-up garbage, then moves every surviving object into the permanent
       generation: a full collection then walks only what serving created since. A D
       process holds ~200k tracked objects after start and a full collection of them
       took ~89 ms on a 2-core CPU (the LB's 65k: ~20 ms; in the LB relaying frames, 51
       ms without the freeze, 8-9 ms with it), every thread stopped: a stall of every
       stream. vLLM freezes the same way.
    2. Sets the thresholds to SERVING_GC_THRESHOLDS."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)
    GC_FROZEN_OBJECTS.set_function(gc.get_freeze_count)
    logger.info("garbage collector settled for serving", extra={
        "frozen_objects": gc.get_freeze_count(), "thresholds": list(gc.get_threshold())})


def watch_gc_pauses() -> None:
    """Times the process's garbage collections into `pdunit_gc_pause_seconds` (idempotent)."""
    if _time_gc not in gc.callbacks:
        gc.callbacks.append(_time_gc)


class CurrentStderrHandler(logging.StreamHandler):
    """Writes each record to the `sys.stderr` of that moment, not of the setup: a process
    that swaps stderr (a test's capture, a daemonizing wrapper) must neither lose its log
    nor fail writing to the stream it closed."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass  # always the current sys.stderr


# No `*_created` series: `setup_logging` (every process's first call) turns them off;
# they would double the series of every counter and histogram, and nothing reads them
# (Prometheus detects counter resets itself).
def setup_logging(component: str, level: str = "info", log_format: LogFormat = "json",
                  log_file: Path | None = None) -> logging.Logger:
    """The whole process's logging; returns the component's logger. Records go to stderr
    as `log_format` lines; with `log_file`, every record goes to that file as JSON lines
    and only warnings and errors to stderr. Also starts timing the process's GC pauses
    and turns off `*_created` series (every process calls this first)."""
    watch_gc_pauses()
    disable_created_metrics()
    formatter = {"json": JsonFormatter, "text": TextFormatter}[log_format](component)
    handler = CurrentStderrHandler()
    handler.setFormatter(formatter)
    handlers: list[logging.Handler] = [handler]
    if log_file is not None:
        handler.setLevel(logging.WARNING)
        to_file = logging.FileHandler(log_file, encoding="utf-8")
        to_file.setFormatter(JsonFormatter(component))
        handlers.append(to_file)
    root = logging.getLogger()
    root.handlers[:] = handlers
    root.setLevel(level.upper())
    # uvicorn/grpc/kopf loggers propagate to the root handler: one format everywhere.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # Access-log-like chatter: one line per request would drown the process's own log
    # (and the stream table of `pdunit local`); their warnings and errors still show.
    for name in ("uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(name).setLevel("WARNING")
    return logging.getLogger(f"pdunit.{component}")


def log_config(logger: logging.Logger, config: BaseModel) -> None:
    logger.info("resolved config", extra={"config": config.model_dump(mode="json")})


def serve_metrics(port: int, host: str = "0.0.0.0") -> None:
    """Expose the default Prometheus registry on `port` (0 = disabled)."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host)


def shutdown_event(logger: logging.Logger | None = None) -> asyncio.Event:
    """An event set on SIGTERM or SIGINT; call from inside the running loop."""
    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    def _set(signame: str) -> None:
        if logger is not None and not event.is_set():
            logger.info("shutdown requested", extra={"signal": signame})
        event.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _set, sig.name)
    return event


def set_on_signals(event: threading.Event, logger: logging.Logger | None = None) -> None:
    """SIGTERM and SIGINT set `event` (a process without an event loop; call from the main
    thread). The handler only writes a byte to a pipe; a daemon thread reads it and sets
    the event. Setting it in the handler itself can deadlock: the handler runs in the main
    thread, possibly while that thread holds the event's (non-reentrant) lock inside
    `event.wait()`; a proxy then ignored SIGTERM for good (seen once in CI)."""
    r, w = os.pipe()
    os.set_blocking(w, False)

    def _handler(signum: int, _frame: Any) -> None:
        try:
            os.write(w, bytes([signum]))
        except BlockingIOError:  # the pipe is full of earlier signals: one is enough
            pass

    def _reader() -> None:
        while True:
            signum = os.read(r, 1)[0]
            if logger is not None and not event.is_set():
                logger.info("shutdown requested", extra={"signal": signal.Signals(signum).name})
            event.set()

    threading.Thread(target=_reader, name="signals", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _handler)


def now_ns() -> int:
    """Wall clock in ns: every stage timestamp of the waterfall uses this one clock."""
    return time.time_ns()


_PR_SET_PDEATHSIG = 1
# Set in a child's environment: the child asks the kernel for SIGTERM when this pid dies
# (engine/cli.py, right after exec). Done by the child itself, never between fork and
# exec: running Python there, in a parent with gRPC threads, crashed children at random
# (gRPC "epoll_wait error: Bad file descriptor", SIGABRT).
PARENT_ENV = "PDUNIT_DIE_WITH_PARENT"


def die_with_parent() -> None:
    """Called by every `pdunit` process at start: if its launcher asked for it, SIGTERM
    when the launcher dies (and exit now if it is already gone)."""
    want = os.environ.get(PARENT_ENV)
    if not want:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return
    if os.getppid() != int(want):  # the launcher died before the prctl took effect
        os._exit(0)
