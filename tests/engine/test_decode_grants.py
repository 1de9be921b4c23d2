"""D's side of the write capabilities (PROTOCOL.md 3.1, engine/decode/worker.py): RESERVE
grants one for exactly the reservation's slots and hands it to P; the grant ends at
COMMIT (before D's checksum reads the rows) and whenever the pages go held (checksum
mismatch, cancel, deadline); a reservation whose grant fails is refused and held."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdunit.engine.kv.pool import PageState
from pdunit.engine.packing import unpack
from pdunit.engine.proto import pdunit_pb2 as pb
from tests.engine.test_decode_commit import ROWS, commit, engine


def reserve(d, rid: int, deadline_unix_ms: int = 0) -> pb.ReserveReply:
    return d.reserve(pb.ReserveRequest(request_id=rid, n_tokens=ROWS, total_tokens=ROWS + 4,
                                       deadline_unix_ms=deadline_unix_ms,
                                       identity=pb.Identity(sender_instance="p")))


def test_reserve_grants_a_capability_for_exactly_the_reservations_slots():
    d, _ = engine()
    reply = reserve(d, 1)
    assert reply.status == pb.STATUS_OK and len(reply.capability) == 32
    slots = unpack(reply.dst_slots, "i8")
    assert d.receiver.grants.check(1, reply.capability, slots, exact=True) == ""
    assert reserve(d, 2).capability != reply.capability  # one per reservation


def test_commit_revokes_the_grant_before_its_checksum_reads_the_rows():
    d, _ = engine()
    order: list[str] = []
    revoke, checksum = d.receiver.revoke, d._checksum
    d.receiver.revoke = lambda rid: (order.append("revoke"), revoke(rid))[1]  # type: ignore[method-assign]
    d._checksum = lambda *a: (order.append("checksum"), checksum(*a))[1]  # type: ignore[method-assign]
    assert commit(d, 3, np.arange(11, dtype=np.int32), max_frames=4, min_frames=4).status == pb.STATUS_OK
    assert order[:2] == ["revoke", "checksum"]
    assert 3 not in d.receiver.grants


@pytest.mark.parametrize("end", ["cancel", "deadline", "checksum"])
def test_every_held_reservation_loses_its_grant(end: str):
    d, _ = engine()
    deadline = int(time.time() * 1000) + (-1 if end == "deadline" else 60_000)
    reply = reserve(d, 4, deadline)
    assert 4 in d.receiver.grants
    if end == "cancel":
        d.cancel(4)
    elif end == "deadline":
        d.expire_reservations()
    else:
        d.commit(pb.CommitRequest(request_id=4, checksum=12345, checksum_sample=1,
                                  identity=pb.Identity(sender_instance="p")))
    assert d.pool.state_of(4) == PageState.HELD
    assert 4 not in d.receiver.grants
    assert d.receiver.grants.late(4, reply.capability)  # its own writer is late, nobody else is


def test_a_reservation_whose_grant_fails_is_refused_and_its_pages_held():
    d, _ = engine()

    def unreachable(*_a: object) -> bytes:
        raise ConnectionError("the proxy does not answer")

    d.receiver.grant = unreachable  # type: ignore[method-assign]
    reply = reserve(d, 5)
    assert reply.status == pb.TRANSFER_FAILED and not reply.capability
    assert "does not answer" in reply.message
    assert d.pool.state_of(5) == PageState.HELD and 5 not in d.reservations
