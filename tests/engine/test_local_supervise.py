"""`pdunit local` supervises its children as a pod's kubelet does its containers (issue
32, finding 7): a child that dies is started again after a backoff, counted and logged,
while the others keep serving; `--no-restart` keeps the old behaviour (any child's
death stops the unit)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx

from pdunit.engine.local import Child, LocalConfig, LocalUnit, RestartBackoff, _spawn
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from tests.engine.unit_client import random_prompt, stream, wait_for


def _pids(local_pid: int) -> dict[str, int]:
    """`pdunit local`'s live children by name (their command: python -m pdunit.engine.cli NAME)."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{local_pid}/task").iterdir():
        for pid in (int(x) for x in (task / "children").read_text().split()):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if b"pdunit.engine.cli" in argv:
                out[argv[argv.index(b"pdunit.engine.cli") + 1].decode()] = pid
    return out


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _info(run: Path, role: str) -> pb.InfoReply | None:
    stub = pbg.PrefillStub if role == "prefill" else pbg.DecodeStub
    try:
        with grpc.insecure_channel(f"unix:{run / role}.sock") as channel:
            return stub(channel).Info(pb.Empty(), timeout=2)
    except grpc.RpcError:
        return None


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _records(path: Path, message: str) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("msg", rec.get("message")) == message:
            out.append(rec)
    return out


def _start(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str, Path]:
    err = tmp_path / "local.err"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdunit.engine.cli", "local", "--lb-port", "0", "--pool-tokens", "4096",
         "--cache-tokens", "4096", "--no-guard", "--log-level", "warning", "--run-dir", str(tmp_path / "run"),
         "--log-format", "json", *flags],  # its own log as JSON lines on stderr, which _records reads
        stdout=subprocess.PIPE, stderr=err.open("wb"), text=True,
    )
    line = proc.stdout.readline()
    assert "unit ready at " in line, (line, err.read_text())
    return proc, line.split("unit ready at ")[1].split()[0], err


def test_a_killed_prefill_is_restarted_while_the_lb_and_decode_keep_serving(tmp_path):
    proc, url, err = _start(tmp_path)
    run = tmp_path / "run"
    try:
        before = _pids(proc.pid)
        d_before = _info(run, "decode")
        assert {"lb", "prefill", "decode"} <= set(before) and d_before is not None
        assert stream(url, random_prompt(40, seed=1), max_frames=6, min_frames=6)[1].get("done")

        os.kill(before["prefill"], signal.SIGKILL)
        new = wait_for(lambda: (p := _info(run, "prefill")) and p.pid != before["prefill"] and p,
                       timeout=120, what="a new P answering Info")
        wait_for(lambda: _ready(url), timeout=120, what="the unit ready again")
        frames, last = stream(url, random_prompt(40, seed=2), max_frames=6, min_frames=6)
        assert last.get("done"), last
        assert len(frames) == 6

        after = _pids(proc.pid)
        assert after["prefill"] == new.pid
        assert after["lb"] == before["lb"] and after["decode"] == before["decode"]
        d_after = _info(run, "decode")
        assert d_after is not None and d_after.instance_id == d_before.instance_id  # D never restarted
        assert proc.poll() is None
        [exited] = _records(err, "child exited: restarting it after its backoff")
        assert (exited["child"], exited["exit_code"], exited["attempt"]) == ("prefill", -signal.SIGKILL, 1)
        [restarted] = _records(err, "restarted")
        assert (restarted["child"], restarted["pid"], restarted["restarts"]) == ("prefill", new.pid, 1)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.2)
        assert [name for name, pid in after.items() if _alive(pid)] == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_no_restart_stops_the_whole_unit_when_a_child_dies(tmp_path):
    proc, _, err = _start(tmp_path, "--no-restart")
    try:
        kids = _pids(proc.pid)
        os.kill(kids["prefill"], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        assert f"prefill exited with {-signal.SIGKILL}" in err.read_text()
        assert _records(err, "restarted") == []
        time.sleep(0.2)
        assert [name for name, pid in kids.items() if _alive(pid)] == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_restart_backoff_doubles_up_to_its_cap_and_resets_after_a_long_run():
    backoff = RestartBackoff(base_s=0.5, max_s=10.0, reset_after_s=30.0)
    assert [backoff.next_delay(up_s=1.0) for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff.next_delay(up_s=30.0) == 0.5  # it stayed up: a new crash loop
    assert backoff.next_delay(up_s=2.0) == 1.0


def test_the_supervisor_restarts_a_dead_child_only_once_its_backoff_passed(tmp_path):
    unit = LocalUnit(LocalConfig(lb_port=0, run_dir=str(tmp_path)))
    argv = [sys.executable, "-c", "raise SystemExit(3)"]
    child = Child("prefill", argv, _spawn(argv, tmp_path / "p.log"), tmp_path / "p.log")
    unit.children.append(child)
    first = child.proc
    first.wait()
    t0 = time.monotonic()
    assert unit.supervise_once(t0) is False
    assert child.proc is first and child.restart_at == t0 + 0.5  # found dead: scheduled
    assert unit.supervise_once(t0 + 0.4) is False
    assert child.proc is first
    assert unit.supervise_once(t0 + 0.5) is True
    assert child.proc is not first and child.restarts == 1 and unit.restarts() == {"prefill": 1}
    child.proc.wait()
    t1 = time.monotonic()
    unit.supervise_once(t1)
    assert child.restart_at == t1 + 1.0  # the second exit in a row waits twice as long
    unit.stop()


def test_the_unit_draws_its_secrets_and_a_non_loopback_admin_port_requires_the_token(tmp_path):
    proc, url, _ = _start(tmp_path, "--admin-host", "0.0.0.0", "--no-restart")
    run = tmp_path / "run"
    try:
        admin = next(line for line in iter(proc.stdout.readline, "") if line.startswith("admin: "))
        admin_url, token_file = admin.split()[1], admin.split("bearer token in ")[1].rstrip(")\n")
        assert token_file == str(run / "admin.token")
        for secret in (run / "unit.secret", run / "admin.token"):
            assert secret.stat().st_mode & 0o777 == 0o600
        kids = _pids(proc.pid)
        for name in ("prefill", "decode"):
            argv = Path(f"/proc/{kids[name]}/cmdline").read_bytes().split(b"\0")
            assert argv[argv.index(b"--unit-secret-file") + 1] == str(run / "unit.secret").encode()
        assert httpx.post(f"{admin_url}/drain", json={"draining": False}, timeout=5).status_code == 401
        token = Path(token_file).read_text().strip()
        ok = httpx.post(f"{admin_url}/drain", json={"draining": False}, timeout=5,
                        headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200, ok.text
        assert _ready(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


_ROLE = """
import os, signal, sys, time
name, events = sys.argv[1], sys.argv[2]
def note(what):
    fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, f"{name} {what}\\n".encode())
    os.close(fd)
def on_term(*_):
    note("sigterm")
    if name == "lb":
        time.sleep(0.5)  # its drain: whatever else stop() signalled meanwhile is in the file first
    note("exited")
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
note("up")
while True:
    time.sleep(1)
"""


def test_stop_signals_the_engines_only_once_the_lb_exited(tmp_path):
    """The LB drains on SIGTERM: its cancels and the streams it lets finish need P and D
    alive, so stop() waits for the LB's exit before it signals anything else."""
    unit = LocalUnit(LocalConfig(lb_port=0, run_dir=str(tmp_path)))
    events = tmp_path / "events"
    for name in ("proxy", "decode", "prefill", "lb", "guard"):  # start order (engine/unit_layout.py)
        argv = [sys.executable, "-c", _ROLE, name, str(events)]
        unit.children.append(Child(name, argv, _spawn(argv, tmp_path / f"{name}.log"), tmp_path / f"{name}.log"))
    wait_for(lambda: events.exists() and events.read_text().count(" up\n") == 5, what="every child up")
    codes = unit.stop()
    lines = [line for line in events.read_text().splitlines() if not line.endswith(" up")]
    assert lines[:2] == ["lb sigterm", "lb exited"], lines
    assert sorted(lines[2:]) == sorted(f"{n} {what}" for n in ("proxy", "decode", "prefill", "guard")
                                       for what in ("sigterm", "exited"))
    assert codes == {"proxy": 0, "decode": 0, "prefill": 0, "lb": 0, "guard": 0}


def test_the_lb_cuts_streams_in_flight_at_stop_unless_drain_s_gives_them_time(tmp_path):
    """A local stop cuts the streams in flight (and cancels them in the engines, alive until
    the LB exited) as it always did, instead of the pod's 30-s drain; --drain-s lets them finish."""
    def lb_argv(**kw) -> list[str]:
        return dict(LocalUnit(LocalConfig(lb_port=0, run_dir=str(tmp_path), **kw)).commands())["lb"]

    argv = lb_argv()
    assert argv[argv.index("--shutdown-timeout-s") + 1] == "0"
    argv = lb_argv(drain_s=12.5)
    assert argv[argv.index("--shutdown-timeout-s") + 1] == "12.5"
