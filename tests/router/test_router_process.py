"""`pdunit router` as a process: config errors, JSON logs, and the SIGTERM drain."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import httpx
import pytest

from pdunit.engine.router.main import main
from tests.router.routerkit import FakeUnit, run_units


def test_bad_static_unit_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--units", "a=10.0.0.1:8000"]) == 2
    err = capsys.readouterr().err
    assert "--units" in err and "expected http://host:port" in err


def test_kubernetes_discovery_without_unit_set_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--discovery", "kubernetes"]) == 2
    assert "--unit-set" in capsys.readouterr().err


def test_load_bound_factor_must_exceed_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--units", "a=http://h:1", "--load-bound-factor", "1.0"]) == 2
    assert "load_bound_factor (from --load-bound-factor)" in capsys.readouterr().err


async def _log_lines(stream: asyncio.StreamReader, sink: list[dict[str, Any]]) -> None:
    while line := await stream.readline():
        sink.append(json.loads(line))  # every line the router writes is one JSON object


async def _wait_log(logs: list[dict[str, Any]], msg: str, timeout_s: float = 20) -> dict[str, Any]:
    for _ in range(int(timeout_s / 0.02)):
        for entry in logs:
            if entry["msg"] == msg:
                return entry
        await asyncio.sleep(0.02)
    raise AssertionError(f"no log line {msg!r} in {logs}")


@pytest.mark.anyio
async def test_sigterm_lets_open_streams_finish_then_exits_0() -> None:
    unit = FakeUnit("a", frames=3, frame_delay_s=0.01)
    unit.hold = asyncio.Event()
    async with run_units(unit) as served:
        env = {**os.environ, "PDUNIT_POLL_INTERVAL_S": "0.05"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pdunit.engine.cli",
            "router",
            "--units",
            f"a={served['a'].url}",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--shutdown-grace-s",
            "10",
            env=env,
            stderr=asyncio.subprocess.PIPE,
        )
        logs: list[dict[str, Any]] = []
        assert proc.stderr is not None
        reader = asyncio.create_task(_log_lines(proc.stderr, logs))
        try:
            config = await _wait_log(logs, "resolved config")
            assert config["component"] == "router" and config["config"]["poll_interval_s"] == 0.05
            port = (await _wait_log(logs, "router listening"))["port"]
            url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient() as client:
                for _ in range(500):
                    if (await client.get(url + "/readyz")).status_code == 200:
                        break
                    await asyncio.sleep(0.02)
                async with client.stream(
                    "POST", url + "/v1/tts/stream", json={"prompt": [[1] * 11]}
                ) as resp:
                    lines = resp.aiter_lines()
                    first = await asyncio.wait_for(lines.__anext__(), timeout=10)
                    # the process's series (before the drain: it takes no new connection then):
                    # no *_created beside its counters and histograms
                    text = (await client.get(url + "/metrics")).text
                    proc.send_signal(signal.SIGTERM)
                    await _wait_log(logs, "draining: no new connections, waiting for open streams")
                    assert proc.returncode is None  # still serving the open stream
                    unit.hold.set()
                    rest = [json.loads(line) async for line in lines if line]
            assert "pdunit_router_decision_latency_seconds_count" in text
            assert "pdunit_router_decisions_total" in text and "_created" not in text
            assert json.loads(first)["i"] == 0 and rest[-1]["done"] is True
            assert await asyncio.wait_for(proc.wait(), timeout=20) == 0
            await reader
            assert logs[-1]["msg"] == "router stopped"
            done = next(e for e in logs if e["msg"] == "stream done")
            assert done["outcome"] == "ok" and done["request_id"]
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            reader.cancel()
