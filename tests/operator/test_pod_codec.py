"""A unit that speaks (spec.codec, spec.audio): the pod's LB and decode commands carry
--model/--codec/--voices and the chunking flags, the LB and the decode engines get
read-only copies of the mounts holding the checkpoint and a codec folder, the LB alone
the voices token of spec.voices.tokenSecret (none: a read-only store), every bad
value is refused naming its field (models and the CRD's CEL rules), and the codec is
part of a set's template hash while a unit without one keeps its hash. No server."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from pydantic import ValidationError

from pdunit.engine.unit_layout import VOICES_TOKEN_FILE
from pdunit.operator import models as m
from pdunit.operator.pod import SECRET_FILE_MODE, VOICES_TOKEN_KEY, desired_pod, unit_defaults
from pdunit.operator.rollout import new_unit
from pdunit.operator.spec_hash import spec_hashes, template_hashes
from tests.operator.test_reconcile import a_set, a_unit, containers

WEIGHTS = {"name": "weights", "persistentVolumeClaim": {"claimName": "csm-1b", "readOnly": True}}
CODECS = {"name": "codecs", "hostPath": {"path": "/var/lib/codecs", "type": "Directory"}}
STORE = {"name": "voice-store", "persistentVolumeClaim": {"claimName": "voices"}}
ON_WEIGHTS = {"prefill": [{"name": "weights", "mountPath": "/models", "readOnly": True}],
              "decode": [{"name": "weights", "mountPath": "/models", "readOnly": True}]}


def speaking_unit(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "/models/csm-1b", "codec": "checkpoint", "volumes": [WEIGHTS, STORE],
                            "volumeMounts": ON_WEIGHTS, "voices": {"volume": "voice-store"}}
    return a_unit(**{**body, **spec})


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {mt["mountPath"]: mt for mt in container["volumeMounts"]}


def test_the_lb_and_every_decode_engine_get_the_codec_and_the_lb_the_model_and_the_voice_store() -> None:
    pod = desired_pod(a_unit(model="random:csm-tiny:0", codec="random:mimi-tiny:3", decoders=2,
                             volumes=[STORE], voices={"volume": "voice-store"}))
    cs = containers(pod)
    lb = cs["lb"]["command"]
    assert (flag(lb, "--model"), flag(lb, "--codec"), flag(lb, "--voices")) == (
        "random:csm-tiny:0", "random:mimi-tiny:3", m.VOICES_MOUNT_PATH)
    for name in ("decode-0", "decode-1"):
        assert flag(cs[name]["command"], "--codec") == "random:mimi-tiny:3"
    assert "--codec" not in cs["prefill"]["command"]  # P never decodes audio
    kubernetes_validate.validate(pod, "1.34.0", strict=True)


def test_without_a_codec_the_lb_serves_frames_only_and_the_voice_store_is_only_mounted() -> None:
    cs = containers(desired_pod(a_unit(volumes=[STORE], voices={"volume": "voice-store"})))
    assert not {"--model", "--codec", "--voices"} & set(cs["lb"]["command"])
    assert "--codec" not in cs["decode"]["command"]
    assert mounts(cs["lb"])[m.VOICES_MOUNT_PATH]["name"] == "voice-store"
    assert "/models" not in mounts(cs["lb"])


def test_a_checkpoint_on_the_engines_volume_is_mounted_read_only_into_the_lb() -> None:
    pod = desired_pod(speaking_unit())
    cs = containers(pod)
    assert flag(cs["lb"]["command"], "--model") == "/models/csm-1b"
    assert flag(cs["lb"]["command"], "--codec") == "checkpoint"
    assert mounts(cs["lb"])["/models"] == {"name": "weights", "mountPath": "/models", "readOnly": True}
    assert flag(cs["decode"]["command"], "--codec") == "checkpoint"
    assert [mt["mountPath"] for mt in cs["decode"]["volumeMounts"]].count("/models") == 1  # its own, once
    for sidecar in ("quiesce-guard", "nvlink-proxy"):
        assert "/models" not in mounts(cs[sidecar])
    kubernetes_validate.validate(pod, "1.34.0", strict=True)


def test_the_carried_mount_keeps_its_sub_path_and_is_read_only_even_when_the_engines_is_not() -> None:
    sub = {"name": "weights", "mountPath": "/models/csm-1b", "subPath": "csm/1b"}
    cs = containers(desired_pod(speaking_unit(volumeMounts={"prefill": [sub], "decode": [sub]})))
    assert mounts(cs["lb"])["/models/csm-1b"] == {**sub, "readOnly": True}
    assert "readOnly" not in mounts(cs["decode"])["/models/csm-1b"]


def test_nothing_is_carried_when_the_lb_mounts_it_itself_or_no_mount_holds_it() -> None:
    own = {"name": "weights", "mountPath": "/models", "readOnly": True}
    cs = containers(desired_pod(speaking_unit(volumeMounts={**ON_WEIGHTS, "lb": [own]})))
    assert [mt["mountPath"] for mt in cs["lb"]["volumeMounts"]].count("/models") == 1
    in_image = containers(desired_pod(speaking_unit(model="/opt/csm-1b", volumeMounts=ON_WEIGHTS)))
    assert not any(mt["name"] == "weights" for mt in in_image["lb"]["volumeMounts"])
    frames_only = containers(desired_pod(speaking_unit(codec=None)))
    assert "/models" not in mounts(frames_only["lb"])


def test_a_codec_folder_on_a_volume_reaches_the_lb_and_every_decode_engine() -> None:
    only_lb = {"lb": [{"name": "codecs", "mountPath": "/codecs"}]}
    pod = desired_pod(speaking_unit(codec="/codecs/mimi", decoders=2, volumes=[WEIGHTS, STORE, CODECS],
                                    volumeMounts={**ON_WEIGHTS, **only_lb}))
    cs = containers(pod)
    for name in ("lb", "decode-0", "decode-1"):
        assert flag(cs[name]["command"], "--codec") == "/codecs/mimi"
    assert mounts(cs["lb"])["/codecs"] == {"name": "codecs", "mountPath": "/codecs"}  # the LB's own, as given
    assert mounts(cs["lb"])["/models"]["readOnly"] is True  # --model
    for name in ("decode-0", "decode-1"):
        assert mounts(cs[name])["/codecs"] == {"name": "codecs", "mountPath": "/codecs", "readOnly": True}
    assert "/codecs" not in mounts(cs["prefill"])
    # a codec folder under the checkpoint's mount comes with it
    under = containers(desired_pod(speaking_unit(codec="/models/mimi")))
    assert [mt["mountPath"] for mt in under["lb"]["volumeMounts"]].count("/models") == 1
    kubernetes_validate.validate(pod, "1.34.0", strict=True)


def test_audio_chunking_reaches_every_decode_engine_before_its_extra_args() -> None:
    cs = containers(desired_pod(speaking_unit(decoders=2, audio={"firstChunkFrames": 2, "chunkFrames": 5},
                                              extraArgs={"decode": ["--audio-chunk-frames", "6"]})))
    for name in ("decode-0", "decode-1"):
        argv = cs[name]["command"]
        flags = [(x, argv[i + 1]) for i, x in enumerate(argv) if x.startswith("--audio-")]
        # spec.audio's, then extraArgs' (last: argparse keeps it)
        assert flags == [("--audio-first-chunk-frames", "2"), ("--audio-chunk-frames", "5"),
                         ("--audio-chunk-frames", "6")]
        assert argv[-2:] == ["--audio-chunk-frames", "6"]
    assert "--audio-chunk-frames" not in cs["lb"]["command"] + cs["prefill"]["command"]
    only_first = containers(desired_pod(speaking_unit(audio={"firstChunkFrames": 3})))["decode"]["command"]
    assert only_first[only_first.index("--audio-first-chunk-frames") + 1] == "3"
    assert "--audio-chunk-frames" not in only_first


@pytest.mark.parametrize(("spec", "field", "words"), [
    ({"codec": "mimi"}, "spec.codec", "random:mimi-tiny:<seed>"),
    ({"codec": "random:mimi:0"}, "spec.codec", "absolute path"),
    ({"codec": "codecs/mimi"}, "spec.codec", "absolute path"),
    ({"codec": "checkpoint"}, "spec.codec", "model must be a checkpoint folder"),
    ({"codec": "/" + "x" * 4096}, "spec.codec", "at most 4096"),
    ({"audio": {"chunkFrames": 2}}, "spec.audio", "needs a codec"),
    ({"codec": "", "audio": {"chunkFrames": 2}}, "spec.audio", "needs a codec"),
    ({"codec": "random:mimi-tiny:0", "audio": {"chunkFrames": 0}}, "spec.audio.chunkFrames", ">= 1"),
    ({"codec": "random:mimi-tiny:0", "audio": {"firstChunkFrames": 101}}, "spec.audio.firstChunkFrames",
     "less than or equal to 100"),
    ({"codec": "random:mimi-tiny:0", "audio": {"frames": 1}}, "spec.audio.frames", "Extra inputs"),
])
def test_bad_codec_and_audio_values_are_refused_naming_the_field(spec: dict[str, Any], field: str,
                                                                 words: str) -> None:
    with pytest.raises(ValidationError) as exc:
        desired_pod(a_unit(model="random:csm-tiny:0", **spec))
    msg = m.validation_message(exc.value)
    assert f"{field}:" in msg and (words in msg or words.replace(">= ", "greater than or equal to ") in msg), msg


@pytest.mark.parametrize("codec", ["", "checkpoint", "random:mimi-tiny:0", "random:mimi-tiny:12", "/codecs/mimi"])
def test_every_codec_form_is_taken(codec: str) -> None:
    assert m.unit_spec({"image": "x", "model": "/models/csm-1b", "codec": codec}).codec == codec


def test_the_crd_checks_the_same_with_cel_naming_the_field() -> None:
    from pdunit.operator.crdgen import unit_crd

    schema = unit_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    (codec_rule,) = schema["properties"]["codec"]["x-kubernetes-validations"]
    assert "random:mimi-tiny:[0-9]+$" in codec_rule["rule"] and "'checkpoint'" in codec_rule["rule"]
    by_path = {r.get("fieldPath"): r for r in schema["x-kubernetes-validations"]}
    assert "self.model.startsWith('/')" in by_path[".codec"]["rule"]
    assert "has(self.codec)" in by_path[".audio"]["rule"]
    audio = schema["properties"]["audio"]["properties"]
    assert {k: (v["minimum"], v["maximum"]) for k, v in audio.items()} == {
        "firstChunkFrames": (1, m.AUDIO_MAX_CHUNK_FRAMES), "chunkFrames": (1, m.AUDIO_MAX_CHUNK_FRAMES)}
    assert "default" not in schema["properties"]["codec"] and all("default" not in v for v in audio.values())


def test_a_unit_without_a_codec_keeps_its_hash_and_a_set_rolls_on_a_codec_change() -> None:
    bare = a_set(1)["spec"]["template"]
    served = {"spec": unit_defaults(bare["spec"])}  # as the operator reads it: no codec key at all
    assert "codec" not in served["spec"] and "audio" not in served["spec"]
    assert template_hashes(served)[0] == template_hashes(bare)[0]
    assert spec_hashes(served["spec"])[0] == spec_hashes(bare["spec"])[0]
    speaking = {"spec": {**bare["spec"], "codec": "random:mimi-tiny:0"}}
    chunked = {"spec": {**speaking["spec"], "audio": {"chunkFrames": 4}}}
    assert len({template_hashes(t)[0] for t in (bare, speaking, chunked)}) == 3


def test_a_set_template_carries_the_codec_to_its_units() -> None:
    s = a_set(1)
    s["spec"]["template"]["spec"].update(model="random:csm-tiny:0", codec="random:mimi-tiny:0",
                                         audio={"chunkFrames": 4})
    m.set_spec(s["spec"])  # the set's models take it
    u = new_unit(s, "0123456789")
    assert (u["spec"]["codec"], u["spec"]["audio"]) == ("random:mimi-tiny:0", {"chunkFrames": 4})
    with pytest.raises(ValidationError) as exc:
        m.set_spec({**s["spec"], "template": {"spec": {**s["spec"]["template"]["spec"], "codec": "mimi"}}})
    assert "spec.template.spec.codec:" in m.validation_message(exc.value)


def test_voice_writes_need_the_token_of_the_named_secret_mounted_into_the_lb_only() -> None:
    pod = desired_pod(speaking_unit(voices={"volume": "voice-store", "tokenSecret": "tts-voices"}))
    cs = containers(pod)
    assert flag(cs["lb"]["command"], "--voices-token-file") == VOICES_TOKEN_FILE
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[VOICES_TOKEN_KEY]["secret"] == {
        "secretName": "tts-voices", "items": [{"key": VOICES_TOKEN_KEY, "path": VOICES_TOKEN_KEY}],
        "defaultMode": SECRET_FILE_MODE}  # the admin token's mode: the engine refuses a file others read
    folder = VOICES_TOKEN_FILE.rsplit("/", 1)[0]
    assert mounts(cs["lb"])[folder] == {"name": VOICES_TOKEN_KEY, "mountPath": folder, "readOnly": True}
    for name, c in cs.items():
        if name != "lb":
            assert all(mt["name"] != VOICES_TOKEN_KEY for mt in c["volumeMounts"]), name
            assert "--voices-token-file" not in c["command"], name
    kubernetes_validate.validate(pod, "1.34.0", strict=True)


def test_without_a_token_secret_the_voice_store_is_read_only_and_mounts_no_token() -> None:
    pod = desired_pod(speaking_unit())
    assert "--voices" in containers(pod)["lb"]["command"]
    assert "--voices-token-file" not in containers(pod)["lb"]["command"]  # the LB refuses every write
    assert VOICES_TOKEN_KEY not in {v["name"] for v in pod["spec"]["volumes"]}


@pytest.mark.parametrize(("voices", "field", "words"), [
    ({"volume": "voice-store", "tokenSecret": "tts-voices", "readOnly": True}, "spec.voices",
     "voices.readOnly refuses them"),
    ({"volume": "voice-store", "tokenSecret": "Not_A_Name"}, "spec.voices.tokenSecret", "pattern"),
])
def test_a_bad_token_secret_is_refused_naming_the_field(voices: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ValidationError) as exc:
        desired_pod(speaking_unit(voices=voices))
    msg = m.validation_message(exc.value)
    assert f"{field}:" in msg and words in msg, msg


def test_the_crd_refuses_a_token_secret_on_a_read_only_store_with_cel() -> None:
    from pdunit.operator.crdgen import unit_crd

    schema = unit_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    voices = schema["properties"]["voices"]
    (rule,) = [r for r in voices["x-kubernetes-validations"] if r.get("fieldPath") == ".tokenSecret"]
    assert "self.readOnly" in rule["rule"]
    assert "default" not in voices["properties"]["tokenSecret"]  # a unit without one keeps its hash
    assert VOICES_TOKEN_KEY in m.OPERATOR_VOLUMES  # nobody names a volume of theirs as the token's
