"""GPUs paired on purpose: gpuAllocation devicePlugin (one gpuResource per engine, the
proxy's access mode envVar or volumeMounts) and dra (one ResourceClaimTemplate, one
request per engine, the proxy holding the whole claim). Pure: the rendered objects and
the pod's references, validated against the Kubernetes 1.34 schemas."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from pydantic import ValidationError

from pdunit.operator import models as m
from pdunit.operator.pod import GPU_CLAIM, desired_claim_template, desired_pod
from tests.operator.test_reconcile import a_unit, containers, env_of

NVLINK = "gpu.nvidia.com/nvlinkDomain"


def dra_unit(**spec: Any) -> dict[str, Any]:
    return a_unit(transfer="proxy", gpuAllocation="dra", **spec)


def test_dra_claim_template_asks_one_gpu_per_engine_sharing_the_nvlink_domain() -> None:
    template = desired_claim_template(dra_unit(decoders=2, dra={"nvlinkDomainAttribute": NVLINK}))
    assert template is not None
    assert template["apiVersion"] == "resource.k8s.io/v1" and template["metadata"]["name"].startswith("u1-gpus-")
    assert template["metadata"]["ownerReferences"][0]["uid"] == "uid-u1"
    devices = template["spec"]["spec"]["devices"]
    assert [r["name"] for r in devices["requests"]] == ["prefill", "decode-0", "decode-1"]
    assert all(r["exactly"] == {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 1}
               for r in devices["requests"])
    assert devices["constraints"] == [{"requests": ["prefill", "decode-0", "decode-1"], "matchAttribute": NVLINK}]
    kubernetes_validate.validate(template, "1.34.0", strict=True)


def test_dra_without_an_nvlink_attribute_has_no_constraint_and_takes_the_device_class() -> None:
    template = desired_claim_template(dra_unit(dra={"deviceClassName": "gpu.example.com"}))
    assert template is not None
    devices = template["spec"]["spec"]["devices"]
    assert "constraints" not in devices and devices["requests"][0]["exactly"]["deviceClassName"] == "gpu.example.com"
    kubernetes_validate.validate(template, "1.34.0", strict=True)


def test_a_unit_asking_for_other_gpus_gets_a_template_of_another_name() -> None:
    names = set()
    for spec in ({}, {"decoders": 2}, {"dra": {"deviceClassName": "gpu.example.com"}}):
        template = desired_claim_template(dra_unit(**spec))
        assert template is not None
        names.add(template["metadata"]["name"])
    assert len(names) == 3
    again = desired_claim_template(dra_unit())
    assert again is not None and again["metadata"]["name"] in names  # stable for one spec


def test_device_plugin_units_have_no_claim_template() -> None:
    assert desired_claim_template(a_unit()) is None
    assert desired_claim_template(a_unit(gpuAllocation="devicePlugin")) is None


def test_dra_pod_gives_each_engine_its_request_and_the_proxy_the_whole_claim() -> None:
    pod = desired_pod(dra_unit(decoders=2, dra={"nvlinkDomainAttribute": NVLINK}))
    template = desired_claim_template(dra_unit(decoders=2, dra={"nvlinkDomainAttribute": NVLINK}))
    assert template is not None
    assert pod["spec"]["resourceClaims"] == [
        {"name": GPU_CLAIM, "resourceClaimTemplateName": template["metadata"]["name"]}]
    cs = containers(pod)
    for name in ("prefill", "decode-0", "decode-1"):
        assert cs[name]["resources"]["claims"] == [{"name": GPU_CLAIM, "request": name}]
        assert "nvidia.com/gpu" not in cs[name]["resources"].get("limits", {})
    proxy = cs["nvlink-proxy"]
    assert proxy["resources"]["claims"] == [{"name": GPU_CLAIM}]
    assert "NVIDIA_VISIBLE_DEVICES" not in env_of(proxy)  # it sees the claim's GPUs, no more
    for name in ("lb", "quiesce-guard"):
        assert "claims" not in cs[name]["resources"]
    kubernetes_validate.validate(pod, "1.34.0", strict=True)


def test_device_plugin_proxy_env_var_mode_is_the_default() -> None:
    for spec in ({}, {"gpuAllocation": "devicePlugin", "proxyDeviceAccess": "envVar"}):
        proxy = containers(desired_pod(a_unit(transfer="proxy", **spec)))["nvlink-proxy"]
        assert env_of(proxy)["NVIDIA_VISIBLE_DEVICES"] == "all"
        assert all(not mt["mountPath"].startswith(m.NVIDIA_DEVICES_DIR) for mt in proxy["volumeMounts"])


def test_device_plugin_proxy_volume_mounts_mode_mounts_all_gpus_instead_of_the_env_var() -> None:
    pod = desired_pod(a_unit(transfer="proxy", proxyDeviceAccess="volumeMounts"))
    proxy = containers(pod)["nvlink-proxy"]
    assert "NVIDIA_VISIBLE_DEVICES" not in env_of(proxy)
    mount = {mt["mountPath"]: mt["name"] for mt in proxy["volumeMounts"]}[f"{m.NVIDIA_DEVICES_DIR}/all"]
    assert {v["name"]: v for v in pod["spec"]["volumes"]}[mount]["emptyDir"]
    assert containers(pod)["prefill"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    kubernetes_validate.validate(pod, "1.34.0", strict=True)


def test_volume_mounts_mode_without_a_proxy_adds_no_volume() -> None:
    pod = desired_pod(a_unit(transfer="tcp", proxyDeviceAccess="volumeMounts"))
    assert all(v["name"] != "nvidia-all-gpus" for v in pod["spec"]["volumes"])


@pytest.mark.parametrize(("spec", "field", "says"), [
    ({"gpuAllocation": "dra", "device": "cpu", "transfer": "host"}, "spec", "gpuAllocation dra needs device cuda"),
    ({"gpuAllocation": "dra", "proxyDeviceAccess": "envVar"}, "spec", "proxyDeviceAccess is for gpuAllocation devicePlugin"),
    ({"dra": {"deviceClassName": "gpu.nvidia.com"}}, "spec", "dra settings need gpuAllocation dra"),
    ({"gpuAllocation": "mig"}, "spec.gpuAllocation", "'devicePlugin' or 'dra'"),
    ({"proxyDeviceAccess": "cdi"}, "spec.proxyDeviceAccess", "'envVar' or 'volumeMounts'"),
    ({"gpuAllocation": "dra", "dra": {"nvlinkDomainAttribute": "bad name!"}}, "spec.dra.nvlinkDomainAttribute", "pattern"),
])
def test_gpu_allocation_mistakes_are_refused_naming_the_field(spec: dict[str, Any], field: str, says: str) -> None:
    with pytest.raises(ValidationError) as exc:
        desired_pod(a_unit(**spec))
    msg = m.validation_message(exc.value)
    assert f"{field}:" in msg and says in msg


def test_the_crd_refuses_the_same_combinations_with_cel() -> None:
    from pdunit.operator.crdgen import unit_crd

    rules = {r["fieldPath"]: r["rule"] for r in
             unit_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]}
    assert "self.device == 'cuda'" in rules[".gpuAllocation"]
    assert "has(self.proxyDeviceAccess)" in rules[".proxyDeviceAccess"]
    assert "has(self.dra)" in rules[".dra"]
