"""A real `pdunit proxy` process per test module (host backend, unix socket in tmp)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def start_proxy(tmp: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    sock = str(tmp / "proxy.sock")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdunit.engine.cli", "proxy", "--socket", sock, "--cuda", "off",
         "--workers", "2", *extra],
        stderr=open(tmp / "proxy.log", "ab"), env=env)
    deadline = time.monotonic() + 60
    while not os.path.exists(sock + ".auth") or not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"proxy did not start: {(tmp / 'proxy.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, sock


def process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat ('T': stopped by a signal; '' once gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def sigstop(pid: int, limit_s: float = 10.0) -> None:
    """SIGSTOP `pid` and return once the kernel shows it stopped: a test that then expects
    the process to answer nothing must not race the stop (seen once on a loaded CI
    machine: a write meant to meet a stopped proxy completed in milliseconds)."""
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + limit_s
    while process_state(pid) not in ("T", "t"):
        if time.monotonic() > end:
            raise AssertionError(f"process {pid} not stopped {limit_s} s after SIGSTOP: state {process_state(pid)!r}")
        time.sleep(0.005)


def stop(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def proxy_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("proxy")
    proc, sock = start_proxy(tmp)
    try:
        yield sock
    finally:
        stop(proc)
