"""The drain of one unit (PROTOCOL.md section 5) as a state machine over plain dicts.

Owns `drain_step`: from the drain's state in the PDUnit status, the LB's `/v1/load`
answer and the pod, the next action (wait, delete the pod, force it after the timeout)
and the next state; and what a finished drain leaves in the status. Must never trust an
unreachable LB or a single empty answer as proof of idleness (two independent empty
checks apart, none busy between), never do I/O and never read the clock (`now` is given).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pdunit.engine.lb.load import LoadDocument
from pdunit.operator.objects import iso_us, parse_time


@dataclass
class DrainStep:
    """What to do next for a draining unit.

    action: "wait" (check again later), "delete" (clean: two empty checks, or no pod
    that could hold streams), "force" (drain timeout passed; `streams_cut` streams die).
    """

    state: dict[str, Any]
    action: str
    request_drain: bool
    streams_cut: int = 0
    reason: str = ""


def drain_step(
    state: dict[str, Any] | None,
    *,
    now: datetime,
    load: LoadDocument | None,
    pod_may_hold_streams: bool,
    timeout_s: float,
    check_interval_s: float,
    last_in_flight: int = 0,
) -> DrainStep:
    """One tick of the unit drain (PROTOCOL.md section 5).

    Two *independent* empty answers, at least `check_interval_s` apart, with no
    non-empty answer between them, prove the unit idle. An unreachable LB proves
    nothing (the checks restart). After `timeout_s` the pod is deleted anyway and the
    streams still in flight are counted as cut.
    """
    st = dict(state or {})
    started = parse_time(st.get("startedAt")) or now
    st["startedAt"] = iso_us(started)
    request = not st.get("requested")
    if not pod_may_hold_streams:
        st.update(emptyChecks=0, firstEmptyAt=None)
        return DrainStep(
            st, "delete", request_drain=False, reason="no running pod: nothing in flight"
        )

    if load is not None and load.empty:
        first = parse_time(st.get("firstEmptyAt"))
        if not st.get("emptyChecks") or first is None:
            st.update(emptyChecks=1, firstEmptyAt=iso_us(now))
            return DrainStep(st, "wait", request, reason="first empty check")
        if (now - first).total_seconds() >= check_interval_s:
            st["emptyChecks"] = 2
            return DrainStep(st, "delete", request, reason="two empty checks")
        return DrainStep(st, "wait", request, reason="second empty check not due yet")

    st.update(emptyChecks=0, firstEmptyAt=None)
    if (now - started).total_seconds() >= timeout_s:
        cut = load.streams_in_flight if load is not None else int(last_in_flight or 0)
        st.update(forced=True, streamsCut=cut)
        return DrainStep(st, "force", request, streams_cut=cut, reason="drain timeout")
    why = "LB unreachable" if load is None else f"{load.streams_in_flight} streams in flight"
    return DrainStep(st, "wait", request, reason=why)



def drain_started_message(timeout_s: float) -> str:
    return f"LB stopped taking streams; waiting up to {timeout_s:g}s for those in flight"


@dataclass(frozen=True)
class DrainEnd:
    """What a drain that ends now does: the state to record (`completedAt` set), whether
    to delete the pod (and with which grace period: None = the pod's own), the result
    counted (clean | forced) and the Event to post."""

    state: dict[str, Any]
    delete_pod: bool
    grace_period_seconds: int | None
    result: str
    warning: bool
    event_reason: str
    event_message: str


def drain_end(step: DrainStep, *, pod: dict[str, Any] | None, pod_terminating: bool, now: datetime,
              timeout_s: float, grace_margin_s: int) -> DrainEnd:
    """The end of a drain whose step says delete or force. A forced end deletes even a
    pod already going, with the short grace period (the streams are cut anyway); a clean
    one leaves a pod already going to its own."""
    if step.action not in ("delete", "force"):
        raise ValueError(f"drain step {step.action!r} does not end the drain: expected delete or force")
    state = {**step.state, "completedAt": iso_us(now)}
    if step.action == "force":
        return DrainEnd(
            state, pod is not None, grace_margin_s, "forced", True, "DrainForced",
            f"drain timeout of {timeout_s:g}s passed with {step.streams_cut} streams in flight; pod deleted, "
            f"{step.streams_cut} streams cut",
        )
    return DrainEnd(state, pod is not None and not pod_terminating, None, "clean", False, "Drained",
                    f"pod deleted: {step.reason}")


def undrain_needed(drain: dict[str, Any] | None, pod_running: bool, pod_ip: str | None) -> bool:
    """Whether a drain given up (spec.draining back to false) must tell the LB: it was
    asked to drain and the pod still runs where the operator can reach it."""
    return bool(drain and drain.get("requested") and pod_running and pod_ip)
