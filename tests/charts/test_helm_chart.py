"""The Helm chart (charts/pdunit): lints, renders, and every rendered object is valid for
the Kubernetes version the envtest control plane pins, with a real, pinned `helm`."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdunit.operator import scaler
from pdunit.operator.proto import externalscaler_pb2 as pb

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pdunit"
NAMESPACE = "tts"
# The example PDUnitSet is off by default (no published unit image); render() turns it on,
# so the tests see every object. A variant's own --set after it wins.
EXAMPLE_SET = ["--set", "examplePDUnitSet.enabled=true"]

# Every combination of toggles that changes which objects exist.
VARIANTS = {
    "default": [],
    "keda": ["--set", "keda.enabled=true"],
    "namespaced-operator": [
        "--set",
        "operator.watchNamespaces={tts,voices}",
        "--set",
        "router.enabled=false",
        "--set",
        "examplePDUnitSet.enabled=false",
    ],
    "tracing": ["--set", "tracing.otlpEndpoint=otel-collector.observability:4317",
                "--set", "router.extraEnv[0].name=EXTRA", "--set-string", "router.extraEnv[0].value=1"],
    "cpu-units": [
        "--set",
        "examplePDUnitSet.device=cpu",
        "--set",
        "examplePDUnitSet.transfer=host",
    ],
    "monitoring": ["--set", "podMonitor.enabled=true", "--set", "grafanaDashboard.enabled=true",
                   "--set", "prometheusRule.enabled=true", "--set",
                   "networkPolicy.prometheus.namespaceSelector.kubernetes\\.io/metadata\\.name=monitoring",
                   "--set", "networkPolicy.prometheus.podSelector.app\\.kubernetes\\.io/name=prometheus"],
    "network-policy": ["--set", "operator.watchNamespaces={tts,voices}", "--set", "networkPolicy.unitNamespaces={lab}",
                       "--set", "networkPolicy.prometheus.podSelector.app=prometheus",
                       "--set-json", 'networkPolicy.extraLbClients=[{"podSelector":{"matchLabels":{"app":"my-router"}}}]'],
    "one-operator": ["--set", "operator.replicas=1", "--set", "operator.leaderElection=false",
                     "--set", "router.replicas=1"],
    "no-network-policy": ["--set", "networkPolicy.enabled=false", "--set", "podMonitor.enabled=true"],
    "keda-other-set": [
        "--set",
        "keda.enabled=true",
        "--set",
        "keda.unitSet=voices",
        "--set",
        "keda.fallback.enabled=true",
        "--set",
        "keda.minReplicaCount=0",
    ],
}


@cache
def helm() -> str:
    """The pinned helm (tools/helm/ensure.sh: on PATH if it matches, else built once)."""
    out = subprocess.run(
        ["bash", str(REPO / "tools" / "helm" / "ensure.sh")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, f"tools/helm/ensure.sh failed:\n{out.stderr}"
    return out.stdout.strip().splitlines()[-1]


@cache
def kube_version() -> str:
    """The Kubernetes release the envtest control plane is built from (tools/envtest)."""
    text = (REPO / "tools" / "envtest" / "ensure.sh").read_text()
    match = re.search(r"^K8S_VERSION=v?([0-9]+\.[0-9]+\.[0-9]+)$", text, re.M)
    assert match, "tools/envtest/ensure.sh has no K8S_VERSION=vX.Y.Z line"
    return match.group(1)


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120)


def render(extra: list[str]) -> list[dict[str, Any]]:
    out = run_helm(
        "template",
        "rel",
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--include-crds",
        "--kube-version",
        kube_version(),
        *EXAMPLE_SET,
        *extra,
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def test_the_example_set_is_off_by_default() -> None:
    """Its unit image is not published: an example set on by default would sit in
    ImagePullBackOff (tests/images builds the image; docs/images.md pushes it)."""
    out = run_helm("template", "rel", str(CHART), "--namespace", NAMESPACE, "--kube-version", kube_version())
    assert out.returncode == 0, out.stderr
    assert not by_kind([d for d in yaml.safe_load_all(out.stdout) if d], "PDUnitSet")


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Unknown fields are errors, as with the apiserver's strict field validation (kubectl's
    default), instead of being pruned silently; JSON Schema alone would let them pass."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    if isinstance(out.get("items"), dict):
        out["items"] = _strict(out["items"])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(out["additionalProperties"])
    return out


def crd_schema(kind: str) -> dict[str, Any]:
    for path in sorted((CHART / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
            return _strict(version["schema"]["openAPIV3Schema"])
    raise AssertionError(f"no CRD for kind {kind} in {CHART / 'crds'}")


# --- the pinned helm ---------------------------------------------------------------------


def test_ensure_sh_gives_the_pinned_helm_quickly_once_built() -> None:
    helm()  # built (or found) once
    pin = re.search(
        r'HELM_VERSION="\$\{PDUNIT_HELM_VERSION:-(v[0-9.]+)\}"',
        (REPO / "tools" / "helm" / "ensure.sh").read_text(),
    )
    assert pin, "tools/helm/ensure.sh has no pinned HELM_VERSION"
    out = subprocess.run(
        ["bash", str(REPO / "tools" / "helm" / "ensure.sh")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == helm()
    assert run_helm("version", "--template", "{{.Version}}").stdout == pin.group(1)
    # Its default Kubernetes version is a current one (a plain `go install` leaves v1.20,
    # which this chart's kubeVersion refuses): `helm template` works without --kube-version.
    plain = run_helm("template", "rel", str(CHART))
    assert plain.returncode == 0, plain.stderr


# --- CRDs ----------------------------------------------------------------------------------


def test_chart_crds_are_exact_copies_of_the_generated_crds() -> None:
    generated = {p.name: p.read_bytes() for p in (REPO / "crds").glob("*.yaml")}
    shipped = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert generated, "crds/ is empty: run `make crds`"
    assert sorted(shipped) == sorted(generated), "run tools/helm/sync-crds.sh after `make crds`"
    for name, text in generated.items():
        assert shipped[name] == text, (
            f"charts/pdunit/crds/{name} is stale: run tools/helm/sync-crds.sh"
        )


# --- lint and render -----------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["default", "keda"])
def test_chart_lints_cleanly(variant: str) -> None:
    out = run_helm(
        "lint",
        str(CHART),
        "--strict",
        "--namespace",
        NAMESPACE,
        "--kube-version",
        kube_version(),
        *VARIANTS[variant],
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


def _validate(doc: dict[str, Any], version: str) -> None:
    kind = doc["kind"]
    if doc["apiVersion"] == "pdunit.dev/v1alpha1":
        # A CRD instance: its own CRD's schema (structural parts; CEL rules need an apiserver).
        jsonschema.validate(doc, crd_schema(kind))
    elif doc["apiVersion"] == "monitoring.coreos.com/v1":
        # The Prometheus Operator's CRDs are not shipped here either: the fields they need
        # (test_pod_monitors_... checks the names against the pods, test_alerts the rules).
        assert kind in ("PodMonitor", "PrometheusRule"), kind
        if kind == "PrometheusRule":
            assert all(rule["expr"] for group in doc["spec"]["groups"] for rule in group["rules"])
            return
        assert doc["spec"]["selector"]["matchLabels"]
        assert all(isinstance(label, str) for label in doc["spec"].get("podTargetLabels", []))
        for endpoint in doc["spec"]["podMetricsEndpoints"]:
            assert {"port", "path", "interval"} <= set(endpoint) <= {"port", "path", "interval", "honorLabels"}, endpoint
            assert isinstance(endpoint.get("honorLabels", False), bool)
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", endpoint["port"]) and len(endpoint["port"]) <= 15
    elif doc["apiVersion"] == "keda.sh/v1alpha1":
        # KEDA's CRD is not shipped here; test_scaled_object_... checks what KEDA and our
        # scaler need from it field by field.
        assert kind == "ScaledObject"
    else:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_rendered_object_is_valid_for_the_pinned_kubernetes(variant: str) -> None:
    version = kube_version()
    docs = render(VARIANTS[variant])
    assert docs
    problems = []
    for doc in docs:
        where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            _validate(doc, version)
        except jsonschema.ValidationError as exc:  # kubernetes_validate's error subclasses it
            path = ".".join(str(p) for p in exc.absolute_path)
            problems.append(f"{where} at {path}: {exc.message}")
    assert not problems, f"{variant}: invalid for Kubernetes {version}:\n" + "\n".join(problems)


def test_kubernetes_validate_knows_the_pinned_minor_version() -> None:
    # kubernetes-validate picks the newest schema set <= the version asked for; the pin must
    # not fall back silently to an older minor version.
    major_minor = ".".join(kube_version().split(".")[:2])
    assert major_minor in {
        ".".join(v.split(".")[:2]) for v in kubernetes_validate.utils.all_versions()
    }


def test_default_render_has_the_operator_scaler_router_and_example_set_but_no_keda() -> None:
    docs = render([])
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == sorted(
        {
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
            "Deployment",
            "Service",
            "PDUnitSet",
            "NetworkPolicy",  # on by default: the units' stream port has no credential
            "PodDisruptionBudget",  # operator and router, 2 replicas each
        }
    )
    assert {d["spec"]["names"]["kind"] for d in by_kind(docs, "CustomResourceDefinition")} == {
        "PDUnit",
        "PDUnitSet",
    }
    assert {d["metadata"]["name"] for d in by_kind(docs, "Deployment")} == {
        "rel-pdunit-operator",
        "rel-pdunit-router",
    }
    operator = one(docs, "Deployment", "rel-pdunit-operator")["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert operator["args"][0] == "operator"
    assert {p["name"]: p["containerPort"] for p in operator["ports"]} == {
        "health": 8080,
        "scaler": 9090,
        "metrics": 9100,
    }


# --- what the objects must mean ------------------------------------------------------------


def test_scaled_object_scales_the_pdunitset_through_the_operators_scaler_service() -> None:
    docs = render(VARIANTS["keda"])
    so = one(docs, "ScaledObject")
    target = so["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": "pdunit.dev/v1alpha1", "kind": "PDUnitSet", "name": "tts"}
    one(docs, "PDUnitSet", "tts")
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "external" and trigger["metricType"] == "AverageValue"
    metadata = trigger["metadata"]
    assert all(isinstance(v, str) for v in metadata.values()), (
        "KEDA trigger metadata is map[string]string"
    )
    # scalerAddress -> the scaler Service -> the operator pod's "scaler" port.
    host, port = metadata["scalerAddress"].rsplit(":", 1)
    service_name, service_ns, _ = host.split(".", 2)
    service = one(docs, "Service", service_name)
    assert service_ns == NAMESPACE
    (svc_port,) = service["spec"]["ports"]
    assert svc_port["port"] == int(port) and svc_port["targetPort"] == "scaler"
    pods = [
        d
        for d in by_kind(docs, "Deployment")
        if all(
            d["spec"]["template"]["metadata"]["labels"].get(k) == v
            for k, v in service["spec"]["selector"].items()
        )
    ]
    assert [p["metadata"]["name"] for p in pods] == ["rel-pdunit-operator"]
    # What KEDA will send is accepted by the scaler's own metadata parser.
    trig = scaler.Trigger.from_ref(
        pb.ScaledObjectRef(
            name=so["metadata"]["name"], namespace=NAMESPACE, scalerMetadata=metadata
        )
    )
    assert (trig.unit_set, trig.namespace, trig.target_in_flight_per_unit) == (
        "tts",
        NAMESPACE,
        32.0,
    )
    # replicas belongs to KEDA once it scales the set: the chart must not reset it.
    assert "replicas" not in one(docs, "PDUnitSet", "tts")["spec"]


def test_without_keda_the_example_set_has_the_configured_replicas() -> None:
    docs = render(["--set", "examplePDUnitSet.replicas=3"])
    assert one(docs, "PDUnitSet", "tts")["spec"]["replicas"] == 3
    assert not by_kind(docs, "ScaledObject")


def _rules(docs: list[dict[str, Any]], kind: str, name_part: str) -> set[tuple[str, str, str]]:
    out = set()
    for role in by_kind(docs, kind):
        if name_part in role["metadata"]["name"]:
            for rule in role["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            out.add((group, resource, verb))
    return out


OPERATOR_APP_RULES = {
    *{("pdunit.dev", "pdunits", v) for v in ("get", "list", "watch", "create", "patch", "delete")},
    *{("pdunit.dev", "pdunitsets", v) for v in ("get", "list", "watch", "patch")},
    ("pdunit.dev", "pdunits/status", "patch"),
    ("pdunit.dev", "pdunitsets/status", "patch"),
    *{("", "pods", v) for v in ("get", "create", "patch", "delete")},
    # each unit's own Secret, by name: never listed, watched, changed or deleted
    ("", "secrets", "get"),
    ("", "secrets", "create"),
    ("", "events", "create"),
    ("resource.k8s.io", "resourceclaimtemplates", "create"),  # a dra unit's own
}


def test_operator_rbac_grants_exactly_the_verbs_the_operator_uses() -> None:
    docs = render([])
    framework = _rules(docs, "ClusterRole", "operator-tts-framework")
    assert framework == {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    }
    assert _rules(docs, "ClusterRole", "operator") - framework == OPERATOR_APP_RULES
    assert not any("*" in rule for rule in _rules(docs, "ClusterRole", ""))
    binding = one(docs, "ClusterRoleBinding", "rel-pdunit-operator-tts")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-pdunit-operator", "namespace": NAMESPACE}
    ]
    assert _rules(docs, "Role", "router") == {
        ("pdunit.dev", "pdunits", v) for v in ("get", "list", "watch")
    }


def test_namespaced_operator_gets_roles_only_in_the_watched_namespaces() -> None:
    docs = render(VARIANTS["namespaced-operator"])
    roles = [r for r in by_kind(docs, "Role") if not r["metadata"]["name"].endswith("-leader-election")]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["tts", "voices"]
    for role in roles:
        assert _rules([role], "Role", "operator") == OPERATOR_APP_RULES
    # Cluster-wide it may only read CRDs and namespaces.
    assert _rules(docs, "ClusterRole", "") == {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        ("", "namespaces", "list"),
        ("", "namespaces", "watch"),
    }
    operator = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "--namespaces=tts,voices" in operator["args"]


def test_every_container_runs_as_non_root_with_no_capabilities() -> None:
    for doc in by_kind(render([]), "Deployment"):
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]


def test_the_operator_and_router_accept_the_flags_the_chart_passes() -> None:
    from pdunit.engine.router.config import RouterConfig, check_discovery
    from pdunit.engine.settings import parse_config
    from pdunit.operator.config import OperatorConfig

    docs = render(["--set", "operator.watchNamespaces={tts}"])
    containers = {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
        for d in by_kind(docs, "Deployment")
    }
    op_args = containers["rel-pdunit-operator"]["args"]
    assert op_args[0] == "operator"
    cfg = parse_config(OperatorConfig, op_args[1:], "pdunit operator", env={})
    assert (cfg.liveness_port, cfg.scaler_port, cfg.metrics_port, cfg.namespaces) == (
        8080,
        9090,
        9100,
        ["tts"],
    )
    router_args = containers["rel-pdunit-router"]["args"]
    assert router_args[0] == "router"
    rcfg = parse_config(RouterConfig, router_args[1:], "pdunit router", env={})
    assert check_discovery(rcfg) is None
    assert (rcfg.discovery, rcfg.namespace, rcfg.unit_set, rcfg.port) == (
        "kubernetes",
        NAMESPACE,
        "tts",
        8080,
    )


# --- values.schema.json --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("replicas=-1", "additional properties 'replicas' not allowed"),  # no such top-level key
        ("examplePDUnitSet.replicas=-1", "/examplePDUnitSet/replicas"),
        ("router.replicas=-1", "/router/replicas"),
        ("examplePDUnitSet.transfer=warp", "/examplePDUnitSet/transfer"),
        ("examplePDUnitSet.kvCacheDtype=fp4", "/examplePDUnitSet/kvCacheDtype"),
        ("examplePDUnitSet.prefillGemm=int8", "/examplePDUnitSet/prefillGemm"),
        ("examplePDUnitSet.decodeGemm=int8", "/examplePDUnitSet/decodeGemm"),
        ("examplePDUnitSet.depthKernels=triton", "/examplePDUnitSet/depthKernels"),
        ("examplePDUnitSet.decodeKernel=fp8_dots", "/examplePDUnitSet/decodeKernel"),
        ("examplePDUnitSet.model=tiny", "/examplePDUnitSet/model"),
        ("examplePDUnitSet.codec=mimi", "/examplePDUnitSet/codec"),
        ("examplePDUnitSet.codecConvTable.configMapName=Bad_Name", "/examplePDUnitSet/codecConvTable/configMapName"),
        ("examplePDUnitSet.codecConvTable.key=", "/examplePDUnitSet/codecConvTable/key"),
        ("keda.targetInFlightPerUnit=0", "/keda/targetInFlightPerUnit"),
        ("operator.logLevel=loud", "/operator/logLevel"),
        ("images.operator.pullPolicy=Sometimes", "/images/operator/pullPolicy"),
        ("operator.scalerPort=70000", "/operator/scalerPort"),
        ("operator.watchNamespaces={Bad_NS}", "/operator/watchNamespaces/0"),
        ("podMonitor.interval=soon", "/podMonitor/interval"),
        ("examplePDUnitSet.metricsPort=70000", "/examplePDUnitSet/metricsPort"),
        ("networkPolicy.enabled=maybe", "/networkPolicy/enabled"),
        ("examplePDUnitSet.adminPort=0", "/examplePDUnitSet/adminPort"),
        ("networkPolicy.unitNamespaces={Bad_NS}", "/networkPolicy/unitNamespaces/0"),
        ("networkPolicy.prometheus.podSelector=x", "/networkPolicy/prometheus/podSelector"),
        ("tracing.otlpEndpoint=grpc://collector:4317", "/tracing/otlpEndpoint"),
    ],
)
def test_values_schema_rejects_a_bad_value_naming_the_field(setting: str, named: str) -> None:
    out = run_helm(
        "template",
        "rel",
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        kube_version(),
        "--set",
        setting,
    )
    assert out.returncode != 0, f"--set {setting} was accepted"
    assert "values don't meet the specifications of the schema" in out.stderr
    assert named in out.stderr, out.stderr


def test_values_schema_lists_the_transfer_modes_of_the_one_list() -> None:
    """The chart's schema cannot import settings.TransferMode, so it keeps a copy: equal,
    in the CRD's order (a mode added to the list fails here until the chart takes it)."""
    import json
    import typing

    from pdunit.engine.settings import TransferMode

    schema = json.loads((CHART / "values.schema.json").read_text())
    enum = schema["properties"]["examplePDUnitSet"]["properties"]["transfer"]["enum"]
    assert enum == list(typing.get_args(TransferMode))


def test_values_schema_lists_the_depth_kernels_of_the_engines() -> None:
    """A copy too (as the transfer modes): equal to settings.DepthKernels, in its order."""
    import json
    import typing

    from pdunit.engine.settings import DepthKernels

    schema = json.loads((CHART / "values.schema.json").read_text())
    enum = schema["properties"]["examplePDUnitSet"]["properties"]["depthKernels"]["enum"]
    assert enum == list(typing.get_args(DepthKernels))


def test_cpu_units_need_a_host_or_tcp_transfer() -> None:
    out = run_helm(
        "template",
        "rel",
        str(CHART),
        "--kube-version",
        kube_version(),
        *EXAMPLE_SET,
        "--set",
        "examplePDUnitSet.device=cpu",
    )
    assert out.returncode != 0
    assert (
        "examplePDUnitSet.transfer=auto does not work with examplePDUnitSet.device=cpu"
        in out.stderr
    )
    docs = render(
        ["--set", "examplePDUnitSet.device=cpu", "--set", "examplePDUnitSet.transfer=host"]
    )
    spec = one(docs, "PDUnitSet")["spec"]["template"]["spec"]
    assert (spec["device"], spec["transfer"]) == ("cpu", "host")


def test_the_example_set_carries_kv_cache_dtype_only_when_it_is_not_auto() -> None:
    """An upgrade that adds the key at its default must not change the set's template
    (its hash rolls every unit)."""
    default = one(render([]), "PDUnitSet")["spec"]["template"]["spec"]
    assert "kvCacheDtype" not in default
    fp8 = one(render(["--set", "examplePDUnitSet.kvCacheDtype=fp8_e4m3"]), "PDUnitSet")
    assert fp8["spec"]["template"]["spec"]["kvCacheDtype"] == "fp8_e4m3"


def test_the_example_set_carries_decode_kernel_only_when_set() -> None:
    default = one(render([]), "PDUnitSet")["spec"]["template"]["spec"]
    assert "decodeKernel" not in default
    set_ = one(render(["--set", "examplePDUnitSet.decodeKernel=kv_as_a=1\\,fp8_dots=1"]), "PDUnitSet")
    assert set_["spec"]["template"]["spec"]["decodeKernel"] == "kv_as_a=1,fp8_dots=1"


def test_the_example_set_carries_a_codec_only_when_set() -> None:
    default = one(render([]), "PDUnitSet")["spec"]["template"]["spec"]
    assert "codec" not in default  # the key would change the template's hash
    speaking = one(render(["--set", "examplePDUnitSet.model=random:csm-tiny:0",
                           "--set", "examplePDUnitSet.codec=random:mimi-tiny:0"]), "PDUnitSet")
    assert speaking["spec"]["template"]["spec"]["codec"] == "random:mimi-tiny:0"


def test_the_example_set_carries_a_codec_conv_table_only_when_named_and_only_with_a_codec() -> None:
    default = one(render([]), "PDUnitSet")["spec"]["template"]["spec"]
    assert "codecConvTable" not in default  # the key would change the template's hash
    tuned = one(render(["--set", "examplePDUnitSet.model=random:csm-tiny:0",
                        "--set", "examplePDUnitSet.codec=random:mimi-tiny:0",
                        "--set", "examplePDUnitSet.codecConvTable.configMapName=codec-conv-h100"]), "PDUnitSet")
    assert tuned["spec"]["template"]["spec"]["codecConvTable"] == {"configMapName": "codec-conv-h100",
                                                                   "key": "codec-conv.json"}
    out = run_helm("template", "rel", str(CHART), "--kube-version", kube_version(), *EXAMPLE_SET,
                   "--set", "examplePDUnitSet.codecConvTable.configMapName=codec-conv-h100")
    assert out.returncode != 0
    assert "examplePDUnitSet.codecConvTable needs examplePDUnitSet.codec" in out.stderr, out.stderr


def test_tracing_sets_the_routers_otlp_endpoint_and_the_example_sets_only_when_given() -> None:
    default = render([])
    router = one(default, "Deployment", "rel-pdunit-router")["spec"]["template"]["spec"]["containers"][0]
    assert "env" not in router and "tracing" not in one(default, "PDUnitSet")["spec"]["template"]["spec"]
    docs = render(VARIANTS["tracing"])
    router = one(docs, "Deployment", "rel-pdunit-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["env"] == [{"name": "PDUNIT_OTLP_ENDPOINT", "value": "otel-collector.observability:4317"},
                             {"name": "EXTRA", "value": "1"}]
    spec = one(docs, "PDUnitSet")["spec"]["template"]["spec"]
    assert spec["tracing"] == {"otlpEndpoint": "otel-collector.observability:4317"}


@pytest.mark.parametrize("key", ["prefillGemm", "decodeGemm"])
def test_the_example_set_carries_a_gemm_precision_only_when_it_is_not_bf16(key: str) -> None:
    """As kvCacheDtype: the key at its default would change the template's hash."""
    default = one(render([]), "PDUnitSet")["spec"]["template"]["spec"]
    assert key not in default
    bf16 = one(render(["--set", f"examplePDUnitSet.{key}=bf16"]), "PDUnitSet")["spec"]["template"]["spec"]
    assert key not in bf16
    fp8 = one(render(["--set", f"examplePDUnitSet.{key}=fp8"]), "PDUnitSet")
    assert fp8["spec"]["template"]["spec"][key] == "fp8"


def test_the_example_set_carries_depth_kernels_only_when_it_is_not_auto() -> None:
    """As the GEMM precisions: the key at its default would change the template's hash."""
    assert "depthKernels" not in one(render([]), "PDUnitSet")["spec"]["template"]["spec"]
    fused = one(render(["--set", "examplePDUnitSet.depthKernels=fused"]), "PDUnitSet")
    assert fused["spec"]["template"]["spec"]["depthKernels"] == "fused"


def test_keda_max_below_min_is_refused_naming_both_fields() -> None:
    out = run_helm(
        "template",
        "rel",
        str(CHART),
        "--kube-version",
        kube_version(),
        "--set",
        "keda.enabled=true",
        "--set",
        "keda.minReplicaCount=5",
        "--set",
        "keda.maxReplicaCount=2",
    )
    assert out.returncode != 0
    assert "keda.maxReplicaCount (2) must be >= keda.minReplicaCount (5)" in out.stderr


def test_the_example_set_carries_metrics_port_only_when_it_is_not_the_default() -> None:
    default = one(render([]), "PDUnitSet")["spec"]["template"]["spec"]
    assert "metricsPort" not in default
    off = one(render(["--set", "examplePDUnitSet.metricsPort=0"]), "PDUnitSet")
    assert off["spec"]["template"]["spec"]["metricsPort"] == 0


def test_the_example_set_carries_admin_port_only_when_it_is_not_the_apis_default() -> None:
    """Left out at the default (a new key in the template would roll every unit), which the
    template spells as the API's own default."""
    from pdunit.operator.models import PDUnitSpec

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["examplePDUnitSet"]["adminPort"] == PDUnitSpec.model_fields["admin_port"].default
    assert "adminPort" not in one(render([]), "PDUnitSet")["spec"]["template"]["spec"]
    moved = one(render(["--set", "examplePDUnitSet.adminPort=8100"]), "PDUnitSet")
    assert moved["spec"]["template"]["spec"]["adminPort"] == 8100


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def test_pod_monitors_scrape_every_metrics_port_of_units_operator_and_router_by_name() -> None:
    """The unit PodMonitor selects the pods the operator writes and names every metrics
    port they can have (up to 7 decode engines); the control one selects the chart's
    operator and router pods and names ports they declare."""
    from pdunit.operator.pod import ADMIN_PORT_NAME, desired_pod

    assert not by_kind(render([]), "PodMonitor")  # off by default: needs the Prometheus Operator
    docs = render(["--set", "podMonitor.enabled=true", "--set", "podMonitor.labels.release=kps",
                   "--set", "podMonitor.unitNamespaces={voices,tts}", *PROMETHEUS])
    units = one(docs, "PodMonitor", "rel-pdunit-units")
    control = one(docs, "PodMonitor", "rel-pdunit-control")
    assert units["metadata"]["labels"]["release"] == control["metadata"]["labels"]["release"] == "kps"
    assert units["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE, "voices"]
    # by default units anywhere (a cluster-wide operator); else where the operator watches
    default = one(render(["--set", "podMonitor.enabled=true", *PROMETHEUS]), "PodMonitor", "rel-pdunit-units")
    assert default["spec"]["namespaceSelector"] == {"any": True}
    watched = one(render(["--set", "podMonitor.enabled=true", "--set", "operator.watchNamespaces={voices,tts}",
                          *PROMETHEUS]), "PodMonitor", "rel-pdunit-units")
    assert watched["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE, "voices"]
    unit_ports = {e["port"] for e in units["spec"]["podMetricsEndpoints"]}
    for decoders in (1, 7):
        pod = desired_pod({"metadata": {"name": "u", "namespace": NAMESPACE, "uid": "x"},
                             "spec": {"image": "i", "model": "random:tiny:0", "transfer": "proxy",
                                      "decoders": decoders}})
        assert _matches(units["spec"]["selector"], pod["metadata"]["labels"])
        declared = {p["name"] for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]
                    for p in c.get("ports", [])} - {ADMIN_PORT_NAME}  # the drain, never scraped
        assert declared <= unit_ports, declared - unit_ports
    assert unit_ports == declared  # 7 decode engines: every name the monitor lists is used
    pods = [d["spec"]["template"] for d in by_kind(docs, "Deployment")]
    selected = [t for t in pods if _matches(control["spec"]["selector"], t["metadata"]["labels"])]
    assert {t["metadata"]["labels"]["app.kubernetes.io/component"] for t in selected} == {"operator", "router"}
    control_ports = {p["name"] for t in selected for c in t["spec"]["containers"] for p in c.get("ports", [])}
    assert {e["port"] for e in control["spec"]["podMetricsEndpoints"]} == {"metrics", "http"} <= control_ports


# --- the unit pods' NetworkPolicy -----------------------------------------------------------

# Prometheus pods by label: what an install with the PodMonitors names.
PROMETHEUS = ["--set", "networkPolicy.prometheus.podSelector.app=prometheus"]


def _unit_pod(decoders: int = 1) -> dict[str, Any]:
    from pdunit.operator.pod import desired_pod

    return desired_pod({"metadata": {"name": "u", "namespace": NAMESPACE, "uid": "x"},
                        "spec": {"image": "i", "model": "random:tiny:0", "transfer": "proxy",
                                 "decoders": decoders}})


def _admitted(policy: dict[str, Any], port: str) -> list[dict[str, Any]]:
    """The peers a policy admits to the named port."""
    return [peer for rule in policy["spec"]["ingress"] if any(p["port"] == port for p in rule["ports"])
            for peer in rule["from"]]


def _peer(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    """The policy peer of the chart's own pods of one component (in the release namespace)."""
    (deploy,) = [d for d in by_kind(docs, "Deployment")
                 if d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
            "podSelector": {"matchLabels": {k: v for k, v in labels.items() if k.startswith("app.kubernetes.io/")
                                            and k in ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                                                      "app.kubernetes.io/component")}}}


def test_units_take_streams_from_the_router_and_operator_the_drain_from_the_operator_only() -> None:
    """On by default: a unit's stream port takes prompts without a credential, so the
    policy admits the router and the operator to it, only the operator to the admin port,
    and the named Prometheus pods to every metrics port the pod can have."""
    docs = render(PROMETHEUS)
    policy = one(docs, "NetworkPolicy")
    assert policy["metadata"]["namespace"] == NAMESPACE
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    pod = _unit_pod(decoders=7)
    assert _matches(policy["spec"]["podSelector"], pod["metadata"]["labels"])
    operator, router = _peer(docs, "operator"), _peer(docs, "router")
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
                  "podSelector": {"matchLabels": {"app": "prometheus"}}}
    assert _admitted(policy, "http") == [operator, router, prometheus]
    assert _admitted(policy, "admin") == [operator]
    declared = {p["name"] for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]
                for p in c.get("ports", [])}
    named = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert declared == named  # every port the pod declares has its rule, and no other port is opened
    for port in declared - {"http", "admin"}:
        assert _admitted(policy, port) == [prometheus], port
    # the selectors match the pods they mean to: the chart's operator and router
    for component, peer in (("operator", operator), ("router", router)):
        (deploy,) = [d for d in by_kind(docs, "Deployment")
                     if d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == component]
        assert _matches(peer["podSelector"], deploy["spec"]["template"]["metadata"]["labels"])


def test_without_a_prometheus_selector_no_scraper_is_admitted_and_pod_monitors_refuse_to_render() -> None:
    policy = one(render([]), "NetworkPolicy")
    assert [port for port in ("metrics-prefill", "metrics-decode0") if _admitted(policy, port)] == []
    out = run_helm("template", "rel", str(CHART), "--namespace", NAMESPACE, "--kube-version", kube_version(),
                   "--set", "podMonitor.enabled=true")
    assert out.returncode != 0 and "networkPolicy.prometheus" in out.stderr, out.stderr
    assert not by_kind(render(VARIANTS["no-network-policy"]), "NetworkPolicy")


def test_the_policy_covers_every_unit_namespace_and_admits_the_extra_lb_clients() -> None:
    docs = render(VARIANTS["network-policy"])
    policies = by_kind(docs, "NetworkPolicy")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["lab", "tts", "voices"]
    for policy in policies:
        assert _admitted(policy, "http")[-2] == {"podSelector": {"matchLabels": {"app": "my-router"}}}
        assert _admitted(policy, "admin") == [_peer(docs, "operator")]  # cross-namespace: by namespace name
    no_router = one(render(["--set", "router.enabled=false"]), "NetworkPolicy")
    assert _admitted(no_router, "http") == [_peer(docs, "operator")]


def test_a_prometheus_namespace_selector_admits_prometheus_of_that_namespace() -> None:
    policy = one(render(VARIANTS["monitoring"]), "NetworkPolicy")
    assert _admitted(policy, "metrics-guard") == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }]


def test_the_charts_pull_secrets_reach_the_operator_for_every_unit_pod() -> None:
    from pdunit.engine.settings import parse_config
    from pdunit.operator.config import OperatorConfig

    docs = render(["--set", "imagePullSecrets[0].name=regcred", "--set", "imagePullSecrets[1].name=mirror"])
    op = one(docs, "Deployment", "rel-pdunit-operator")["spec"]["template"]["spec"]["containers"][0]
    cfg = parse_config(OperatorConfig, op["args"][1:], "pdunit operator", env={})
    assert cfg.unit_image_pull_secrets == ["regcred", "mirror"]
    default = one(render([]), "Deployment", "rel-pdunit-operator")["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--unit-image-pull-secrets") for a in default["args"])
