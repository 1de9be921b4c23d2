"""spec.codecConvTable: one key of a ConfigMap (the table `pdunit bench codec --tune-conv`
wrote) mounted read-only into every decode engine, whose --codec-conv-table names the
mounted file; nothing else of the pod changes, a unit without it gets none of the three,
and every bad value is refused naming its field (models and the CRD). No server."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
from pydantic import ValidationError

from pdunit.engine.unit_layout import UnitSpec, unit_commands
from pdunit.operator import models as m
from pdunit.operator.pod import desired_pod
from pdunit.operator.spec_hash import template_hashes
from tests.operator.test_pod_voices_claim_and_tracing import spec_schema
from tests.operator.test_reconcile import a_set, a_unit, containers

SPEAKING = {"model": "random:csm-tiny:0", "codec": "random:mimi-tiny:0"}
TABLE = {"configMapName": "codec-conv-h100", "key": "codec-conv-20261207-h100.json"}


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_every_decode_engine_mounts_the_tables_key_read_only_and_names_it_with_the_flag() -> None:
    pod = desired_pod(a_unit(**SPEAKING, decoders=2, transfer="proxy", codecConvTable=TABLE))
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == m.CODEC_CONV_TABLE_VOLUME]
    assert volume["configMap"] == {"name": "codec-conv-h100",
                                   "items": [{"key": "codec-conv-20261207-h100.json", "path": "codec-conv.json"}]}
    cs = containers(pod)
    for name in ("decode-0", "decode-1"):
        assert {"name": m.CODEC_CONV_TABLE_VOLUME, "mountPath": m.CODEC_CONV_TABLE_DIR,
                "readOnly": True} in cs[name]["volumeMounts"]
        assert flag(cs[name]["command"], "--codec-conv-table") == m.CODEC_CONV_TABLE_FILE
    assert m.CODEC_CONV_TABLE_FILE == f"{m.CODEC_CONV_TABLE_DIR}/codec-conv.json"  # the item's path, mounted
    for name in ("lb", "prefill", "nvlink-proxy", "quiesce-guard"):  # only the engines that decode audio
        assert "--codec-conv-table" not in cs[name]["command"], name
        assert all(mt["name"] != m.CODEC_CONV_TABLE_VOLUME for mt in cs[name]["volumeMounts"]), name
    kubernetes_validate.validate(pod, "1.34.0", strict=True)


def _without_the_table(pod: dict[str, Any]) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    pod["metadata"]["annotations"].pop(m.ANNOTATION_SPEC_HASH)
    spec = pod["spec"]
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != m.CODEC_CONV_TABLE_VOLUME]
    for c in spec["containers"] + spec["initContainers"]:
        c["volumeMounts"] = [mt for mt in c["volumeMounts"] if mt["name"] != m.CODEC_CONV_TABLE_VOLUME]
        if "--codec-conv-table" in c["command"]:
            at = c["command"].index("--codec-conv-table")
            del c["command"][at:at + 2]
    return pod


def test_the_table_adds_the_volume_the_mounts_and_the_flag_and_nothing_else() -> None:
    bare = desired_pod(a_unit(**SPEAKING, decoders=2))
    tuned = desired_pod(a_unit(**SPEAKING, decoders=2, codecConvTable=TABLE))
    assert tuned != bare
    assert _without_the_table(tuned) == _without_the_table(bare)
    # without the field: no volume, no mount, no flag
    assert _without_the_table(bare)["spec"] == bare["spec"]


def test_a_new_table_rolls_a_set_and_a_set_without_one_keeps_its_hash() -> None:
    bare = a_set(1)["spec"]["template"]
    speaking = {"spec": {**bare["spec"], **SPEAKING}}
    tuned = {"spec": {**speaking["spec"], "codecConvTable": TABLE}}
    retuned = {"spec": {**speaking["spec"], "codecConvTable": {**TABLE, "configMapName": "codec-conv-h100-v2"}}}
    hashes = {template_hashes(t)[0] for t in (speaking, tuned, retuned)}
    assert len(hashes) == 3
    # the defaults the operator fills in (unit_defaults) leave the field out: the hash stays
    assert "codecConvTable" not in m.unit_spec(speaking["spec"]).model_dump(by_alias=True, exclude_none=True)


def test_the_monolith_takes_the_flag_from_the_layout_too() -> None:
    cmds = unit_commands(UnitSpec(model="random:csm-tiny:0", mode="monolith", codec="random:mimi-tiny:0",
                                  codec_conv_table="/tables/codec-conv.json"))
    assert flag(cmds["monolith"], "--codec-conv-table") == "/tables/codec-conv.json"
    assert "--codec-conv-table" not in cmds["lb"]


@pytest.mark.parametrize(("table", "field", "words"), [
    ({"configMapName": "", "key": "codec-conv.json"}, "spec.codecConvTable.configMapName", "at least 1 character"),
    ({"configMapName": "codec-conv", "key": ""}, "spec.codecConvTable.key", "at least 1 character"),
    ({"configMapName": "Codec_Conv", "key": "codec-conv.json"}, "spec.codecConvTable.configMapName", "pattern"),
    ({"configMapName": "codec-conv", "key": "tables/h100.json"}, "spec.codecConvTable.key", "pattern"),
    ({"configMapName": "codec-conv", "key": ".."}, "spec.codecConvTable.key", "pattern"),
    ({"configMapName": "codec-conv"}, "spec.codecConvTable.key", "Field required"),
    ({"name": "codec-conv", "key": "codec-conv.json"}, "spec.codecConvTable.configMapName", "Field required"),
])
def test_a_bad_table_reference_is_refused_naming_the_field(table: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ValidationError) as exc:
        desired_pod(a_unit(**SPEAKING, codecConvTable=table))
    msg = m.validation_message(exc.value)
    assert f"{field}:" in msg and words in msg, msg


@pytest.mark.parametrize("codec", [None, ""])
def test_a_table_without_a_codec_is_refused_naming_the_field(codec: str | None) -> None:
    spec: dict[str, Any] = {"image": "x", "model": "random:csm-tiny:0", "codecConvTable": TABLE}
    if codec is not None:
        spec["codec"] = codec
    with pytest.raises(ValidationError) as exc:
        m.unit_spec(spec)
    msg = m.validation_message(exc.value)
    assert "spec.codecConvTable:" in msg and "need a codec" in msg, msg


def test_the_tables_volume_name_and_folder_are_the_operators() -> None:
    with pytest.raises(ValidationError) as exc:
        m.unit_spec({"image": "x", "model": "random:tiny:0",
                     "volumes": [{"name": m.CODEC_CONV_TABLE_VOLUME, "emptyDir": {}}]})
    assert "spec.volumes.0.name:" in m.validation_message(exc.value)
    with pytest.raises(ValidationError) as exc:
        m.unit_spec({"image": "x", "model": "random:tiny:0", "volumes": [{"name": "mine", "emptyDir": {}}],
                     "volumeMounts": {"decode": [{"name": "mine", "mountPath": f"{m.CODEC_CONV_TABLE_DIR}/x"}]}})
    assert "spec.volumeMounts.decode.0.mountPath:" in m.validation_message(exc.value)


def test_the_crd_refuses_the_same_with_its_schema_and_cel() -> None:
    schema = spec_schema()
    table = schema["properties"]["codecConvTable"]
    assert table["required"] == ["configMapName", "key"] and "default" not in table
    for name in ("configMapName", "key"):
        assert table["properties"][name]["minLength"] == 1
    assert table["properties"]["key"]["pattern"] == m.CONFIG_MAP_KEY_PATTERN
    (rule,) = [r for r in schema["x-kubernetes-validations"] if r.get("fieldPath") == ".codecConvTable"]
    assert "has(self.codec)" in rule["rule"] and "need a codec" in rule["message"]
    volume_rule = schema["properties"]["volumes"]["items"]["properties"]["name"]["x-kubernetes-validations"][0]
    assert f"'{m.CODEC_CONV_TABLE_VOLUME}'" in volume_rule["rule"]
