"""What the quiesce-guard decides, as a pure function of what P and D report
(PROTOCOL.md section 4).

Owns the rules (`evaluate` states them): when P must exit or be killed for held aborts,
when a D must drain for held pages, and what is reported. No I/O here: the guard loop
(main.py) feeds observations in and carries the returned actions out, so every rule is
tested without processes. Must never act itself: it only returns actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DecodeObservation:
    name: str                          # decode, or decode-0, decode-1, ... (1PnD)
    reachable: bool = False
    held_pages: int = 0
    pool_pages: int = 0
    draining: bool = False


@dataclass(frozen=True)
class Observation:
    at: float                          # monotonic seconds
    p_reachable: bool
    p_instance: str = ""
    p_pid: int = 0
    p_held_aborts: int = 0
    decoders: tuple[DecodeObservation, ...] = ()


@dataclass(frozen=True)
class Action:
    kind: str        # p_over_limit | kill_p | p_restarted | d_drain_started | d_drain_ended | d_not_draining | p_unreachable | d_unreachable
    message: str
    pid: int = 0
    decode: str = ""  # the D an action is about


@dataclass
class DecodeState:
    draining: bool = False
    over: bool = False
    reachable: bool = True


@dataclass
class GuardState:
    p_instance: str = ""
    p_over_since: float | None = None
    killed_instance: str = ""
    p_reachable: bool = True
    decoders: dict[str, DecodeState] = field(default_factory=dict)
    actions_total: dict[str, int] = field(default_factory=dict)


def evaluate(obs: Observation, state: GuardState, max_held_aborts: int, held_drain_fraction: float,
             enforce_grace_s: float) -> list[Action]:
    """The actions for one observation (updating `state`):
    - P holding `max_held_aborts` unanswered aborts must exit (its restart is proof (b)).
      P exits by itself; if it still reports the limit after `enforce_grace_s`, the guard
      kills it (SIGKILL through the pod's shared PID namespace).
    - Every D (one, or each of a 1PnD unit's) above `held_drain_fraction` held pages must
      be draining; the guard reports when each starts and ends, and flags a D that is over
      the threshold without draining. Actions about a D name it.
    - A new P instance id is reported (held requests of the old one become releasable)."""
    actions: list[Action] = []
    if obs.p_reachable != state.p_reachable:
        state.p_reachable = obs.p_reachable
        if not obs.p_reachable:
            actions.append(Action("p_unreachable", "prefill does not answer Info"))
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
    for d in obs.decoders:
        actions += _evaluate_decode(d, state.decoders.setdefault(d.name, DecodeState()), held_drain_fraction)
    for a in actions:
        state.actions_total[a.kind] = state.actions_total.get(a.kind, 0) + 1
    return actions


def _evaluate_decode(d: DecodeObservation, state: DecodeState, held_drain_fraction: float) -> list[Action]:
    actions: list[Action] = []
    if d.reachable != state.reachable:
        state.reachable = d.reachable
        if not d.reachable:
            actions.append(Action("d_unreachable", f"{d.name} does not answer Info", decode=d.name))
    if d.reachable and d.pool_pages:
        over = d.held_pages / d.pool_pages > held_drain_fraction
        if d.draining != state.draining:
            state.draining = d.draining
            kind = "d_drain_started" if d.draining else "d_drain_ended"
            actions.append(Action(kind, f"{d.name} held pages {d.held_pages}/{d.pool_pages}", decode=d.name))
        if over and not d.draining and not state.over:
            actions.append(Action("d_not_draining", f"{d.name} holds {d.held_pages}/{d.pool_pages} pages "
                                                    f"(> {held_drain_fraction:.0%}) but is not draining",
                                  decode=d.name))
        state.over = over and not d.draining
    return actions
