"""Two spec fields of the unit pod: `voices.claimName` (one ReadWriteMany claim every unit
of a set mounts into its LB: the set's one voice store) and `tracing.otlpEndpoint`
(PDUNIT_OTLP_ENDPOINT on the processes that handle a request), each refusal naming its
field in the models and the CRD's CEL rules."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from pydantic import ValidationError

from pdunit.operator import models as m
from pdunit.operator.crdgen import unit_crd
from pdunit.operator.pod import OTLP_ENDPOINT_ENV, desired_pod
from pdunit.operator.rollout import new_unit
from pdunit.operator.spec_hash import template_hashes
from tests.operator.test_reconcile import a_set, a_unit, containers, env_of

SPEAKING = {"model": "random:csm-tiny:0", "codec": "random:mimi-tiny:0"}


def spec_schema() -> dict[str, Any]:
    return unit_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]  # type: ignore[no-any-return]


# ------------------------------------------------------------------ voices.claimName


def test_every_unit_of_a_set_mounts_the_one_claim_into_its_lb_only() -> None:
    s = a_set(2)
    s["spec"]["template"]["spec"].update(SPEAKING, voices={"claimName": "tts-voices", "tokenSecret": "tts-vt"})
    m.set_spec(s["spec"])
    pods = [desired_pod({**new_unit(s, "0123456789"), "metadata": {
        **new_unit(s, "0123456789")["metadata"], "name": name, "uid": f"uid-{name}"}}) for name in ("u1", "u2")]
    for pod in pods:
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes[m.VOICES_CLAIM_VOLUME] == {"name": m.VOICES_CLAIM_VOLUME,
                                                  "persistentVolumeClaim": {"claimName": "tts-voices"}}
        cs = containers(pod)
        lb = cs["lb"]
        assert {"name": m.VOICES_CLAIM_VOLUME, "mountPath": m.VOICES_MOUNT_PATH} in lb["volumeMounts"]
        assert lb["command"][lb["command"].index("--voices") + 1] == m.VOICES_MOUNT_PATH
        assert "--voices-token-file" in lb["command"]
        for name, c in cs.items():
            if name != "lb":
                assert all(mt["name"] != m.VOICES_CLAIM_VOLUME for mt in c["volumeMounts"]), name
        kubernetes_validate.validate(pod, "1.34.0", strict=True)


def test_a_read_only_claim_is_mounted_and_claimed_read_only() -> None:
    pod = desired_pod(a_unit(**SPEAKING, voices={"claimName": "tts-voices", "readOnly": True, "subPath": "v1"}))
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == m.VOICES_CLAIM_VOLUME]
    assert volume["persistentVolumeClaim"] == {"claimName": "tts-voices", "readOnly": True}
    (mount,) = [mt for mt in containers(pod)["lb"]["volumeMounts"] if mt["name"] == m.VOICES_CLAIM_VOLUME]
    assert mount == {"name": m.VOICES_CLAIM_VOLUME, "mountPath": m.VOICES_MOUNT_PATH, "readOnly": True,
                     "subPath": "v1"}


def test_a_volume_of_the_spec_still_works_and_adds_no_claim_volume() -> None:
    pod = desired_pod(a_unit(**SPEAKING, volumes=[{"name": "vs", "emptyDir": {}}], voices={"volume": "vs"}))
    assert m.VOICES_CLAIM_VOLUME not in {v["name"] for v in pod["spec"]["volumes"]}
    assert {"name": "vs", "mountPath": m.VOICES_MOUNT_PATH} in containers(pod)["lb"]["volumeMounts"]


@pytest.mark.parametrize(("voices", "field", "words"), [
    ({"claimName": "a", "volume": "vs"}, "spec.voices", "exactly one of volume"),
    ({"subPath": "x"}, "spec.voices", "exactly one of volume"),
    ({"claimName": "Not_A_Claim"}, "spec.voices.claimName", "pattern"),
])
def test_a_bad_voice_store_source_is_refused_naming_the_field(voices: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ValidationError) as exc:
        desired_pod(a_unit(**SPEAKING, volumes=[{"name": "vs", "emptyDir": {}}], voices=voices))
    msg = m.validation_message(exc.value)
    assert f"{field}:" in msg and words in msg, msg


def test_the_claims_volume_name_is_the_operators() -> None:
    with pytest.raises(ValidationError) as exc:
        m.unit_spec({"image": "x", "model": "random:tiny:0",
                     "volumes": [{"name": m.VOICES_CLAIM_VOLUME, "emptyDir": {}}]})
    assert "spec.volumes.0.name:" in m.validation_message(exc.value)
    rule = spec_schema()["properties"]["volumes"]["items"]["properties"]["name"]["x-kubernetes-validations"][0]
    assert f"'{m.VOICES_CLAIM_VOLUME}'" in rule["rule"]


def test_the_crd_wants_exactly_one_voice_store_source_with_cel() -> None:
    voices = spec_schema()["properties"]["voices"]
    rules = [r["rule"] for r in voices["x-kubernetes-validations"]]
    assert "has(self.volume) != has(self.claimName)" in rules
    assert "required" not in voices and "default" not in voices["properties"]["claimName"]


# ------------------------------------------------------------------ tracing.otlpEndpoint


def test_the_otlp_endpoint_reaches_the_lb_prefill_and_every_decode_engine_not_the_sidecars() -> None:
    pod = desired_pod(a_unit(decoders=2, transfer="proxy", tracing={"otlpEndpoint": "otel-collector.obs:4317"}))
    cs = containers(pod)
    traced = {name for name, c in cs.items() if OTLP_ENDPOINT_ENV in env_of(c)}
    assert traced == {"lb", "prefill", "decode-0", "decode-1"} and {"nvlink-proxy", "quiesce-guard"} <= set(cs)
    assert {env_of(cs[n])[OTLP_ENDPOINT_ENV] for n in traced} == {"otel-collector.obs:4317"}
    kubernetes_validate.validate(pod, "1.34.0", strict=True)


def test_without_tracing_no_process_gets_the_variable_and_the_hash_stays() -> None:
    pod = desired_pod(a_unit())
    assert all(OTLP_ENDPOINT_ENV not in env_of(c) for c in containers(pod).values())
    bare = a_set(1)["spec"]["template"]
    traced = {"spec": {**bare["spec"], "tracing": {"otlpEndpoint": "collector:4317"}}}
    assert template_hashes(bare)[0] != template_hashes(traced)[0]  # a set rolls when tracing changes


def test_the_users_env_may_override_the_endpoint_of_one_role() -> None:
    pod = desired_pod(a_unit(tracing={"otlpEndpoint": "collector:4317"},
                             roleEnv={"decode": [{"name": OTLP_ENDPOINT_ENV, "value": "near-gpu:4317"}]}))
    cs = containers(pod)
    assert env_of(cs["decode"])[OTLP_ENDPOINT_ENV] == "near-gpu:4317"
    assert env_of(cs["lb"])[OTLP_ENDPOINT_ENV] == "collector:4317"
    assert [e["name"] for e in cs["decode"]["env"]].count(OTLP_ENDPOINT_ENV) == 1


@pytest.mark.parametrize("endpoint", ["collector:4317", "otel.obs.svc.cluster.local:4317", "10.0.0.7:4317",
                                      "http://collector:4317", "https://otel.example.com:443", "[fd00::1]:4317"])
def test_every_endpoint_form_is_taken(endpoint: str) -> None:
    spec = m.unit_spec({"image": "x", "model": "random:tiny:0", "tracing": {"otlpEndpoint": endpoint}})
    assert spec.tracing is not None and spec.tracing.otlp_endpoint == endpoint


@pytest.mark.parametrize("endpoint", ["collector", "collector:", "grpc://collector:4317", "collector:70000",
                                      "collector:0", "http://collector:4317/v1/traces", "a b:1", ""])
def test_a_bad_endpoint_is_refused_naming_the_field(endpoint: str) -> None:
    with pytest.raises(ValidationError) as exc:
        m.unit_spec({"image": "x", "model": "random:tiny:0", "tracing": {"otlpEndpoint": endpoint}})
    msg = m.validation_message(exc.value)
    assert "spec.tracing.otlpEndpoint:" in msg and "host:port or http(s)://host:port" in msg, msg


def test_the_crd_checks_the_endpoint_with_cel() -> None:
    tracing = spec_schema()["properties"]["tracing"]
    assert tracing["required"] == ["otlpEndpoint"]
    (rule,) = tracing["properties"]["otlpEndpoint"]["x-kubernetes-validations"]
    assert "self.matches(" in rule["rule"] and "65535" in rule["rule"]
    assert rule["message"].startswith("otlpEndpoint must be host:port")
