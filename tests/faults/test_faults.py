"""The fault-injection suite (PROTOCOL.md section 7, issue 5): real local units under
live traffic, faults injected one after another, and after each one the contract is
checked (bench/faults.py runs the scenario engine; these tests set the counts).

What every run asserts (`report["violations"]` lists any breach, with the numbers):
- affected clients got their error within `error_bound_s` of the request, naming the
  cause (checksum_mismatch, transfer_failed, deadline_exceeded, prefill_unavailable,
  not_ready / draining while the unit recovers); no request failed outside a fault;
- no kind of fault stalled or slowed the streams it did not touch, judged against the
  run's own baseline (`judge_stalls`: a kind's median fault against the median of the
  other kinds' faults, never stricter than 8 frames/s and 0.5 s): load on the 2 shared
  cores slows every fault alike, a D that stops stepping during one kind of fault
  (a 1 s stall) slows that kind alone; the absolute figures are reported;
- held pages went back to 0 after every fault, released by the expected proof kind
  (abort_ack, new_instance, receiver_state), counted from D's metrics;
- P exited with 75 at 3 held aborts, the guard reported it, D drained above 25 % held
  pages and came back;
- KV mismatches == injected corruptions; every completed stream's frames equal the
  reference computed here (the canary); markers replayed into held pages, and late TCP
  chunks sent after release, changed nothing;
- no page leaked once the unit is idle.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import pytest

from pdunit.bench.fault_scenarios import FaultRecord, StallRelay
from pdunit.bench.fault_unit import FaultsConfig, Outcome, Prompt, Unit, build_bank
from pdunit.bench.faults import judge_stalls, run, run_on, stall_relay

# Every run here draws its traffic from one bank (its reference frames take ~45 ms a
# prompt to compute); 64 prompts, each streamed ~10 times a run.
BANK = FaultsConfig(bank=64)


@pytest.fixture(scope="module")
def bank() -> list[Prompt]:
    return build_bank(BANK)


@pytest.fixture(scope="module")
def host_unit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Unit]:
    """One host-transport unit for the host runs below: each starts and leaves it idle,
    and checks only what changed during its own run."""
    with Unit(BANK, str(tmp_path_factory.mktemp("faults") / "unit")) as unit:
        yield unit


@pytest.fixture(scope="module")
def tcp_unit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Unit, StallRelay]]:
    """One tcp unit behind its stall relay, shared by the tcp runs below as host_unit is."""
    holder: dict[str, Unit] = {}
    relay = stall_relay(lambda: holder["unit"])
    try:
        # the relay reaches D through holder from P's first connection on, during the start
        holder["unit"] = Unit(BANK.model_copy(update=dict(transfer="tcp")),
                              str(tmp_path_factory.mktemp("faults") / "tcp"), tcp_relay_port=relay.port)
        with holder["unit"] as unit:
            yield unit, relay
    finally:
        relay.close()


@pytest.fixture(scope="module")
def proxy_unit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Unit]:
    """A unit over --transfer proxy (the sidecar over host shared memory)."""
    with Unit(BANK.model_copy(update=dict(transfer="proxy")), str(tmp_path_factory.mktemp("faults") / "proxy")) as unit:
        yield unit


def _print(report: dict) -> None:
    print(json.dumps({k: v for k, v in report.items() if k != "fault_details"}, indent=1, default=str))


def _assert_contract(report: dict, transfers: int, faults: int) -> None:
    _print(report)
    assert report["violations"] == []
    assert report["transfers"] >= transfers
    assert report["faults"] >= faults
    assert report["pages_leaked"] == 0
    assert report["kv_mismatches_unexpected"] == 0
    assert report["kv_mismatches"] == report["kv_mismatches_injected"]
    assert report["canary_mismatches"] == 0
    assert report["canary_streams_checked"] >= transfers * 0.9


def _assert_kinds(report: dict, at_least: dict[str, int]) -> None:
    """The schedule (seeded) gave every kind its count: a kind judged against the run's
    baseline (judge_stalls) needs 3 faults, so that one descheduled stream moves one
    fault and not the kind's median."""
    kinds = Counter(report["faults_by_kind"])
    assert set(kinds) == set(at_least), kinds
    assert all(kinds[k] >= n for k, n in at_least.items()), kinds


def _run_kinds(unit: Unit, bank: list[Prompt], kinds: dict[str, int], transfers: int, seed: int,
               relay: StallRelay | None = None, **cfg: int) -> dict:
    """One run on `unit` of `kinds` (kind -> faults of it, in schedule order) under
    `transfers` transfers, checked against the whole page contract and the kinds'
    counts; the report for the test's own checks of its kinds."""
    faults = sum(kinds.values())
    run_cfg = unit.cfg.model_copy(update=dict(kinds=",".join(kinds), transfers=transfers,
                                              faults=faults, seed=seed, max_seconds=120, **cfg))
    report = run_on(unit, run_cfg, bank, relay)
    _assert_contract(report, transfers, faults)
    _assert_kinds(report, kinds)
    return report


@pytest.mark.timeout(240)
def test_slow_writes_keep_the_page_contract(host_unit, bank):
    """Writes paused past their deadline (slow) and corruptions, three of each (seed 2's
    first 6 faults), under live traffic: markers replayed into the held pages of the
    paused writes change no stream; slow is judged against the corruptions' baseline."""
    report = _run_kinds(host_unit, bank, {"corrupt": 3, "slow": 3}, transfers=120, seed=2)
    # a marker went into the pages of a paused write (one that D released meanwhile is
    # counted apart: the canary judges it); replays into pages surely held: the P-stop run
    assert report["replays"].get("replay_into_held", 0) + report["replays"].get("replay_raced_release", 0) >= 1


@pytest.mark.timeout(240)
def test_stopped_p_and_lb_keep_the_page_contract(host_unit, bank):
    """P stopped past the deadline three times, the LB stopped once, three corruptions
    (seed 14's first 7 faults), under live traffic: faults that leave P running, with
    test_slow_writes_keep_the_page_contract. The soak below runs 20,000 transfers and 500
    faults."""
    report = _run_kinds(host_unit, bank, {"corrupt": 3, "p_stop": 3, "lb_stop": 1},
                        transfers=120, seed=14)
    assert report["replays"].get("replay_into_held", 0) >= 1  # into the pages held while P was stopped


@pytest.mark.timeout(240)
def test_restarted_and_exiting_p_keep_the_page_contract(host_unit, bank):
    """P killed (new_instance proof) and P exiting with 75 at 3 held aborts (the guard
    reports it, D drains above 25 % held pages and comes back), a corruption before,
    between and after them: the new P instance's transfers are checked too."""
    report = _run_kinds(host_unit, bank, {"corrupt": 3, "p_kill": 1, "held_exit": 1},
                        transfers=100, seed=0, restart_every=2)
    exits = [f for f in report["fault_details"] if f["kind"] == "held_exit"]
    assert all(f["p_exit_code"] == 75 and f["d_drained"] for f in exits)


@pytest.mark.timeout(240)
def test_stalled_tcp_sender_late_chunks_are_dropped(tcp_unit, bank):
    """--transfer tcp: chunks held back by a stalled relay reach D after it aborted the
    request; D drops them (proof c) and no live stream changes. Seed 3's first 6 faults:
    three of each kind."""
    unit, relay = tcp_unit
    report = _run_kinds(unit, bank, {"tcp_stall": 3, "corrupt": 3}, transfers=100, seed=3,
                        relay=relay)
    stalls = [f for f in report["fault_details"] if f["kind"] == "tcp_stall"]
    assert sum(sum(f["tcp_dropped_chunks_total"].values()) for f in stalls) > 0
    answered = {k: v for k, v in report["replays"].items() if k.startswith("tcp_late_chunk_answered_")}
    assert answered and set(answered) <= {"tcp_late_chunk_answered_aborted", "tcp_late_chunk_answered_completed"}


@pytest.mark.timeout(240)
def test_stopped_p_over_tcp_releases_by_receiver_state(tcp_unit, bank):
    """--transfer tcp: P stopped past the deadline (D's receiver state, proof c, releases
    its pages) and corruptions, three of each (seed 15's first 6 faults), on the unit of
    the test above."""
    unit, relay = tcp_unit
    _run_kinds(unit, bank, {"p_stop": 3, "corrupt": 3}, transfers=100, seed=15, relay=relay)


@pytest.mark.timeout(240)
def test_stopped_proxy_mid_transfer_keeps_the_page_contract(proxy_unit, bank):
    """--transfer proxy (the sidecar over host shared memory): the proxy is stopped while
    a copy job runs, past the deadline; pages stay held until proof and no late copy
    changes a live stream. Seed 3's first 6 faults: three of each kind."""
    report = _run_kinds(proxy_unit, bank, {"proxy_stop": 3, "corrupt": 3}, transfers=100,
                        seed=3)
    stops = [f for f in report["fault_details"] if f["kind"] == "proxy_stop"]
    assert any(f.get("held_while_stopped") for f in stops), stops


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak_20000_transfers_500_faults(tmp_path):
    cfg = FaultsConfig(transfers=20000, faults=500, max_seconds=3000, restart_every=10)
    report = run(cfg, run_dir=str(tmp_path / "unit"))
    _assert_contract(report, 20000, 500)


def _synthetic_run(kinds: list[str], per_kind: int, step_s: float, stall_s: dict[str, float],
                   pause: tuple[int, float] | None = None) -> tuple[list[Outcome], list[FaultRecord]]:
    """Faults of `kinds` in turn, 2 s each, with 0.2 s between (as `_drive` runs them); in
    each, two unaffected 8-frame streams a frame every `step_s`. `stall_s[kind]`: D stops
    stepping that long in every fault of that kind; `pause` = (fault index, seconds): one
    stream of that one fault pauses once (a descheduled process)."""
    outcomes, faults = [], []
    t = 100.0
    for n in range(per_kind * len(kinds)):
        kind = kinds[n % len(kinds)]
        faults.append(FaultRecord(kind, t, t + 2.0))
        for s in range(2):
            times, now = [], t + 0.4 + 0.3 * s
            for frame in range(8):
                if frame == 4:
                    now += stall_s.get(kind, 0.0)
                    if pause and pause[0] == n and s == 0:
                        now += pause[1]
                times.append(now)
                now += step_s
            outcomes.append(Outcome(0, times[0] - 0.05, times[-1], times, [[0]] * 8, 200, ""))
        t += 2.2
    return outcomes, faults


def test_a_kind_of_fault_that_stalls_d_fails_against_the_runs_own_baseline():
    outcomes, faults = _synthetic_run(["corrupt", "slow", "p_stop"], 6, 0.05, {"p_stop": 1.0})
    report = judge_stalls(FaultsConfig(), outcomes, faults)
    assert report["violations"], report
    assert all(v.startswith("p_stop: ") for v in report["violations"]), report["violations"]
    assert "p_stop: unaffected streams stalled" in report["violations"][0]
    assert report["stalls_by_kind"]["p_stop"]["gap_median_s"] >= 1.0


def test_a_busy_machine_slows_every_kind_alike_and_fails_none():
    # every frame 0.2 s apart (5 frames/s, under the idle floor of 8) and one stream
    # paused 0.7 s once: the shape of the CI failure of issue 33, which the idle-machine
    # bounds failed; no kind is slower than the others, so nothing stalled
    outcomes, faults = _synthetic_run(["corrupt", "slow", "p_stop"], 6, 0.2, {}, pause=(4, 0.7))
    report = judge_stalls(FaultsConfig(), outcomes, faults)
    assert report["violations"] == [], report["violations"]
    assert report["streams_under_floor"] == len(outcomes)  # under the idle bounds: reported, not judged


def test_the_same_stall_fails_on_a_busy_machine_too():
    outcomes, faults = _synthetic_run(["corrupt", "slow", "p_stop"], 6, 0.1, {"slow": 1.5}, pause=(0, 0.7))
    report = judge_stalls(FaultsConfig(), outcomes, faults)
    assert [v.split(":")[0] for v in report["violations"]] == ["slow", "slow"], report["violations"]


def test_isolated_run_names_the_device_field_when_not_cuda():
    with pytest.raises(ValueError, match="device: --isolate needs --device cuda"):
        run(FaultsConfig(isolate=True, device="cpu", transfer="proxy", kinds="corrupt"))
