"""The example manifests under docs/examples are valid: every object against Kubernetes
1.34 (PDUnits and PDUnitSets against their CRDs' schemas and the operator's models), and
the pod the operator makes of each unit against the Pod schema of 1.34."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pdunit.operator import models as m
from pdunit.operator.pod import desired_pod
from tests.charts.test_helm_chart import _validate

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
FILES = sorted(EXAMPLES.glob("*.yaml"))


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _unit_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == m.UNIT_KIND:
        return [m.unit_spec(doc["spec"]).model_dump(by_alias=True, exclude_none=True)]
    if doc["kind"] == m.SET_KIND:
        return [m.set_spec(doc["spec"]).template.spec.model_dump(by_alias=True, exclude_none=True)]
    return []


def test_there_are_examples() -> None:
    assert FILES and all(_docs(f) for f in FILES)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_example_object_and_its_unit_pod_are_valid_for_kubernetes_1_34(path: Path) -> None:
    units = 0
    for doc in _docs(path):
        _validate(doc, "1.34.0")
        for spec in _unit_specs(doc):
            unit = {"metadata": {"name": "u", "namespace": "tts", "uid": "x"}, "spec": spec}
            kubernetes_validate.validate(desired_pod(unit), "1.34.0", strict=True)
            units += 1
    assert units, f"{path.name} has no PDUnit or PDUnitSet"


def test_the_weights_example_mounts_the_model_into_prefill_and_decode_and_voices_into_the_lb() -> None:
    docs = {d["metadata"]["name"]: d for d in _docs(EXAMPLES / "unit-weights-and-voices.yaml")}
    (spec,) = _unit_specs(docs["tts"])
    cs = {c["name"]: c for c in desired_pod({"metadata": {"name": "u", "uid": "x"}, "spec": spec})["spec"]["containers"]}
    for name in ("prefill", "decode"):
        mounts = {mt["mountPath"]: mt["name"] for mt in cs[name]["volumeMounts"]}
        assert spec["model"].startswith("/models/") and mounts["/models"] == "weights"
    # the set's one voices claim in every unit's LB, written with the Secret's token
    assert {"name": m.VOICES_CLAIM_VOLUME, "mountPath": m.VOICES_MOUNT_PATH} in cs["lb"]["volumeMounts"]
    assert docs["tts-voices"]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert spec["voices"] == {"claimName": "tts-voices", "tokenSecret": "tts-voices-token"}
    assert "voices-token" in docs["tts-voices-token"]["stringData"]
    assert "--voices-token-file" in cs["lb"]["command"]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_speaking_examples_give_the_lb_the_model_codec_and_voices_and_the_mounts_they_live_on() -> None:
    docs = {d["metadata"]["name"]: d for d in _docs(EXAMPLES / "unit-weights-and-voices.yaml")}
    (spec,) = _unit_specs(docs["tts"])
    pod = desired_pod({"metadata": {"name": "u", "uid": "x"}, "spec": spec})
    cs = {c["name"]: c for c in pod["spec"]["containers"]}
    lb = cs["lb"]["command"]
    assert (_flag(lb, "--model"), _flag(lb, "--codec"), _flag(lb, "--voices")) == (
        spec["model"], "checkpoint", m.VOICES_MOUNT_PATH)
    assert _flag(cs["decode"]["command"], "--codec") == "checkpoint"
    assert {"name": "weights", "mountPath": "/models", "readOnly": True} in cs["lb"]["volumeMounts"]
    (own,) = _unit_specs(docs["tts-own-codec"])
    cs = {c["name"]: c for c in desired_pod({"metadata": {"name": "u", "uid": "x"}, "spec": own})["spec"]["containers"]}
    assert _flag(cs["lb"]["command"], "--codec") == _flag(cs["decode"]["command"], "--codec") == "/codecs/mimi"
    assert {"name": "codecs", "mountPath": "/codecs", "readOnly": True} in cs["lb"]["volumeMounts"]
    assert not any(mt["name"] == "codecs" for mt in cs["prefill"]["volumeMounts"])
