"""`pdunit lb` as a process: config errors, JSON logs, graceful SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx

from pdunit.engine.lb.main import main
from tests.lb.conftest import wait_until


def test_a_bad_flag_value_exits_2_naming_the_field(capsys):
    assert main(["--vocab-sizes", "big"]) == 2
    err = capsys.readouterr().err
    assert "invalid vocab_sizes (from --vocab-sizes)" in err and "must be integers" in err


def test_sigterm_refuses_new_streams_lets_streams_in_flight_finish_then_exits(fake_unit, short_dir):
    fake_unit.decode.step_s = 0.05  # 40 frames: about 2 s
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdunit.engine.lb.main",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--admin-port",
            "0",
            "--prefill-socket",
            fake_unit.prefill_socket,
            "--decode-socket",
            fake_unit.decode_socket,
            "--probe-interval-s",
            "0.2",
            "--shutdown-timeout-s",
            "20",
            "--unit-name",
            "sigterm-test",
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=short_dir,  # not the repo root: operator/ shadows the stdlib
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    logs: list[dict] = []

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            try:
                logs.append(json.loads(line))
            except ValueError:
                logs.append({"raw": line})

    threading.Thread(target=pump, daemon=True).start()
    try:
        wait_until(
            lambda: any(r.get("msg") == "listening" for r in logs), timeout=30, what="LB listening"
        )
        port = next(r["port"] for r in logs if r.get("msg") == "listening")
        assert any(
            r.get("msg") == "resolved config" and r["config"]["unit_name"] == "sigterm-test"
            for r in logs
        )
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=20)
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=20, what="LB ready")
        prompt = [[1] * 11] * 4
        with client.stream(
            "POST", "/v1/tts/stream", json={"prompt": prompt, "max_frames": 40}
        ) as s:
            lines = s.iter_lines()
            assert json.loads(next(lines))["i"] == 0
            proc.send_signal(signal.SIGTERM)
            wait_until(
                lambda: client.get("/readyz").status_code == 503, what="not ready after SIGTERM"
            )
            refused = client.post("/v1/tts/stream", json={"prompt": prompt, "max_frames": 5})
            assert refused.status_code == 503 and "retry-after" in refused.headers
            rest = [json.loads(line) for line in lines if line]
        assert rest[-1]["done"] is True and rest[-1]["frames"] == 40
        client.close()
        assert proc.wait(timeout=20) == 0
        assert any(r.get("msg") == "stopped" and r.get("streams_cut") == 0 for r in logs)
        stream_log = next(r for r in logs if r.get("msg") == "stream ended")
        assert stream_log["frames"] == 40 and len(stream_log["request_id"]) == 16
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
