"""CPU probe (not a test): the LB's garbage-collection pauses while it relays frames,
with Python's collector as it starts and as the serving processes settle it
(engine/observability.settle_gc_for_serving: start-up objects frozen, young collections
less frequent).

The real LB runs as a process of its own (`pdunit lb`, or the same with the freeze
turned into a no-op), in front of the fake P and D of tests/lb/fakes.py (this process):
the fake D sends one frame per stream every `--step-ms`, so `--streams` streams at 10 ms
are 100 frames/s each (on a 2-core machine a run relays either ~10.5k or ~5.4k frames/s
with 120 streams, whatever the mode: compare runs at the same rate). Modes: `no-freeze`
(Python's defaults), `shipped` (the LB as it ships), `gc=A/B/C` (as it ships with
other collector thresholds; `gc=700/10/10` is the freeze alone). Client processes keep `--streams` streams open for `--seconds`.
At the end it reads the LB's own metrics: frames relayed, its CPU seconds, and its GC
pauses per generation.

    .venv/bin/python -m tests.lb.gc_probe --streams 100 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from pdunit.bench.report import scrape_metrics
from pdunit.engine.ports import free_port
from tests.lb.fakes import FakeUnit, LoopThread

# The LB's own main, with the freeze optionally replaced before lb.main imports it.
LB_CODE = """
import gc, sys
import pdunit.engine.observability as o
if sys.argv[1] == "no-freeze":  # Python's collector as it starts
    o.settle_gc_for_serving = lambda logger: None
if sys.argv[1].startswith("gc="):  # the freeze, with these thresholds
    o.SERVING_GC_THRESHOLDS = tuple(int(x) for x in sys.argv[1][3:].split("/"))
from pdunit.engine.lb.main import main
sys.exit(main(sys.argv[2:]))
"""


async def _client(url: str, streams: int, seconds: float, frames: int) -> int:
    body = {"prompt": [[1] * 11 for _ in range(20)], "max_frames": frames, "min_frames": frames}
    end = time.monotonic() + seconds
    got = 0

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal got
        while time.monotonic() < end:
            async with client.stream("POST", f"{url}/v1/tts/stream", json=body) as r:
                async for line in r.aiter_lines():
                    got += line.startswith('{"frame"')

    async with httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=streams)) as client:
        await asyncio.gather(*(one(client) for _ in range(streams)))
    return got


def _client_proc(url: str, streams: int, seconds: float, frames: int, out: Any) -> None:
    out.put(asyncio.run(_client(url, streams, seconds, frames)))


def probe(mode: str, args: argparse.Namespace, unit: FakeUnit) -> dict[str, float]:
    port = free_port()
    lb = subprocess.Popen([sys.executable, "-c", LB_CODE, mode, "--host", "127.0.0.1", "--port", str(port),
                           "--prefill-socket", unit.prefill_socket, "--decode-socket", unit.decode_socket,
                           "--unit-name", "probe", "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise SystemExit(f"{mode}: the LB never became ready at {url}")
        before = scrape_metrics(port)
        ctx = mp.get_context("spawn")  # this process runs gRPC threads: a forked child can crash
        out = ctx.Queue()
        per = args.streams // args.client_procs
        procs = [ctx.Process(target=_client_proc, args=(url, per, args.seconds, args.frames, out))
                 for _ in range(args.client_procs)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        wall = time.monotonic() - t0
        if any(p.exitcode for p in procs) or out.qsize() < len(procs):
            raise SystemExit(f"{mode}: a client process failed (exit codes {[p.exitcode for p in procs]})")
        after = scrape_metrics(port)
    finally:
        lb.terminate()
        lb.wait(10)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    frames = delta("pdunit_lb_frames_total")
    row = {"mode": mode, "seconds": round(wall, 1), "frames_per_s": round(frames / wall),
           "lb_cpu_us_per_frame": round(1e6 * delta("process_cpu_seconds_total") / max(frames, 1), 1),
           "frozen": after.get("pdunit_gc_frozen_objects", 0.0)}
    for g in "012":
        n = delta(f'pdunit_gc_pause_seconds_count{{generation="{g}"}}')
        s = delta(f'pdunit_gc_pause_seconds_sum{{generation="{g}"}}')
        row[f"gen{g}_per_s"] = round(n / wall, 2)
        row[f"gen{g}_mean_ms"] = round(1000 * s / n, 3) if n else None
    row["gc_ms_per_s"] = round(1000 * sum(delta(f'pdunit_gc_pause_seconds_sum{{generation="{g}"}}')
                                          for g in "012") / wall, 3)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--frames", type=int, default=300, help="frames per stream (then the client starts another)")
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--modes", default="no-freeze,shipped")
    args = ap.parse_args()
    loop = LoopThread()
    try:
        for mode in args.modes.split(","):
            # a fresh fake unit per mode: streams a stopped LB left in the fake D would
            # otherwise keep it sending
            with tempfile.TemporaryDirectory(prefix="pdgc", dir="/tmp") as d:
                unit = FakeUnit(d)
                unit.decode.step_s = args.step_ms / 1000
                loop.run(unit.start())
                try:
                    print(probe(mode, args, unit), flush=True)
                finally:
                    loop.run(unit.stop())
    finally:
        loop.close()
    print(f"machine: {os.cpu_count()} CPUs; command: {' '.join(sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
