"""The observed state of one PDUnit: its pod's readiness and problems, the LB's `/v1/load`
answer, turned into the PDUnit status (phase, message, figures, conditions).

Owns `unit_status`, `invalid_status`, the conditions (`set_condition`: a transition time
changes only when the status flips) and the TcpFallback rule. Must never call a unit
Ready on the pod alone (the LB must say so too), never drop the last figures on one
failed scrape, never do I/O and never read the clock (`now` is given).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pdunit.engine.lb.load import LoadDocument
from pdunit.operator import models as m
from pdunit.operator.objects import iso, metadata_of, status_of, terminating
from pdunit.operator.spec_hash import spec_hashes


def pod_ready(pod: dict[str, Any] | None) -> bool:
    if not pod:
        return False
    for cond in status_of(pod).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def pod_running(pod: dict[str, Any] | None) -> bool:
    """Whether the pod's containers may hold streams (only a Running pod can)."""
    return status_of(pod).get("phase") == "Running"


def pod_problem(pod: dict[str, Any]) -> str | None:
    """The first waiting/terminated reason of any container, or why it is unschedulable."""
    status = status_of(pod)
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in status.get(key) or []:
            state = cs.get("state") or {}
            waiting = state.get("waiting") or {}
            if waiting.get("reason") and waiting["reason"] not in (
                "ContainerCreating",
                "PodInitializing",
            ):
                return f"container {cs.get('name')}: {waiting['reason']}: {waiting.get('message', '')}".strip()
            term = state.get("terminated") or {}
            if term and term.get("exitCode", 0) != 0:
                return f"container {cs.get('name')} exited {term.get('exitCode')}: {term.get('reason', '')}"
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"unschedulable: {cond.get('message', cond.get('reason', ''))}"
    return None


def set_condition(
    conditions: list[dict[str, Any]] | None,
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: datetime,
) -> list[dict[str, Any]]:
    """Upsert one condition; lastTransitionTime changes only when the status flips."""
    out = [dict(c) for c in conditions or []]
    value = "True" if status else "False"
    for cond in out:
        if cond.get("type") == type_:
            if cond.get("status") != value:
                cond["lastTransitionTime"] = iso(now)
            cond.update(status=value, reason=reason, message=message)
            return out
    out.append(
        {
            "type": type_,
            "status": value,
            "reason": reason,
            "message": message,
            "lastTransitionTime": iso(now),
        }
    )
    return out


def unit_status(
    unit: dict[str, Any],
    pod: dict[str, Any] | None,
    load: LoadDocument | None,
    load_error: str | None,
    now: datetime,
    *,
    port: int,
    drain: dict[str, Any] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    """The PDUnit status from its pod and the LB's `/v1/load` (None when unreachable)."""
    spec = unit.get("spec") or {}
    old = status_of(unit)
    conditions = old.get("conditions")
    draining = bool(spec.get("draining")) or deleting
    status: dict[str, Any] = {
        "observedGeneration": metadata_of(unit).get("generation"),
        "podName": metadata_of(pod)["name"] if pod else None,
        "podIP": status_of(pod).get("podIP") if pod else None,
        "nodeName": (pod.get("spec") or {}).get("nodeName") if pod else None,
        "lbPort": port,
        "draining": draining or bool(load and load.draining),
        "transferMode": (load.transfer_mode if load else None) or old.get("transferMode"),
        "inFlight": load.streams_in_flight if load else (old.get("inFlight") if pod else 0),
        "heldPages": load.held_pages if load else (old.get("heldPages") if pod else 0),
        "drain": drain,
    }
    problem = pod_problem(pod) if pod else None
    if load is None and load_error and pod_ready(pod):
        # One failed scrape (a busy node, a slow answer) is not a readiness change: the
        # kubelet's probe on /readyz is the authority, so keep the LB's last answer;
        # LoadReachable=False below says the figures are stale.
        lb_ready = bool(old.get("ready")) and not status["draining"]
    else:
        lb_ready = bool(load and load.ready) and not status["draining"]
    ready = pod_ready(pod) and lb_ready

    if draining:
        done = bool(drain and drain.get("completedAt")) and pod is None
        phase = "Drained" if done else "Draining"
        message = "drained: pod deleted" if done else "draining: waiting for streams to finish"
        if drain and drain.get("forced"):
            message += f" (forced after timeout, {drain.get('streamsCut', 0)} streams cut)"
    elif pod is None:
        phase, message = "Pending", "creating the pod"
    elif status_of(pod).get("phase") in ("Failed", "Succeeded"):
        phase, message = (
            "Failed",
            f"pod {status_of(pod).get('phase')}: {problem or status_of(pod).get('reason', '')}",
        )
    elif status_of(pod).get("phase") != "Running":
        phase, message = "Pending", problem or "pod pending"
    elif ready:
        phase, message = "Ready", "serving"
    else:
        phase = "Starting"
        if problem:
            message = problem
        elif load_error:
            message = f"LB /v1/load unreachable: {load_error}"
        elif load is not None and not load.ready:
            message = "LB reports not ready (prefill/decode starting)"
        else:
            message = "waiting for pod readiness"
    status["phase"] = phase
    status["ready"] = ready and phase == "Ready"
    status["message"] = message
    conditions = set_condition(conditions, "SpecValid", True, "Valid", "", now)
    conditions = set_condition(conditions, "Reconciled", True, "Reconciled", "", now)
    conditions = set_condition(conditions, "Ready", status["ready"], phase, message, now)
    reachable = load is not None
    conditions = set_condition(
        conditions,
        "LoadReachable",
        reachable,
        "Reachable" if reachable else ("NoPod" if not pod_running(pod) else "Unreachable"),
        "" if reachable else (load_error or "pod not running"),
        now,
    )
    fallback = tcp_fallback(spec, status["transferMode"])
    if fallback is not None:
        conditions = set_condition(
            conditions,
            "TcpFallback",
            bool(fallback),
            "AutoChoseTcp" if fallback else "NoFallback",
            fallback,
            now,
        )
    status["conditions"] = conditions
    return status


TCP_FALLBACK_MESSAGE = (
    "transfer auto chose tcp on a GPU unit: KV goes over the loopback network, tens of times "
    "slower than the proxy; every faster mode failed its verified probe (the prefill container's "
    "'transfer probe' log lines name each error; docs/transfer.md lists what a pod needs)"
)


def tcp_fallback(spec: dict[str, Any], transfer_mode: str | None) -> str | None:
    """What the TcpFallback condition says: TCP_FALLBACK_MESSAGE when `transfer: auto` on
    a GPU unit ended on tcp (the articles' worst bug was such a switch, silent and ~300x
    slower), "" when the mode in use is another, None while no mode is known yet. A
    `transfer: tcp` the spec asks for is not a fallback."""
    if not transfer_mode:
        return None
    on_tcp = spec.get("transfer", "auto") == "auto" and spec.get("device", "cuda") == "cuda" and \
        "tcp" in transfer_mode.split(",")
    return TCP_FALLBACK_MESSAGE if on_tcp else ""


def invalid_status(unit: dict[str, Any], message: str, now: datetime) -> dict[str, Any]:
    """Status of a unit whose spec the operator cannot use: Failed, naming the field."""
    conditions = set_condition(
        status_of(unit).get("conditions"), "SpecValid", False, "InvalidSpec", message, now
    )
    return {
        "phase": "Failed",
        "ready": False,
        "message": f"invalid spec: {message}",
        "observedGeneration": metadata_of(unit).get("generation"),
        "conditions": conditions,
    }



def pod_may_hold_streams(pod: dict[str, Any] | None) -> bool:
    """Whether streams may be in flight in the pod: it runs and is not being deleted."""
    return pod_running(pod) and not terminating(pod)


def conflict_status(unit: dict[str, Any], reason: str, message: str, now: datetime) -> dict[str, Any]:
    """Status of a unit that cannot get its pod because of an object that is not its own:
    Failed, the fix in the message."""
    return {
        "phase": "Failed",
        "ready": False,
        "message": message,
        "conditions": set_condition(status_of(unit).get("conditions"), "Ready", False, reason, message, now),
    }


def tcp_fallback_news(spec: dict[str, Any], old_mode: str | None, new_mode: str | None) -> str | None:
    """The TcpFallback warning to post once: when the unit fell back to tcp since the last
    status (None when it did not, or had already)."""
    fallback = tcp_fallback(spec, new_mode)
    return fallback if fallback and not tcp_fallback(spec, old_mode) else None


POD_STALE_MESSAGE = (
    "the spec changed after the pod was created; PDUnitSets roll units "
    "automatically, for a standalone PDUnit delete its pod (it drains first) to apply"
)


def with_pod_up_to_date(status: dict[str, Any], pod: dict[str, Any], spec: dict[str, Any],
                        now: datetime) -> dict[str, Any]:
    """`status` with the PodUpToDate condition: whether the pod was made from this spec
    (its spec-hash annotation, current or legacy)."""
    current = (metadata_of(pod).get("annotations") or {}).get(m.ANNOTATION_SPEC_HASH)
    fresh = current in spec_hashes(spec)
    conditions = set_condition(status.get("conditions"), "PodUpToDate", fresh,
                               "UpToDate" if fresh else "SpecChanged", "" if fresh else POD_STALE_MESSAGE, now)
    return {**status, "conditions": conditions}


def reconcile_error_patch(obj: dict[str, Any], message: str, now: datetime, *, unit: bool) -> dict[str, Any]:
    """The status patch of a reconcile that failed unexpectedly: Reconciled=False naming
    the error (and the message of a PDUnit)."""
    patch: dict[str, Any] = {
        "conditions": set_condition(status_of(obj).get("conditions"), "Reconciled", False, "Error", message, now)
    }
    if unit:
        patch["message"] = f"reconcile failed: {message}"
    return patch
