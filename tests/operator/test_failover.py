"""Two operators against one envtest apiserver (issue 27.6): one acts, the other waits,
and takes over when the first is killed without a goodbye (SIGKILL: a crash, or a node
cut off, as the Lease sees it). Own control plane: the session's operator must not act
on these objects."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.operator.envtest import (
    REPO,
    Api,
    ControlPlane,
    Operator,
    ensure_assets,
    start_operator,
    wait_for,
)
from tests.operator.test_integration import unit

FAST_LEASE = ("--lease-seconds", "3", "--renew-deadline-seconds", "2", "--lease-retry-seconds", "0.5")
LEASE = "/apis/coordination.k8s.io/v1/namespaces/default/leases/pdunit-operator"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlane, Api]]:
    assets, why = ensure_assets()
    if assets is None:
        pytest.skip(f"no envtest binaries and they cannot be built here: {why}")
    cp = ControlPlane(assets=assets, workdir=tmp_path_factory.mktemp("failover"))
    api = None
    try:
        cp.start()
        cp.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        cp.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                   "crd/pdunits.pdunit.dev", "crd/pdunitsets.pdunit.dev")
        api = Api(cp.server, cp.token)
        yield cp, api
    finally:
        if api is not None:
            api.close()
        cp.stop()


def _start(cp: ControlPlane, workdir: Path, identity: str) -> tuple[Operator, int]:
    workdir.mkdir()
    return start_operator(cp.kubeconfig, workdir, "--scaler-port", "0",
                          "--leader-identity", identity, *FAST_LEASE)


def _healthy(op: Operator, port: int) -> bool:
    if op.proc.poll() is not None:
        raise AssertionError(f"operator exited {op.proc.returncode}:\n{op.tail()}")
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _holder(api: Api) -> str | None:
    return ((api.get(LEASE) or {}).get("spec") or {}).get("holderIdentity")


def _actors(api: Api, ns: str, name: str) -> set[str]:
    """reportingInstance of every Event on the object: which operator replica acted."""
    events = api.items(f"/api/v1/namespaces/{ns}/events")
    return {e.get("reportingInstance") for e in events if e["involvedObject"]["name"] == name}


def _pod(api: Api, ns: str, name: str) -> dict[str, Any] | None:
    return api.get(f"/api/v1/namespaces/{ns}/pods/{name}")


def test_one_of_two_operators_acts_and_the_other_takes_over_when_it_dies(
    plane: tuple[ControlPlane, Api], tmp_path: Path
) -> None:
    cp, api = plane
    ns = "failover"
    cp.kubectl("create", "namespace", ns)
    a, a_port = _start(cp, tmp_path / "a", "op-a")
    b: Operator | None = None
    try:
        wait_for(lambda: _holder(api) == "op-a", 60, "op-a to hold the Lease", describe=a.tail)
        wait_for(lambda: _healthy(a, a_port), 60, "op-a's liveness endpoint")
        b, b_port = _start(cp, tmp_path / "b", "op-b")
        # The standby answers its liveness probe (else its Deployment would restart it).
        wait_for(lambda: _healthy(b, b_port), 60, "op-b's standby liveness endpoint")
        assert "waiting for leadership" in b.log.read_text()

        cp.kubectl("apply", "-n", ns, "-f", "-", input=unit("before"))
        wait_for(lambda: _pod(api, ns, "before"), 60, "the pod of PDUnit before", describe=a.tail)
        wait_for(lambda: "PodCreated" in str(api.items(f"/api/v1/namespaces/{ns}/events")), 30,
                 "the PodCreated Event of PDUnit before")
        assert _actors(api, ns, "before") == {"op-a"}
        assert _holder(api) == "op-a"
        assert "pod created" not in b.log.read_text()

        a.proc.send_signal(signal.SIGKILL)  # no release: the Lease must run out
        a.proc.wait(timeout=30)
        cp.kubectl("apply", "-n", ns, "-f", "-", input=unit("after"))
        wait_for(lambda: _holder(api) == "op-b", 60, "op-b to take the Lease", describe=b.tail)
        wait_for(lambda: _pod(api, ns, "after"), 60, "the pod of PDUnit after", describe=b.tail)
        wait_for(lambda: _actors(api, ns, "after"), 30, "an Event on PDUnit after")
        assert _actors(api, ns, "after") == {"op-b"}
        assert int((api.get(LEASE) or {})["spec"]["leaseTransitions"]) >= 1

        # SIGTERM: the leader stops cleanly and gives the Lease back for the next one.
        assert b.stop() == 0, b.tail()
        assert _holder(api) == ""
    finally:
        for op in (a, b):
            if op is not None:
                op.stop()


class Partition:
    """A TCP forwarder between one operator and the apiserver; `cut()` drops every
    connection and refuses new ones, as a node cut off from the control plane sees it."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.cutoff = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.cutoff.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                if self.cutoff.is_set():  # accepted while cut() ran: it must not slip through
                    client.close()
                    upstream.close()
                    return
                self.conns += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self.lock:  # after this no accepted connection joins the pipes (_accept checks)
            self.cutoff.set()
        self.listener.close()
        with self.lock:
            for s in self.conns:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


def test_a_partitioned_leader_stops_before_the_standby_takes_over(
    plane: tuple[ControlPlane, Api], tmp_path: Path
) -> None:
    cp, api = plane
    ns = "partition"
    cp.kubectl("create", "namespace", ns)
    api.delete(LEASE)
    partition = Partition(int(cp.server.rsplit(":", 1)[1]))
    config = yaml.safe_load(cp.kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{partition.port}"
    cut_off = tmp_path / "partitioned-kubeconfig"
    cut_off.write_text(yaml.safe_dump(config))
    timing = ("--lease-seconds", "6", "--renew-deadline-seconds", "2", "--lease-retry-seconds", "0.5")
    (tmp_path / "a").mkdir()
    a, _ = start_operator(cut_off, tmp_path / "a", "--scaler-port", "0", "--leader-identity", "op-a", *timing)
    b: Operator | None = None
    try:
        wait_for(lambda: _holder(api) == "op-a", 60, "op-a to hold the Lease", describe=a.tail)
        (tmp_path / "b").mkdir()
        b, _ = start_operator(cp.kubeconfig, tmp_path / "b", "--scaler-port", "0",
                              "--leader-identity", "op-b", *timing)
        wait_for(lambda: "waiting for leadership" in b.log.read_text(), 60, "op-b to wait")
        partition.cut()

        def taken_over() -> bool:
            holder = _holder(api)
            # Never two acting: when op-b holds the Lease, op-a has already stopped.
            assert holder != "op-b" or a.proc.poll() is not None, "op-b took over a running leader"
            return holder == "op-b"

        wait_for(taken_over, 60, "op-b to take the Lease", interval=0.05, describe=b.tail)
        assert a.proc.returncode == 1, a.tail()
        assert "leadership lost" in a.log.read_text()
        cp.kubectl("apply", "-n", ns, "-f", "-", input=unit("after-cut"))
        wait_for(lambda: _pod(api, ns, "after-cut"), 60, "op-b to act", describe=b.tail)
    finally:
        partition.cut()
        for op in (a, b):
            if op is not None:
                op.stop()
