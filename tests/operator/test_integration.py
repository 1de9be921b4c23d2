"""The real operator against a real kube-apiserver (envtest), with a stand-in kubelet.

What is real: kube-apiserver + etcd of Kubernetes v1.34 (CRD schema validation, CEL,
/scale, finalizers, status subresource), kubectl, and `pdunit operator` (kopf) as a
subprocess. What is played by the test: the kubelet (pods Running/Ready on 127.0.0.1)
and each unit's LB (tests.operator.envtest.FakeLb), whose in-flight count the test sets.
"""

from __future__ import annotations

import base64
import json
import re
import time
from typing import Any

import pytest
import yaml

from tests.operator.envtest import ControlPlane, FakeLb, Kubelet, wait_for

GROUP_PATH = "/apis/pdunit.dev/v1alpha1"


def unit_set(name: str, replicas: int, image: str = "pdunit:cpu-1", **spec: Any) -> str:
    template_spec = {
        "image": image,
        "model": "random:tiny:0",
        "device": "cpu",
        "transfer": "host",
        "drainTimeoutSeconds": 120,
        **spec,
    }
    return yaml.safe_dump(
        {
            "apiVersion": "pdunit.dev/v1alpha1",
            "kind": "PDUnitSet",
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "template": {"metadata": {"labels": {"team": "tts"}}, "spec": template_spec},
            },
        }
    )


def unit(name: str, **spec: Any) -> str:
    body = {
        "image": "pdunit:cpu-1",
        "model": "random:tiny:0",
        "device": "cpu",
        "transfer": "host",
        **spec,
    }
    return yaml.safe_dump(
        {
            "apiVersion": "pdunit.dev/v1alpha1",
            "kind": "PDUnit",
            "metadata": {"name": name},
            "spec": body,
        }
    )


def units_of(api: Any, ns: str, set_name: str) -> list[dict[str, Any]]:
    return api.items(f"{GROUP_PATH}/namespaces/{ns}/pdunits", f"pdunit.dev/set={set_name}")


def get_unit(api: Any, ns: str, name: str) -> dict[str, Any] | None:
    return api.get(f"{GROUP_PATH}/namespaces/{ns}/pdunits/{name}")


def get_pod(api: Any, ns: str, name: str) -> dict[str, Any] | None:
    return api.get(f"/api/v1/namespaces/{ns}/pods/{name}")


def ready_units(units: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        u
        for u in units
        if (u.get("status") or {}).get("phase") == "Ready"
        and (u.get("status") or {}).get("ready")
        and not u["spec"].get("draining")
    ]


def events(cp: ControlPlane, ns: str, name: str) -> list[dict[str, Any]]:
    out = cp.kubectl(
        "get", "events", "-n", ns, "-o", "json", "--field-selector", f"involvedObject.name={name}"
    )
    return json.loads(out.stdout)["items"]


def reasons(cp: ControlPlane, ns: str, name: str) -> list[str]:
    return [e["reason"] for e in events(cp, ns, name)]


def wait_ready(
    api: Any, ns: str, set_name: str, n: int, timeout: float = 60
) -> list[dict[str, Any]]:
    def check() -> list[dict[str, Any]] | None:
        units = units_of(api, ns, set_name)
        ready = ready_units(units)
        return ready if len(ready) == n and len(units) == n else None

    return wait_for(
        check,
        timeout,
        f"{n} ready units in {ns}/{set_name}",
        describe=lambda: summary(units_of(api, ns, set_name)),
    )


def summary(units: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """(name, draining, phase, ready, inFlight, message) of each unit, for failure messages."""
    return [
        (
            u["metadata"]["name"],
            u["spec"].get("draining"),
            (u.get("status") or {}).get("phase"),
            (u.get("status") or {}).get("ready"),
            (u.get("status") or {}).get("inFlight"),
            (u.get("status") or {}).get("message"),
        )
        for u in units
    ]


def set_in_flight(kubelet: Kubelet, api: Any, ns: str, name: str, n: int) -> FakeLb:
    lb = kubelet.lb(ns, name)
    lb.in_flight = n
    wait_for(
        lambda: (get_unit(api, ns, name) or {}).get("status", {}).get("inFlight") == n,
        20,
        f"{name} status.inFlight == {n}",
    )
    return lb


def test_pdunitset_creates_units_and_pods_with_the_unit_labels(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    ns = namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit_set("tts", 2))
    ready = wait_ready(api, ns, "tts", 2)
    for u in ready:
        name = u["metadata"]["name"]
        assert u["metadata"]["labels"]["pdunit.dev/template-hash"]
        assert u["metadata"]["labels"]["team"] == "tts"
        assert u["status"]["podIP"] == "127.0.0.1"
        assert u["status"]["lbPort"] == kubelet.lb(ns, name).port
        assert u["status"]["transferMode"] == "host"
        assert "pdunit.dev/drain" in u["metadata"]["finalizers"]
        pod = get_pod(api, ns, name)
        assert pod is not None
        labels = pod["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "pdunit"
        assert labels["app.kubernetes.io/component"] == "unit"
        assert labels["pdunit.dev/unit"] == name
        assert labels["pdunit.dev/set"] == "tts"
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "PDUnit",
            u["metadata"]["uid"],
            True,
        )
        # The apiserver accepted the native sidecars (initContainers, restartPolicy Always).
        assert [c["name"] for c in pod["spec"]["initContainers"]] == ["quiesce-guard"]
        assert pod["spec"]["initContainers"][0]["restartPolicy"] == "Always"

    def set_counts() -> tuple[int, int, int] | None:
        st = api.get(f"{GROUP_PATH}/namespaces/{ns}/pdunitsets/tts").get("status") or {}
        got = (st.get("replicas"), st.get("readyReplicas"), st.get("updatedReplicas"))
        return got if got == (2, 2, 2) else None

    wait_for(set_counts, 10, "set status replicas/ready/updated == 2/2/2")
    status = api.get(f"{GROUP_PATH}/namespaces/{ns}/pdunitsets/tts")["status"]
    assert status["selector"] == "pdunit.dev/set=tts"
    assert "UnitCreated" in reasons(control_plane, ns, "tts")


def test_scale_down_drains_the_busy_victim_until_it_reports_empty_twice(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    ns = namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit_set("tts", 3))
    names = sorted(u["metadata"]["name"] for u in wait_ready(api, ns, "tts", 3))
    idle, busy, busiest = names
    # Victims are the two with the fewest streams: `idle` (0) and `busy` (2); `busiest` stays.
    set_in_flight(kubelet, api, ns, idle, 0)
    busy_lb = set_in_flight(kubelet, api, ns, busy, 2)
    set_in_flight(kubelet, api, ns, busiest, 5)

    out = control_plane.kubectl("scale", "-n", ns, "pdunitset/tts", "--replicas=1")
    assert "scaled" in out.stdout
    # /scale wrote spec.replicas.
    assert api.get(f"{GROUP_PATH}/namespaces/{ns}/pdunitsets/tts")["spec"]["replicas"] == 1

    wait_for(lambda: get_unit(api, ns, idle) is None, 20, f"idle victim {idle} deleted")
    wait_for(
        lambda: (get_unit(api, ns, busy) or {}).get("status", {}).get("phase") == "Draining",
        20,
        f"{busy} Draining",
    )
    assert busy_lb.drain_log and busy_lb.drain_log[0][1] is True, (
        "the LB never got POST /v1/admin/drain"
    )
    # While streams are in flight the unit and its pod stay, for as long as it takes.
    for _ in range(6):
        time.sleep(0.5)
        assert get_pod(api, ns, busy) is not None, (
            "pod of the busy victim deleted with streams in flight"
        )
        assert get_unit(api, ns, busy) is not None
    survivor = get_unit(api, ns, busiest)
    assert survivor is not None and not survivor["spec"]["draining"]

    released_at = time.monotonic()
    busy_lb.in_flight = 0
    wait_for(lambda: get_unit(api, ns, busy) is None, 30, f"drained {busy} deleted")
    gone = kubelet.gone_at[f"{ns}/{busy}"]
    empties = [t for t, empty in busy_lb.load_log if empty and released_at <= t <= gone]
    assert len(empties) >= 2, f"pod deleted after {len(empties)} empty answers"
    # Two independent checks at least --drain-check-interval-seconds (1 s) apart.
    assert gone - released_at >= 1.0
    assert max(empties) - min(empties) >= 1.0
    assert {"DrainStarted", "Drained"} <= set(reasons(control_plane, ns, busy))
    wait_for(
        lambda: (
            (api.get(f"{GROUP_PATH}/namespaces/{ns}/pdunitsets/tts")["status"].get("replicas")) == 1
        ),
        10,
        "status.replicas == 1",
    )
    assert [u["metadata"]["name"] for u in units_of(api, ns, "tts")] == [busiest]


def test_image_change_rolls_one_unit_at_a_time_never_below_replicas(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    ns = namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit_set("tts", 2))
    old = {u["metadata"]["name"] for u in wait_ready(api, ns, "tts", 2)}
    old_hash = next(iter(units_of(api, ns, "tts")))["metadata"]["labels"][
        "pdunit.dev/template-hash"
    ]

    control_plane.kubectl(
        "apply", "-n", ns, "-f", "-", input=unit_set("tts", 2, image="pdunit:cpu-2")
    )
    samples: list[tuple[int, int, int]] = []  # (ready, old draining, units) over time
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        units = units_of(api, ns, "tts")
        ready = ready_units(units)
        draining_old = [
            u for u in units if u["metadata"]["name"] in old and u["spec"].get("draining")
        ]
        # a Drained unit's pod is gone (it holds no GPU): it waits only for its object's
        # deletion, so it does not count against maxSurge
        holding = [u for u in units if (u.get("status") or {}).get("phase") != "Drained"]
        samples.append((len(ready), len(draining_old), len(holding)))
        new_ready = [
            u for u in ready if u["metadata"]["labels"]["pdunit.dev/template-hash"] != old_hash
        ]
        if len(new_ready) == 2 and len(units) == 2:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"rollout did not finish: {summary(units_of(api, ns, 'tts'))}")

    assert min(s[0] for s in samples) >= 2, f"ready units fell below replicas: {samples}"
    assert max(s[1] for s in samples) <= 1, "two old units drained at once"
    assert max(s[2] for s in samples) <= 3, "more than maxSurge=1 extra unit"
    for u in units_of(api, ns, "tts"):
        assert u["metadata"]["name"] not in old
        assert kubelet.images[f"{ns}/{u['metadata']['name']}"] == "pdunit:cpu-2"
    status = api.get(f"{GROUP_PATH}/namespaces/{ns}/pdunitsets/tts")["status"]
    wait_for(
        lambda: (
            api.get(f"{GROUP_PATH}/namespaces/{ns}/pdunitsets/tts")["status"].get("updatedReplicas")
            == 2
        ),
        10,
        "updatedReplicas == 2",
    )
    assert status["templateHash"] != old_hash


def test_units_of_an_older_operator_are_kept_through_an_upgrade_and_relabelled(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    """An operator before 2026-11-30 labelled units with the hash of the template as the
    apiserver serves it, CRD defaults included. After an upgrade those units are the
    current template: relabelled in place, none drained, none created."""
    from pdunit.operator.spec_hash import template_hashes

    ns = namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit_set("tts", 2))
    names = {u["metadata"]["name"] for u in wait_ready(api, ns, "tts", 2)}
    served = api.get(f"{GROUP_PATH}/namespaces/{ns}/pdunitsets/tts")["spec"]["template"]
    current, legacy = template_hashes(served)
    assert current != legacy, "the served template carries defaults: the two hashes differ"
    victim = sorted(names)[0]
    resp = api.patch(f"{GROUP_PATH}/namespaces/{ns}/pdunits/{victim}",
                     {"metadata": {"labels": {"pdunit.dev/template-hash": legacy}}})
    assert resp.status_code == 200, resp.text
    wait_for(
        lambda: (get_unit(api, ns, victim) or {})["metadata"]["labels"]["pdunit.dev/template-hash"] == current,
        20,
        f"{victim} relabelled to {current}",
    )
    units = units_of(api, ns, "tts")
    assert {u["metadata"]["name"] for u in units} == names
    assert not any(u["spec"].get("draining") for u in units), summary(units)
    assert "UnitRelabelled" in reasons(control_plane, ns, "tts")


@pytest.mark.parametrize(
    ("manifest", "field", "fragment"),
    [
        (unit("bad-transfer", transfer="rdma"), "spec.transfer", "Unsupported value"),
        (unit("bad-kv", kvCacheDtype="fp4"), "spec.kvCacheDtype", "Unsupported value"),
        (unit("bad-prefill-gemm", prefillGemm="int8"), "spec.prefillGemm", "Unsupported value"),
        (unit("bad-decode-gemm", decodeGemm="int8"), "spec.decodeGemm", "Unsupported value"),
        (unit("bad-kernel", decodeKernel="fp8_dots"), "spec.decodeKernel", "should match"),
        (unit("bad-port", lbPort=0), "spec.lbPort", "greater than or equal to 1"),
        (unit("bad-model", model="qwen"), "spec.model", "random:<config>:<seed>"),
        (
            unit("bad-cpu", transfer="proxy"),
            "spec.transfer",
            "device cpu needs transfer host or tcp",
        ),
        (unit("bad-field", gpus=2), "spec.gpus", "unknown field"),
        # the CRD's rule, on the defaulted metricsPort (9400..9403) and on a given one
        (unit("bad-metrics", lbPort=9403), "spec.metricsPort", "leave out lbPort"),
        (unit("bad-metrics-end", metricsPort=65533), "spec.metricsPort", "end by 65535"),
        (unit_set("bad-replicas", -1), "spec.replicas", "greater than or equal to 0"),
        # the admin port of its own, and no fault injection in a pod (CEL rules per item)
        (unit("bad-admin", lbPort=8001), "spec.adminPort", "must differ from lbPort"),
        (unit("bad-admin-metrics", adminPort=9401), "spec.metricsPort", "leave out lbPort and adminPort"),
        (unit("bad-fault-arg", extraArgs={"prefill": ["--cache-tokens", "64", "--fault-w=3"]}),
         "spec.extraArgs.prefill[2]", "--fault-w=3 is a fault-injection flag"),
        (unit("bad-fault-env", env=[{"name": "PDUNIT_FAULT_INJECTION", "value": "1"}]),
         "spec.env[0].name", "PDUNIT_FAULT_INJECTION turns on fault injection"),
        (unit_set("bad-set-fault", 1, extraArgs={"decode": ["--debug-port", "9999"]}),
         "spec.template.spec.extraArgs.decode[0]", "never in a unit pod"),
    ],
)
def test_invalid_spec_is_refused_by_the_apiserver_naming_the_field(
    control_plane: ControlPlane, namespace: str, manifest: str, field: str, fragment: str
) -> None:
    out = control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=manifest, check=False)
    assert out.returncode != 0, "the apiserver accepted an invalid spec"
    assert field in out.stderr and fragment in out.stderr, out.stderr


def test_strategy_that_could_never_progress_is_refused(
    control_plane: ControlPlane, namespace: str
) -> None:
    doc = yaml.safe_load(unit_set("stuck", 1))
    doc["spec"]["strategy"] = {"maxSurge": 0, "maxUnavailable": 0}
    out = control_plane.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False
    )
    assert out.returncode != 0
    assert "spec.strategy" in out.stderr and "cannot both be 0" in out.stderr, out.stderr


def test_deleting_a_unit_with_streams_in_flight_waits_for_its_drain(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    ns = namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit("solo"))
    wait_for(
        lambda: (get_unit(api, ns, "solo") or {}).get("status", {}).get("phase") == "Ready",
        30,
        "solo Ready",
    )
    lb = set_in_flight(kubelet, api, ns, "solo", 3)
    control_plane.kubectl("delete", "-n", ns, "pdunit/solo", "--wait=false")
    wait_for(
        lambda: (get_unit(api, ns, "solo") or {}).get("status", {}).get("phase") == "Draining",
        20,
        "solo Draining",
    )
    for _ in range(6):
        time.sleep(0.5)
        held = get_unit(api, ns, "solo")
        assert held is not None and held["metadata"].get("deletionTimestamp"), (
            "finalizer did not hold"
        )
        assert get_pod(api, ns, "solo") is not None
    assert lb.draining, "the LB was not told to drain"
    lb.in_flight = 0
    wait_for(lambda: get_unit(api, ns, "solo") is None, 30, "solo deleted after its drain")
    assert get_pod(api, ns, "solo") is None


def test_drain_timeout_forces_deletion_and_reports_the_cut_streams(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    ns = namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit("stuck", drainTimeoutSeconds=2))
    wait_for(
        lambda: (get_unit(api, ns, "stuck") or {}).get("status", {}).get("phase") == "Ready",
        30,
        "stuck Ready",
    )
    set_in_flight(kubelet, api, ns, "stuck", 4)
    started = time.monotonic()
    control_plane.kubectl("delete", "-n", ns, "pdunit/stuck", "--wait=false")
    wait_for(lambda: get_unit(api, ns, "stuck") is None, 30, "stuck force-deleted")
    assert time.monotonic() - started >= 2.0, "deleted before drainTimeoutSeconds"
    forced = [e for e in events(control_plane, ns, "stuck") if e["reason"] == "DrainForced"]
    assert forced and forced[0]["type"] == "Warning"
    assert "4 streams cut" in forced[0]["message"]


def test_standalone_unit_draining_flag_stops_and_restarts_its_pod(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    ns = namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit("flip"))
    wait_for(
        lambda: (get_unit(api, ns, "flip") or {}).get("status", {}).get("phase") == "Ready",
        30,
        "flip Ready",
    )
    first_uid = get_pod(api, ns, "flip")["metadata"]["uid"]
    control_plane.kubectl(
        "patch", "-n", ns, "pdunit/flip", "--type=merge", "-p", '{"spec": {"draining": true}}'
    )
    wait_for(
        lambda: (get_unit(api, ns, "flip") or {}).get("status", {}).get("phase") == "Drained",
        20,
        "flip Drained",
    )
    assert get_pod(api, ns, "flip") is None
    control_plane.kubectl(
        "patch", "-n", ns, "pdunit/flip", "--type=merge", "-p", '{"spec": {"draining": false}}'
    )
    wait_for(
        lambda: (get_unit(api, ns, "flip") or {}).get("status", {}).get("phase") == "Ready",
        30,
        "flip Ready again",
    )
    assert get_pod(api, ns, "flip")["metadata"]["uid"] != first_uid


def _secret(api: Any, ns: str, name: str) -> dict[str, Any] | None:
    return api.get(f"/api/v1/namespaces/{ns}/secrets/{name}-unit-secret")


def test_a_unit_gets_a_secret_of_its_own_kept_across_pod_replacements_and_drains_with_its_token(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    ns = namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit("keep"))
    wait_for(lambda: (get_unit(api, ns, "keep") or {}).get("status", {}).get("phase") == "Ready", 30, "keep Ready")
    owner = get_unit(api, ns, "keep")["metadata"]["uid"]
    secret = _secret(api, ns, "keep")
    assert secret is not None and secret["immutable"] is True
    ref = secret["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("PDUnit", "keep", owner, True)
    values = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(values) == {"unit-secret", "admin-token"}
    assert all(re.fullmatch("[0-9a-f]{64}", v) for v in values.values()), "not 32 random bytes, hex"
    assert values["unit-secret"] != values["admin-token"]
    pod = get_pod(api, ns, "keep")
    assert {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v} == {"keep-unit-secret"}
    lb = kubelet.lb(ns, "keep")
    assert lb.token == values["admin-token"]

    first_pod = pod["metadata"]["uid"]
    control_plane.kubectl("patch", "-n", ns, "pdunit/keep", "--type=merge", "-p", '{"spec": {"draining": true}}')
    wait_for(lambda: (get_unit(api, ns, "keep") or {}).get("status", {}).get("phase") == "Drained", 20, "Drained")
    # the operator's drain reached the admin port with the Secret's token, and nothing was refused
    assert lb.drain_log and lb.drain_log[0][1] is True and not lb.refused_log, (lb.drain_log, lb.refused_log)
    control_plane.kubectl("patch", "-n", ns, "pdunit/keep", "--type=merge", "-p", '{"spec": {"draining": false}}')
    wait_for(lambda: (get_unit(api, ns, "keep") or {}).get("status", {}).get("phase") == "Ready", 30, "Ready again")
    assert get_pod(api, ns, "keep")["metadata"]["uid"] != first_pod
    again = _secret(api, ns, "keep")
    assert again["metadata"]["uid"] == secret["metadata"]["uid"] and again["data"] == secret["data"]
    assert kubelet.lb(ns, "keep").token == values["admin-token"]


def test_a_secret_the_operator_did_not_make_is_never_given_to_a_unit(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    """Someone who planted `<unit>-unit-secret` first would know the unit's P<->D secret and
    admin token: the operator refuses it, names the fix, and starts no pod until it is gone."""
    ns = namespace
    known = base64.b64encode(b"0" * 64).decode()
    planted = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "victim-unit-secret"},
               "data": {"unit-secret": known, "admin-token": known}}
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(planted))
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit("victim"))

    def refused() -> str | None:
        status = (get_unit(api, ns, "victim") or {}).get("status") or {}
        return status.get("message") if status.get("phase") == "Failed" else None

    message = wait_for(refused, 20, "victim Failed on the planted secret")
    assert "victim-unit-secret exists and is not this unit's" in message and "delete it" in message, message
    assert get_pod(api, ns, "victim") is None
    assert "SecretConflict" in reasons(control_plane, ns, "victim")
    control_plane.kubectl("delete", "-n", ns, "secret", "victim-unit-secret")
    wait_for(lambda: (get_unit(api, ns, "victim") or {}).get("status", {}).get("phase") == "Ready", 30, "Ready")
    data = _secret(api, ns, "victim")["data"]
    assert known not in data.values()
    assert kubelet.lb(ns, "victim").token != "0" * 64


def test_a_unit_the_operator_cannot_reconcile_gets_a_condition_and_others_keep_working(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    ns = namespace
    # The CRD accepts any nodeSelector map; the pod API refuses this key. The operator
    # must report it on the unit and carry on with every other object.
    control_plane.kubectl(
        "apply", "-n", ns, "-f", "-", input=unit("broken", nodeSelector={"bad key!": "x"})
    )
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit("fine"))

    def reconcile_error() -> dict[str, Any] | None:
        conds = ((get_unit(api, ns, "broken") or {}).get("status") or {}).get("conditions") or []
        return next(
            (c for c in conds if c["type"] == "Reconciled" and c["status"] == "False"), None
        )

    cond = wait_for(reconcile_error, 20, "Reconciled=False on the broken unit")
    assert "nodeSelector" in cond["message"]
    wait_for(
        lambda: (get_unit(api, ns, "fine") or {}).get("status", {}).get("phase") == "Ready",
        30,
        "the healthy unit Ready",
    )


def test_a_gpu_unit_whose_auto_transfer_fell_back_to_tcp_gets_a_condition_and_a_warning(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    """No silent switch to TCP: the LB's /v1/load names the mode P chose, and a GPU unit
    on `transfer: auto` that ended on tcp says so on the PDUnit and in a Warning event."""
    ns = namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit("slow", device="cuda", transfer="auto"))
    kubelet.lb(ns, "slow").transfer_mode = "proxy"

    def condition() -> dict[str, Any] | None:
        conds = ((get_unit(api, ns, "slow") or {}).get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == "TcpFallback"), None)

    first = wait_for(condition, 30, "TcpFallback condition")
    assert first["status"] == "False", first
    kubelet.lb(ns, "slow").transfer_mode = "tcp"  # P restarted and its probe chose tcp
    cond = wait_for(lambda: (c := condition()) and c["status"] == "True" and c, 30, "TcpFallback=True")
    assert cond["reason"] == "AutoChoseTcp" and "tcp" in cond["message"]
    assert (get_unit(api, ns, "slow") or {})["status"]["transferMode"] == "tcp"
    wait_for(lambda: "TcpFallback" in reasons(control_plane, ns, "slow"), 20, "a TcpFallback event")
