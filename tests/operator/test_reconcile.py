"""Pure reconcile logic on plain dicts: pod shape, victim choice, rollout order, drain timing.

No server, no kopf: exactly the dicts the Kubernetes API serves, in and out.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import io
import re
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from pydantic import BaseModel, ValidationError

from pdunit.bench.scaler_bench import fake_load_document
from pdunit.engine.lb.load import LoadDocument, read_load_document
from pdunit.engine.security import write_secret_file
from pdunit.engine.settings import parse_config
from pdunit.engine.unit_layout import ADMIN_TOKEN_FILE, UNIT_SECRET_FILE, metrics_block
from pdunit.operator import models as m
from pdunit.operator.drain import DrainStep, drain_step
from pdunit.operator.objects import iso, iso_us
from pdunit.operator.pod import (
    ADMIN_TOKEN_KEY,
    SECRET_FILE_MODE,
    UNIT_SECRET_KEY,
    admin_port,
    desired_pod,
    desired_secret,
    lb_port,
    secret_name,
    secret_value,
    unit_defaults,
)
from pdunit.operator.rollout import new_unit, pick_victims, plan_units, set_status
from pdunit.operator.spec_hash import spec_hashes, template_hashes
from pdunit.operator.unit_status import unit_status
from tests.operator.envtest import FakeLb, wait_for

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def a_unit(name: str = "u1", set_name: str | None = "tts", **spec: Any) -> dict[str, Any]:
    labels = {"team": "tts"}
    if set_name:
        labels.update({m.LABEL_SET: set_name, m.LABEL_TEMPLATE_HASH: "abc"})
    return {
        "apiVersion": m.API_VERSION,
        "kind": m.UNIT_KIND,
        "metadata": {
            "name": name,
            "namespace": "prod",
            "uid": f"uid-{name}",
            "labels": labels,
            "generation": 3,
        },
        "spec": {"image": "reg/pdunit:1", "model": "random:qwen3-4b-shape:0", **spec},
    }


@functools.cache
def _secret_files() -> dict[str, str]:
    """The pod's secret files as the Secret's volume gives them (mode 0440), in a folder of
    this test run: the engines read them when they parse their flags."""
    folder = Path(tempfile.mkdtemp(prefix="pdunit-secrets-"))
    atexit.register(shutil.rmtree, folder, True)
    files = {}
    for path in (UNIT_SECRET_FILE, ADMIN_TOKEN_FILE):
        local = folder / Path(path).name
        write_secret_file(str(local))
        local.chmod(SECRET_FILE_MODE)
        files[path] = str(local)
    return files


def argv_here(command: list[str]) -> list[str]:
    """A container's `pdunit <role> ...` command as flags to parse here (its secret files
    in a local folder)."""
    return [_secret_files().get(a, a) for a in command[2:]]


def containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = pod["spec"]
    return {c["name"]: c for c in spec["containers"] + spec["initContainers"]}


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"] if "value" in e}


# ------------------------------------------------------------------------- pod shape


def test_pod_runs_lb_prefill_decode_with_proxy_and_guard_as_native_sidecars() -> None:
    pod = desired_pod(a_unit(transfer="auto"))
    assert [c["name"] for c in pod["spec"]["containers"]] == ["lb", "prefill", "decode"]
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["nvlink-proxy", "quiesce-guard"]
    for sidecar in pod["spec"]["initContainers"]:
        assert sidecar["restartPolicy"] == "Always"
    assert pod["spec"]["shareProcessNamespace"] is True


def test_prefill_and_decode_get_one_gpu_each_and_nothing_else_does() -> None:
    pod = desired_pod(
        a_unit(
            gpuResource="example.com/h200",
            resources={"prefill": {"limits": {"example.com/h200": 4, "memory": "64Gi"}}},
        )
    )
    cs = containers(pod)
    for name in ("prefill", "decode"):
        assert cs[name]["resources"]["limits"]["example.com/h200"] == 1
    assert cs["prefill"]["resources"]["limits"]["memory"] == "64Gi"
    for name in ("lb", "nvlink-proxy", "quiesce-guard"):
        assert "example.com/h200" not in (cs[name]["resources"].get("limits") or {})


def test_proxy_sees_all_gpus_without_requesting_one() -> None:
    proxy = containers(desired_pod(a_unit(transfer="proxy")))["nvlink-proxy"]
    assert env_of(proxy)["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert not proxy["resources"].get("limits")
    assert proxy["command"] == ["pdunit", "proxy", "--socket", "/run/pdunit/proxy.sock", "--metrics-port", "9401"]


@pytest.mark.parametrize(
    ("transfer", "has_proxy"),
    [
        ("auto", True),
        ("proxy", True),
        ("fabric", False),
        ("ipc", False),
        ("posix-fd", False),
        ("tcp", False),
        ("host", False),
    ],
)
def test_proxy_sidecar_only_for_proxy_and_auto_transfer(transfer: str, has_proxy: bool) -> None:
    names = [c["name"] for c in desired_pod(a_unit(transfer=transfer))["spec"]["initContainers"]]
    assert ("nvlink-proxy" in names) is has_proxy
    assert "quiesce-guard" in names


def test_container_commands_are_the_pdunit_cli() -> None:
    cs = containers(
        desired_pod(
            a_unit(transfer="fabric", lbPort=8100, extraArgs={"decode": ["--max-batch", "64"]})
        )
    )
    assert cs["lb"]["command"] == [
        "pdunit",
        "lb",
        "--prefill-socket",
        "/run/pdunit/prefill.sock",
        "--decode-socket",
        "/run/pdunit/decode.sock",
        "--port",
        "8100",
        "--admin-port",
        "8001",
        "--admin-host",
        "0.0.0.0",
        "--admin-token-file",
        "/var/run/secrets/pdunit/admin/admin-token",
    ]
    assert cs["prefill"]["command"] == [
        "pdunit",
        "prefill",
        "--socket",
        "/run/pdunit/prefill.sock",
        "--decode-socket",
        "/run/pdunit/decode.sock",
        "--model",
        "random:qwen3-4b-shape:0",
        "--transfer",
        "fabric",
        "--device",
        "cuda",
        "--unit-secret-file",
        "/var/run/secrets/pdunit/unit/unit-secret",
        "--metrics-port",
        "9400",
    ]
    assert cs["decode"]["command"] == [
        "pdunit",
        "decode",
        "--socket",
        "/run/pdunit/decode.sock",
        "--prefill-socket",
        "/run/pdunit/prefill.sock",
        "--model",
        "random:qwen3-4b-shape:0",
        "--transfer",
        "fabric",
        "--device",
        "cuda",
        "--unit-secret-file",
        "/var/run/secrets/pdunit/unit/unit-secret",
        "--metrics-port",
        "9403",
        "--max-batch",
        "64",
    ]
    assert cs["quiesce-guard"]["command"] == [
        "pdunit",
        "guard",
        "--prefill-socket",
        "/run/pdunit/prefill.sock",
        "--decode-socket",
        "/run/pdunit/decode.sock",
        "--port",
        "9402",
    ]


def _config_model(module: str) -> type[BaseModel]:
    mod = importlib.import_module(module)
    found = [
        v
        for v in vars(mod).values()
        if isinstance(v, type) and issubclass(v, BaseModel) and v.__name__.endswith("Config")
    ]
    assert len(found) == 1, f"{module} should define one *Config model, found {found}"
    return found[0]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_commands_parse_with_the_engines_own_config(role: str) -> None:
    """The flags desired_pod writes are flags the real processes accept."""
    module = {"prefill": "pdunit.engine.prefill.main", "decode": "pdunit.engine.decode.main"}[role]
    model = _config_model(module)
    argv = argv_here(containers(desired_pod(a_unit(transfer="proxy")))[role]["command"])
    cfg = parse_config(model, argv, f"pdunit {role}", env={})
    assert cfg.transfer == "proxy"  # type: ignore[attr-defined]
    assert cfg.device == "cuda"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("role", "module"),
    [
        ("lb", "pdunit.engine.lb.main"),
        ("proxy", "pdunit.sidecars.nvlink_proxy.main"),
        ("guard", "pdunit.sidecars.quiesce_guard.main"),
    ],
)
def test_sidecar_and_lb_commands_parse_with_their_config(role: str, module: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not written yet (another engineer's)")
    name = {"lb": "lb", "proxy": "nvlink-proxy", "guard": "quiesce-guard"}[role]
    argv = argv_here(containers(desired_pod(a_unit(transfer="proxy")))[name]["command"])
    parse_config(_config_model(module), argv, f"pdunit {role}", env={})


_MODULES = {
    "prefill": "pdunit.engine.prefill.main",
    "decode": "pdunit.engine.decode.main",
    "proxy": "pdunit.sidecars.nvlink_proxy.main",
    "guard": "pdunit.sidecars.quiesce_guard.main",
}
_ROLE_OF = {"prefill": "prefill", "decode-0": "decode", "decode-1": "decode", "nvlink-proxy": "proxy",
            "quiesce-guard": "guard"}


def _served_port(container: dict[str, Any]) -> int:
    """The port the container's process will serve /metrics on, read the way the process
    reads its flags."""
    role = _ROLE_OF[container["name"]]
    cfg = parse_config(_config_model(_MODULES[role]), argv_here(container["command"]), f"pdunit {role}", env={})
    return int(cfg.port if role == "guard" else cfg.metrics_port)  # type: ignore[attr-defined]


def test_every_process_but_the_lb_serves_metrics_on_a_named_port_of_the_block() -> None:
    """Without these, a pod exposed only the LB's metrics: D's steps, P's queue, the KV
    checks and the transfer mode (what the chart's dashboard queries) were never served."""
    pod = desired_pod(a_unit(transfer="proxy", decoders=2, metricsPort=9500))
    cs = containers(pod)
    declared = {name: c["ports"] for name, c in cs.items() if name != "lb"}
    assert set(declared) == set(_ROLE_OF)
    by_name = {}
    for name, ports in declared.items():
        assert len(ports) == 1, (name, ports)
        port = ports[0]
        assert port["containerPort"] == _served_port(cs[name]), name
        by_name[port["name"]] = port["containerPort"]
    assert by_name == {"metrics-prefill": 9500, "metrics-proxy": 9501, "metrics-guard": 9502,
                       "metrics-decode0": 9503, "metrics-decode1": 9504}
    assert sorted(by_name.values()) == list(metrics_block(9500, 2))
    assert cs["lb"]["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"},  # and its /metrics
                                 {"name": "admin", "containerPort": 8001, "protocol": "TCP"}]
    kubernetes_validate.validate(pod, "1.34.0", strict=True)  # port names are IANA service names


def test_metrics_port_zero_declares_no_metrics_port_and_the_guard_serves_no_http() -> None:
    cs = containers(desired_pod(a_unit(transfer="proxy", metricsPort=0)))
    assert [name for name, c in cs.items() if "ports" in c] == ["lb"]
    assert _served_port(cs["quiesce-guard"]) == 0
    for name in ("prefill", "nvlink-proxy"):
        assert "--metrics-port" not in cs[name]["command"]


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ({"lbPort": 9403}, "lbPort 9403 is one of 9400..9403"),  # the default block, one decoder
        ({"lbPort": 9404, "decoders": 2}, "lbPort 9404 is one of 9400..9404"),
        ({"metricsPort": 65533}, "65533 + 2 + decoders is 65536"),
    ],
)
def test_a_metrics_block_over_the_lb_port_or_past_65535_is_refused_naming_metrics_port(
        spec: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError) as exc:
        desired_pod(a_unit(**spec))
    message = m.validation_message(exc.value)
    assert "spec.metricsPort" in message and fragment in message, message
    desired_pod(a_unit(**{**spec, "metricsPort": 0}))  # no block, no clash


def test_cpu_device_requests_no_gpu() -> None:
    cs = containers(desired_pod(a_unit(device="cpu", transfer="host")))
    for name in ("prefill", "decode"):
        assert "nvidia.com/gpu" not in (cs[name]["resources"].get("limits") or {})
        command = cs[name]["command"]
        assert command[command.index("--device") + 1] == "cpu"


def test_sockets_live_in_one_shared_memory_volume() -> None:
    pod = desired_pod(a_unit())
    run = next(v for v in pod["spec"]["volumes"] if v["name"] == "run")
    assert run["emptyDir"]["medium"] == "Memory"
    for c in containers(pod).values():
        assert {"name": "run", "mountPath": "/run/pdunit"} in c["volumeMounts"]


def test_readiness_is_the_lb_readyz_on_the_unit_port() -> None:
    lb = containers(desired_pod(a_unit(lbPort=9000)))["lb"]
    assert lb["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 9000}
    assert lb["ports"][0]["containerPort"] == 9000


def test_grace_period_covers_the_drain_timeout() -> None:
    pod = desired_pod(a_unit(drainTimeoutSeconds=900))
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 900 + 10


def test_every_container_drops_all_capabilities_and_runs_read_only_as_non_root() -> None:
    pod = desired_pod(a_unit())
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["automountServiceAccountToken"] is False
    for c in containers(pod).values():
        sc = c["securityContext"]
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]


def test_a_1p2d_unit_runs_two_decode_engines_each_on_its_own_gpu_and_socket() -> None:
    pod = desired_pod(a_unit(decoders=2))
    by_name = {c["name"]: c for c in pod["spec"]["containers"]}
    assert set(by_name) == {"lb", "prefill", "decode-0", "decode-1"}
    socks = ["/run/pdunit/decode-0.sock", "/run/pdunit/decode-1.sock"]
    for i, sock in enumerate(socks):
        cmd = by_name[f"decode-{i}"]["command"]
        assert cmd[cmd.index("--socket") + 1] == sock
        assert by_name[f"decode-{i}"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    for role in ("prefill", "lb"):
        cmd = by_name[role]["command"]
        assert cmd[cmd.index("--decode-socket") + 1] == ",".join(socks)
    guard = next(c for c in pod["spec"]["initContainers"] if c["name"] == "quiesce-guard")["command"]
    assert guard[guard.index("--decode-socket") + 1] == ",".join(socks)  # the guard watches every D
    gpus = sum(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0) for c in pod["spec"]["containers"])
    assert gpus == 3
    # 1P1D keeps the plain socket name
    one = {c["name"]: c for c in desired_pod(a_unit())["spec"]["containers"]}
    assert "/run/pdunit/decode.sock" in one["decode"]["command"]


def test_kv_cache_dtype_reaches_prefill_and_every_decode_engine_alike() -> None:
    """One spec field, so P and its D's cannot disagree (P would refuse the D at Hello)."""
    by_name = {c["name"]: c for c in desired_pod(a_unit(decoders=2, kvCacheDtype="fp8_e4m3"))["spec"]["containers"]}
    for name, module in (("prefill", "pdunit.engine.prefill.main"), ("decode-0", "pdunit.engine.decode.main"),
                         ("decode-1", "pdunit.engine.decode.main")):
        argv = argv_here(by_name[name]["command"])
        cfg = parse_config(_config_model(module), argv, f"pdunit {name}", env={})
        assert cfg.kv_cache_dtype == "fp8_e4m3", name  # type: ignore[attr-defined]
    assert "--kv-cache-dtype" not in by_name["lb"]["command"]
    with pytest.raises(ValidationError) as exc:
        desired_pod(a_unit(kvCacheDtype="fp4"))
    assert "spec.kvCacheDtype" in m.validation_message(exc.value)


def test_decode_kernel_reaches_every_decode_engine_only_in_its_canonical_form() -> None:
    spec = a_unit(decoders=2, kvCacheDtype="fp8_e4m3", decodeKernel="fp8_dots=0,kv_as_a=1,block_n=64")
    by_name = {c["name"]: c for c in desired_pod(spec)["spec"]["containers"]}
    for name in ("decode-0", "decode-1"):
        cfg = parse_config(_config_model("pdunit.engine.decode.main"), argv_here(by_name[name]["command"]),
                           f"pdunit {name}", env={})
        assert cfg.decode_kernel == "kv_as_a=1,fp8_dots=0", name  # type: ignore[attr-defined]
    others = [n for n in by_name if not n.startswith("decode")]
    assert "prefill" in others and "lb" in others
    for name in others:
        assert "--decode-kernel" not in by_name[name]["command"], name
    # unset, empty or the defaults only: no flag at all
    for value in (None, "", "block_n=64"):
        pod = desired_pod(a_unit(**({} if value is None else {"decodeKernel": value})))
        decode = next(c for c in pod["spec"]["containers"] if c["name"] == "decode")
        assert "--decode-kernel" not in decode["command"], value
    for bad, fragment in (("nope=1", "unknown setting 'nope'"), ("fp8_dots=3", "fp8_dots=3 is not one of"),
                          ("fp8_dots", "should match pattern")):
        with pytest.raises(ValidationError) as exc:
            desired_pod(a_unit(decodeKernel=bad))
        message = m.validation_message(exc.value)
        assert "spec.decodeKernel" in message and fragment in message, message


@pytest.mark.parametrize(("field", "flag", "engines"), [
    ("prefillGemm", "--prefill-gemm", {"prefill": "pdunit.engine.prefill.main"}),
    # P too: its first frames run the depth decoder's GEMMs as D's do (FirstFrameFields.decode_gemm)
    ("decodeGemm", "--decode-gemm", {"decode-0": "pdunit.engine.decode.main", "decode-1": "pdunit.engine.decode.main",
                                     "prefill": "pdunit.engine.prefill.main"}),
])
def test_a_gemm_field_reaches_its_engines_only_and_only_when_fp8(field: str, flag: str,
                                                                 engines: dict[str, str]) -> None:
    by_name = containers(desired_pod(a_unit(decoders=2, **{field: "fp8"})))
    for name, module in engines.items():
        cfg = parse_config(_config_model(module), argv_here(by_name[name]["command"]), f"pdunit {name}", env={})
        assert getattr(cfg, flag[2:].replace("-", "_")) == "fp8", name
    others = set(by_name) - set(engines)
    assert {"lb", "nvlink-proxy", "quiesce-guard"} <= others, others
    for name in others:
        assert flag not in by_name[name]["command"], name
    # unset or bf16 (the engine's default): no flag at all
    for value in (None, "bf16"):
        pod = desired_pod(a_unit(decoders=2, **({} if value is None else {field: value})))
        for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]:
            assert flag not in c["command"], (value, c["name"])
    with pytest.raises(ValidationError) as exc:
        desired_pod(a_unit(**{field: "int8"}))
    assert f"spec.{field}" in m.validation_message(exc.value)


@pytest.mark.parametrize("kernels", ["torch", "fused"])
def test_depth_kernels_reach_every_decode_engine_and_prefills_first_frames_alike(kernels: str) -> None:
    engines = {"decode-0": "pdunit.engine.decode.main", "decode-1": "pdunit.engine.decode.main",
               "prefill": "pdunit.engine.prefill.main"}
    by_name = containers(desired_pod(a_unit(decoders=2, depthKernels=kernels)))
    for name, module in engines.items():
        cfg = parse_config(_config_model(module), argv_here(by_name[name]["command"]), f"pdunit {name}", env={})
        assert cfg.depth_kernels == kernels, name  # type: ignore[attr-defined]
    for name in set(by_name) - set(engines):
        assert "--depth-kernels" not in by_name[name]["command"], name
    # a flag in extraArgs comes after the field's and wins for its role only
    by_name = containers(desired_pod(a_unit(depthKernels=kernels, extraArgs={"decode": ["--depth-kernels", "auto"]})))
    got = {name: parse_config(_config_model(module), argv_here(by_name[name]["command"]), name, env={})
           for name, module in (("decode", "pdunit.engine.decode.main"), ("prefill", "pdunit.engine.prefill.main"))}
    assert (got["decode"].depth_kernels, got["prefill"].depth_kernels) == ("auto", kernels)  # type: ignore[attr-defined]


def test_depth_kernels_unset_or_auto_pass_no_flag_and_another_value_is_refused_naming_the_field() -> None:
    for value in (None, "auto"):
        pod = desired_pod(a_unit(decoders=2, **({} if value is None else {"depthKernels": value})))
        for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]:
            assert "--depth-kernels" not in c["command"], (value, c["name"])
    # D's extra flags stay D's: P takes the field, never D's extraArgs
    pod = desired_pod(a_unit(extraArgs={"decode": ["--depth-kernels", "torch"]}))
    assert "--depth-kernels" not in containers(pod)["prefill"]["command"]
    with pytest.raises(ValidationError) as exc:
        desired_pod(a_unit(depthKernels="triton"))
    assert "spec.depthKernels" in m.validation_message(exc.value)


def test_pod_is_owned_by_its_unit_and_carries_the_selector_labels() -> None:
    pod = desired_pod(a_unit("tts-abc12-x7"))
    assert pod["metadata"]["name"] == "tts-abc12-x7"
    assert pod["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "pdunit.dev/v1alpha1",
            "kind": "PDUnit",
            "name": "tts-abc12-x7",
            "uid": "uid-tts-abc12-x7",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    labels = pod["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "pdunit"
    assert labels["app.kubernetes.io/component"] == "unit"
    assert labels["pdunit.dev/unit"] == "tts-abc12-x7"
    assert labels["pdunit.dev/set"] == "tts"
    assert labels["team"] == "tts"
    assert m.LABEL_TEMPLATE_HASH not in labels


def test_standalone_unit_pod_has_no_set_label() -> None:
    assert m.LABEL_SET not in desired_pod(a_unit(set_name=None))["metadata"]["labels"]


def test_user_env_overrides_and_scheduling_fields_pass_through() -> None:
    pod = desired_pod(
        a_unit(
            env=[{"name": "HOME", "value": "/data"}, {"name": "X", "value": "1"}],
            nodeSelector={"gpu": "h200"},
            tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        )
    )
    env = env_of(containers(pod)["decode"])
    assert env["HOME"] == "/data" and env["X"] == "1" and env["PDUNIT_UNIT"] == "u1"
    assert pod["spec"]["nodeSelector"] == {"gpu": "h200"}
    assert pod["spec"]["tolerations"] == [
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]


@pytest.mark.parametrize("transfer", ["auto", "fabric"])
def test_pod_validates_against_the_kubernetes_1_34_schema(transfer: str) -> None:
    pod = desired_pod(a_unit(transfer=transfer, resources={"lb": {"requests": {"cpu": "500m"}}}))
    kubernetes_validate.validate(pod, "1.34.0", strict=True)


def test_invalid_unit_spec_raises_naming_the_field() -> None:
    with pytest.raises(ValidationError) as exc:
        desired_pod(a_unit(transfer="rdma"))
    assert "spec.transfer" in m.validation_message(exc.value)


def _pre_stop_argv(container: dict[str, Any], token_file: Path) -> list[str]:
    """The hook's argv to run here: this Python, the token file of the test's folder, and
    a short gap between the checks."""
    argv = container["lifecycle"]["preStop"]["exec"]["command"]
    assert argv[0] == "python3"
    argv = [sys.executable, *argv[1:]]
    argv = [str(token_file) if a == ADMIN_TOKEN_FILE else a for a in argv]
    argv[-1] = "0.2"
    return argv


def test_prestop_drains_with_the_admin_token_then_waits_for_two_empty_answers(tmp_path: Path) -> None:
    """The real hook script against a fake LB: it asks for the drain on the admin port
    with the token of its mounted file, holds while streams are in flight, and returns
    once /v1/load said empty twice."""
    token = "ab" * 32
    (tmp_path / "admin-token").write_text(token + "\n")
    lb = FakeLb("u1", token=token)
    try:
        lb.in_flight = 1
        cs = containers(desired_pod(a_unit(lbPort=lb.port, adminPort=lb.admin_port, drainTimeoutSeconds=30)))
        proc = subprocess.Popen(_pre_stop_argv(cs["lb"], tmp_path / "admin-token"), stderr=subprocess.PIPE)
        wait_for(lambda: lb.drain_log, 10, "the hook's drain request")
        assert proc.poll() is None, "preStop returned while a stream was in flight"
        assert lb.draining and lb.drain_log[0][1] is True and not lb.refused_log
        lb.in_flight = 0
        assert proc.wait(timeout=10) == 0
        assert sum(1 for _, empty in lb.load_log if empty) >= 2
    finally:
        lb.stop()


def test_prestop_of_prefill_and_decode_only_waits_and_holds_no_token(tmp_path: Path) -> None:
    """Only the LB's hook asks for the drain (only it mounts the admin token); the engines'
    hooks wait for the same two empty answers so they serve the streams in flight."""
    lb = FakeLb("u1", token="ab" * 32)
    try:
        cs = containers(desired_pod(a_unit(lbPort=lb.port, adminPort=lb.admin_port, drainTimeoutSeconds=30)))
        for name in ("prefill", "decode"):
            argv = cs[name]["lifecycle"]["preStop"]["exec"]["command"]
            assert ADMIN_TOKEN_FILE not in argv and str(lb.admin_port) not in argv
            assert subprocess.run(_pre_stop_argv(cs[name], tmp_path / "none"), timeout=10).returncode == 0
        assert not lb.drain_log and not lb.refused_log
        assert sum(1 for _, empty in lb.load_log if empty) >= 4
    finally:
        lb.stop()


# ------------------------------------------------------- the unit's Secret and admin port

SECRET = "5e" * 32
TOKEN = "a0" * 32


def test_the_unit_secret_is_owned_by_its_unit_immutable_and_holds_both_values() -> None:
    unit = a_unit("u7")
    secret = desired_secret(unit, SECRET, TOKEN)
    assert secret["metadata"]["name"] == secret_name("u7") == "u7-unit-secret"
    assert secret["metadata"]["namespace"] == "prod"
    owner = secret["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("PDUnit", "u7", "uid-u7", True)
    assert secret["immutable"] is True  # kept as created: P and D of every pod share it
    assert secret_value(secret, UNIT_SECRET_KEY) == SECRET
    assert secret_value(secret, ADMIN_TOKEN_KEY) == TOKEN
    kubernetes_validate.validate(secret, "1.34.0", strict=True)


@pytest.mark.parametrize("short", ["", "0" * 31])
def test_the_unit_secret_never_holds_an_empty_or_short_value(short: str) -> None:
    with pytest.raises(ValueError, match="unit-secret has"):
        desired_secret(a_unit(), short, TOKEN)
    with pytest.raises(ValueError, match="admin-token has"):
        desired_secret(a_unit(), SECRET, short)


def test_a_secret_value_that_is_missing_short_or_not_base64_is_no_value() -> None:
    secret = desired_secret(a_unit(), SECRET, TOKEN)
    assert secret_value({"data": {}}, ADMIN_TOKEN_KEY) is None
    assert secret_value({"data": {ADMIN_TOKEN_KEY: "c2hvcnQ="}}, ADMIN_TOKEN_KEY) is None  # "short"
    assert secret_value({"data": {ADMIN_TOKEN_KEY: "not base64!"}}, ADMIN_TOKEN_KEY) is None
    assert secret_value(secret, ADMIN_TOKEN_KEY) == TOKEN


def test_engines_mount_only_the_unit_secret_and_the_lb_only_the_admin_token_read_only() -> None:
    pod = desired_pod(a_unit("u7", decoders=2))
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for key in (UNIT_SECRET_KEY, ADMIN_TOKEN_KEY):
        assert volumes[key]["secret"] == {
            "secretName": "u7-unit-secret", "items": [{"key": key, "path": key}], "defaultMode": 0o440,
        }
    secret_mounts = {
        name: [(v["name"], v["mountPath"], v.get("readOnly")) for v in c["volumeMounts"] if v["name"] in volumes
               and "secret" in volumes[v["name"]]]
        for name, c in containers(pod).items()
    }
    unit_secret = [(UNIT_SECRET_KEY, "/var/run/secrets/pdunit/unit", True)]
    assert secret_mounts == {
        "lb": [(ADMIN_TOKEN_KEY, "/var/run/secrets/pdunit/admin", True)],
        "prefill": unit_secret, "decode-0": unit_secret, "decode-1": unit_secret,
        "nvlink-proxy": [], "quiesce-guard": [],
    }
    cs = containers(pod)
    for name in ("prefill", "decode-0", "decode-1"):
        i = cs[name]["command"].index("--unit-secret-file")
        assert cs[name]["command"][i + 1] == UNIT_SECRET_FILE
    # root-owned files of mode 0440 and group fsGroup: the pod's user reads them as the group
    assert pod["spec"]["securityContext"]["fsGroup"] == pod["spec"]["securityContext"]["runAsUser"]


def test_the_mounted_file_mode_passes_the_engines_secret_file_rule(tmp_path: Path) -> None:
    """The engine refuses a secret file other users may read; the mode the pod's Secret
    volume gives passes that rule, and the mode of a plain ConfigMap-like 0644 does not."""
    from pdunit.engine.security import SecretFileError, read_secret_file

    path = tmp_path / "unit-secret"
    path.write_text(SECRET + "\n")
    path.chmod(SECRET_FILE_MODE)
    assert read_secret_file(str(path)) == SECRET.encode()
    path.chmod(0o644)
    with pytest.raises(SecretFileError, match="readable or writable by others"):
        read_secret_file(str(path))


def test_the_lb_serves_admin_routes_on_its_own_named_port_with_the_token() -> None:
    pod = desired_pod(a_unit(lbPort=8100, adminPort=8200))
    lb = containers(pod)["lb"]
    assert lb["ports"] == [
        {"name": "http", "containerPort": 8100, "protocol": "TCP"},
        {"name": "admin", "containerPort": 8200, "protocol": "TCP"},
    ]
    cmd = lb["command"]
    flags = {cmd[i]: cmd[i + 1] for i in range(2, len(cmd) - 1, 2)}
    assert flags["--port"] == "8100"
    assert (flags["--admin-port"], flags["--admin-host"], flags["--admin-token-file"]) == (
        "8200", "0.0.0.0", ADMIN_TOKEN_FILE,
    )
    assert admin_port(pod, allow_override=False) == 8200
    assert lb["readinessProbe"]["httpGet"]["port"] == 8100  # probes stay on the stream port
    cfg = parse_config(_config_model("pdunit.engine.lb.main"), argv_here(cmd), "pdunit lb", env={})
    assert (cfg.port, cfg.admin_port, cfg.admin_host) == (8100, 8200, "0.0.0.0")  # type: ignore[attr-defined]
    assert cfg.admin_token_file  # type: ignore[attr-defined]


def test_a_pod_from_before_the_admin_port_is_drained_on_its_lb_port() -> None:
    old = desired_pod(a_unit())
    lb = next(c for c in old["spec"]["containers"] if c["name"] == "lb")
    lb["ports"] = [p for p in lb["ports"] if p["name"] != "admin"]
    assert admin_port(old, allow_override=False) is None
    assert admin_port(None, allow_override=False) is None


def test_the_admin_port_override_annotation_counts_only_when_allowed() -> None:
    pod = desired_pod(a_unit())
    pod["metadata"]["annotations"][m.ANNOTATION_ADMIN_PORT_OVERRIDE] = "31337"
    assert admin_port(pod, allow_override=False) == 8001
    assert admin_port(pod, allow_override=True) == 31337


@pytest.mark.parametrize(
    ("spec", "field", "fragment"),
    [
        ({"lbPort": 8001}, "spec.adminPort", "adminPort must differ from lbPort"),
        ({"lbPort": 9000, "adminPort": 9000}, "spec.adminPort", "both are 9000"),
        ({"adminPort": 9402}, "spec.metricsPort", "adminPort 9402 is one of 9400..9403"),
    ],
)
def test_an_admin_port_on_the_lb_port_or_in_the_metrics_block_is_refused_naming_the_field(
        spec: dict[str, Any], field: str, fragment: str) -> None:
    with pytest.raises(ValidationError) as exc:
        desired_pod(a_unit(**spec))
    message = m.validation_message(exc.value)
    assert field in message and fragment in message, message


# ------------------------------------------------------------ fault injection refused

_ROLE_MODULES = {
    "lb": "pdunit.engine.lb.main",
    "prefill": "pdunit.engine.prefill.main",
    "decode": "pdunit.engine.decode.main",
    "proxy": "pdunit.sidecars.nvlink_proxy.main",
    "guard": "pdunit.sidecars.quiesce_guard.main",
}


@pytest.mark.parametrize("role", ["prefill", "decode", "lb"])
@pytest.mark.parametrize(
    "args",
    [
        ["--fault-corrupt-id", "3"],
        ["--fault-wedge-id=7"],
        ["--fault-w", "7"],  # argparse takes a unique prefix for the whole flag
        ["--cache-tokens", "16384", "--fault-tcp-relay", "10.0.0.9:9999"],
        ["--transfer-chunk-tokens", "64"],
        ["--transfer-chunk-d", "50"],
        ["--debug-port", "9999"],
    ],
)
def test_fault_injection_flags_in_extra_args_are_refused_naming_the_field_and_the_flag(
        role: str, args: list[str]) -> None:
    with pytest.raises(ValidationError) as exc:
        desired_pod(a_unit(extraArgs={role: args}))
    message = m.validation_message(exc.value)
    index = next(i for i, a in enumerate(args) if a.startswith(("--fa", "--transfer-c", "--deb")))
    assert f"spec.extraArgs.{role}.{index}" in message, message
    assert repr(args[index]) in message and "fault-injection flag" in message, message


@pytest.mark.parametrize(
    "name", ["PDUNIT_FAULT_INJECTION", "PDUNIT_FAULT_CORRUPT_ID", "PDUNIT_FAULT_TCP_RELAY",
             "PDUNIT_TRANSFER_CHUNK_DELAY_MS", "PDUNIT_DEBUG_PORT"])
def test_fault_injection_env_is_refused_naming_the_field(name: str) -> None:
    with pytest.raises(ValidationError) as exc:
        desired_pod(a_unit(env=[{"name": "X", "value": "1"}, {"name": name, "value": "1"}]))
    message = m.validation_message(exc.value)
    assert "spec.env.1.name" in message and name in message and "fault injection" in message, message


def test_flags_and_env_near_the_fault_ones_still_pass() -> None:
    pod = desired_pod(a_unit(
        extraArgs={"prefill": ["--transfer-workers", "8", "--transfer-deadline-ms", "500", "--fp8-min-rows", "0"],
                   "decode": ["--decode-kernel", "fp8_dots=0", "--device", "cuda:0"]},
        env=[{"name": "PDUNIT_TRANSFER_WORKERS", "value": "8"}, {"name": "PDUNIT_DEBUG", "value": "1"}],
    ))
    assert containers(pod)["prefill"]["command"][-6:] == [
        "--transfer-workers", "8", "--transfer-deadline-ms", "500", "--fp8-min-rows", "0"]


def _flags_and_env(model: type[BaseModel]) -> list[tuple[str, str, str, str]]:
    """(field, flag, env, description) of each field, the way engine/settings.py names them."""
    return [(name, "--" + name.replace("_", "-"), "PDUNIT_" + name.upper(), f.description or "")
            for name, f in model.model_fields.items()]


def _resolves_to(parser: Any, token: str) -> str | None:
    """The field argparse gives `token 1`, None when it refuses it (unknown, ambiguous)."""
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            ns = parser.parse_args([token, "1"])
        except SystemExit:
            return None
    return next((k for k, v in vars(ns).items() if v == "1"), None)


@pytest.mark.parametrize("role", sorted(_ROLE_MODULES))
def test_no_flag_of_a_unit_process_is_refused_but_its_fault_injection_ones(role: str) -> None:
    """Against each process's real flags: the refused prefixes hit a flag (and its env
    name) exactly when the engine describes it as fault injection."""
    for _, flag, env, description in _flags_and_env(_config_model(_ROLE_MODULES[role])):
        is_fault = "fault injection" in description
        assert bool(re.match(m.FAULT_FLAG_PATTERN, flag)) is is_fault, flag
        assert bool(re.match(m.FAULT_ENV_PATTERN, env)) is is_fault, env


def test_every_spelling_of_a_fault_suite_switch_is_refused_and_nothing_else_of_it() -> None:
    """The fault suite's P (what PDUNIT_FAULT_INJECTION=1 starts): every --fault-* switch,
    every abbreviation argparse resolves to one, their env names and the switch itself are
    refused; its production flags are not."""
    from pdunit.bench.fault_injection import FaultFields, FaultyPrefillConfig
    from pdunit.engine.settings import build_parser

    parser = build_parser(FaultyPrefillConfig, "pdunit prefill")
    faults = set(FaultFields.model_fields)
    assert faults, "the fault suite has no switches"
    for name, flag, env, _ in _flags_and_env(FaultyPrefillConfig):
        assert bool(re.match(m.FAULT_FLAG_PATTERN, flag)) is (name in faults), flag
        assert bool(re.match(m.FAULT_ENV_PATTERN, env)) is (name in faults), env
        for n in range(3, len(flag) + 1):
            if _resolves_to(parser, flag[:n]) in faults:
                assert re.match(m.FAULT_FLAG_PATTERN, flag[:n]), f"{flag[:n]} reaches a fault switch and passes"
    assert re.match(m.FAULT_ENV_PATTERN, "PDUNIT_FAULT_INJECTION")


# --------------------------------------------------------------------- unit status


def pod(phase: str = "Running", ready: bool = True, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "u1", "uid": "pod-1", "annotations": {}},
        "status": {
            "phase": phase,
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            **status,
        },
    }


LOAD = read_load_document(fake_load_document(
    "u0", ready=True, draining=False, transfer_mode="proxy", streams_in_flight=7, held_pages=2, empty=False,
))


def test_status_ready_carries_the_lb_load() -> None:
    st = unit_status(a_unit(), pod(), LOAD, None, T0, port=8000)
    assert (st["phase"], st["ready"], st["inFlight"], st["heldPages"], st["transferMode"]) == (
        "Ready",
        True,
        7,
        2,
        "proxy",
    )
    assert (st["podIP"], st["lbPort"], st["observedGeneration"]) == ("10.1.2.3", 8000, 3)


@pytest.mark.parametrize(
    ("spec", "mode", "fallback"),
    [
        ({}, "tcp", True),  # transfer auto on GPUs (the defaults) ended on tcp
        ({}, "proxy,tcp", True),  # 1P2D: one D's link on tcp is enough
        ({}, "proxy", False),
        ({"transfer": "tcp"}, "tcp", False),  # asked for: not a fallback
        ({"device": "cpu", "transfer": "host"}, "tcp", False),
    ],
)
def test_tcp_fallback_condition_only_when_auto_on_gpus_ended_on_tcp(
        spec: dict[str, Any], mode: str, fallback: bool) -> None:
    unit = a_unit(**spec)
    unit["spec"] = unit_defaults(unit["spec"])  # as the handler passes it
    st = unit_status(unit, pod(), LOAD.model_copy(update={"transfer_mode": mode}), None, T0, port=8000)
    (cond,) = [c for c in st["conditions"] if c["type"] == "TcpFallback"]
    assert (cond["status"], cond["reason"]) == (("True", "AutoChoseTcp") if fallback else ("False", "NoFallback"))
    assert ("transfer auto chose tcp" in cond["message"]) is fallback


def test_no_tcp_fallback_condition_before_a_transfer_mode_is_known() -> None:
    st = unit_status(a_unit(), pod(), None, "connection refused", T0, port=8000)
    assert "TcpFallback" not in {c["type"] for c in st["conditions"]}


def test_status_starting_names_the_unreachable_lb() -> None:
    st = unit_status(
        a_unit(), pod(), None, "GET http://10.1.2.3:8000/v1/load: ConnectTimeout", T0, port=8000
    )
    assert st["phase"] == "Starting" and st["ready"] is False
    assert "10.1.2.3:8000/v1/load" in st["message"]
    cond = next(c for c in st["conditions"] if c["type"] == "LoadReachable")
    assert cond["status"] == "False"


def test_one_failed_scrape_keeps_a_ready_unit_ready_but_marks_the_figures_stale() -> None:
    ready_unit = a_unit()
    ready_unit["status"] = {"ready": True, "phase": "Ready", "inFlight": 4}
    st = unit_status(ready_unit, pod(), None, "GET /v1/load: ReadTimeout", T0, port=8000)
    assert st["ready"] is True and st["phase"] == "Ready"
    assert st["inFlight"] == 4  # the last known figure, not a silent zero
    cond = next(c for c in st["conditions"] if c["type"] == "LoadReachable")
    assert cond["status"] == "False"


def test_status_pending_shows_why_the_pod_waits() -> None:
    waiting = pod(
        "Pending",
        ready=False,
        containerStatuses=[
            {
                "name": "prefill",
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": "not found"}},
            }
        ],
    )
    st = unit_status(a_unit(), waiting, None, None, T0, port=8000)
    assert st["phase"] == "Pending" and "ImagePullBackOff" in st["message"]


def test_status_draining_then_drained() -> None:
    unit = a_unit(draining=True)
    assert (
        unit_status(unit, pod(), LOAD, None, T0, port=8000, drain={"startedAt": "x"})["phase"]
        == "Draining"
    )
    st = unit_status(unit, None, None, None, T0, port=8000, drain={"completedAt": "y"})
    assert st["phase"] == "Drained" and st["ready"] is False


def test_readiness_flips_only_when_the_status_changes() -> None:
    st1 = unit_status(a_unit(), pod(), LOAD, None, T0, port=8000)
    st2 = unit_status(
        {**a_unit(), "status": st1}, pod(), LOAD, None, T0 + timedelta(minutes=5), port=8000
    )
    ready = [next(c for c in s["conditions"] if c["type"] == "Ready") for s in (st1, st2)]
    assert ready[0]["lastTransitionTime"] == ready[1]["lastTransitionTime"]


def test_lb_port_override_only_when_allowed() -> None:
    p = pod()
    p["metadata"]["annotations"][m.ANNOTATION_LB_PORT_OVERRIDE] = "41234"
    assert lb_port({"lbPort": 8000}, p, allow_override=False) == 8000
    assert lb_port({"lbPort": 8000}, p, allow_override=True) == 41234


# ------------------------------------------------------------------------ the drain


def step(
    state: dict[str, Any] | None, t: float, load: LoadDocument | None, **kw: Any
) -> DrainStep:
    args: dict[str, Any] = {"pod_may_hold_streams": True, "timeout_s": 600, "check_interval_s": 5}
    args.update(kw)
    return drain_step(state, now=T0 + timedelta(seconds=t), load=load, **args)


EMPTY = read_load_document(fake_load_document("u0", empty=True, streams_in_flight=0))
BUSY = read_load_document(fake_load_document("u0", empty=False, streams_in_flight=3))


def test_drain_deletes_only_after_two_empty_checks_apart() -> None:
    s = step(None, 0, BUSY)
    assert (s.action, s.request_drain) == ("wait", True)
    s.state["requested"] = True
    s = step(s.state, 1, EMPTY)
    assert s.action == "wait" and s.state["emptyChecks"] == 1 and not s.request_drain
    s = step(s.state, 3, EMPTY)
    assert s.action == "wait", "second check sooner than check_interval_s is not independent"
    s = step(s.state, 6, EMPTY)
    assert s.action == "delete" and s.state["emptyChecks"] == 2


def test_a_busy_or_unreachable_answer_between_empty_checks_restarts_them() -> None:
    s = step({"requested": True}, 0, EMPTY)
    s = step(s.state, 6, BUSY)
    assert s.action == "wait" and s.state["emptyChecks"] == 0
    s = step(s.state, 7, EMPTY)
    s = step(s.state, 9, None)  # LB unreachable proves nothing
    assert s.action == "wait" and s.state["emptyChecks"] == 0
    s = step(s.state, 10, EMPTY)
    assert step(s.state, 12, EMPTY).action == "wait"
    assert step(s.state, 15, EMPTY).action == "delete"


def test_drain_timeout_forces_and_counts_cut_streams() -> None:
    s = step({"requested": True, "startedAt": iso_us(T0)}, 599, BUSY)
    assert s.action == "wait"
    s = step(s.state, 600, BUSY)
    assert (s.action, s.streams_cut, s.state["forced"], s.state["streamsCut"]) == (
        "force",
        3,
        True,
        3,
    )


def test_drain_timeout_with_unreachable_lb_counts_the_last_known_streams() -> None:
    s = step({"requested": True, "startedAt": iso_us(T0)}, 700, None, last_in_flight=5)
    assert (s.action, s.streams_cut) == ("force", 5)


def test_a_pod_that_is_not_running_holds_no_streams() -> None:
    s = step(None, 0, None, pod_may_hold_streams=False)
    assert s.action == "delete" and not s.request_drain


# ---------------------------------------------------------------------- the unit set


def set_unit(
    name: str,
    thash: str,
    *,
    ready: bool = True,
    in_flight: int = 0,
    draining: bool = False,
    phase: str | None = None,
    created: int = 0,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {m.LABEL_SET: "tts", m.LABEL_TEMPLATE_HASH: thash},
            "creationTimestamp": iso(T0 + timedelta(seconds=created)),
        },
        "spec": {"draining": draining},
        "status": {
            "phase": phase or ("Ready" if ready else "Starting"),
            "ready": ready,
            "inFlight": in_flight,
        },
    }


def a_set(
    replicas: int, image: str = "img:1", max_surge: int = 1, max_unavailable: int = 0
) -> dict[str, Any]:
    return {
        "metadata": {"name": "tts", "namespace": "prod", "uid": "set-uid", "generation": 2},
        "spec": {
            "replicas": replicas,
            "template": {"spec": {"image": image, "model": "random:tiny:0"}},
            "strategy": {"maxSurge": max_surge, "maxUnavailable": max_unavailable},
        },
    }


def cur(s: dict[str, Any]) -> str:
    return template_hashes(s["spec"]["template"])[0]


def test_victims_are_not_ready_first_then_fewest_in_flight() -> None:
    units = [
        set_unit("a", "h", in_flight=9),
        set_unit("b", "h", in_flight=1),
        set_unit("c", "h", ready=False, in_flight=4),
        set_unit("d", "h", in_flight=0),
    ]
    assert [u["metadata"]["name"] for u in pick_victims(units, 3)] == ["c", "d", "b"]


def test_victim_ties_go_to_the_newest_unit() -> None:
    units = [set_unit("old", "h", created=0), set_unit("new", "h", created=100)]
    assert pick_victims(units, 1)[0]["metadata"]["name"] == "new"


def test_scale_up_creates_the_missing_units() -> None:
    s = a_set(3)
    plan = plan_units(s, [set_unit("a", cur(s))])
    assert plan.kinds() == ["create", "create"]


def test_scale_down_drains_the_units_with_fewest_streams() -> None:
    s = a_set(1)
    h = cur(s)
    plan = plan_units(
        s,
        [
            set_unit("a", h, in_flight=5),
            set_unit("b", h, in_flight=2),
            set_unit("c", h, in_flight=0),
        ],
    )
    assert sorted((a.kind, a.unit) for a in plan.actions) == [("drain", "b"), ("drain", "c")]


def test_drained_units_are_deleted_and_draining_ones_left_alone() -> None:
    s = a_set(1)
    h = cur(s)
    plan = plan_units(
        s,
        [
            set_unit("a", h),
            set_unit("b", h, draining=True, in_flight=3),
            set_unit("c", h, draining=True, phase="Drained", ready=False),
        ],
    )
    assert [(a.kind, a.unit) for a in plan.actions] == [("delete", "c")]


def test_scale_up_reclaims_a_draining_unit_before_creating() -> None:
    s = a_set(2)
    h = cur(s)
    plan = plan_units(s, [set_unit("a", h), set_unit("b", h, draining=True, ready=False)])
    assert [(a.kind, a.unit) for a in plan.actions] == [("undrain", "b")]


def test_rollout_waits_for_the_surged_unit_before_draining_an_old_one() -> None:
    s = a_set(2, image="img:2")
    units = [set_unit("a", "old"), set_unit("b", "old")]
    assert plan_units(s, units).kinds() == ["create"]
    units.append(set_unit("n1", cur(s), ready=False))
    assert plan_units(s, units).kinds() == [], "drained an old unit before the new one was Ready"
    units[-1] = set_unit("n1", cur(s), ready=True)
    plan = plan_units(s, units)
    assert plan.kinds() == ["drain"]


def test_rollout_replaces_a_not_ready_old_unit_at_once() -> None:
    s = a_set(2, image="img:2")
    plan = plan_units(s, [set_unit("a", "old"), set_unit("b", "old", ready=False)])
    assert sorted((a.kind, a.unit) for a in plan.actions) == [("create", None), ("drain", "b")]


def simulate(
    s: dict[str, Any], units: list[dict[str, Any]], steps: int = 60
) -> list[dict[str, int]]:
    """Apply plans step by step; new units turn Ready one step after creation, a
    draining unit reports Drained one step after the drain began. Returns a trace."""
    h = cur(s)
    trace = []
    counter = 0
    for _ in range(steps):
        for u in units:  # the world moves: units start and drains finish
            if u["spec"]["draining"] and u["status"]["phase"] != "Drained":
                u["status"].update(phase="Drained", ready=False)
            elif u["status"]["phase"] == "Starting":
                u["status"].update(phase="Ready", ready=True)
        plan = plan_units(s, units)
        for a in plan.actions:
            if a.kind == "create":
                counter += 1
                units.append(set_unit(f"n{counter}", h, ready=False))
            elif a.kind == "drain":
                next(u for u in units if u["metadata"]["name"] == a.unit)["spec"]["draining"] = True
                next(u for u in units if u["metadata"]["name"] == a.unit)["status"]["ready"] = False
            elif a.kind == "delete":
                units[:] = [u for u in units if u["metadata"]["name"] != a.unit]
        active = [u for u in units if not u["spec"]["draining"]]
        trace.append(
            {
                "ready": sum(1 for u in active if u["status"]["ready"]),
                "pods": len(units),
                "new": sum(
                    1 for u in active if u["metadata"]["labels"][m.LABEL_TEMPLATE_HASH] == h
                ),
                "old_draining": sum(
                    1
                    for u in units
                    if u["spec"]["draining"] and u["metadata"]["labels"][m.LABEL_TEMPLATE_HASH] != h
                ),
            }
        )
        if (
            not plan.actions
            and len(units) == s["spec"]["replicas"]
            and all(
                u["metadata"]["labels"][m.LABEL_TEMPLATE_HASH] == h and u["status"]["ready"]
                for u in units
            )
        ):
            return trace
    raise AssertionError(f"rollout did not converge: {trace[-5:]}")


@pytest.mark.parametrize(
    ("replicas", "surge", "unavailable"),
    [
        (3, 1, 0),
        (2, 2, 0),
        (4, 0, 1),
        (3, 1, 1),
        (1, 1, 0),
    ],
)
def test_rollout_keeps_ready_units_at_or_above_replicas_minus_max_unavailable(
    replicas: int, surge: int, unavailable: int
) -> None:
    s = a_set(replicas, image="img:2", max_surge=surge, max_unavailable=unavailable)
    units = [set_unit(f"o{i}", "old") for i in range(replicas)]
    trace = simulate(s, units)
    assert min(t["ready"] for t in trace) >= replicas - unavailable, trace
    assert max(t["pods"] for t in trace) <= replicas + surge, trace
    if unavailable == 0:
        assert max(t["old_draining"] for t in trace) <= surge, trace
    # New units only ever grow during a rollout.
    news = [t["new"] for t in trace]
    assert news == sorted(news)


def test_default_rollout_replaces_one_unit_at_a_time() -> None:
    s = a_set(3, image="img:2")
    trace = simulate(s, [set_unit(f"o{i}", "old") for i in range(3)])
    assert max(t["old_draining"] for t in trace) == 1
    assert max(t["pods"] for t in trace) == 4


def test_set_status_counts_and_selector() -> None:
    s = a_set(2, image="img:2")
    h = cur(s)
    st = set_status(
        s,
        [set_unit("a", h), set_unit("b", "old", ready=False), set_unit("c", h, draining=True)],
        T0,
    )
    assert (st["replicas"], st["readyReplicas"], st["updatedReplicas"], st["drainingReplicas"]) == (
        2,
        1,
        1,
        1,
    )
    assert st["selector"] == "pdunit.dev/set=tts"
    assert st["observedGeneration"] == 2


def test_new_unit_is_owned_by_the_set_and_labelled_with_the_template_hash() -> None:
    s = a_set(1)
    s["spec"]["template"]["metadata"] = {"labels": {"team": "tts"}}
    u = new_unit(s, "0123456789")
    assert u["metadata"]["generateName"] == "tts-01234-"
    assert u["metadata"]["labels"] == {
        "team": "tts",
        m.LABEL_SET: "tts",
        m.LABEL_TEMPLATE_HASH: "0123456789",
    }
    assert u["metadata"]["ownerReferences"][0]["uid"] == "set-uid"
    assert u["spec"]["draining"] is False


def test_template_hash_changes_with_the_image_only() -> None:
    a, b = a_set(1, image="img:1"), a_set(5, image="img:1")
    assert cur(a) == cur(b), "replicas must not change the template hash"
    assert cur(a) != cur(a_set(1, image="img:2"))


def test_template_hash_leaves_out_fields_at_their_api_defaults() -> None:
    """The apiserver serves every stored template with the CRD's defaults filled in: a CRD
    upgrade adding a defaulted field must not change the hash (it would roll every unit)."""
    bare = a_set(1)["spec"]["template"]
    served = {"spec": {**bare["spec"], "transfer": "auto", "decoders": 1, "device": "cuda", "lbPort": 8000}}
    assert template_hashes(served)[0] == template_hashes(bare)[0]
    assert template_hashes(served)[1] != template_hashes(bare)[1]  # the legacy hash sees them
    assert template_hashes({"spec": {**bare["spec"], "decoders": 2}})[0] != template_hashes(bare)[0]
    unit_spec = {**bare["spec"], "draining": True}
    assert spec_hashes({**unit_spec, "transfer": "auto"})[0] == spec_hashes(unit_spec)[0]


def test_units_labelled_with_the_legacy_hash_are_current_and_get_relabelled() -> None:
    """Units an older operator created carry the full-spec hash: they are the current
    template (no rollout on upgrade), and are relabelled once."""
    s = a_set(2)
    s["spec"]["template"]["spec"]["transfer"] = "auto"  # as served: a default filled in
    current, legacy = template_hashes(s["spec"]["template"])
    assert current != legacy
    units = [set_unit("a", legacy), set_unit("b", current)]
    plan = plan_units(s, units)
    assert plan.kinds() == ["relabel"]
    assert (plan.actions[0].unit, plan.actions[0].template_hash) == ("a", current)
    assert set_status(s, units, T0)["updatedReplicas"] == 2
    assert plan_units(s, [set_unit("a", current), set_unit("b", current)]).kinds() == []
