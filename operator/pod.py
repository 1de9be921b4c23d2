"""Pure reconcile logic of the operator: (spec, observed state) -> manifests and actions.

Everything here takes and returns plain dicts/dataclasses, exactly as the Kubernetes API
serves them (camelCase), and never does I/O, never reads the clock (callers pass `now`)
and never talks to kopf. handlers.py does the I/O around these functions; tests call
them directly.

- `desired_pod(unit)`: the pod of one PDUnit (LB, prefill, decode, native sidecars).
- `desired_secret(unit, unit_secret, admin_token)`: the unit's Secret (the P<->D secret
  and the LB's admin token; the caller draws the values, this module never does).
- `unit_status(...)`: the PDUnit status from its pod and the LB's `/v1/load` answer.
- `drain_step(...)`: the drain state machine of PROTOCOL.md section 5.
- `plan_units(unitset, units)` / `pick_victims(units, n)`: scale-up, scale-down and
  rolling replacement of a PDUnitSet's units.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pdunit.engine.unit_layout import decode_names, metrics_port_of
from pdunit.operator import models as m

RUN_DIR = "/run/pdunit"
PREFILL_SOCKET = f"{RUN_DIR}/prefill.sock"
DECODE_SOCKET = f"{RUN_DIR}/decode.sock"
PROXY_SOCKET = f"{RUN_DIR}/proxy.sock"
# Pod UID/GID of every container. One shared non-root UID is what lets the proxy open
# P's and D's CUDA IPC handles through the shared PID namespace (/proc/<pid> access
# between processes of the same UID needs no capability).
RUN_AS_USER = 10001
# Seconds added to drainTimeoutSeconds for the grace period: the preStop drain may use
# the whole drain timeout, then the processes still need time to exit on SIGTERM.
GRACE_MARGIN_SECONDS = 30
# Between the two independent empty checks of the preStop hook.
PRESTOP_CHECK_INTERVAL_SECONDS = 2
TRANSFERS_WITH_PROXY = ("proxy", "auto")
# The unit's Secret (desired_secret): one per PDUnit, owned by it, created once. P and D
# see only the unit secret, the LB only the admin token, each a read-only file of mode
# 0440 owned by root and the pod's fsGroup (the engine refuses a secret file other users
# can read; RUN_AS_USER reads it through the group).
UNIT_SECRET_KEY = "unit-secret"
ADMIN_TOKEN_KEY = "admin-token"
SECRET_FILE_MODE = 0o440
SECRETS_DIR = "/var/run/secrets/pdunit"
UNIT_SECRET_FILE = f"{SECRETS_DIR}/unit/{UNIT_SECRET_KEY}"
ADMIN_TOKEN_FILE = f"{SECRETS_DIR}/admin/{ADMIN_TOKEN_KEY}"
SECRET_MIN_CHARS = 32  # the values are 32 random bytes, hex: 64 characters
ADMIN_PORT_NAME = "admin"  # the LB container's port of POST /v1/admin/drain

# The preStop hook of lb, prefill and decode (stdlib only, so it works whatever the
# `pdunit` CLI offers): the LB's asks for the drain (POST /v1/admin/drain on the admin
# port, with the bearer token of its mounted file; prefill and decode hold no token and
# pass admin port 0), then each waits until /v1/load says `empty` twice,
# PRESTOP_CHECK_INTERVAL_SECONDS apart, or the drain timeout passes. The kubelet runs
# each container's preStop before sending it SIGTERM, so prefill and decode keep serving
# the streams in flight while the LB finishes them; the sidecars are stopped only after
# all three exited (native sidecar ordering). When the operator drained the unit first,
# the hook returns after two quick empty answers.
PRESTOP_DRAIN_SCRIPT = """\
import json, sys, time, urllib.request as u
port, admin, token_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
timeout, gap = float(sys.argv[4]), float(sys.argv[5])
deadline = time.monotonic() + timeout
def call(port, path, data=None, token=None):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = "Bearer " + token
    req = u.Request("http://127.0.0.1:%d%s" % (port, path), data=data,
                    method="POST" if data else "GET", headers=headers)
    with u.urlopen(req, timeout=2) as r:
        return json.load(r)
if admin:
    try:
        with open(token_file) as f:
            call(admin, "/v1/admin/drain", b'{"draining": true}', f.read().strip())
    except Exception as e:
        print("preStop: drain request failed: %s" % e, file=sys.stderr)
empties = 0
while time.monotonic() < deadline:
    try:
        empties = empties + 1 if call(port, "/v1/load").get("empty") else 0
    except Exception:
        empties = 0
    if empties >= 2:
        sys.exit(0)
    time.sleep(gap)
print("preStop: drain timeout, streams may be cut", file=sys.stderr)
"""


# ---------------------------------------------------------------------------- helpers


def iso(ts: datetime) -> str:
    """RFC 3339, seconds (Kubernetes' convention for conditions)."""
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def iso_us(ts: datetime) -> str:
    """RFC 3339 with microseconds: the drain's empty checks are compared sub-second."""
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _hash(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


# Every PDUnit spec field that has a value without being set: its default, by wire name.
_UNIT_DEFAULTS: dict[str, Any] = {
    f.alias or name: f.default for name, f in m.PDUnitSpec.model_fields.items() if not f.is_required()
}


def _without_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's fields that differ from the API's defaults. The apiserver fills a
    field's CRD default into every stored object it serves, so a CRD upgrade adding a
    defaulted field would change every hash of the full spec, and roll every unit."""
    return {k: v for k, v in spec.items() if k not in _UNIT_DEFAULTS or _UNIT_DEFAULTS[k] != v}


def template_hashes(template: dict[str, Any]) -> tuple[str, str]:
    """(current, legacy) hashes of a PDUnitSet template (labels + spec): a change starts a
    rollout. The current one leaves out fields at their defaults; a unit labelled with
    the legacy one (the full spec, before 2026-11-30) has the same template."""
    labels = (template.get("metadata") or {}).get("labels") or {}
    spec = template.get("spec") or {}
    return _hash({"labels": labels, "spec": _without_defaults(spec)}), _hash({"labels": labels, "spec": spec})


def spec_hashes(spec: dict[str, Any]) -> tuple[str, str]:
    """(current, legacy) hashes of the pod-shaping part of a PDUnit spec (`draining` does
    not reshape the pod), as `template_hashes`."""
    shaping = {k: v for k, v in spec.items() if k != "draining"}
    return _hash(_without_defaults(shaping)), _hash(shaping)


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    return obj.get("metadata") or {}


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return _meta(obj).get("labels") or {}


def _status(obj: dict[str, Any]) -> dict[str, Any]:
    return obj.get("status") or {}


# ------------------------------------------------------------------------- the pod


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _resources(spec: dict[str, Any], role: str, gpu: bool) -> dict[str, Any]:
    given = ((spec.get("resources") or {}).get(role)) or {}
    out: dict[str, Any] = {}
    for key in ("requests", "limits"):
        if given.get(key):
            out[key] = {k: v for k, v in given[key].items()}
    if gpu:
        # Exactly one GPU per engine container is the unit's contract; a user value for
        # the GPU resource is overridden rather than silently doubled.
        gpu_name = spec.get("gpuResource", "nvidia.com/gpu")
        out.setdefault("limits", {})[gpu_name] = 1
        if "requests" in out:
            out["requests"][gpu_name] = 1
    return out


def _env(unit_name: str, spec: dict[str, Any], role: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "PDUNIT_UNIT", "value": unit_name},
        {"name": "PDUNIT_ROLE", "value": role},
        # Read-only root filesystem: every cache (torch, triton, pip) goes to /tmp.
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "PDUNIT_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "PDUNIT_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if role == "proxy":
        # No GPU is requested, yet the proxy must see every GPU to open P's and D's
        # memory in one context (NVIDIA container runtime honours this env variable).
        env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"})
        env.append({"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"})
    # User env last: it may override ours on purpose (e.g. HOME), never the reverse.
    seen = {e["name"]: i for i, e in enumerate(env)}
    for item in spec.get("env") or []:
        entry = {"name": item["name"], "value": item.get("value", "")}
        if item["name"] in seen:
            env[seen[item["name"]]] = entry
        else:
            env.append(entry)
    return env


# The Secret's key each role reads (its volume carries that key only).
_SECRET_OF_ROLE = {"prefill": UNIT_SECRET_KEY, "decode": UNIT_SECRET_KEY, "lb": ADMIN_TOKEN_KEY}
_SECRET_FILE = {UNIT_SECRET_KEY: UNIT_SECRET_FILE, ADMIN_TOKEN_KEY: ADMIN_TOKEN_FILE}


def _mounts(role: str) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"name": "run", "mountPath": RUN_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    key = _SECRET_OF_ROLE.get(role)
    if key:
        folder = _SECRET_FILE[key].rsplit("/", 1)[0]
        mounts.append({"name": key, "mountPath": folder, "readOnly": True})
    return mounts


def secret_name(unit_name: str) -> str:
    """The name of a unit's Secret (next to its pod, which has the unit's name)."""
    return f"{unit_name}-unit-secret"


def desired_secret(unit: dict[str, Any], unit_secret: str, admin_token: str) -> dict[str, Any]:
    """The Secret of one PDUnit: `unit-secret` (P authenticates to D's tcp KV listener with
    it) and `admin-token` (the bearer token of the LB's admin port). The caller draws both
    (32 random bytes, hex) once; the Secret is immutable and goes with its unit
    (ownerReference), so every pod of the unit gets the same values."""
    for key, value in ((UNIT_SECRET_KEY, unit_secret), (ADMIN_TOKEN_KEY, admin_token)):
        if len(value) < SECRET_MIN_CHARS:
            raise ValueError(f"{key} has {len(value)} characters, at least {SECRET_MIN_CHARS} needed "
                             "(draw 32 random bytes, hex)")
    meta = _meta(unit)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name(meta["name"]),
            "namespace": meta.get("namespace"),
            "labels": {
                m.LABEL_NAME: "pdunit",
                m.LABEL_COMPONENT: "unit-secret",
                m.LABEL_MANAGED_BY: "pdunit-operator",
                m.LABEL_UNIT: meta["name"],
            },
            "ownerReferences": [_owner(unit)],
        },
        "type": "Opaque",
        "immutable": True,
        "data": {
            UNIT_SECRET_KEY: base64.b64encode(unit_secret.encode()).decode(),
            ADMIN_TOKEN_KEY: base64.b64encode(admin_token.encode()).decode(),
        },
    }


def secret_value(secret: dict[str, Any], key: str) -> str | None:
    """One value of a unit's Secret as text, None when it is missing or too short to be one."""
    raw = (secret.get("data") or {}).get(key)
    if not raw:
        return None
    try:
        value = base64.b64decode(raw, validate=True).decode().strip()
    except (ValueError, UnicodeDecodeError):
        return None
    return value if len(value) >= SECRET_MIN_CHARS else None


def _owner(unit: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": m.API_VERSION,
        "kind": m.UNIT_KIND,
        "name": _meta(unit)["name"],
        "uid": _meta(unit)["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _pre_stop(spec: dict[str, Any], role: str) -> dict[str, Any]:
    asks = role == "lb"  # the one container holding the admin token
    return {
        "exec": {
            "command": [
                "python3",
                "-c",
                PRESTOP_DRAIN_SCRIPT,
                str(spec["lbPort"]),
                str(spec["adminPort"] if asks else 0),
                ADMIN_TOKEN_FILE if asks else "",
                str(spec["drainTimeoutSeconds"]),
                str(PRESTOP_CHECK_INTERVAL_SECONDS),
            ]
        }
    }


def decode_sockets(spec: dict[str, Any]) -> list[str]:
    """One socket per decode engine: 1P1D keeps the plain name, 1PnD numbers them."""
    n = int(spec.get("decoders", 1))
    return [DECODE_SOCKET] if n == 1 else [f"{RUN_DIR}/decode-{i}.sock" for i in range(n)]


def metrics_port(spec: dict[str, Any], role: str, index: int = 0) -> tuple[str, int] | None:
    """(container port name, port) that `role`'s process serves Prometheus /metrics on,
    decode engine `index` for a decode role; None for the LB (its /metrics is on lbPort)
    and for every role when metricsPort is 0. Names are fixed so that one PodMonitor
    (the chart's) lists them all."""
    port = metrics_port_of(int(spec["metricsPort"]), role, index)
    if port is None:
        return None
    return (f"metrics-decode{index}" if role == "decode" else f"metrics-{role}"), port


def role_command(spec: dict[str, Any], role: str, index: int = 0) -> list[str]:
    """The `pdunit <role>` command line of one container (the real CLI); `index` picks
    the decode engine of a 1PnD unit."""
    port = str(spec["lbPort"])
    transfer = spec["transfer"]
    socks = decode_sockets(spec)
    all_decoders = ",".join(socks)
    kv_dtype = spec.get("kvCacheDtype") or "auto"  # one value for P and every D
    kv_cache_flags = [] if kv_dtype == "auto" else ["--kv-cache-dtype", kv_dtype]
    if role == "lb":
        cmd = [
            "pdunit",
            "lb",
            "--prefill-socket",
            PREFILL_SOCKET,
            "--decode-socket",
            all_decoders,
            "--port",
            port,
            # on the pod IP for the operator's drain, behind the token (and the chart's
            # NetworkPolicy); the stream port serves no admin route
            "--admin-port",
            str(spec["adminPort"]),
            "--admin-host",
            "0.0.0.0",
            "--admin-token-file",
            ADMIN_TOKEN_FILE,
        ]
        if transfer in TRANSFERS_WITH_PROXY:  # the drain's empty check asks the proxy too
            cmd += ["--proxy-socket", PROXY_SOCKET]
    elif role == "prefill":
        cmd = [
            "pdunit",
            "prefill",
            "--socket",
            PREFILL_SOCKET,
            "--decode-socket",
            all_decoders,
            "--model",
            spec["model"],
            "--transfer",
            transfer,
            "--device",
            spec["device"],
            "--unit-secret-file",
            UNIT_SECRET_FILE,
            *kv_cache_flags,
        ]
        if spec.get("prefillGemm") == "fp8":  # bf16 is the engine's default
            cmd += ["--prefill-gemm", "fp8"]
    elif role == "decode":
        cmd = [
            "pdunit",
            "decode",
            "--socket",
            socks[index],
            "--prefill-socket",
            PREFILL_SOCKET,
            "--model",
            spec["model"],
            "--transfer",
            transfer,
            "--device",
            spec["device"],
            "--unit-secret-file",
            UNIT_SECRET_FILE,
            *kv_cache_flags,
        ]
        if spec.get("decodeKernel"):  # every D alike
            cmd += ["--decode-kernel", spec["decodeKernel"]]
        if spec.get("decodeGemm") == "fp8":  # every D alike; bf16 is the engine's default
            cmd += ["--decode-gemm", "fp8"]
    elif role == "proxy":
        cmd = ["pdunit", "proxy", "--socket", PROXY_SOCKET]
    elif role == "guard":
        cmd = [
            "pdunit",
            "guard",
            "--prefill-socket",
            PREFILL_SOCKET,
            "--decode-socket",
            ",".join(socks),  # every D: each one's held pages and draining are watched
        ]
    else:
        raise ValueError(f"unknown role {role!r}; expected one of {m.ROLES}")
    metrics = metrics_port(spec, role, index)
    if role == "guard":  # one HTTP server: /status, /healthz and /metrics, or none at all
        cmd += ["--port", str(metrics[1] if metrics else 0)]
    elif metrics:
        cmd += ["--metrics-port", str(metrics[1])]
    return cmd + list(((spec.get("extraArgs") or {}).get(role)) or [])


def _container(unit_name: str, spec: dict[str, Any], role: str, name: str, index: int = 0) -> dict[str, Any]:
    metrics = metrics_port(spec, role, index)
    ports = [{"name": metrics[0], "containerPort": metrics[1], "protocol": "TCP"}] if metrics else []
    return {
        "name": name,
        "image": spec["image"],
        "imagePullPolicy": spec.get("imagePullPolicy", "IfNotPresent"),
        "command": role_command(spec, role, index),
        "env": _env(unit_name, spec, role),
        "resources": _resources(
            spec, role, gpu=role in ("prefill", "decode") and spec["device"] == "cuda"
        ),
        "volumeMounts": _mounts(role),
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **({"ports": ports} if ports else {}),
    }


def unit_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec with the CRD defaults applied (objects from the API already have them)."""
    return m.PDUnitSpec.model_validate(spec).model_dump(by_alias=True, exclude_none=True)


def desired_pod(unit: dict[str, Any]) -> dict[str, Any]:
    """The Pod manifest of one PDUnit. Raises pydantic.ValidationError on a bad spec."""
    meta = _meta(unit)
    name = meta["name"]
    spec = unit_defaults(unit.get("spec") or {})
    port = spec["lbPort"]

    labels = {k: v for k, v in _labels(unit).items() if k != m.LABEL_TEMPLATE_HASH}
    labels.update(
        {
            m.LABEL_NAME: "pdunit",
            m.LABEL_COMPONENT: "unit",
            m.LABEL_MANAGED_BY: "pdunit-operator",
            m.LABEL_UNIT: name,
        }
    )
    if m.LABEL_SET in _labels(unit):
        labels[m.LABEL_SET] = _labels(unit)[m.LABEL_SET]

    lb = _container(name, spec, "lb", "lb")
    lb["ports"] = [
        {"name": "http", "containerPort": port, "protocol": "TCP"},  # streams, /v1/load, /metrics
        {"name": ADMIN_PORT_NAME, "containerPort": spec["adminPort"], "protocol": "TCP"},
    ]
    lb["readinessProbe"] = {
        "httpGet": {"path": "/readyz", "port": port},
        "periodSeconds": 2,
        "timeoutSeconds": 1,
        "failureThreshold": 1,
        "successThreshold": 1,
    }
    lb["livenessProbe"] = {
        "httpGet": {"path": "/healthz", "port": port},
        "periodSeconds": 10,
        "timeoutSeconds": 2,
        "failureThreshold": 3,
    }
    containers = [lb, _container(name, spec, "prefill", "prefill")]
    n_decoders = int(spec.get("decoders", 1))
    for i, container in enumerate(decode_names(n_decoders)):  # 1PnD: one decode engine (and GPU) each
        containers.append(_container(name, spec, "decode", container, i))
    for c, role in zip(containers, ["lb", "prefill", *["decode"] * n_decoders], strict=True):
        c["lifecycle"] = {"preStop": _pre_stop(spec, role)}

    sidecars = []
    if spec["transfer"] in TRANSFERS_WITH_PROXY:
        proxy = _container(name, spec, "proxy", "nvlink-proxy")
        # Native sidecar: started before prefill/decode, which start only once the
        # startup probe sees the proxy's socket, and stopped after them.
        proxy["restartPolicy"] = "Always"
        proxy["startupProbe"] = {
            "exec": {
                "command": [
                    "python3",
                    "-c",
                    f"import os,sys; sys.exit(not os.path.exists({PROXY_SOCKET!r}))",
                ]
            },
            "periodSeconds": 1,
            "failureThreshold": 120,
        }
        sidecars.append(proxy)
    guard = _container(name, spec, "guard", "quiesce-guard")
    guard["restartPolicy"] = "Always"
    sidecars.append(guard)

    pod_spec: dict[str, Any] = {
        "initContainers": sidecars,
        "containers": containers,
        # Measured: a proxy in a PID namespace of its own cannot open the other
        # containers' CUDA IPC handles.
        "shareProcessNamespace": True,
        "terminationGracePeriodSeconds": spec["drainTimeoutSeconds"] + GRACE_MARGIN_SECONDS,
        "restartPolicy": "Always",
        # Unit pods never talk to the Kubernetes API.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumes": [
            {"name": "run", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "4Gi"}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
            *(
                {
                    "name": key,
                    "secret": {
                        "secretName": secret_name(name),
                        "items": [{"key": key, "path": key}],
                        "defaultMode": SECRET_FILE_MODE,
                    },
                }
                for key in (UNIT_SECRET_KEY, ADMIN_TOKEN_KEY)
            ),
        ],
    }
    if spec.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(spec["nodeSelector"])
    if spec.get("tolerations"):
        pod_spec["tolerations"] = [dict(t) for t in spec["tolerations"]]

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": meta.get("namespace"),
            "labels": labels,
            "annotations": {m.ANNOTATION_SPEC_HASH: spec_hashes(spec)[0]},
            "ownerReferences": [_owner(unit)],
        },
        "spec": pod_spec,
    }


# ------------------------------------------------------------------ observed status


def pod_ready(pod: dict[str, Any] | None) -> bool:
    if not pod:
        return False
    for cond in _status(pod).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def pod_running(pod: dict[str, Any] | None) -> bool:
    """Whether the pod's containers may hold streams (only a Running pod can)."""
    return bool(pod) and _status(pod).get("phase") == "Running"  # type: ignore[arg-type]


def pod_problem(pod: dict[str, Any]) -> str | None:
    """The first waiting/terminated reason of any container, or why it is unschedulable."""
    status = _status(pod)
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in status.get(key) or []:
            state = cs.get("state") or {}
            waiting = state.get("waiting") or {}
            if waiting.get("reason") and waiting["reason"] not in (
                "ContainerCreating",
                "PodInitializing",
            ):
                return f"container {cs.get('name')}: {waiting['reason']}: {waiting.get('message', '')}".strip()
            term = state.get("terminated") or {}
            if term and term.get("exitCode", 0) != 0:
                return f"container {cs.get('name')} exited {term.get('exitCode')}: {term.get('reason', '')}"
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"unschedulable: {cond.get('message', cond.get('reason', ''))}"
    return None


def lb_port(unit_spec: dict[str, Any], pod: dict[str, Any] | None, allow_override: bool) -> int:
    """The LB port to reach: spec.lbPort, or the test-only pod annotation when allowed."""
    port = int(unit_spec.get("lbPort", 8000))
    if allow_override and pod:
        raw = (_meta(pod).get("annotations") or {}).get(m.ANNOTATION_LB_PORT_OVERRIDE)
        if raw and raw.isdigit() and 0 < int(raw) < 65536:
            port = int(raw)
    return port


def admin_port(pod: dict[str, Any] | None, allow_override: bool) -> int | None:
    """The port of the pod's LB admin routes: the LB container's `admin` port (or the
    test-only annotation when allowed). None for a pod an operator made before the admin
    port existed: its LB serves the drain on lbPort, without a token."""
    if not pod:
        return None
    if allow_override:
        raw = (_meta(pod).get("annotations") or {}).get(m.ANNOTATION_ADMIN_PORT_OVERRIDE)
        if raw and raw.isdigit() and 0 < int(raw) < 65536:
            return int(raw)
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == "lb":
            for p in c.get("ports") or []:
                if p.get("name") == ADMIN_PORT_NAME:
                    return int(p["containerPort"])
    return None


def set_condition(
    conditions: list[dict[str, Any]] | None,
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: datetime,
) -> list[dict[str, Any]]:
    """Upsert one condition; lastTransitionTime changes only when the status flips."""
    out = [dict(c) for c in conditions or []]
    value = "True" if status else "False"
    for cond in out:
        if cond.get("type") == type_:
            if cond.get("status") != value:
                cond["lastTransitionTime"] = iso(now)
            cond.update(status=value, reason=reason, message=message)
            return out
    out.append(
        {
            "type": type_,
            "status": value,
            "reason": reason,
            "message": message,
            "lastTransitionTime": iso(now),
        }
    )
    return out


def unit_status(
    unit: dict[str, Any],
    pod: dict[str, Any] | None,
    load: dict[str, Any] | None,
    load_error: str | None,
    now: datetime,
    *,
    port: int,
    drain: dict[str, Any] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    """The PDUnit status from its pod and the LB's `/v1/load` (None when unreachable)."""
    spec = unit.get("spec") or {}
    old = _status(unit)
    conditions = old.get("conditions")
    draining = bool(spec.get("draining")) or deleting
    status: dict[str, Any] = {
        "observedGeneration": _meta(unit).get("generation"),
        "podName": _meta(pod)["name"] if pod else None,
        "podIP": _status(pod).get("podIP") if pod else None,
        "nodeName": (pod.get("spec") or {}).get("nodeName") if pod else None,
        "lbPort": port,
        "draining": draining or bool(load and load.get("draining")),
        "transferMode": (load or {}).get("transfer_mode") or old.get("transferMode"),
        "inFlight": int((load or {}).get("streams_in_flight", 0))
        if load
        else (old.get("inFlight") if pod else 0),
        "heldPages": int((load or {}).get("held_pages", 0))
        if load
        else (old.get("heldPages") if pod else 0),
        "drain": drain,
    }
    problem = pod_problem(pod) if pod else None
    if load is None and load_error and pod_ready(pod):
        # One failed scrape (a busy node, a slow answer) is not a readiness change: the
        # kubelet's probe on /readyz is the authority, so keep the LB's last answer;
        # LoadReachable=False below says the figures are stale.
        lb_ready = bool(old.get("ready")) and not status["draining"]
    else:
        lb_ready = bool(load and load.get("ready")) and not status["draining"]
    ready = pod_ready(pod) and lb_ready

    if draining:
        done = bool(drain and drain.get("completedAt")) and pod is None
        phase = "Drained" if done else "Draining"
        message = "drained: pod deleted" if done else "draining: waiting for streams to finish"
        if drain and drain.get("forced"):
            message += f" (forced after timeout, {drain.get('streamsCut', 0)} streams cut)"
    elif pod is None:
        phase, message = "Pending", "creating the pod"
    elif _status(pod).get("phase") in ("Failed", "Succeeded"):
        phase, message = (
            "Failed",
            f"pod {_status(pod).get('phase')}: {problem or _status(pod).get('reason', '')}",
        )
    elif _status(pod).get("phase") != "Running":
        phase, message = "Pending", problem or "pod pending"
    elif ready:
        phase, message = "Ready", "serving"
    else:
        phase = "Starting"
        if problem:
            message = problem
        elif load_error:
            message = f"LB /v1/load unreachable: {load_error}"
        elif load is not None and not load.get("ready"):
            message = "LB reports not ready (prefill/decode starting)"
        else:
            message = "waiting for pod readiness"
    status["phase"] = phase
    status["ready"] = ready and phase == "Ready"
    status["message"] = message
    conditions = set_condition(conditions, "SpecValid", True, "Valid", "", now)
    conditions = set_condition(conditions, "Reconciled", True, "Reconciled", "", now)
    conditions = set_condition(conditions, "Ready", status["ready"], phase, message, now)
    reachable = load is not None
    conditions = set_condition(
        conditions,
        "LoadReachable",
        reachable,
        "Reachable" if reachable else ("NoPod" if not pod_running(pod) else "Unreachable"),
        "" if reachable else (load_error or "pod not running"),
        now,
    )
    fallback = tcp_fallback(spec, status["transferMode"])
    if fallback is not None:
        conditions = set_condition(
            conditions,
            "TcpFallback",
            bool(fallback),
            "AutoChoseTcp" if fallback else "NoFallback",
            fallback,
            now,
        )
    status["conditions"] = conditions
    return status


TCP_FALLBACK_MESSAGE = (
    "transfer auto chose tcp on a GPU unit: KV goes over the loopback network, tens of times "
    "slower than the proxy; every faster mode failed its verified probe (the prefill container's "
    "'transfer probe' log lines name each error; docs/transfer.md lists what a pod needs)"
)


def tcp_fallback(spec: dict[str, Any], transfer_mode: str | None) -> str | None:
    """What the TcpFallback condition says: TCP_FALLBACK_MESSAGE when `transfer: auto` on
    a GPU unit ended on tcp (the articles' worst bug was such a switch, silent and ~300x
    slower), "" when the mode in use is another, None while no mode is known yet. A
    `transfer: tcp` the spec asks for is not a fallback."""
    if not transfer_mode:
        return None
    on_tcp = spec.get("transfer", "auto") == "auto" and spec.get("device", "cuda") == "cuda" and \
        "tcp" in transfer_mode.split(",")
    return TCP_FALLBACK_MESSAGE if on_tcp else ""


def invalid_status(unit: dict[str, Any], message: str, now: datetime) -> dict[str, Any]:
    """Status of a unit whose spec the operator cannot use: Failed, naming the field."""
    conditions = set_condition(
        _status(unit).get("conditions"), "SpecValid", False, "InvalidSpec", message, now
    )
    return {
        "phase": "Failed",
        "ready": False,
        "message": f"invalid spec: {message}",
        "observedGeneration": _meta(unit).get("generation"),
        "conditions": conditions,
    }


# ------------------------------------------------------------------------ the drain


@dataclass
class DrainStep:
    """What to do next for a draining unit.

    action: "wait" (check again later), "delete" (clean: two empty checks, or no pod
    that could hold streams), "force" (drain timeout passed; `streams_cut` streams die).
    """

    state: dict[str, Any]
    action: str
    request_drain: bool
    streams_cut: int = 0
    reason: str = ""


def drain_step(
    state: dict[str, Any] | None,
    *,
    now: datetime,
    load: dict[str, Any] | None,
    pod_may_hold_streams: bool,
    timeout_s: float,
    check_interval_s: float,
    last_in_flight: int = 0,
) -> DrainStep:
    """One tick of the unit drain (PROTOCOL.md section 5).

    Two *independent* empty answers, at least `check_interval_s` apart, with no
    non-empty answer between them, prove the unit idle. An unreachable LB proves
    nothing (the checks restart). After `timeout_s` the pod is deleted anyway and the
    streams still in flight are counted as cut.
    """
    st = dict(state or {})
    started = parse_time(st.get("startedAt")) or now
    st["startedAt"] = iso_us(started)
    request = not st.get("requested")
    if not pod_may_hold_streams:
        st.update(emptyChecks=0, firstEmptyAt=None)
        return DrainStep(
            st, "delete", request_drain=False, reason="no running pod: nothing in flight"
        )

    if load is not None and load.get("empty") is True:
        first = parse_time(st.get("firstEmptyAt"))
        if not st.get("emptyChecks") or first is None:
            st.update(emptyChecks=1, firstEmptyAt=iso_us(now))
            return DrainStep(st, "wait", request, reason="first empty check")
        if (now - first).total_seconds() >= check_interval_s:
            st["emptyChecks"] = 2
            return DrainStep(st, "delete", request, reason="two empty checks")
        return DrainStep(st, "wait", request, reason="second empty check not due yet")

    st.update(emptyChecks=0, firstEmptyAt=None)
    if (now - started).total_seconds() >= timeout_s:
        cut = int(load.get("streams_in_flight", 0)) if load else int(last_in_flight or 0)
        st.update(forced=True, streamsCut=cut)
        return DrainStep(st, "force", request, streams_cut=cut, reason="drain timeout")
    why = (
        "LB unreachable"
        if load is None
        else f"{load.get('streams_in_flight', '?')} streams in flight"
    )
    return DrainStep(st, "wait", request, reason=why)


# -------------------------------------------------------------------- the unit set


@dataclass
class Action:
    """One decision of the set controller. kind: create | drain | undrain | delete |
    relabel (a unit of the current template labelled with its legacy hash)."""

    kind: str
    unit: str | None = None
    template_hash: str | None = None
    reason: str = ""


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    template_hash: str = ""

    def kinds(self) -> list[str]:
        return [a.kind for a in self.actions]


def unit_is_ready(unit: dict[str, Any]) -> bool:
    return bool(_status(unit).get("ready")) and _status(unit).get("phase") == "Ready"


def unit_in_flight(unit: dict[str, Any]) -> int:
    return int(_status(unit).get("inFlight") or 0)


def unit_deleting(unit: dict[str, Any]) -> bool:
    return bool(_meta(unit).get("deletionTimestamp"))


def unit_draining(unit: dict[str, Any]) -> bool:
    return bool((unit.get("spec") or {}).get("draining"))


def unit_drained(unit: dict[str, Any]) -> bool:
    return _status(unit).get("phase") == "Drained"


def pick_victims(units: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The n units to remove first: not-ready first, then fewest streams in flight,
    then the newest (least warm cache), then by name for a stable order."""
    if n <= 0:
        return []

    def key(u: dict[str, Any]) -> tuple[int, int, float, str]:
        created = parse_time(_meta(u).get("creationTimestamp"))
        age_key = -created.timestamp() if created else 0.0
        return (1 if unit_is_ready(u) else 0, unit_in_flight(u), age_key, _meta(u).get("name", ""))

    return sorted(units, key=key)[:n]


def plan_units(unitset: dict[str, Any], units: list[dict[str, Any]]) -> Plan:
    """Actions that move the set's units toward spec (one step; call again next tick).

    - Drained units are deleted; units being deleted are left to their finalizer.
    - Units of the current template hash are "new", others "old".
    - Missing new units: reclaim draining new units first (undrain), then create; while
      old units remain, creations are capped so that all units (draining included)
      stay within replicas + maxSurge.
    - Removal (drain) of old units, then of new units beyond replicas: not-ready units
      always may go; a ready unit only while the ready count stays >= replicas -
      maxUnavailable. So a rollout surges, waits for the new unit to be Ready, drains
      one old unit, and repeats; a scale-down drains the excess at once.
    """
    spec = unitset.get("spec") or {}
    replicas = int(spec.get("replicas", 1))
    strategy = spec.get("strategy") or {}
    max_surge = int(strategy.get("maxSurge", 1))
    max_unavailable = int(strategy.get("maxUnavailable", 0))
    hashes = template_hashes(spec.get("template") or {})
    current = hashes[0]
    plan = Plan(template_hash=current)
    for u in units:
        if _labels(u).get(m.LABEL_TEMPLATE_HASH) == hashes[1] != current and not unit_deleting(u):
            plan.actions.append(Action("relabel", unit=_meta(u)["name"], template_hash=current,
                                       reason="its template, hashed without API defaults"))

    active: list[dict[str, Any]] = []
    draining: list[dict[str, Any]] = []
    for u in units:
        name = _meta(u).get("name")
        if unit_deleting(u):
            draining.append(u)
        elif unit_drained(u):
            plan.actions.append(Action("delete", unit=name, reason="drained"))
        elif unit_draining(u):
            draining.append(u)
        else:
            active.append(u)
    new = [u for u in active if _labels(u).get(m.LABEL_TEMPLATE_HASH) in hashes]
    old = [u for u in active if _labels(u).get(m.LABEL_TEMPLATE_HASH) not in hashes]

    missing = replicas - len(new)
    if missing > 0:
        reclaimable = [
            u
            for u in draining
            if not unit_deleting(u) and _labels(u).get(m.LABEL_TEMPLATE_HASH) in hashes
        ]
        for u in reclaimable[:missing]:
            plan.actions.append(
                Action(
                    "undrain",
                    unit=_meta(u)["name"],
                    reason=f"scale-up to {replicas}: reuse a draining unit",
                )
            )
            active.append(u)
            draining.remove(u)
            missing -= 1
        creates = missing
        if old:
            total = len(active) + len(draining)
            creates = min(missing, replicas + max_surge - total)
        for _ in range(max(0, creates)):
            why = f"rollout to template {current}" if old else f"scale-up to {replicas}"
            plan.actions.append(Action("create", template_hash=current, reason=why))

    ready_count = sum(1 for u in active if unit_is_ready(u))
    budget = ready_count - (replicas - max_unavailable)
    removals: list[tuple[dict[str, Any], str]] = []
    for u in pick_victims(old, len(old)):
        if not unit_is_ready(u):
            removals.append((u, "rollout: replace a not-ready unit of an old template"))
        elif budget > 0:
            budget -= 1
            removals.append((u, f"rollout: replaced by template {current}"))
    excess = len(new) - replicas
    for u in pick_victims(new, max(0, excess)):
        if not unit_is_ready(u):
            removals.append((u, f"scale-down to {replicas}: not ready"))
        elif budget > 0:
            budget -= 1
            removals.append((u, f"scale-down to {replicas}: {unit_in_flight(u)} streams in flight"))
    for u, why in removals:
        plan.actions.append(Action("drain", unit=_meta(u)["name"], reason=why))
    return plan


def set_status(
    unitset: dict[str, Any], units: list[dict[str, Any]], now: datetime
) -> dict[str, Any]:
    """PDUnitSet status: counts over its units, the /scale selector, conditions."""
    spec = unitset.get("spec") or {}
    replicas = int(spec.get("replicas", 1))
    max_unavailable = int((spec.get("strategy") or {}).get("maxUnavailable", 0))
    hashes = template_hashes(spec.get("template") or {})
    active = [u for u in units if not (unit_deleting(u) or unit_draining(u) or unit_drained(u))]
    ready = sum(1 for u in active if unit_is_ready(u))
    updated = sum(1 for u in active if _labels(u).get(m.LABEL_TEMPLATE_HASH) in hashes)
    name = _meta(unitset)["name"]
    conditions = _status(unitset).get("conditions")
    available = ready >= replicas - max_unavailable
    conditions = set_condition(
        conditions,
        "Available",
        available,
        "MinimumUnitsReady" if available else "TooFewReadyUnits",
        f"{ready}/{replicas} units ready",
        now,
    )
    progressing = updated < replicas or len(active) != replicas or ready < replicas
    conditions = set_condition(
        conditions,
        "Progressing",
        progressing,
        "Reconciling" if progressing else "Complete",
        f"{updated} updated, {len(active)} current, {ready} ready of {replicas}",
        now,
    )
    conditions = set_condition(conditions, "SpecValid", True, "Valid", "", now)
    conditions = set_condition(conditions, "Reconciled", True, "Reconciled", "", now)
    return {
        "replicas": len(active),
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "drainingReplicas": len(units) - len(active),
        "selector": f"{m.LABEL_SET}={name}",
        "templateHash": hashes[0],
        "observedGeneration": _meta(unitset).get("generation"),
        "conditions": conditions,
    }


def new_unit(unitset: dict[str, Any], thash: str) -> dict[str, Any]:
    """A PDUnit manifest for the set's current template (name from generateName)."""
    meta = _meta(unitset)
    template = (unitset.get("spec") or {}).get("template") or {}
    tmeta = template.get("metadata") or {}
    labels = dict(tmeta.get("labels") or {})
    labels.update({m.LABEL_SET: meta["name"], m.LABEL_TEMPLATE_HASH: thash})
    spec = dict(template.get("spec") or {})
    spec["draining"] = False
    return {
        "apiVersion": m.API_VERSION,
        "kind": m.UNIT_KIND,
        "metadata": {
            "generateName": f"{meta['name']}-{thash[:5]}-",
            "namespace": meta.get("namespace"),
            "labels": labels,
            "annotations": dict(tmeta.get("annotations") or {}),
            "ownerReferences": [
                {
                    "apiVersion": m.API_VERSION,
                    "kind": m.SET_KIND,
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": spec,
    }
