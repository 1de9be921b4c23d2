"""What the quiesce-guard decides, as a pure function of what P and D report
(PROTOCOL.md section 4). No I/O here: the guard loop feeds observations in and carries
the returned actions out, so every rule is tested without processes.

Rules:
- P holding `max_held_aborts` unanswered aborts must exit (its restart is proof (b)).
  P exits by itself; if it still reports the limit after `enforce_grace_s`, the guard
  kills it (SIGKILL through the pod's shared PID namespace).
- D above `held_drain_fraction` held pages must be draining; the guard reports when it
  starts and ends, and flags a D that is over the threshold without draining.
- A new P instance id is reported (held requests of the old one become releasable).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Observation:
    at: float                          # monotonic seconds
    p_reachable: bool
    p_instance: str = ""
    p_pid: int = 0
    p_held_aborts: int = 0
    d_reachable: bool = False
    d_held_pages: int = 0
    d_pool_pages: int = 0
    d_draining: bool = False


@dataclass(frozen=True)
class Action:
    kind: str        # p_over_limit | kill_p | p_restarted | d_drain_started | d_drain_ended | d_not_draining | p_unreachable | d_unreachable
    message: str
    pid: int = 0


@dataclass
class GuardState:
    p_instance: str = ""
    p_over_since: float | None = None
    killed_instance: str = ""
    d_draining: bool = False
    d_over: bool = False
    p_reachable: bool = True
    d_reachable: bool = True
    actions_total: dict[str, int] = field(default_factory=dict)


def evaluate(obs: Observation, state: GuardState, max_held_aborts: int, held_drain_fraction: float,
             enforce_grace_s: float) -> list[Action]:
    actions: list[Action] = []
    if obs.p_reachable != state.p_reachable:
        state.p_reachable = obs.p_reachable
        if not obs.p_reachable:
            actions.append(Action("p_unreachable", "prefill does not answer Info"))
    if obs.d_reachable != state.d_reachable:
        state.d_reachable = obs.d_reachable
        if not obs.d_reachable:
            actions.append(Action("d_unreachable", "decode does not answer Info"))
    if obs.p_reachable:
        if state.p_instance and obs.p_instance != state.p_instance:
            actions.append(Action("p_restarted", f"prefill instance {state.p_instance[:8]} -> {obs.p_instance[:8]}"))
            state.p_over_since = None
        state.p_instance = obs.p_instance
        if obs.p_held_aborts >= max_held_aborts:
            if state.p_over_since is None:
                state.p_over_since = obs.at
                actions.append(Action("p_over_limit",
                                      f"prefill holds {obs.p_held_aborts} unanswered aborts (limit {max_held_aborts}): "
                                      "it must exit so its restart proves them", obs.p_pid))
            elif (obs.at - state.p_over_since >= enforce_grace_s and obs.p_pid
                  and state.killed_instance != obs.p_instance):
                state.killed_instance = obs.p_instance
                actions.append(Action("kill_p", f"prefill still holds {obs.p_held_aborts} aborts after "
                                                f"{enforce_grace_s}s: killing pid {obs.p_pid}", obs.p_pid))
        else:
            state.p_over_since = None
    if obs.d_reachable and obs.d_pool_pages:
        over = obs.d_held_pages / obs.d_pool_pages > held_drain_fraction
        if obs.d_draining != state.d_draining:
            state.d_draining = obs.d_draining
            kind = "d_drain_started" if obs.d_draining else "d_drain_ended"
            actions.append(Action(kind, f"decode held pages {obs.d_held_pages}/{obs.d_pool_pages}"))
        if over and not obs.d_draining and not state.d_over:
            actions.append(Action("d_not_draining", f"decode holds {obs.d_held_pages}/{obs.d_pool_pages} pages "
                                                    f"(> {held_drain_fraction:.0%}) but is not draining"))
        state.d_over = over and not obs.d_draining
    for a in actions:
        state.actions_total[a.kind] = state.actions_total.get(a.kind, 0) + 1
    return actions
