"""A first run that reads well (issue 28 item 6): every log line carries an RFC 3339
time; `pdunit local` sends its own log and every child's to files in its run dir and
prints the unit's URLs, the stream table, what the pass column judges, the KV counters
and a verdict, with no JSON log line on the terminal."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from pdunit.engine.observability import JsonFormatter, TextFormatter, setup_logging


def _record(msg: str = "restarted", level: int = logging.WARNING, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("pdunit.local", level, __file__, 1, msg, (), None)
    record.__dict__.update(extra)
    return record


def _is_rfc3339_utc(ts: object) -> datetime:
    assert isinstance(ts, str) and ts.endswith("Z") and "T" in ts, ts
    return datetime.fromisoformat(ts)


def test_json_log_lines_carry_an_rfc3339_utc_time_and_keep_their_fields():
    record = _record(child="prefill", pid=12)
    line = json.loads(JsonFormatter("local").format(record))
    when = _is_rfc3339_utc(line["ts"])
    assert abs(when.timestamp() - record.created) < 1e-5 and when.tzinfo == UTC
    assert {k: line[k] for k in ("level", "component", "logger", "msg", "child", "pid")} == {
        "level": "warning", "component": "local", "logger": "pdunit.local", "msg": "restarted",
        "child": "prefill", "pid": 12}


def test_text_log_lines_read_as_time_level_component_message_and_fields():
    record = _record(child="prefill", cmd="pdunit prefill --x 1", codes={"lb": 0})
    stamp, level, rest = TextFormatter("local").format(record).split(" ", 2)
    _is_rfc3339_utc(stamp)
    assert level == "warning"
    assert rest == 'local: restarted child=prefill cmd="pdunit prefill --x 1" codes={"lb": 0}'


def test_a_log_file_takes_every_record_and_stderr_only_warnings(tmp_path, capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        log = setup_logging("local", "info", "text", tmp_path / "local.log")
        log.info("resolved config", extra={"config": {"a": 1}})
        log.warning("child exited: restarting it after its backoff", extra={"child": "lb"})
        for handler in root.handlers:
            handler.flush()
    finally:
        for handler in root.handlers:
            if isinstance(handler, logging.FileHandler):
                handler.close()
        root.handlers[:], level = saved
        root.setLevel(level)
    in_file = [json.loads(line)["msg"] for line in (tmp_path / "local.log").read_text().splitlines()]
    assert in_file == ["resolved config", "child exited: restarting it after its backoff"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and " warning local: child exited: restarting it after its backoff child=lb" in err[0]


def test_stderr_records_follow_the_current_sys_stderr_not_a_closed_one(monkeypatch):
    """A process whose stderr is swapped after setup (a test's capture ends and closes its
    file) logs to the new stream; before, records hit the closed file ('Logging error')."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    first, second = io.StringIO(), io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", first)
        log = setup_logging("local", "info", "text")
        log.warning("one")
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        log.warning("two")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    assert second.getvalue().count("local: two") == 1 and "one" not in second.getvalue()


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """`make run`'s command, with a smaller load."""
    run = tmp_path_factory.mktemp("first") / "run"
    out = subprocess.run(
        [sys.executable, "-m", "pdunit.engine.cli", "local", "--model", "random:tiny:0", "--lb-port", "0",
         "--pool-tokens", "4096", "--cache-tokens", "4096", "--no-guard", "--run-dir", str(run),
         "--load-streams", "2", "--load-requests", "2", "--load-frames", "20", "--load-prompt-rows", "50-100"],
        capture_output=True, text=True, timeout=240, cwd=run.parent)
    return out, run


def test_the_first_run_prints_urls_table_criteria_kv_counters_and_a_verdict(first_run):
    out, run = first_run
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("unit ready at http://127.0.0.1:") and f"logs: {run / 'logs'}" in lines[0]
    assert any(line.startswith("metrics: lb http://") for line in lines)
    assert any(line.startswith("admin: http://") for line in lines)
    table = next(i for i, line in enumerate(lines) if line.split()[:2] == ["mode", "conc"])
    assert lines[table + 2].split()[0] == "local-pd" and lines[table].split()[-1] == "pass"
    assert any(line.startswith("pass: the GPU criteria: every stream") and ">= 42 frames/s" in line
               and "TTFA p95 <= 500 ms" in line for line in lines)
    assert any("runs on the CPU, where they are not expected to hold" in line for line in lines)
    assert any(line.startswith("KV checks: 2  mismatches: 0") for line in lines)
    assert lines[-1].startswith("result: OK (exit 0): 2 of 2 streams completed")


def test_the_first_run_keeps_json_off_the_terminal_and_in_the_log_files(first_run):
    out, run = first_run
    terminal = out.stdout.splitlines() + out.stderr.replace("\r", "\n").splitlines()
    assert not [line for line in terminal if line.lstrip().startswith("{")]
    assert f"every process logs to {run / 'logs'}/<name>.log" in out.stderr
    logs = {p.name for p in (run / "logs").iterdir()}
    assert {"local.log", "lb.log", "prefill.log", "decode.log"} <= logs
    for name in ("local.log", "lb.log"):  # the children's JSON, read back as the tests and the fault suite do
        records = [json.loads(line) for line in (run / "logs" / name).read_text().splitlines()
                   if line.startswith("{")]
        assert any(r["msg"] == "resolved config" for r in records)
        for r in records:
            _is_rfc3339_utc(r["ts"])
