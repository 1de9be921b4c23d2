"""A sender's quiesce bookkeeping (engine/transfer/base.py: WriteGate), shared by the host,
tcp and direct (ipc, posix-fd, fabric) senders: the batch-quiesce proof of PROTOCOL.md
section 3.5 rests on it."""

from __future__ import annotations

import time

import pytest

from pdunit.engine.transfer.base import TransferError, WriteGate


def _later() -> int:
    return int(time.time() * 1000) + 60_000


def test_a_quiesce_during_a_write_answers_false_until_it_ends_and_refuses_later_writes():
    gate = WriteGate()
    with gate.writing(7, _later()):
        assert gate.in_flight() == [7]
        assert gate.quiesce(7) is False  # a write is in flight: no proof yet
        with pytest.raises(TransferError, match=r"request 7 was cancelled \(quiesced\): stopped after 3 of 9"):
            gate.check(7, _later(), "stopped after 3 of 9 rows")
    assert gate.in_flight() == [] and gate.quiesce(7) is True
    with pytest.raises(TransferError, match="request 7 was cancelled .quiesced.: write refused"):
        with gate.writing(7, _later()):
            pass
    assert gate.in_flight() == []  # a refused write never counted


def test_two_writes_of_one_request_count_until_both_end_even_when_one_raises():
    gate = WriteGate()
    with gate.writing(3, _later()):
        with pytest.raises(RuntimeError), gate.writing(3, _later()):
            raise RuntimeError("copy failed")
        assert gate.in_flight() == [3] and gate.quiesce(3) is False
    assert gate.quiesce(3) is True


def test_a_passed_deadline_refuses_and_the_memory_of_quiesced_ids_is_bounded():
    gate = WriteGate(memory=2)
    with pytest.raises(TransferError, match=r"request 1: transfer deadline passed \d+ ms ago: write refused"):
        with gate.writing(1, int(time.time() * 1000) - 5):
            pass
    for rid in (10, 11, 12):
        gate.quiesce(rid)
    assert not gate.quiesced(10) and gate.quiesced(11) and gate.quiesced(12)  # the oldest forgotten
    gate.quiesce(11)  # a repeat refreshes it: 12 is now the oldest
    gate.quiesce(13)
    assert gate.quiesced(11) and not gate.quiesced(12)
