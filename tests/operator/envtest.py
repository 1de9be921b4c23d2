"""A real Kubernetes control plane for the operator tests (envtest): etcd + kube-apiserver
on free loopback ports, a stand-in kubelet, and fake unit LBs.

- `ControlPlane`: starts etcd and kube-apiserver from tools/envtest/ensure.sh's folder,
  secure serving with the apiserver's self-signed cert, a static token file with one
  admin user in system:masters, RBAC authorization; writes a kubeconfig.
- `Api`: a tiny synchronous REST client (httpx) for the tests' own reads and writes.
- `FakeLb`: plays one unit's LB (docs/api.md): `/v1/load` with an in-flight count the
  test sets, `/readyz`, `/healthz` on its stream port, `POST /v1/admin/drain` on an admin
  port of its own behind the bearer token (a call without it gets 401 and is logged), and
  a log of every answer.
- `Kubelet`: there is no kubelet, scheduler or controller-manager in envtest. This
  thread plays the kubelet for pdunit pods: for each new pod it reads the admin token
  from the Secret its admin-token volume names (as the kubelet mounts it), starts a
  FakeLb on ports of its own (every pod gets IP 127.0.0.1, so the ports go into the
  test-only annotations pdunit.dev/lb-port-override and admin-port-override), marks the
  pod Running with that IP, and keeps its Ready condition equal to the fake LB's
  /readyz, like a readiness probe would.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdunit.bench.scaler_bench import fake_load_document
from pdunit.engine.ports import free_port

REPO = Path(__file__).resolve().parents[2]
OVERRIDE = "pdunit.dev/lb-port-override"
ADMIN_OVERRIDE = "pdunit.dev/admin-port-override"


def wait_for(
    check: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.2,
    describe: Callable[[], Any] | None = None,
) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` (and `describe()`)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    seen = describe() if describe is not None else last
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {seen!r})")


def ensure_assets() -> tuple[Path | None, str]:
    """(folder with kube-apiserver, etcd, kubectl) or (None, why not)."""
    try:
        out = subprocess.run(
            ["bash", str(REPO / "tools/envtest/ensure.sh")],
            capture_output=True,
            text=True,
            timeout=3600,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"tools/envtest/ensure.sh failed to run: {exc}"
    if out.returncode != 0:
        return None, f"tools/envtest/ensure.sh failed: {out.stderr.strip()[-2000:]}"
    return Path(out.stdout.strip().splitlines()[-1]), ""


class Api:
    """Just enough of the Kubernetes REST API for tests."""

    def __init__(self, server: str, token: str) -> None:
        self.http = httpx.Client(
            base_url=server,
            verify=False,
            timeout=10,
            trust_env=False,
            headers={"Authorization": f"Bearer {token}"},
        )

    def get(self, path: str, **params: Any) -> dict[str, Any] | None:
        resp = self.http.get(path, params=params)
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return resp.json()

    def items(self, path: str, selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": selector} if selector else {}
        return list((self.get(path, **params) or {}).get("items") or [])

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(path, json=body)

    def patch(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.patch(
            path, content=json.dumps(body), headers={"Content-Type": "application/merge-patch+json"}
        )

    def delete(self, path: str) -> httpx.Response:
        return self.http.delete(path)

    def close(self) -> None:
        self.http.close()


@dataclass
class ControlPlane:
    assets: Path
    workdir: Path
    server: str = ""
    token: str = "pdunit-envtest-admin-token"
    kubeconfig: Path = field(default_factory=Path)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: dict[str, Path] = field(default_factory=dict)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = self.workdir / f"{name}.log"
        self.logs[name] = log
        proc = subprocess.Popen(
            argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        self.procs.append(proc)
        return proc

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.logs.get(name)
        if not path or not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def start(self) -> None:
        w = self.workdir
        etcd_client, etcd_peer, secure = free_port(), free_port(), free_port()
        self._spawn(
            "etcd",
            [
                str(self.assets / "etcd"),
                "--name",
                "envtest",
                "--data-dir",
                str(w / "etcd"),
                "--listen-client-urls",
                f"http://127.0.0.1:{etcd_client}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{etcd_client}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{etcd_peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{etcd_peer}",
                "--initial-cluster",
                f"envtest=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ],
        )
        key = w / "sa.key"
        subprocess.run(
            ["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True
        )
        subprocess.run(
            ["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(w / "sa.pub")],
            check=True,
            capture_output=True,
        )
        (w / "tokens.csv").write_text(f'{self.token},admin,admin,"system:masters"\n')
        self.server = f"https://127.0.0.1:{secure}"
        self._spawn(
            "kube-apiserver",
            [
                str(self.assets / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                f"--secure-port={secure}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--cert-dir={w / 'certs'}",
                "--service-cluster-ip-range=10.0.0.0/24",
                f"--service-account-issuer={self.server}",
                f"--service-account-key-file={w / 'sa.pub'}",
                f"--service-account-signing-key-file={key}",
                f"--token-auth-file={w / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                # No controller-manager creates the "default" ServiceAccount in envtest.
                "--disable-admission-plugins=ServiceAccount",
                "--allow-privileged=true",
                "--endpoint-reconciler-type=none",
                "--enable-priority-and-fairness=false",
                "--v=0",
            ],
        )
        self.kubeconfig = w / "kubeconfig"
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "envtest",
                    "clusters": [
                        {
                            "name": "envtest",
                            "cluster": {"server": self.server, "insecure-skip-tls-verify": True},
                        }
                    ],
                    "users": [{"name": "admin", "user": {"token": self.token}}],
                    "contexts": [
                        {
                            "name": "envtest",
                            "context": {
                                "cluster": "envtest",
                                "user": "admin",
                                "namespace": "default",
                            },
                        }
                    ],
                }
            )
        )
        api = Api(self.server, self.token)
        deadline = time.monotonic() + 120
        try:
            while True:
                for proc in self.procs:
                    if proc.poll() is not None:
                        raise RuntimeError(
                            f"{proc.args[0]} exited {proc.returncode}:\n"
                            f"{self.tail('etcd')}\n{self.tail('kube-apiserver')}"
                        )
                try:
                    if api.http.get("/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"kube-apiserver not ready in 120s:\n{self.tail('kube-apiserver')}"
                    )
                time.sleep(0.5)
        finally:
            api.close()

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [str(self.assets / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            input=input,
            timeout=timeout,
            check=False,
        )
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {out.stderr}")
        return out

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.workdir / "etcd", ignore_errors=True)


class FakeLb:
    """One unit's LB as the operator sees it; the test sets `in_flight` and reads the logs.
    `token`: the admin token (None: the admin port refuses every call, as an LB whose
    token file is missing never starts)."""

    def __init__(self, unit: str, token: str | None = None) -> None:
        self.unit = unit
        self.token = token
        self.in_flight = 0
        self.draining = False
        self.transfer_mode = "host"  # what P reports having chosen
        self.lock = threading.Lock()
        self.load_log: list[tuple[float, bool]] = []  # (time, empty) of every /v1/load answer
        self.drain_log: list[tuple[float, bool]] = []  # (time, draining) of every drain call
        self.refused_log: list[tuple[float, str]] = []  # (time, Authorization header) of refused admin calls
        lb = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/v1/load":
                    self._send(200, lb.load(record=True))
                elif self.path == "/readyz":
                    ok = lb.ready()
                    self._send(200 if ok else 503, {"ready": ok})
                elif self.path == "/healthz":
                    self._send(200, {"ok": True})
                else:
                    self._send(404, {"error": {"code": "not_found"}})

            def do_POST(self) -> None:  # noqa: N802
                self._send(404, {"error": {"code": "not_found"}})  # admin routes are not here

        class AdminHandler(Handler):
            def do_GET(self) -> None:  # noqa: N802
                self._send(404, {"error": {"code": "not_found"}})

            def do_POST(self) -> None:  # noqa: N802
                if self.path != "/v1/admin/drain":
                    self._send(404, {"error": {"code": "not_found"}})
                    return
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                given = self.headers.get("Authorization") or ""
                if lb.token is None or given != f"Bearer {lb.token}":
                    with lb.lock:
                        lb.refused_log.append((time.monotonic(), given))
                    self._send(401, {"error": {"code": "unauthorized"}})
                    return
                draining = bool(json.loads(raw).get("draining", True)) if raw else True
                with lb.lock:
                    lb.draining = draining
                    lb.drain_log.append((time.monotonic(), draining))
                self._send(200, lb.load(record=False))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.admin_server = ThreadingHTTPServer(("127.0.0.1", 0), AdminHandler)
        self.admin_port = int(self.admin_server.server_address[1])
        self.threads = [threading.Thread(target=srv.serve_forever, daemon=True)
                        for srv in (self.server, self.admin_server)]
        for thread in self.threads:
            thread.start()

    def ready(self) -> bool:
        return not self.draining

    def load(self, record: bool) -> dict[str, Any]:
        with self.lock:
            n = self.in_flight
            empty = n == 0
            if record:
                self.load_log.append((time.monotonic(), empty))
            # every field of a LoadDocument: the operator parses /v1/load strictly
            return fake_load_document(self.unit, ready=not self.draining, draining=self.draining,
                                      transfer_mode=self.transfer_mode, streams_in_flight=n, decode_in_flight=n,
                                      pool_pages=4096, free_pages=4096 - n, empty=empty)

    def stop(self) -> None:
        for srv in (self.server, self.admin_server):
            srv.shutdown()
            srv.server_close()


class Kubelet(threading.Thread):
    """Marks pdunit pods Running/Ready on 127.0.0.1, each with its own FakeLb port."""

    def __init__(self, api: Api) -> None:
        super().__init__(daemon=True, name="stand-in-kubelet")
        self.api = api
        self.lbs: dict[str, FakeLb] = {}  # "<namespace>/<pod>" -> its fake LB
        self.pods: dict[str, dict[str, Any]] = {}  # uid -> what we know
        self.gone_at: dict[str, float] = {}  # "<namespace>/<pod>" -> first time seen gone
        self.images: dict[str, str] = {}  # "<namespace>/<pod>" -> lb container image
        self.stopping = threading.Event()
        self.errors: list[str] = []

    def lb(self, namespace: str, pod: str) -> FakeLb:
        return wait_for(
            lambda: self.lbs.get(f"{namespace}/{pod}"), 30, f"fake LB of {namespace}/{pod}"
        )

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.tick()
            except Exception as exc:  # keep running; the test sees the errors
                self.errors.append(repr(exc))
            self.stopping.wait(0.2)
        for lb in self.lbs.values():
            lb.stop()

    def tick(self) -> None:
        pods = self.api.items("/api/v1/pods", "app.kubernetes.io/name=pdunit")
        seen = set()
        for pod in pods:
            meta = pod["metadata"]
            ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
            key = f"{ns}/{name}"
            seen.add(uid)
            base = f"/api/v1/namespaces/{ns}/pods/{name}"
            if uid not in self.pods:
                lb = FakeLb(name, self.admin_token(ns, pod))
                old = self.lbs.get(key)
                if old is not None:
                    old.stop()
                self.lbs[key] = lb
                self.gone_at.pop(key, None)
                self.images[key] = pod["spec"]["containers"][0]["image"]
                self.pods[uid] = {"key": key, "ready": None}
                annotations = {OVERRIDE: str(lb.port), ADMIN_OVERRIDE: str(lb.admin_port)}
                self.api.patch(base, {"metadata": {"annotations": annotations}})
            lb = self.lbs[self.pods[uid]["key"]]
            ready = lb.ready()
            if self.pods[uid]["ready"] != ready:
                flag = "True" if ready else "False"
                now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                resp = self.api.patch(
                    base + "/status",
                    {
                        "status": {
                            "phase": "Running",
                            "podIP": "127.0.0.1",
                            "podIPs": [{"ip": "127.0.0.1"}],
                            "startTime": now,
                            "conditions": [
                                {
                                    "type": "PodScheduled",
                                    "status": "True",
                                    "lastTransitionTime": now,
                                },
                                {
                                    "type": "Initialized",
                                    "status": "True",
                                    "lastTransitionTime": now,
                                },
                                {
                                    "type": "ContainersReady",
                                    "status": flag,
                                    "lastTransitionTime": now,
                                },
                                {"type": "Ready", "status": flag, "lastTransitionTime": now},
                            ],
                        }
                    },
                )
                if resp.status_code < 300:
                    self.pods[uid]["ready"] = ready
        for uid in list(self.pods):
            if uid not in seen:
                key = self.pods.pop(uid)["key"]
                self.gone_at.setdefault(key, time.monotonic())
                # The fake LB stays up (its logs are read by tests) until a new pod takes the name.

    def admin_token(self, namespace: str, pod: dict[str, Any]) -> str | None:
        """The admin token the LB container would find in its mounted file: the key of the
        Secret its `admin-token` volume names (None when there is none)."""
        for volume in pod["spec"].get("volumes") or []:
            source = volume.get("secret") or {}
            if volume["name"] == "admin-token" and source.get("secretName"):
                secret = self.api.get(f"/api/v1/namespaces/{namespace}/secrets/{source['secretName']}")
                raw = ((secret or {}).get("data") or {}).get("admin-token")
                return base64.b64decode(raw).decode().strip() if raw else None
        return None

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)


@dataclass
class Operator:
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def start_operator(kubeconfig: Path, workdir: Path, *extra: str) -> tuple[Operator, int]:
    """`pdunit operator` as a subprocess against the envtest apiserver; returns it and its liveness port."""
    liveness = free_port()
    log = workdir / "operator.log"
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1")
    env.pop("KUBERNETES_SERVICE_HOST", None)
    argv = [
        str(REPO / ".venv/bin/pdunit"),
        "operator",
        "--resync-seconds",
        "0.5",
        "--drain-check-interval-seconds",
        "1",
        "--load-timeout-seconds",
        "0.5",
        "--liveness-port",
        str(liveness),
        "--metrics-port",
        "0",
        "--allow-lb-port-override",
        *extra,
    ]
    proc = subprocess.Popen(
        argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
    )
    return Operator(proc, log), liveness
