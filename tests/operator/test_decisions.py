"""The decisions handlers.py used to take itself, as pure functions on plain dicts: whose a
pod is, whether a Secret may be used, when a pod is replaced, how a drain ends, what a set's
actions patch and post. No server, no kopf."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pdunit.operator import models as m
from pdunit.operator.drain import DrainStep, drain_end, drain_started_message, undrain_needed
from pdunit.operator.pod import (
    ADMIN_TOKEN_KEY,
    GRACE_MARGIN_SECONDS,
    UNIT_SECRET_KEY,
    claim_pod,
    desired_pod,
    desired_secret,
    replacement_reason,
    secret_problem,
    unit_defaults,
)
from pdunit.operator.rollout import Action, action_event, invalid_set_status, unit_patch
from pdunit.operator.spec_hash import spec_hashes
from pdunit.operator.unit_status import (
    POD_STALE_MESSAGE,
    TCP_FALLBACK_MESSAGE,
    conflict_status,
    pod_may_hold_streams,
    reconcile_error_patch,
    tcp_fallback_news,
    with_pod_up_to_date,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
HEX = "ab" * 32  # a drawn value's shape: 32 random bytes, hex


def a_unit(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": m.API_VERSION, "kind": m.UNIT_KIND,
            "metadata": {"name": "u1", "namespace": "prod", "uid": "uid-u1", "generation": 2},
            "spec": {"image": "reg/pdunit:1", "model": "random:tiny:0", **spec}}


def a_pod(phase: str = "Running", owner_uid: str | None = "uid-u1", labels: dict[str, str] | None = None,
          **meta: Any) -> dict[str, Any]:
    refs = [{"uid": owner_uid, "controller": True}] if owner_uid else []
    return {"metadata": {"name": "u1", "uid": "pod-uid", "labels": labels or {}, "ownerReferences": refs, **meta},
            "status": {"phase": phase}}


# ---------------------------------------------------------------------- whose pod


def test_a_unit_creates_its_missing_pod_and_keeps_its_own() -> None:
    assert claim_pod(a_unit(), None).kind == "create"
    assert claim_pod(a_unit(), a_pod()).kind == "own"


def test_a_pod_with_the_units_label_and_no_controller_is_adopted_with_the_units_owner_reference() -> None:
    claim = claim_pod(a_unit(), a_pod(owner_uid=None, labels={m.LABEL_UNIT: "u1"}))
    assert claim.kind == "adopt" and claim.message == "adopted existing pod u1"
    assert claim.patch == {"metadata": {"ownerReferences": desired_pod(a_unit())["metadata"]["ownerReferences"]}}


@pytest.mark.parametrize("pod", [a_pod(owner_uid="someone-else", labels={m.LABEL_UNIT: "u1"}),
                                 a_pod(owner_uid=None, labels={m.LABEL_UNIT: "other"})],
                         ids=["another-controller", "another-units-label"])
def test_a_pod_that_is_not_the_units_is_a_conflict_naming_the_fix(pod: dict[str, Any]) -> None:
    claim = claim_pod(a_unit(), pod)
    assert claim.kind == "conflict" and claim.patch is None
    assert "pod prod/u1 exists and is not this unit's" in claim.message
    assert claim.message.endswith("delete or rename that pod")


# ------------------------------------------------------------------------ secret


def test_the_units_own_secret_with_both_values_is_usable() -> None:
    assert secret_problem(a_unit(), desired_secret(a_unit(), HEX, HEX)) is None


def test_a_secret_another_made_is_never_used() -> None:
    secret = desired_secret(a_unit(), HEX, HEX)
    secret["metadata"]["ownerReferences"] = []
    problem = secret_problem(a_unit(), secret)
    assert problem and "secret prod/u1-unit-secret exists and is not this unit's" in problem
    assert "PDUnit u1 uid uid-u1" in problem and "delete it" in problem


def test_a_secret_with_a_short_value_names_the_key_and_the_fix() -> None:
    secret = desired_secret(a_unit(), HEX, HEX)
    secret["data"][ADMIN_TOKEN_KEY] = base64.b64encode(b"short").decode()
    problem = secret_problem(a_unit(), secret)
    assert problem and f"has no valid {ADMIN_TOKEN_KEY} (base64 of at least 32 characters)" in problem
    assert UNIT_SECRET_KEY not in problem.split("has no valid")[1]


# ------------------------------------------------------------------ replacement


def test_only_an_ended_pod_that_is_not_already_going_is_replaced() -> None:
    assert replacement_reason(a_pod("Running")) is None
    assert replacement_reason(a_pod("Pending")) is None
    assert replacement_reason(a_pod("Failed", deletionTimestamp="2026-01-01T00:00:00Z")) is None
    evicted = a_pod("Failed")
    evicted["status"]["reason"] = "Evicted"
    assert replacement_reason(evicted) == "pod u1 is Failed (Evicted); recreating it"
    assert replacement_reason(a_pod("Succeeded")) == "pod u1 is Succeeded (Succeeded); recreating it"


def test_only_a_running_pod_not_being_deleted_may_hold_streams() -> None:
    assert pod_may_hold_streams(a_pod("Running"))
    assert not pod_may_hold_streams(a_pod("Running", deletionTimestamp="2026-01-01T00:00:00Z"))
    assert not pod_may_hold_streams(a_pod("Pending"))
    assert not pod_may_hold_streams(None)


# ------------------------------------------------------------------------ status


def test_a_conflict_fails_the_unit_with_the_fix_in_its_ready_condition() -> None:
    status = conflict_status(a_unit(), "PodConflict", "delete or rename that pod", T0)
    assert status["phase"] == "Failed" and status["ready"] is False
    (ready,) = status["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "PodConflict")
    assert ready["message"] == "delete or rename that pod"


def test_the_tcp_fallback_warning_is_news_once() -> None:
    auto_gpu = unit_defaults(a_unit()["spec"])  # transfer auto, device cuda
    assert tcp_fallback_news(auto_gpu, None, "tcp") == TCP_FALLBACK_MESSAGE
    assert tcp_fallback_news(auto_gpu, "proxy", "tcp") == TCP_FALLBACK_MESSAGE
    assert tcp_fallback_news(auto_gpu, "tcp", "tcp") is None  # already said
    assert tcp_fallback_news(auto_gpu, None, "proxy") is None
    assert tcp_fallback_news({**auto_gpu, "transfer": "tcp"}, None, "tcp") is None  # asked for, no fallback


def test_pod_up_to_date_follows_the_pods_spec_hash_current_or_legacy() -> None:
    spec = unit_defaults(a_unit()["spec"])
    current, legacy = spec_hashes(spec)
    for value, fresh in ((current, True), (legacy, True), ("other", False)):
        pod = a_pod(annotations={m.ANNOTATION_SPEC_HASH: value})
        (cond,) = with_pod_up_to_date({"phase": "Ready"}, pod, spec, T0)["conditions"]
        assert cond["type"] == "PodUpToDate" and cond["status"] == str(fresh)
        assert cond["message"] == ("" if fresh else POD_STALE_MESSAGE)


def test_a_failed_reconcile_records_the_error_and_a_units_message() -> None:
    unit_patch_ = reconcile_error_patch(a_unit(), "Kubernetes API 500: boom", T0, unit=True)
    assert unit_patch_["message"] == "reconcile failed: Kubernetes API 500: boom"
    (cond,) = unit_patch_["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("Reconciled", "False", "Error")
    assert "message" not in reconcile_error_patch({"metadata": {"name": "s"}}, "x", T0, unit=False)


# ------------------------------------------------------------------------- drain


def _step(action: str, cut: int = 0) -> DrainStep:
    return DrainStep({"startedAt": "2026-01-01T00:00:00.000000Z", "requested": True}, action, False,
                     streams_cut=cut, reason="two empty checks" if action == "delete" else "drain timeout")


def test_a_clean_drain_end_deletes_a_pod_not_already_going_with_its_own_grace() -> None:
    now = T0 + timedelta(seconds=5)
    end = drain_end(_step("delete"), pod=a_pod(), pod_terminating=False, now=now, timeout_s=600,
                    grace_margin_s=GRACE_MARGIN_SECONDS)
    assert (end.delete_pod, end.grace_period_seconds, end.result, end.warning) == (True, None, "clean", False)
    assert (end.event_reason, end.event_message) == ("Drained", "pod deleted: two empty checks")
    assert end.state["completedAt"] == "2026-01-01T00:00:05.000000Z" and end.state["requested"] is True
    going = drain_end(_step("delete"), pod=a_pod(), pod_terminating=True, now=now, timeout_s=600,
                      grace_margin_s=GRACE_MARGIN_SECONDS)
    assert not going.delete_pod
    assert not drain_end(_step("delete"), pod=None, pod_terminating=False, now=now, timeout_s=600,
                         grace_margin_s=GRACE_MARGIN_SECONDS).delete_pod


def test_a_forced_drain_end_deletes_even_a_going_pod_with_the_short_grace_and_counts_the_cut() -> None:
    end = drain_end(_step("force", cut=3), pod=a_pod(), pod_terminating=True, now=T0, timeout_s=600,
                    grace_margin_s=GRACE_MARGIN_SECONDS)
    assert (end.delete_pod, end.grace_period_seconds, end.result, end.warning) == (
        True, GRACE_MARGIN_SECONDS, "forced", True)
    assert end.event_reason == "DrainForced"
    assert end.event_message == ("drain timeout of 600s passed with 3 streams in flight; pod deleted, "
                                 "3 streams cut")


def test_a_waiting_drain_step_does_not_end_the_drain() -> None:
    with pytest.raises(ValueError, match="drain step 'wait' does not end the drain"):
        drain_end(_step("wait"), pod=a_pod(), pod_terminating=False, now=T0, timeout_s=600, grace_margin_s=30)


def test_a_drain_given_up_tells_the_lb_only_when_it_was_asked_and_can_be_reached() -> None:
    asked = {"requested": True}
    assert undrain_needed(asked, pod_running=True, pod_ip="10.0.0.1")
    assert not undrain_needed({"requested": False}, pod_running=True, pod_ip="10.0.0.1")
    assert not undrain_needed(asked, pod_running=False, pod_ip="10.0.0.1")
    assert not undrain_needed(asked, pod_running=True, pod_ip=None)
    assert not undrain_needed(None, pod_running=True, pod_ip="10.0.0.1")
    assert drain_started_message(600) == "LB stopped taking streams; waiting up to 600s for those in flight"


# ------------------------------------------------------------------------- the set


def test_an_invalid_set_keeps_its_scale_selector_and_names_the_field() -> None:
    unitset = {"metadata": {"name": "tts", "generation": 4}, "status": {}}
    status = invalid_set_status(unitset, "spec.replicas: must be >= 0", T0)
    assert status["selector"] == f"{m.LABEL_SET}=tts" and status["observedGeneration"] == 4
    (cond,) = status["conditions"]
    assert (cond["type"], cond["status"], cond["reason"], cond["message"]) == (
        "SpecValid", "False", "InvalidSpec", "spec.replicas: must be >= 0")


def test_set_actions_patch_their_unit_and_post_one_event_each() -> None:
    assert unit_patch(Action("drain", unit="u1")) == {"spec": {"draining": True}}
    assert unit_patch(Action("undrain", unit="u1")) == {"spec": {"draining": False}}
    assert unit_patch(Action("relabel", unit="u1", template_hash="h2")) == {
        "metadata": {"labels": {m.LABEL_TEMPLATE_HASH: "h2"}}}
    with pytest.raises(ValueError, match="action 'create' patches no unit"):
        unit_patch(Action("create"))
    assert action_event(Action("create", reason="scale-up to 2"), "tts-abcde-x1") == (
        "UnitCreated", "created unit tts-abcde-x1: scale-up to 2")
    assert action_event(Action("drain", unit="u1", reason="why")) == ("UnitDraining", "draining unit u1: why")
    assert action_event(Action("undrain", unit="u1", reason="why")) == ("UnitUndrained", "keeping unit u1: why")
    assert action_event(Action("relabel", unit="u1", reason="why")) == ("UnitRelabelled", "unit u1: why")
    assert action_event(Action("delete", unit="u1", reason="drained")) == ("UnitDeleted", "deleted unit u1: drained")
    with pytest.raises(ValueError, match="unknown action 'scale'"):
        action_event(Action("scale", unit="u1"))
