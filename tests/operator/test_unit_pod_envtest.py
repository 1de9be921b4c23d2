"""The adapted unit pod on a real kube-apiserver (envtest, Kubernetes v1.34): a PDUnit
with every pod and container override gives a pod the apiserver accepts (its admission
checks the priority class and the runtime class exist), carrying them; the CRD's CEL
rules refuse the operator's own names before any pod is made; a set's units share one
voices claim and send traces to the set's OTLP endpoint.
"""

from __future__ import annotations

from typing import Any

import yaml

from pdunit.engine.unit_layout import VOICES_TOKEN_FILE
from tests.operator.envtest import ControlPlane, Kubelet, wait_for
from tests.operator.test_integration import get_pod, get_unit, unit, unit_set


def _apply(cp: ControlPlane, ns: str, doc: dict[str, Any]) -> None:
    cp.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))


def test_a_unit_with_overrides_gets_a_pod_the_apiserver_accepts_with_them(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    ns = namespace
    _apply(control_plane, ns, {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                               "metadata": {"name": f"{ns}-high"}, "value": 1000})
    _apply(control_plane, ns, {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                               "metadata": {"name": f"{ns}-nvidia"}, "handler": "nvidia"})
    spread = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
              "labelSelector": {"matchLabels": {"pdunit.dev/unit": "adapted"}}}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}]}}}
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit(
        "adapted",
        podMetadata={"labels": {"cost": "gpu"}, "annotations": {"example.com/owner": "voice"}},
        imagePullSecrets=[{"name": "regcred"}],
        serviceAccountName="units",
        priorityClassName=f"{ns}-high",
        runtimeClassName=f"{ns}-nvidia",
        affinity=affinity,
        topologySpreadConstraints=[spread],
        volumes=[{"name": "weights", "hostPath": {"path": "/models", "type": "Directory"}},
                 {"name": "voice-store", "persistentVolumeClaim": {"claimName": "voices"}}],
        volumeMounts={"prefill": [{"name": "weights", "mountPath": "/models", "readOnly": True}],
                      "decode": [{"name": "weights", "mountPath": "/models", "readOnly": True}]},
        voices={"volume": "voice-store"},
        env=[{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        qos="Guaranteed",
        model="/models/qwen3-4b",
    ))
    pod = wait_for(lambda: get_pod(api, ns, "adapted"), 30, "pod adapted",
                   describe=lambda: (get_unit(api, ns, "adapted") or {}).get("status"))
    spec = pod["spec"]
    assert pod["metadata"]["labels"]["cost"] == "gpu"
    assert pod["metadata"]["annotations"]["example.com/owner"] == "voice"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert (spec["serviceAccountName"], spec["priorityClassName"], spec["runtimeClassName"]) == (
        "units", f"{ns}-high", f"{ns}-nvidia")
    assert spec["priority"] == 1000  # the Priority admission plugin resolved the class
    assert spec["affinity"] == affinity and spec["topologySpreadConstraints"] == [spread]
    assert {"weights", "voice-store"} <= {v["name"] for v in spec["volumes"]}
    cs = {c["name"]: c for c in spec["containers"]}
    assert any(mt["mountPath"] == "/models" for mt in cs["decode"]["volumeMounts"])
    assert any(mt["name"] == "voice-store" for mt in cs["lb"]["volumeMounts"])
    assert {"name": "NODE", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}}} in (
        cs["lb"]["env"])
    assert pod["status"]["qosClass"] == "Guaranteed"  # computed by the apiserver at create


def test_the_crd_refuses_the_operators_volume_and_mount_names(
    control_plane: ControlPlane, namespace: str
) -> None:
    bad_volume = control_plane.kubectl("apply", "-n", namespace, "-f", "-", check=False, input=unit(
        "bad-volume", volumes=[{"name": "run", "emptyDir": {}}]))
    assert bad_volume.returncode != 0 and "spec.volumes[0].name" in bad_volume.stderr
    assert "volume name run is one of the operator's" in bad_volume.stderr
    bad_mount = control_plane.kubectl("apply", "-n", namespace, "-f", "-", check=False, input=unit(
        "bad-mount", volumes=[{"name": "w", "emptyDir": {}}],
        volumeMounts={"lb": [{"name": "w", "mountPath": "/run/pdunit/x"}]}))
    assert bad_mount.returncode != 0 and "spec.volumeMounts.lb[0].mountPath" in bad_mount.stderr
    bad_label = control_plane.kubectl("apply", "-n", namespace, "-f", "-", check=False, input=unit(
        "bad-label", podMetadata={"labels": {"app.kubernetes.io/component": "x"}}))
    assert bad_label.returncode != 0 and "spec.podMetadata.labels" in bad_label.stderr


def test_a_dra_unit_gets_its_claim_template_and_a_pod_whose_containers_reference_it(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    """resource.k8s.io/v1 is served by the v1.34 apiserver: the operator creates the
    unit's ResourceClaimTemplate, then the pod whose engines each use one request of it
    and whose proxy holds the whole claim; the apiserver accepts both."""
    ns = namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit(
        "paired", device="cuda", transfer="proxy", decoders=2, gpuAllocation="dra",
        dra={"nvlinkDomainAttribute": "gpu.nvidia.com/nvlinkDomain"}))
    (template,) = wait_for(
        lambda: api.items(f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates", "pdunit.dev/unit=paired"),
        30, "the ResourceClaimTemplate of paired", describe=lambda: (get_unit(api, ns, "paired") or {}).get("status"))
    name = template["metadata"]["name"]
    assert name.startswith("paired-gpus-")
    owner = template["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("PDUnit", "paired")
    devices = template["spec"]["spec"]["devices"]
    assert [r["name"] for r in devices["requests"]] == ["prefill", "decode-0", "decode-1"]
    assert devices["constraints"][0]["matchAttribute"] == "gpu.nvidia.com/nvlinkDomain"
    pod = wait_for(lambda: get_pod(api, ns, "paired"), 30, "pod paired")
    assert pod["spec"]["resourceClaims"] == [{"name": "gpus", "resourceClaimTemplateName": name}]
    cs = {c["name"]: c for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]}
    assert [cs[n]["resources"]["claims"] for n in ("prefill", "decode-0", "decode-1")] == [
        [{"name": "gpus", "request": n}] for n in ("prefill", "decode-0", "decode-1")]
    assert cs["nvlink-proxy"]["resources"]["claims"] == [{"name": "gpus"}]


def test_the_crd_refuses_a_bad_codec_naming_the_field(control_plane: ControlPlane, namespace: str) -> None:
    cases = [
        ({"codec": "mimi"}, "spec.codec", "codec must be empty, 'checkpoint', 'random:mimi-tiny:<seed>'"),
        ({"codec": "checkpoint"}, "spec.codec", "codec checkpoint reads the model checkpoint's own codec"),
        ({"audio": {"chunkFrames": 2}}, "spec.audio", "audio chunking needs a codec"),
        ({"codec": "random:mimi-tiny:0", "audio": {"chunkFrames": 0}}, "spec.audio.chunkFrames", "0"),
    ]
    for i, (spec, field, words) in enumerate(cases):
        out = control_plane.kubectl("apply", "-n", namespace, "-f", "-", check=False,
                                    input=unit(f"bad-codec-{i}", model="random:csm-tiny:0", **spec))
        assert out.returncode != 0 and f"{field}:" in out.stderr and words in out.stderr, (spec, out.stderr)


def test_the_crd_refuses_a_bad_codec_conv_table_and_a_good_one_reaches_the_decode_engine(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    speaking = {"model": "random:csm-tiny:0", "codec": "random:mimi-tiny:0"}
    cases = [
        ({"codecConvTable": {"configMapName": "t", "key": "k.json"}}, "spec.codecConvTable", "need a codec"),
        ({**speaking, "codecConvTable": {"configMapName": "", "key": "k.json"}},
         "spec.codecConvTable.configMapName", "should be at least 1 chars long"),
        ({**speaking, "codecConvTable": {"configMapName": "t", "key": ""}},
         "spec.codecConvTable.key", "should be at least 1 chars long"),
        ({**speaking, "codecConvTable": {"configMapName": "t"}}, "spec.codecConvTable.key", "Required value"),
    ]
    for i, (spec, field, words) in enumerate(cases):
        out = control_plane.kubectl("apply", "-n", namespace, "-f", "-", check=False,
                                    input=unit(f"bad-table-{i}", **spec))
        assert out.returncode != 0 and f"{field}:" in out.stderr and words in out.stderr, (spec, out.stderr)
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=unit(
        "tuned", **speaking, codecConvTable={"configMapName": "codec-conv-h100", "key": "h100.json"}))
    pod = wait_for(lambda: get_pod(api, namespace, "tuned"), 30, "pod tuned",
                   describe=lambda: (get_unit(api, namespace, "tuned") or {}).get("status"))
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "codec-conv-table"]
    assert volume["configMap"]["name"] == "codec-conv-h100"
    assert volume["configMap"]["items"] == [{"key": "h100.json", "path": "codec-conv.json"}]
    decode = next(c for c in pod["spec"]["containers"] if c["name"] == "decode")
    assert {"name": "codec-conv-table", "mountPath": "/etc/pdunit/codec-conv", "readOnly": True} in [
        {k: mt[k] for k in ("name", "mountPath", "readOnly") if k in mt} for mt in decode["volumeMounts"]]
    argv = decode["command"]
    assert argv[argv.index("--codec-conv-table") + 1] == "/etc/pdunit/codec-conv/codec-conv.json"


def test_a_speaking_unit_gets_a_pod_whose_lb_reads_the_checkpoint_from_the_engines_volume(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    ns = namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit(
        "speaking", model="/models/csm-1b", codec="checkpoint", audio={"chunkFrames": 4},
        volumes=[{"name": "weights", "hostPath": {"path": "/models", "type": "Directory"}},
                 {"name": "voice-store", "emptyDir": {}}],
        volumeMounts={"prefill": [{"name": "weights", "mountPath": "/models", "readOnly": True}],
                      "decode": [{"name": "weights", "mountPath": "/models", "readOnly": True}]},
        voices={"volume": "voice-store", "tokenSecret": "speaking-voices"},
    ))
    pod = wait_for(lambda: get_pod(api, ns, "speaking"), 30, "pod speaking",
                   describe=lambda: (get_unit(api, ns, "speaking") or {}).get("status"))
    cs = {c["name"]: c for c in pod["spec"]["containers"]}
    lb = cs["lb"]["command"]
    assert lb[lb.index("--model") + 1] == "/models/csm-1b" and lb[lb.index("--codec") + 1] == "checkpoint"
    assert "--voices" in lb
    # voice writes need the token of the named Secret, mounted as the admin token is, in the LB only
    assert lb[lb.index("--voices-token-file") + 1] == VOICES_TOKEN_FILE
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "voices-token"]
    assert volume["secret"] == {"secretName": "speaking-voices", "defaultMode": 0o440,
                                "items": [{"key": "voices-token", "path": "voices-token"}]}
    assert [mt["name"] for c in cs.values() for mt in c["volumeMounts"] if mt["name"] == "voices-token"] == [
        "voices-token"]
    refused = control_plane.kubectl("apply", "-n", ns, "-f", "-", check=False, input=unit(
        "read-only-writes", model="random:csm-tiny:0", codec="random:mimi-tiny:0",
        volumes=[{"name": "voice-store", "emptyDir": {}}],
        voices={"volume": "voice-store", "tokenSecret": "speaking-voices", "readOnly": True}))
    assert refused.returncode != 0 and "spec.voices.tokenSecret:" in refused.stderr, refused.stderr
    assert {"name": "weights", "mountPath": "/models", "readOnly": True} in [
        {k: mt[k] for k in ("name", "mountPath", "readOnly") if k in mt} for mt in cs["lb"]["volumeMounts"]]
    decode = cs["decode"]["command"]
    assert decode[decode.index("--audio-chunk-frames") + 1] == "4"


def test_a_sets_units_mount_one_voices_claim_and_their_engines_get_the_otlp_endpoint(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    ns = namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit_set(
        "shared", 2, model="random:csm-tiny:0", codec="random:mimi-tiny:0",
        voices={"claimName": "tts-voices", "tokenSecret": "tts-voices-token"},
        tracing={"otlpEndpoint": "http://otel-collector.observability:4317"}))
    pods = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(
        api.items(f"/api/v1/namespaces/{ns}/pods", "pdunit.dev/set=shared")), 60, "the set's two pods")
    for pod in pods:
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "pdunit-voices"]
        assert volume["persistentVolumeClaim"] == {"claimName": "tts-voices"}
        cs = {c["name"]: c for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]}
        assert {"name": "pdunit-voices", "mountPath": "/var/lib/pdunit/voices"} in cs["lb"]["volumeMounts"]
        traced = {n for n, c in cs.items() if {"name": "PDUNIT_OTLP_ENDPOINT",
                                                "value": "http://otel-collector.observability:4317"} in c["env"]}
        assert traced == {"lb", "prefill", "decode"}, traced


def test_the_crd_refuses_a_bad_otlp_endpoint_and_a_voice_store_of_two_sources(
    control_plane: ControlPlane, namespace: str
) -> None:
    cases = [
        ({"tracing": {"otlpEndpoint": "collector"}}, "spec.tracing.otlpEndpoint", "otlpEndpoint must be host:port"),
        ({"tracing": {"otlpEndpoint": "collector:99999"}}, "spec.tracing.otlpEndpoint", "host:port"),
        ({"tracing": {"otlpEndpoint": "grpc://c:4317"}}, "spec.tracing.otlpEndpoint", "host:port"),
        ({"volumes": [{"name": "vs", "emptyDir": {}}], "voices": {"volume": "vs", "claimName": "c"}},
         "spec.voices", "exactly one of volume"),
        ({"voices": {"subPath": "x"}}, "spec.voices", "exactly one of volume"),
    ]
    for i, (spec, field, words) in enumerate(cases):
        out = control_plane.kubectl("apply", "-n", namespace, "-f", "-", check=False,
                                    input=unit(f"bad-spec-{i}", **spec))
        assert out.returncode != 0 and f"{field}:" in out.stderr and words in out.stderr, (spec, out.stderr)
    for i, endpoint in enumerate(["collector:4317", "https://otel.example.com:443", "[fd00::1]:4317"]):
        control_plane.kubectl("apply", "-n", namespace, "-f", "-",
                              input=unit(f"traced-{i}", tracing={"otlpEndpoint": endpoint}))
