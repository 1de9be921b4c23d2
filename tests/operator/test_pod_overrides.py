"""The unit pod adapted to a cluster: pod-level and per-container overrides merged into
`desired_pod`, default requests and QoS, and every refusal of what the operator owns
(by the models, naming the field, and by the CRD's CEL rules on the same names).

No server: the CEL rules are read from the generated CRD and checked for the names
they refuse; the envtest test (test_integration) shows the apiserver takes the pod.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from pydantic import ValidationError

from pdunit.engine.unit_layout import RUN_DIR, SECRETS_DIR
from pdunit.operator import models as m
from pdunit.operator.pod import DEFAULT_REQUESTS, desired_pod
from tests.operator.test_reconcile import a_unit, containers

PVC = {"name": "weights", "persistentVolumeClaim": {"claimName": "qwen3-4b", "readOnly": True}}
AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H200"]}]}]}}}
SPREAD = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
          "labelSelector": {"matchLabels": {"pdunit.dev/set": "tts"}}}


def overridden_unit(**extra: Any) -> dict[str, Any]:
    return a_unit(
        podMetadata={"labels": {"team": "voice", "cost": "gpu"}, "annotations": {"example.com/x": "1"}},
        imagePullSecrets=[{"name": "regcred"}],
        serviceAccountName="units",
        priorityClassName="inference-high",
        runtimeClassName="nvidia",
        affinity=AFFINITY,
        topologySpreadConstraints=[SPREAD],
        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        volumes=[PVC],
        volumeMounts={"prefill": [{"name": "weights", "mountPath": "/models", "readOnly": True}],
                      "decode": [{"name": "weights", "mountPath": "/models", "readOnly": True}]},
        env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        resources={"prefill": {"requests": {"memory": "40Gi"}}},
        **extra,
    )


def test_pod_level_overrides_reach_the_pod_and_the_operators_fields_stay() -> None:
    pod = desired_pod(overridden_unit(), image_pull_secrets=["chart-cred", "regcred"])
    spec, meta = pod["spec"], pod["metadata"]
    assert meta["labels"]["cost"] == "gpu" and meta["labels"][m.LABEL_UNIT] == "u1"
    assert meta["annotations"]["example.com/x"] == "1" and m.ANNOTATION_SPEC_HASH in meta["annotations"]
    # the chart's secrets first, each name once
    assert spec["imagePullSecrets"] == [{"name": "chart-cred"}, {"name": "regcred"}]
    assert (spec["serviceAccountName"], spec["priorityClassName"], spec["runtimeClassName"]) == (
        "units", "inference-high", "nvidia")
    assert spec["affinity"] == AFFINITY and spec["topologySpreadConstraints"] == [SPREAD]
    assert spec["volumes"][-1] == PVC and [v["name"] for v in spec["volumes"]][:3] == ["run", "tmp", "shm"]
    assert spec["shareProcessNamespace"] is True and spec["automountServiceAccountToken"] is False


def test_container_overrides_reach_their_role_only() -> None:
    cs = containers(desired_pod(overridden_unit(decoders=2)))
    for name in ("prefill", "decode-0", "decode-1"):
        assert {"name": "weights", "mountPath": "/models", "readOnly": True} in cs[name]["volumeMounts"]
        assert cs[name]["volumeMounts"][0] == {"name": "run", "mountPath": RUN_DIR}
    assert all(mt["name"] != "weights" for mt in cs["lb"]["volumeMounts"])
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert all(token in c["env"] for c in cs.values())
    assert cs["prefill"]["resources"]["requests"]["memory"] == "40Gi"
    assert cs["prefill"]["resources"]["requests"]["cpu"] == DEFAULT_REQUESTS["prefill"]["cpu"]


def test_role_env_reaches_its_role_only_and_wins_over_spec_env() -> None:
    cs = containers(desired_pod(a_unit(
        decoders=2, env=[{"name": "A", "value": "all"}],
        roleEnv={"decode": [{"name": "A", "value": "d"},
                            {"name": "GPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory"}}}]})))
    for name in ("decode-0", "decode-1"):
        assert [e for e in cs[name]["env"] if e["name"] == "A"] == [{"name": "A", "value": "d"}]
        assert any(e["name"] == "GPU" and "valueFrom" in e for e in cs[name]["env"])
    assert [e for e in cs["prefill"]["env"] if e["name"] == "A"] == [{"name": "A", "value": "all"}]
    assert all(e["name"] != "GPU" for e in cs["lb"]["env"])


def test_role_env_refuses_fault_injection_naming_the_item() -> None:
    msg = _refusal(roleEnv={"prefill": [{"name": "PDUNIT_FAULT_INJECTION", "value": "1"}]})
    assert "spec.roleEnv.prefill.0.name" in msg


def test_the_overridden_pod_validates_against_the_kubernetes_1_34_schema() -> None:
    kubernetes_validate.validate(desired_pod(overridden_unit(), ["chart-cred"]), "1.34.0", strict=True)


def test_without_overrides_the_pod_has_none_of_their_fields() -> None:
    spec = desired_pod(a_unit())["spec"]
    for field in ("imagePullSecrets", "serviceAccountName", "priorityClassName", "runtimeClassName",
                  "affinity", "topologySpreadConstraints"):
        assert field not in spec


def test_every_container_requests_cpu_and_memory_so_the_pod_is_burstable() -> None:
    for c in containers(desired_pod(a_unit(transfer="proxy"))).values():
        requests = c["resources"]["requests"]
        assert requests["cpu"] and requests["memory"], c["name"]
        assert "cpu" not in c["resources"].get("limits", {}), c["name"]


def test_guaranteed_sets_limits_equal_to_requests_in_every_container() -> None:
    pod = desired_pod(a_unit(transfer="proxy", qos="Guaranteed",
                             resources={"lb": {"limits": {"cpu": "2"}}, "decode": {"requests": {"memory": "8Gi"}}}))
    cs = containers(pod)
    for c in cs.values():
        r = c["resources"]
        assert all(r["limits"][k] == r["requests"][k] for k in ("cpu", "memory")), c["name"]
    assert cs["lb"]["resources"]["requests"]["cpu"] == "2"  # a given limit is the request too
    assert cs["decode"]["resources"]["limits"]["memory"] == "8Gi"
    assert cs["prefill"]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_a_limit_without_a_request_is_also_the_request() -> None:
    lb = containers(desired_pod(a_unit(resources={"lb": {"limits": {"memory": "1Gi"}}})))["lb"]
    assert lb["resources"]["requests"]["memory"] == "1Gi"


def _refusal(**spec: Any) -> str:
    with pytest.raises(ValidationError) as exc:
        desired_pod(a_unit(**spec))
    return m.validation_message(exc.value)


@pytest.mark.parametrize("owned", m.OPERATOR_VOLUMES)
def test_a_volume_named_as_the_operators_is_refused_by_name(owned: str) -> None:
    msg = _refusal(volumes=[{"name": owned, "emptyDir": {}}])
    assert "spec.volumes.0.name" in msg and owned in msg and "rename" in msg


@pytest.mark.parametrize("path", [RUN_DIR, "/tmp", "/tmp/x", "/dev/shm", SECRETS_DIR + "/unit",
                                  m.VOICES_MOUNT_PATH])
def test_a_mount_at_or_under_the_operators_paths_is_refused_by_name(path: str) -> None:
    msg = _refusal(volumes=[PVC], volumeMounts={"lb": [{"name": "weights", "mountPath": path}]})
    assert "spec.volumeMounts.lb.0.mountPath" in msg and path in msg


def test_a_mount_of_a_volume_the_spec_lacks_is_refused_naming_it() -> None:
    msg = _refusal(volumeMounts={"decode": [{"name": "weights", "mountPath": "/models"}]})
    assert "volumeMounts.decode[0].name 'weights'" in msg and "spec.volumes" in msg


@pytest.mark.parametrize("label", [m.LABEL_UNIT, m.LABEL_SET, m.LABEL_NAME, m.LABEL_COMPONENT, m.LABEL_MANAGED_BY])
def test_the_operators_pod_labels_are_refused_by_name(label: str) -> None:
    msg = _refusal(podMetadata={"labels": {label: "x"}})
    assert "spec.podMetadata.labels" in msg and label in msg


def test_the_operators_pod_annotations_are_refused_by_name() -> None:
    msg = _refusal(podMetadata={"annotations": {m.ANNOTATION_SPEC_HASH: "x"}})
    assert "spec.podMetadata.annotations" in msg and m.ANNOTATION_SPEC_HASH in msg


@pytest.mark.parametrize("field", ["shareProcessNamespace", "containers", "initContainers", "command",
                                   "readinessProbe", "livenessProbe", "automountServiceAccountToken"])
def test_the_operators_pod_fields_are_no_spec_fields(field: str) -> None:
    msg = _refusal(**{field: True})
    assert f"spec.{field}" in msg and "Extra inputs are not permitted" in msg


def test_an_env_with_value_and_value_from_is_refused_naming_it() -> None:
    msg = _refusal(env=[{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}])
    assert "spec.env.0" in msg and "env A has both value and valueFrom" in msg


def _rules(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [r["rule"] for r in node.get("x-kubernetes-validations", [])]
        return own + [r for v in node.values() for r in _rules(v)]
    if isinstance(node, list):
        return [r for v in node for r in _rules(v)]
    return []


def test_the_crd_refuses_the_same_names_with_cel() -> None:
    from pdunit.operator.crdgen import unit_crd

    spec = unit_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    volume_rules = _rules(spec["volumes"]["items"]["properties"]["name"])
    assert all(f"'{v}'" in volume_rules[0] for v in m.OPERATOR_VOLUMES)
    mount_rules = _rules(spec["volumeMounts"]["properties"]["lb"]["items"]["properties"]["mountPath"])
    assert all(f"'{p}'" in mount_rules[0] for p in m.OPERATOR_MOUNT_PATHS)
    label_rules = _rules(spec["podMetadata"]["properties"]["labels"])
    assert all(f"'{k}'" in label_rules[0] for k in m.OPERATOR_LABEL_KEYS) and "'pdunit.dev/'" in label_rules[0]
    for big in ("affinity", "topologySpreadConstraints", "volumes"):
        node = spec[big].get("items", spec[big])
        assert node["x-kubernetes-preserve-unknown-fields"] is True, big
