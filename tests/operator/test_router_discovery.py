"""The router discovers units from PDUnit status on a real apiserver (envtest), with the
real operator making the PDUnits and a stand-in kubelet serving each pod's LB."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import httpx

from pdunit.engine.ports import free_port
from tests.operator.envtest import ControlPlane, wait_for
from tests.operator.test_integration import unit_set, wait_ready


def routable(port: int) -> set[str] | None:
    try:
        doc = httpx.get(f"http://127.0.0.1:{port}/v1/units", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return None
    units = doc["units"] if isinstance(doc, dict) else doc
    return {u["name"] for u in units if u.get("state") == "routable"}


def test_router_follows_pdunit_status_through_scale_up_and_down(
    control_plane: ControlPlane, api: Any, kubelet: Any, namespace: str, tmp_path
) -> None:
    ns = namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit_set("voices", 2))
    names = {u["metadata"]["name"] for u in wait_ready(api, ns, "voices", 2)}
    port = free_port()
    log = open(tmp_path / "router.log", "wb")  # noqa: SIM115 - closed below
    router = subprocess.Popen(
        [sys.executable, "-m", "pdunit.engine.cli", "router", "--port", str(port), "--host", "127.0.0.1",
         "--discovery", "kubernetes", "--namespace", ns, "--unit-set", "voices"],
        env=dict(os.environ, KUBECONFIG=str(control_plane.kubeconfig)), stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: routable(port) == names, 60, "both units routable in the router",
                 describe=lambda: (tmp_path / "router.log").read_text()[-3000:])
        control_plane.kubectl("scale", "pdunitset/voices", "-n", ns, "--replicas=1")
        (kept,) = wait_ready(api, ns, "voices", 1, timeout=90)
        wait_for(lambda: routable(port) == {kept["metadata"]["name"]}, 60,
                 "the drained unit gone from the routing table",
                 describe=lambda: (tmp_path / "router.log").read_text()[-3000:])
    finally:
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(timeout=40)
        except subprocess.TimeoutExpired:
            router.kill()
        log.close()
