"""The quiesce-guard's rules (PROTOCOL.md section 4), on plain observations."""

from pdunit.sidecars.quiesce_guard.policy import GuardState, Observation, evaluate


def obs(t, **kw):
    base = dict(at=t, p_reachable=True, p_instance="p1", p_pid=1234, d_reachable=True, d_pool_pages=100)
    base.update(kw)
    return Observation(**base)


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
