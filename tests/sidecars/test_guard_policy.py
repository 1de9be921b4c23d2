"""The quiesce-guard's rules (PROTOCOL.md section 4), on plain observations."""

from pdunit.sidecars.quiesce_guard.policy import (
    DecodeObservation,
    GuardState,
    Observation,
    evaluate,
)


def obs(t, d_held_pages=0, d_draining=False, decoders=None, **kw):
    """P's fields as keywords; one D named `decode` unless `decoders` lists several."""
    base = dict(at=t, p_reachable=True, p_instance="p1", p_pid=1234)
    base.update(kw)
    if decoders is None:
        decoders = (DecodeObservation("decode", True, d_held_pages, 100, d_draining),)
    return Observation(**base, decoders=tuple(decoders))


def kinds(actions):
    return [a.kind for a in actions]


def test_p_at_held_abort_limit_is_reported_then_killed_after_grace():
    s = GuardState()
    assert kinds(evaluate(obs(0, p_held_aborts=2), s, 3, 0.25, 3.0)) == []
    assert kinds(evaluate(obs(1, p_held_aborts=3), s, 3, 0.25, 3.0)) == ["p_over_limit"]
    assert kinds(evaluate(obs(2, p_held_aborts=3), s, 3, 0.25, 3.0)) == []
    acts = evaluate(obs(4.5, p_held_aborts=3), s, 3, 0.25, 3.0)
    assert kinds(acts) == ["kill_p"] and acts[0].pid == 1234
    # never twice for the same instance
    assert kinds(evaluate(obs(9, p_held_aborts=3), s, 3, 0.25, 3.0)) == []


def test_p_that_exits_by_itself_is_not_killed():
    s = GuardState()
    evaluate(obs(0, p_held_aborts=3), s, 3, 0.25, 3.0)
    assert kinds(evaluate(obs(1, p_reachable=False), s, 3, 0.25, 3.0)) == ["p_unreachable"]
    acts = evaluate(obs(5, p_instance="p2", p_held_aborts=0), s, 3, 0.25, 3.0)
    assert kinds(acts) == ["p_restarted"]


def test_held_aborts_under_the_limit_clear_the_timer():
    s = GuardState()
    evaluate(obs(0, p_held_aborts=3), s, 3, 0.25, 3.0)
    evaluate(obs(1, p_held_aborts=1), s, 3, 0.25, 3.0)
    assert kinds(evaluate(obs(3.5, p_held_aborts=3), s, 3, 0.25, 3.0)) == ["p_over_limit"]


def test_d_drain_start_and_end_are_reported():
    s = GuardState()
    assert kinds(evaluate(obs(0, d_held_pages=30, d_draining=True), s, 3, 0.25, 3.0)) == ["d_drain_started"]
    assert kinds(evaluate(obs(1, d_held_pages=10, d_draining=False), s, 3, 0.25, 3.0)) == ["d_drain_ended"]


def test_d_over_threshold_without_draining_is_flagged_once():
    s = GuardState()
    assert kinds(evaluate(obs(0, d_held_pages=26), s, 3, 0.25, 3.0)) == ["d_not_draining"]
    assert kinds(evaluate(obs(1, d_held_pages=27), s, 3, 0.25, 3.0)) == []
    assert kinds(evaluate(obs(2, d_held_pages=25), s, 3, 0.25, 3.0)) == []  # 25% is not above 25%


def test_each_decoder_of_a_1pnd_unit_is_watched_and_named():
    s = GuardState()
    calm = DecodeObservation("decode-0", True, 5, 100, False)
    over = DecodeObservation("decode-1", True, 40, 100, False)
    acts = evaluate(obs(0, decoders=[calm, over]), s, 3, 0.25, 3.0)
    assert kinds(acts) == ["d_not_draining"] and acts[0].decode == "decode-1" and "decode-1" in acts[0].message
    draining = DecodeObservation("decode-1", True, 40, 100, True)
    gone = DecodeObservation("decode-0")  # no answer to Info
    acts = evaluate(obs(1, decoders=[gone, draining]), s, 3, 0.25, 3.0)
    assert sorted((a.kind, a.decode) for a in acts) == [("d_drain_started", "decode-1"),
                                                       ("d_unreachable", "decode-0")]
