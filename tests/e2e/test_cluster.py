"""End to end on a real cluster (kind, k3d, or any): the chart, real unit pods on CPU,
a scale-down that drains a unit with a stream in flight.

Skipped unless KUBECONFIG is set (and deselected by `-m 'not e2e'` in the default
pytest options): run `python -m pytest -m e2e tests/e2e`. docs/operator.md says how to
build the images and load them into kind or k3d. Environment:
- KUBECONFIG: the cluster (required).
- PDUNIT_E2E_UNIT_IMAGE: unit image, a CPU build works (default pdunit/unit:0.1.0).
- PDUNIT_E2E_OPERATOR_IMAGE: operator image (default pdunit/operator:0.1.0).
- PDUNIT_E2E_MAX_FRAMES: frames of the test streams, long enough to outlast the scale
  decision (default 3000).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdunit.engine.ports import free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.environ.get("KUBECONFIG"), reason="e2e needs KUBECONFIG (a real cluster)"
    ),
    pytest.mark.timeout(1800),
]
UNIT_IMAGE = os.environ.get("PDUNIT_E2E_UNIT_IMAGE", "pdunit/unit:0.1.0")
OPERATOR_IMAGE = os.environ.get("PDUNIT_E2E_OPERATOR_IMAGE", "pdunit/operator:0.1.0")
MAX_FRAMES = int(os.environ.get("PDUNIT_E2E_MAX_FRAMES", "3000"))


def _tool(name: str, ensure: str) -> str:
    found = shutil.which(name)
    if name == "kubectl" and found and "google-cloud-sdk" in os.path.realpath(found):
        found = None  # a gcloud dispatcher, not a kubectl
    if found:
        return found
    out = subprocess.run(["bash", str(REPO / ensure)], capture_output=True, text=True, check=True)
    path = out.stdout.strip().splitlines()[-1]
    return str(Path(path) / name) if Path(path).is_dir() else path


def _split(image: str) -> tuple[str, str]:
    repo, _, tag = image.rpartition(":")
    return (repo, tag) if repo and "/" not in tag else (image, "latest")


@dataclass
class Cluster:
    kubectl_bin: str
    helm_bin: str
    ns: str
    release: str
    forwards: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        out = subprocess.run(
            [self.kubectl_bin, "-n", self.ns, *args],
            capture_output=True,
            text=True,
            input=input,
            timeout=300,
            check=False,
        )
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {out.stderr}")
        return out.stdout

    def units(self) -> list[dict[str, Any]]:
        return json.loads(self.kubectl("get", "pdunits", "-l", "pdunit.dev/set=e2e", "-o", "json"))[
            "items"
        ]

    def port_forward(self, pod: str, port: int) -> int:
        local = free_port()
        proc = subprocess.Popen(
            [self.kubectl_bin, "-n", self.ns, "port-forward", f"pod/{pod}", f"{local}:{port}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.forwards.append(proc)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{local}/healthz", timeout=2).status_code == 200:
                    return local
            except httpx.HTTPError:
                time.sleep(0.5)
        raise AssertionError(f"port-forward to {pod} never answered")


def wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(2)
    raise AssertionError(f"timed out after {timeout}s: {what}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    kubectl = _tool("kubectl", "tools/envtest/ensure.sh")
    helm = _tool("helm", "tools/helm/ensure.sh")
    suffix = uuid.uuid4().hex[:6]
    c = Cluster(kubectl, helm, ns=f"pdunit-e2e-{suffix}", release=f"e2e-{suffix}")
    op_repo, op_tag = _split(OPERATOR_IMAGE)
    unit_repo, unit_tag = _split(UNIT_IMAGE)
    out = subprocess.run(
        [
            helm,
            "install",
            c.release,
            str(REPO / "charts/pdunit"),
            "--namespace",
            c.ns,
            "--create-namespace",
            "--wait",
            "--timeout",
            "10m",
            "--set",
            f"images.operator.repository={op_repo}",
            "--set",
            f"images.operator.tag={op_tag}",
            "--set",
            f"images.unit.repository={unit_repo}",
            "--set",
            f"images.unit.tag={unit_tag}",
            "--set",
            "examplePDUnitSet.enabled=false",
            "--set",
            "router.enabled=false",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert out.returncode == 0, f"helm install failed:\n{out.stdout}\n{out.stderr}"
    try:
        yield c
    finally:
        for proc in c.forwards:
            proc.terminate()
        c.kubectl(
            "delete",
            "pdunitset",
            "e2e",
            "--ignore-not-found",
            "--wait=true",
            "--timeout=300s",
            check=False,
        )
        subprocess.run(
            [helm, "uninstall", c.release, "--namespace", c.ns, "--wait"],
            capture_output=True,
            timeout=300,
            check=False,
        )
        subprocess.run(
            [kubectl, "delete", "namespace", c.ns, "--wait=false"],
            capture_output=True,
            timeout=60,
            check=False,
        )


class Stream(threading.Thread):
    """One long TTS stream through a unit's LB; records how it ended."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.frames = 0
        self.trailer: dict[str, Any] | None = None
        self.error: str | None = None

    def run(self) -> None:
        body = {"prompt": [[0] * 11 for _ in range(16)], "max_frames": MAX_FRAMES, "seed": 1}
        try:
            with httpx.stream(
                "POST",
                f"http://127.0.0.1:{self.port}/v1/tts/stream",
                json=body,
                timeout=httpx.Timeout(60, read=120),
            ) as resp:
                if resp.status_code != 200:
                    self.error = f"HTTP {resp.status_code}: {resp.read()[:300]!r}"
                    return
                for line in resp.iter_lines():
                    doc = json.loads(line)
                    if "frame" in doc:
                        self.frames += 1
                    else:
                        self.trailer = doc
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"


def test_scale_down_drains_a_unit_with_a_stream_in_flight(cluster: Cluster) -> None:
    c = cluster
    c.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump(
            {
                "apiVersion": "pdunit.dev/v1alpha1",
                "kind": "PDUnitSet",
                "metadata": {"name": "e2e"},
                "spec": {
                    "replicas": 2,
                    "template": {
                        "spec": {
                            "image": UNIT_IMAGE,
                            "model": "random:tiny:0",
                            "device": "cpu",
                            "transfer": "host",
                            "drainTimeoutSeconds": 600,
                        }
                    },
                },
            }
        ),
    )
    ready = wait(
        lambda: (
            [u for u in c.units() if (u.get("status") or {}).get("phase") == "Ready"]
            if len(c.units()) == 2
            else None
        ),
        900,
        "2 Ready units",
    )
    assert len(ready) == 2
    # Every port the unit's pod declares serves Prometheus metrics (the chart's PodMonitor
    # scrapes them by these names).
    pod = json.loads(c.kubectl("get", "pod", ready[0]["status"]["podName"], "-o", "json"))
    declared = {p["name"]: p["containerPort"] for ct in pod["spec"]["containers"] + pod["spec"]["initContainers"]
                for p in ct.get("ports", [])}
    assert {"http", "metrics-prefill", "metrics-guard", "metrics-decode0"} <= set(declared), declared
    for port_name, port in declared.items():
        local = c.port_forward(pod["metadata"]["name"], port)
        body = httpx.get(f"http://127.0.0.1:{local}/metrics", timeout=5).text
        assert "pdunit_" in body, f"{port_name} serves no pdunit_ metric"
    streams: dict[str, Stream] = {}
    for u in ready:
        port = c.port_forward(u["status"]["podName"], u["status"]["lbPort"])
        streams[u["metadata"]["name"]] = Stream(port)
        streams[u["metadata"]["name"]].start()
    wait(
        lambda: all((u.get("status") or {}).get("inFlight", 0) >= 1 for u in c.units()),
        120,
        "both units report a stream in flight",
    )

    c.kubectl("scale", "pdunitset/e2e", "--replicas=1")
    victim = wait(
        lambda: next((u for u in c.units() if u["spec"].get("draining")), None),
        60,
        "a unit chosen to drain",
    )
    name = victim["metadata"]["name"]
    # Its stream runs to the end: the drain waits for it.
    while streams[name].is_alive():
        assert c.kubectl("get", "pod", name, "--ignore-not-found", "-o", "name").strip(), (
            f"pod {name} deleted while its stream was in flight"
        )
        time.sleep(1)
    assert streams[name].error is None, streams[name].error
    assert streams[name].trailer and streams[name].trailer.get("done") is True, streams[
        name
    ].trailer
    wait(
        lambda: not c.kubectl("get", "pdunit", name, "--ignore-not-found", "-o", "name").strip(),
        300,
        f"{name} deleted after its drain",
    )
    wait(
        lambda: not c.kubectl("get", "pod", name, "--ignore-not-found", "-o", "name").strip(),
        300,
        f"pod {name} gone",
    )
    events = c.kubectl(
        "get", "events", "--field-selector", f"involvedObject.name={name}", "-o", "json"
    )
    reasons = {e["reason"] for e in json.loads(events)["items"]}
    assert {"DrainStarted", "Drained"} <= reasons, reasons
    (survivor,) = c.units()
    assert survivor["metadata"]["name"] != name and not survivor["spec"].get("draining")
