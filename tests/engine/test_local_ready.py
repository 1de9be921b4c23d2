"""`pdunit local` calls its unit ready only when the LB it started answers as this unit:
another process on `--lb-port` made it print "unit ready" 150 ms after start while its
own LB died with EADDRINUSE, and `bench capacity` then measured that stranger (issue 28
item 5)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdunit.bench.scaler_bench import fake_load_document
from pdunit.engine.local import LocalConfig, LocalUnit


class FakeLB:
    """An HTTP server on a free port that answers /readyz 200 and /v1/load as unit `unit`."""

    def __init__(self, unit: str) -> None:
        self.unit = unit
        self.partial = False  # answer /v1/load with a document that is not a LoadDocument
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/readyz":
                    body = {"ready": True, "reason": ""}
                elif self.path == "/v1/load":
                    body = fake_load_document(fake.unit, lb_instance="f" * 32, empty=None if fake.partial else True)
                else:
                    self.send_error(404)
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stranger() -> Iterator[FakeLB]:
    lb = FakeLB("someone-else")
    yield lb
    lb.close()


def test_a_ready_stranger_on_the_lb_port_is_not_this_units_lb(stranger, tmp_path):
    unit = LocalUnit(LocalConfig(lb_port=stranger.port, run_dir=str(tmp_path), guard=False))
    assert not unit.answers_ready()
    assert "answers as unit 'someone-else'" in unit.why_not and unit.unit_name in unit.why_not
    with pytest.raises(TimeoutError, match=f"another process holds port {stranger.port}"):
        unit.wait_ready(timeout_s=3.0)
    assert unit.lb_instance == ""


def test_a_stranger_whose_load_is_no_load_document_is_not_this_units_lb(stranger, tmp_path):
    unit = LocalUnit(LocalConfig(lb_port=stranger.port, run_dir=str(tmp_path), guard=False))
    stranger.unit, stranger.partial = unit.unit_name, True  # even naming this unit
    assert not unit.answers_ready()
    assert "field empty is missing" in unit.why_not
    assert f"another process holds port {stranger.port}" in unit.why_not
    assert unit.lb_instance == ""


def test_the_unit_is_ready_once_its_own_lb_answers(stranger, tmp_path):
    unit = LocalUnit(LocalConfig(lb_port=stranger.port, run_dir=str(tmp_path), guard=False))
    stranger.unit = unit.unit_name  # the LB it would start, named by the unit
    unit.wait_ready(timeout_s=5.0)
    assert unit.lb_instance == "f" * 32


def test_each_unit_names_its_lb_differently(tmp_path):
    a, b = (LocalUnit(LocalConfig(lb_port=0, run_dir=str(tmp_path / n), guard=False)) for n in "ab")
    assert a.unit_name != b.unit_name
    lb = dict(a.commands())["lb"]
    assert lb[lb.index("--unit-name") + 1] == a.unit_name


def test_pdunit_local_with_a_taken_lb_port_fails_before_starting_a_child(stranger, tmp_path):
    """The stranger answers /readyz 200, as another `pdunit local` does."""
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "pdunit.engine.cli", "local", "--lb-port", str(stranger.port), "--no-guard",
         "--run-dir", str(run)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert "unit ready" not in out.stdout and "Traceback" not in out.stderr
    assert f"--lb-port {stranger.port}: cannot listen on 127.0.0.1:{stranger.port}" in out.stderr
    assert "give --lb-port 0 for a free port" in out.stderr
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["local.log"]  # no child ever ran
