"""Fault injection lives off the production path (issue 32, finding 10; issue 22):
`pdunit prefill` refuses the `--fault-*` switches, the fault suite's own entry point
(bench/fault_injection.py) starts only with PDUNIT_FAULT_INJECTION=1, and the faults
themselves are a wrapping KVSender, checked here against a recording sender."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pdunit.bench.fault_injection import (
    FaultFields,
    FaultyPrefillConfig,
    FaultyPrefillEngine,
    FaultySender,
)
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.prefill.main import FAULT_ENV, PrefillConfig
from pdunit.engine.prefill.scheduler import PrefillJob, PrefillScheduler
from pdunit.engine.settings import parse_config
from pdunit.engine.transfer.base import Descriptor, KVSender, TransferError

CAP = b"c" * 32


class RecordingSender(KVSender):
    mode = "host"

    def __init__(self) -> None:
        self.writes: list[tuple[int, torch.Tensor, np.ndarray, np.ndarray, bytes]] = []
        self.quiesced: list[int] = []

    def write(self, request_id, src, src_slots, dst_slots, deadline_unix_ms, *, capability):
        rows = src.index_select(2, torch.from_numpy(np.asarray(src_slots, dtype=np.int64))).clone()
        self.writes.append((request_id, rows, np.asarray(dst_slots), capability))

    def quiesce(self, request_id: int) -> bool:
        self.quiesced.append(request_id)
        return True


def _pool() -> torch.Tensor:
    return torch.arange(2 * 2 * 8 * 2 * 4, dtype=torch.float32).view(2, 2, 8, 2, 4)


def _write(sender: FaultySender, rid: int, pool: torch.Tensor) -> None:
    sender.write(rid, pool, np.array([1, 3, 5, 7]), np.array([10, 11, 12, 13]), 2**62, capability=CAP)


def test_prefill_refuses_a_fault_switch_without_the_environment_switch():
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    out = subprocess.run([sys.executable, "-m", "pdunit.engine.cli", "prefill", "--fault-corrupt-id", "1"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert "--fault-corrupt-id" in out.stderr and f"{FAULT_ENV}=1" in out.stderr, out.stderr


def test_the_fault_entry_point_refuses_to_start_without_the_environment_switch():
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    out = subprocess.run([sys.executable, "-m", "pdunit.bench.fault_injection", "--fault-corrupt-id", "1"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert f"{FAULT_ENV}=1" in out.stderr, out.stderr


def test_the_production_config_has_no_fault_switch_and_the_fault_config_has_them_all():
    assert [name for name in PrefillConfig.model_fields if "fault" in name or "chunk" in name] == []
    cfg = parse_config(FaultyPrefillConfig, ["--fault-corrupt-id", "1", "--fault-chunk-tokens", "8"],
                       "pdunit prefill", env={})
    assert (cfg.fault_corrupt_id, cfg.fault_chunk_tokens) == (1, 8)


def test_an_unmarked_write_reaches_the_sender_unchanged_with_its_capability():
    inner, pool = RecordingSender(), _pool()
    _write(FaultySender(inner, {}, 0.0), 5, pool)
    [(rid, rows, dst, cap)] = inner.writes
    assert rid == 5 and cap == CAP and dst.tolist() == [10, 11, 12, 13]
    assert torch.equal(rows, pool[:, :, [1, 3, 5, 7]])


def test_a_corrupt_write_differs_from_the_true_rows_in_exactly_one_bit():
    inner, pool = RecordingSender(), _pool()
    before = pool.clone()
    _write(FaultySender(inner, {5: "corrupt"}, 0.0), 5, pool)
    [(_, rows, dst, cap)] = inner.writes
    true = before[:, :, [1, 3, 5, 7]].contiguous()
    diff = (rows.contiguous().view(-1).view(torch.uint8) ^ true.view(-1).view(torch.uint8))
    assert sum(bin(int(b)).count("1") for b in diff) == 1
    assert torch.equal(pool, before)  # P's own rows (its checksum) are untouched
    assert dst.tolist() == [10, 11, 12, 13] and cap == CAP


def test_a_slow_write_goes_in_two_halves():
    inner, pool = RecordingSender(), _pool()
    _write(FaultySender(inner, {5: "slow"}, 0.0), 5, pool)
    assert [w[2].tolist() for w in inner.writes] == [[10, 11], [12, 13]]
    assert all(w[3] == CAP for w in inner.writes)


def test_a_wedged_write_fails_and_its_request_never_proves_quiescent():
    inner, pool = RecordingSender(), _pool()
    sender = FaultySender(inner, {5: "wedge"}, 0.0)
    with pytest.raises(TransferError, match="wedged"):
        _write(sender, 5, pool)
    assert inner.writes == []
    assert sender.quiesce(5) is False
    assert sender.quiesce(6) is True
    assert inner.quiesced == [5, 6]  # the inner sender is always asked: it bars later writes


def test_the_faulty_engine_marks_prompts_and_wraps_its_sender_through_the_relay(monkeypatch):
    faults = FaultFields(fault_corrupt_id=7, fault_wedge_id=9, fault_tcp_relay="127.0.0.1:4567")
    engine = FaultyPrefillEngine(None, "random:tiny:0", "cpu", None, None, PrefillScheduler(4, 4096),
                                 "d0.sock", "tcp", {}, faults=faults)
    for rid, first in ((1, 7), (2, 9), (3, 8)):
        prompt = np.full((4, 11), 3, dtype=np.int64)
        prompt[0, 0] = first
        engine.submit(PrefillJob(rid, prompt, SamplingParams(), 0, {}))
    assert engine.marked == {1: "corrupt", 2: "wedge"}
    attached: list[Descriptor] = []
    monkeypatch.setattr("pdunit.engine.prefill.worker.make_sender",
                        lambda offered, *a: attached.extend(offered) or RecordingSender())
    sender = engine.attach_sender([Descriptor("tcp", {"host": "10.0.0.1", "port": "9"})], None)  # type: ignore[arg-type]
    assert isinstance(sender, FaultySender) and sender.marked is engine.marked
    assert attached[0].params == {"host": "127.0.0.1", "port": "4567"}
