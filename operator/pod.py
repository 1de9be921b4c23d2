"""The desired pod of one PDUnit and its Secret, as plain dicts the Kubernetes API takes.

Owns `desired_pod` (containers lb, prefill, decode or decode-<i>, native sidecars
nvlink-proxy and quiesce-guard; env, mounts, resources, probes, the preStop drain hook,
the spec's overrides merged in), `desired_secret`, `desired_claim_template` (gpuAllocation
dra) and how the operator reaches a pod's LB (`lb_port`, `admin_port`). The
commands come from engine/unit_layout.py, the one place `pdunit local` builds them too.
Must never draw a secret value (the caller does), never do I/O, never give an engine
container more or less than one GPU.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdunit.engine.unit_layout import (
    ADMIN_TOKEN_FILE,
    LB_PORT,
    RUN_DIR,
    UNIT_SECRET_FILE,
    VOICES_TOKEN_FILE,
    UnitPaths,
    UnitSpec,
    container_name,
    decode_names,
    metrics_port_of,
    unit_commands,
)
from pdunit.operator import models as m
from pdunit.operator.objects import (
    has_controller,
    labels_of,
    metadata_of,
    owned_by,
    status_of,
    terminating,
)
from pdunit.operator.spec_hash import spec_hashes
from pdunit.operator.unit_status import pod_problem

# Pod UID/GID of every container. One shared non-root UID is what lets the proxy open
# P's and D's CUDA IPC handles through the shared PID namespace (/proc/<pid> access
# between processes of the same UID needs no capability).
RUN_AS_USER = 10001
# Seconds added to drainTimeoutSeconds for the grace period: the preStop drain may use
# the whole drain timeout, then the processes still need time to exit on SIGTERM.
GRACE_MARGIN_SECONDS = 30
# Between the two independent empty checks of the preStop hook.
PRESTOP_CHECK_INTERVAL_SECONDS = 2
# The unit's Secret (desired_secret): one per PDUnit, owned by it, created once. P and D
# see only the unit secret, the LB only the admin token, each a read-only file of mode
# 0440 owned by root and the pod's fsGroup (the engine refuses a secret file other users
# can read; RUN_AS_USER reads it through the group).
# The keys are the files' names (engine/unit_layout.py places the files; the volume's
# item path is the key).
UNIT_SECRET_KEY = UNIT_SECRET_FILE.rsplit("/", 1)[1]
ADMIN_TOKEN_KEY = ADMIN_TOKEN_FILE.rsplit("/", 1)[1]
# The voices token is the user's (spec.voices.tokenSecret: one Secret for a set's units,
# whose voices a client uploads to each), mounted as the admin token is: key = file name.
VOICES_TOKEN_KEY = VOICES_TOKEN_FILE.rsplit("/", 1)[1]
SECRET_FILE_MODE = 0o440
# spec.tracing.otlpEndpoint reaches the processes that handle a request (the sidecars
# handle none) as the environment form of their --otlp-endpoint.
OTLP_ENDPOINT_ENV = "PDUNIT_OTLP_ENDPOINT"
TRACED_ROLES = ("lb", "prefill", "decode")
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


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


# CPU and memory every container requests unless spec.resources.<role> says otherwise:
# a pod holding two GPUs must not be QoS BestEffort (the first evicted under memory
# pressure). Sized for the processes' own needs; a large model's weights in host memory
# need more on prefill and decode (spec.resources).
DEFAULT_REQUESTS: dict[str, dict[str, str]] = {
    "lb": {"cpu": "250m", "memory": "512Mi"},
    "prefill": {"cpu": "1", "memory": "4Gi"},
    "decode": {"cpu": "1", "memory": "4Gi"},
    "proxy": {"cpu": "100m", "memory": "256Mi"},
    "guard": {"cpu": "50m", "memory": "128Mi"},
}


def _resources(spec: dict[str, Any], role: str, gpu: bool) -> dict[str, Any]:
    given = ((spec.get("resources") or {}).get(role)) or {}
    out: dict[str, Any] = {key: dict(given.get(key) or {}) for key in ("requests", "limits")}
    for name, amount in DEFAULT_REQUESTS[role].items():
        # A limit without a request makes Kubernetes request the limit: keep that meaning.
        out["requests"].setdefault(name, out["limits"].get(name, amount))
    if spec.get("qos") == "Guaranteed":
        for name in ("cpu", "memory"):
            out["limits"][name] = out["requests"][name] = out["limits"].get(name, out["requests"][name])
    if gpu:
        # Exactly one GPU per engine container is the unit's contract; a user value for
        # the GPU resource is overridden rather than silently doubled.
        gpu_name = spec.get("gpuResource", "nvidia.com/gpu")
        out["limits"][gpu_name] = 1
        out["requests"][gpu_name] = 1
    return {key: value for key, value in out.items() if value}


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
    if role == "proxy" and not uses_dra(spec):
        # No GPU is requested, yet the proxy must see every GPU to open P's and D's
        # memory in one context: the NVIDIA container runtime honours this env variable,
        # or (proxyDeviceAccess volumeMounts) a mount under NVIDIA_DEVICES_DIR (_mounts).
        if spec.get("proxyDeviceAccess", "envVar") == "envVar":
            env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"})
        env.append({"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"})
    endpoint = (spec.get("tracing") or {}).get("otlpEndpoint")
    if endpoint and role in TRACED_ROLES:  # engine/tracing.py's --otlp-endpoint
        env.append({"name": OTLP_ENDPOINT_ENV, "value": endpoint})
    # User env last: it may override ours on purpose (e.g. HOME), never the reverse.
    seen = {e["name"]: i for i, e in enumerate(env)}
    for item in [*(spec.get("env") or []), *((spec.get("roleEnv") or {}).get(role) or [])]:
        entry = {k: item[k] for k in ("name", "value", "valueFrom") if item.get(k) is not None}
        if item["name"] in seen:
            env[seen[item["name"]]] = entry
        else:
            seen[item["name"]] = len(env)
            env.append(entry)
    return env


# The Secret's key each role reads (its volume carries that key only).
_SECRET_OF_ROLE = {"prefill": UNIT_SECRET_KEY, "decode": UNIT_SECRET_KEY, "lb": ADMIN_TOKEN_KEY}
_SECRET_FILE = {UNIT_SECRET_KEY: UNIT_SECRET_FILE, ADMIN_TOKEN_KEY: ADMIN_TOKEN_FILE,
                VOICES_TOKEN_KEY: VOICES_TOKEN_FILE}


def _voices_token_secret(spec: dict[str, Any]) -> str | None:
    """The Secret holding the voices token, when the unit's voice store takes writes."""
    return (spec.get("voices") or {}).get("tokenSecret") or None


def _mounts(spec: dict[str, Any], role: str) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"name": "run", "mountPath": RUN_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    keys = [_SECRET_OF_ROLE[role]] if role in _SECRET_OF_ROLE else []
    if role == "lb" and _voices_token_secret(spec):
        keys.append(VOICES_TOKEN_KEY)
    for key in keys:
        folder = _SECRET_FILE[key].rsplit("/", 1)[0]
        mounts.append({"name": key, "mountPath": folder, "readOnly": True})
    if role == "proxy" and _proxy_mounts_devices(spec):
        mounts.append({"name": NVIDIA_ALL_GPUS_VOLUME, "mountPath": f"{m.NVIDIA_DEVICES_DIR}/all",
                       "readOnly": True})
    if role == "decode" and spec.get("codecConvTable"):  # the file of _codec_conv_table_volume
        mounts.append({"name": m.CODEC_CONV_TABLE_VOLUME, "mountPath": m.CODEC_CONV_TABLE_DIR, "readOnly": True})
    voices = spec.get("voices")
    if voices and role == "lb":  # claimName: the pod volume _voices_volume adds
        mounts.append({"name": voices.get("volume") or m.VOICES_CLAIM_VOLUME, "mountPath": m.VOICES_MOUNT_PATH,
                       **{k: voices[k] for k in ("subPath", "readOnly") if k in voices}})
    # The user's mounts after ours (the models refuse names and paths of ours).
    mounts.extend(dict(x) for x in (spec.get("volumeMounts") or {}).get(role) or [])
    return mounts + _carried_mounts(spec, role, mounts)


def _voices_volume(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod volume of spec.voices.claimName: the set's shared voice store (one
    ReadWriteMany claim that every unit's LB mounts). None for spec.voices.volume (the
    user's own volume of spec.volumes) or no voice store."""
    claim = (spec.get("voices") or {}).get("claimName")
    if not claim:
        return []
    source: dict[str, Any] = {"claimName": claim}
    if (spec.get("voices") or {}).get("readOnly"):
        source["readOnly"] = True
    return [{"name": m.VOICES_CLAIM_VOLUME, "persistentVolumeClaim": source}]


def _codec_conv_table_volume(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod volume of spec.codecConvTable: the one ConfigMap key, as the file
    CODEC_CONV_TABLE_FILE names (every decode engine mounts its folder read-only)."""
    table = spec.get("codecConvTable")
    if not table:
        return []
    file = m.CODEC_CONV_TABLE_FILE.rsplit("/", 1)[1]
    return [{"name": m.CODEC_CONV_TABLE_VOLUME,
             "configMap": {"name": table["configMapName"], "items": [{"key": table["key"], "path": file}]}}]


def folders_read(spec: dict[str, Any], role: str) -> list[str]:
    """The folders a speaking unit's `role` reads that the engines' mounts may hold: the
    LB spec.model (tokenizer.json, config.json; `checkpoint`: its codec) and a codec
    folder, every decode engine the codec folder. Absolute paths only."""
    codec = spec.get("codec") or ""
    if not codec:
        return []
    wanted = [spec["model"]] if role == "lb" else []
    if role in ("lb", "decode") and codec.startswith("/"):
        wanted.append(codec)
    return [p for p in wanted if p.startswith("/")]


def _holder(mounts: Sequence[dict[str, Any]], path: str) -> dict[str, Any] | None:
    """The mount whose mountPath is the deepest at or above `path`."""
    best: dict[str, Any] | None = None
    for mount in mounts:
        at = mount["mountPath"].rstrip("/")
        if (path == at or path.startswith(at + "/")) and (best is None or len(at) > len(best["mountPath"].rstrip("/"))):
            best = mount
    return best


def _carried_mounts(spec: dict[str, Any], role: str, own: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Read-only copies of the spec's mounts (of prefill, decode or the LB) holding a
    folder `role` reads (folders_read) that none of its own mounts holds: a checkpoint
    on a volume mounted for prefill and decode reaches the LB at the same path. A folder
    no mount holds is the image's."""
    user = spec.get("volumeMounts") or {}
    carried: list[dict[str, Any]] = []
    for path in folders_read(spec, role):
        if _holder([*own, *carried], path):
            continue
        for other in ("prefill", "decode", "lb"):
            found = _holder(user.get(other) or [], path)
            if found:
                carried.append({**found, "readOnly": True})
                break
    return carried


NVIDIA_ALL_GPUS_VOLUME = "nvidia-all-gpus"
# The pod's claim of the unit's GPUs (gpuAllocation dra) and its template's requests: one
# per engine container, named as the container; the proxy holds the whole claim.
GPU_CLAIM = "gpus"


def uses_dra(spec: dict[str, Any]) -> bool:
    return spec.get("gpuAllocation") == "dra"


def _proxy_mounts_devices(spec: dict[str, Any]) -> bool:
    return not uses_dra(spec) and spec.get("proxyDeviceAccess") == "volumeMounts"


def claim_template_name(unit_name: str, devices: dict[str, Any]) -> str:
    """The name of a unit's ResourceClaimTemplate (gpuAllocation dra): the unit's name and
    a hash of what it asks for. Templates are immutable, so a spec that asks for other
    GPUs (more decoders, another class) gets a template of its own for its next pod."""
    digest = hashlib.sha256(json.dumps(devices, sort_keys=True).encode()).hexdigest()[:8]
    return f"{unit_name}-gpus-{digest}"


def _engine_names(spec: dict[str, Any]) -> list[str]:
    return [container_name("prefill"), *(container_name(p) for p in decode_names(int(spec.get("decoders", 1))))]


def desired_claim_template(unit: dict[str, Any]) -> dict[str, Any] | None:
    """The ResourceClaimTemplate (resource.k8s.io/v1) of a gpuAllocation dra unit, None for
    any other: one request of exactly one GPU per engine container (named as it), all of
    them constrained to one value of spec.dra.nvlinkDomainAttribute when it is set. The
    kubelet's claim is made from it per pod and goes with the pod; the template goes with
    the unit (ownerReference)."""
    spec = unit_defaults(unit.get("spec") or {})
    if not uses_dra(spec):
        return None
    dra = spec.get("dra") or m.DraSettings().model_dump(by_alias=True, exclude_none=True)
    names = _engine_names(spec)
    devices: dict[str, Any] = {"requests": [
        {"name": n, "exactly": {"deviceClassName": dra["deviceClassName"], "allocationMode": "ExactCount",
                                "count": 1}} for n in names]}
    if dra.get("nvlinkDomainAttribute"):
        devices["constraints"] = [{"requests": names, "matchAttribute": dra["nvlinkDomainAttribute"]}]
    meta = metadata_of(unit)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": claim_template_name(meta["name"], devices),
            "namespace": meta.get("namespace"),
            "labels": {m.LABEL_NAME: "pdunit", m.LABEL_COMPONENT: "unit-gpus",
                       m.LABEL_MANAGED_BY: "pdunit-operator", m.LABEL_UNIT: meta["name"]},
            "ownerReferences": [_owner(unit)],
        },
        "spec": {"spec": {"devices": devices}},
    }


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
    meta = metadata_of(unit)
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
        "name": metadata_of(unit)["name"],
        "uid": metadata_of(unit)["uid"],
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



def metrics_port(spec: dict[str, Any], role: str, index: int = 0) -> tuple[str, int] | None:
    """(container port name, port) that `role`'s process serves Prometheus /metrics on,
    decode engine `index` for a decode role; None for the LB (its /metrics is on lbPort)
    and for every role when metricsPort is 0. Names are fixed so that one PodMonitor
    (the chart's) lists them all."""
    port = metrics_port_of(int(spec["metricsPort"]), role, index)
    if port is None:
        return None
    return (f"metrics-decode{index}" if role == "decode" else f"metrics-{role}"), port


def layout_of(spec: dict[str, Any]) -> UnitSpec:
    """The unit's layout (engine/unit_layout.py) from a PDUnit spec with its defaults: the
    pod's paths, its ports, its engine options; everything else is the engines' default."""
    return UnitSpec(
        model=spec["model"],
        transfer=spec["transfer"],
        device=spec["device"],
        decoders=int(spec.get("decoders", 1)),
        kv_cache_dtype=spec.get("kvCacheDtype") or "auto",  # one value for P and every D
        prefill_gemm=spec.get("prefillGemm") or "bf16",
        decode_gemm=spec.get("decodeGemm") or "bf16",  # every D and P alike
        depth_kernels=spec.get("depthKernels") or "auto",  # every D and P alike
        decode_kernel=spec.get("decodeKernel") or "",
        lb_port=spec["lbPort"],
        # on the pod IP for the operator's drain, behind the token (and the chart's
        # NetworkPolicy); the stream port serves no admin route
        admin_port=spec["adminPort"],
        admin_host="0.0.0.0",
        metrics_port=int(spec["metricsPort"]),
        codec=spec.get("codec") or "",  # D's and the LB's --codec; with it the LB takes text (--model)
        voices=m.VOICES_MOUNT_PATH if spec.get("voices") else "",  # passed only with a codec
        paths=UnitPaths(voices_token_file=VOICES_TOKEN_FILE if _voices_token_secret(spec) else None),
        audio_first_chunk_frames=(spec.get("audio") or {}).get("firstChunkFrames"),
        audio_chunk_frames=(spec.get("audio") or {}).get("chunkFrames"),
        codec_conv_table=m.CODEC_CONV_TABLE_FILE if spec.get("codecConvTable") else "",
        extra_args={role: list(args or []) for role, args in (spec.get("extraArgs") or {}).items()},
    )


def _container(
    unit_name: str, spec: dict[str, Any], role: str, process: str, command: list[str], index: int = 0
) -> dict[str, Any]:
    metrics = metrics_port(spec, role, index)
    ports = [{"name": metrics[0], "containerPort": metrics[1], "protocol": "TCP"}] if metrics else []
    return {
        "name": container_name(process),
        "image": spec["image"],
        "imagePullPolicy": spec.get("imagePullPolicy", "IfNotPresent"),
        "command": command,
        "env": _env(unit_name, spec, role),
        "resources": _resources(
            spec, role, gpu=role in ("prefill", "decode") and spec["device"] == "cuda" and not uses_dra(spec)
        ),
        "volumeMounts": _mounts(spec, role),
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **({"ports": ports} if ports else {}),
    }


# Pod fields the spec passes through as they are (the apiserver validates them).
_POD_FIELDS = ("serviceAccountName", "priorityClassName", "runtimeClassName", "nodeSelector",
               "tolerations", "affinity", "topologySpreadConstraints")


def unit_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec with the CRD defaults applied (objects from the API already have them)."""
    return m.PDUnitSpec.model_validate(spec).model_dump(by_alias=True, exclude_none=True)


def desired_pod(unit: dict[str, Any], image_pull_secrets: Sequence[str] = ()) -> dict[str, Any]:
    """The Pod manifest of one PDUnit, pulled with `image_pull_secrets` (the operator's
    --unit-image-pull-secrets, the chart's imagePullSecrets) and the spec's own. Raises
    pydantic.ValidationError on a bad spec."""
    meta = metadata_of(unit)
    name = meta["name"]
    spec = unit_defaults(unit.get("spec") or {})
    port = spec["lbPort"]

    labels = {k: v for k, v in labels_of(unit).items() if k != m.LABEL_TEMPLATE_HASH}
    labels.update((spec.get("podMetadata") or {}).get("labels") or {})
    labels.update(
        {
            m.LABEL_NAME: "pdunit",
            m.LABEL_COMPONENT: "unit",
            m.LABEL_MANAGED_BY: "pdunit-operator",
            m.LABEL_UNIT: name,
        }
    )
    if m.LABEL_SET in labels_of(unit):
        labels[m.LABEL_SET] = labels_of(unit)[m.LABEL_SET]

    layout = layout_of(spec)
    commands = unit_commands(layout)
    lb = _container(name, spec, "lb", "lb", commands["lb"])
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
    containers = [lb, _container(name, spec, "prefill", "prefill", commands["prefill"])]
    n_decoders = layout.decoders
    for i, process in enumerate(decode_names(n_decoders)):  # 1PnD: one decode engine (and GPU) each
        containers.append(_container(name, spec, "decode", process, commands[process], i))
    for c, role in zip(containers, ["lb", "prefill", *["decode"] * n_decoders], strict=True):
        c["lifecycle"] = {"preStop": _pre_stop(spec, role)}

    sidecars = []
    if layout.runs_proxy:
        proxy = _container(name, spec, "proxy", "proxy", commands["proxy"])
        # Native sidecar: started before prefill/decode, which start only once the
        # startup probe sees the proxy's socket, and stopped after them.
        proxy["restartPolicy"] = "Always"
        proxy["startupProbe"] = {
            "exec": {
                "command": [
                    "python3",
                    "-c",
                    f"import os,sys; sys.exit(not os.path.exists({layout.paths.sock('proxy')!r}))",
                ]
            },
            "periodSeconds": 1,
            "failureThreshold": 120,
        }
        sidecars.append(proxy)
    guard = _container(name, spec, "guard", "guard", commands["guard"])
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
            *(
                {
                    "name": VOICES_TOKEN_KEY,
                    "secret": {
                        "secretName": secret,
                        "items": [{"key": VOICES_TOKEN_KEY, "path": VOICES_TOKEN_KEY}],
                        "defaultMode": SECRET_FILE_MODE,
                    },
                }
                for secret in [_voices_token_secret(spec)] if secret
            ),
            *_voices_volume(spec),
            *_codec_conv_table_volume(spec),
            *(dict(v) for v in spec.get("volumes") or []),
        ],
    }
    if _proxy_mounts_devices(spec) and layout.runs_proxy:
        pod_spec["volumes"].append({"name": NVIDIA_ALL_GPUS_VOLUME, "emptyDir": {"sizeLimit": "1Mi"}})
    if uses_dra(spec):
        template = desired_claim_template(unit)
        assert template is not None  # uses_dra
        pod_spec["resourceClaims"] = [{"name": GPU_CLAIM, "resourceClaimTemplateName": template["metadata"]["name"]}]
        for c in [*containers, *sidecars]:
            if c["name"] in _engine_names(spec):
                c["resources"]["claims"] = [{"name": GPU_CLAIM, "request": c["name"]}]
            elif c["name"] == container_name("proxy"):
                c["resources"]["claims"] = [{"name": GPU_CLAIM}]  # every request: the unit's GPUs
    pull = list(dict.fromkeys([*image_pull_secrets, *(s["name"] for s in spec.get("imagePullSecrets") or [])]))
    if pull:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in pull]
    for field in _POD_FIELDS:
        if spec.get(field):
            pod_spec[field] = spec[field]
    annotations = {**((spec.get("podMetadata") or {}).get("annotations") or {}),
                   m.ANNOTATION_SPEC_HASH: spec_hashes(spec)[0]}

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": meta.get("namespace"),
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [_owner(unit)],
        },
        "spec": pod_spec,
    }


def lb_port(unit_spec: dict[str, Any], pod: dict[str, Any] | None, allow_override: bool) -> int:
    """The LB port to reach: spec.lbPort, or the test-only pod annotation when allowed."""
    port = int(unit_spec.get("lbPort", LB_PORT))
    if allow_override and pod:
        raw = (metadata_of(pod).get("annotations") or {}).get(m.ANNOTATION_LB_PORT_OVERRIDE)
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
        raw = (metadata_of(pod).get("annotations") or {}).get(m.ANNOTATION_ADMIN_PORT_OVERRIDE)
        if raw and raw.isdigit() and 0 < int(raw) < 65536:
            return int(raw)
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == "lb":
            for p in c.get("ports") or []:
                if p.get("name") == ADMIN_PORT_NAME:
                    return int(p["containerPort"])
    return None



@dataclass(frozen=True)
class PodClaim:
    """What the unit does with the pod of its name: `create` (there is none), `own` (it
    is the unit's), `adopt` (it carries the unit's label and no controller: `patch` makes
    it the unit's) or `conflict` (another's: `message` says the fix)."""

    kind: str
    patch: dict[str, Any] | None = None
    message: str = ""


def claim_pod(unit: dict[str, Any], pod: dict[str, Any] | None) -> PodClaim:
    """Whose the pod named as the unit is (never take a pod another controller owns)."""
    meta = metadata_of(unit)
    if pod is None:
        return PodClaim("create")
    if owned_by(pod, meta["uid"]):
        return PodClaim("own")
    if labels_of(pod).get(m.LABEL_UNIT) == meta["name"] and not has_controller(pod):
        return PodClaim("adopt", patch={"metadata": {"ownerReferences": [_owner(unit)]}},
                        message=f"adopted existing pod {meta['name']}")
    ns, name = meta.get("namespace"), meta["name"]
    return PodClaim("conflict", message=(
        f"pod {ns}/{name} exists and is not this unit's (no {m.LABEL_UNIT}={name} label "
        "or another controller owns it); delete or rename that pod"))


def secret_problem(unit: dict[str, Any], secret: dict[str, Any]) -> str | None:
    """What is wrong with the unit's existing Secret and the fix; None when it is the
    unit's own and holds both values. A Secret someone else made is never used: its
    values would be known to them."""
    meta = metadata_of(unit)
    ns, name, uid = meta.get("namespace"), meta["name"], meta["uid"]
    secret_id = f"{ns}/{secret_name(name)}"
    if not owned_by(secret, uid):
        return (
            f"secret {secret_id} exists and is not this unit's (no controller ownerReference to "
            f"PDUnit {name} uid {uid}): delete it, the operator then creates the unit's own"
        )
    bad = [k for k in (UNIT_SECRET_KEY, ADMIN_TOKEN_KEY) if secret_value(secret, k) is None]
    if bad:
        return (
            f"secret {secret_id} has no valid {' or '.join(bad)} (base64 of at least "
            f"{SECRET_MIN_CHARS} characters): delete it, the operator then creates a new one"
        )
    return None


def replacement_reason(pod: dict[str, Any]) -> str | None:
    """Why the unit's pod must be deleted and made again (it ended: with restartPolicy
    Always only eviction or node loss ends a pod), None while it may still serve or is
    already going."""
    phase = status_of(pod).get("phase")
    if phase not in ("Failed", "Succeeded") or terminating(pod):
        return None
    why = pod_problem(pod) or status_of(pod).get("reason") or phase
    return f"pod {metadata_of(pod).get('name')} is {phase} ({why}); recreating it"
