"""The host shared-memory transport: a second process writes rows into D's pool
bit-exactly; quiesce and deadlines stop writes; P never unlinks D's segment."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from pdunit.engine.kv.checksum import kv_checksum
from pdunit.engine.transfer.base import Descriptor, PoolGeometry, TransferError
from pdunit.engine.transfer.host import HostReceiver, HostSender
from pdunit.kernels.reference import copy_rows

GEOMETRY = PoolGeometry(
    n_layers=2, n_kv_heads=2, head_dim=16, dtype=torch.bfloat16, n_slots=96, page_size=1
)
P_SLOTS = 40  # P's own pool size
SRC_SLOTS = np.array([3, 1, 4, 15, 9, 26, 5, 35, 8, 39, 7, 0], dtype=np.int64)
DST_SLOTS = np.array([90, 2, 51, 13, 77, 6, 60, 41, 33, 12, 88, 70], dtype=np.int64)
NO_CAPABILITY = b""  # host writes D's shared memory directly: nothing checks a capability


def p_pool(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (GEOMETRY.n_layers, 2, P_SLOTS, GEOMETRY.n_kv_heads, GEOMETRY.head_dim)
    return torch.randn(shape, generator=g).to(GEOMETRY.dtype)


def far_deadline() -> int:
    return int(time.time() * 1000) + 60_000


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _sender_process(
    descriptor: Descriptor, geometry: PoolGeometry, seed: int, results: Any
) -> None:
    """P in another process: attach to D's segment, write, report the source checksum."""
    torch.set_num_threads(1)
    sender = HostSender(descriptor, geometry)
    src = p_pool(seed)
    sender.write(1, src, SRC_SLOTS, DST_SLOTS, far_deadline(), capability=NO_CAPABILITY)
    results.put(kv_checksum(src, SRC_SLOTS))
    sender.close()


@pytest.fixture
def receiver() -> Iterator[HostReceiver]:
    r = HostReceiver(GEOMETRY)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="module")
def cross_process() -> Iterator[dict[str, Any]]:
    """D here, P in a spawned process that writes once and exits."""
    r = HostReceiver(GEOMETRY)
    try:
        g = torch.Generator().manual_seed(99)
        r.storage.copy_(torch.randn(GEOMETRY.shape(), generator=g).to(GEOMETRY.dtype))
        before = r.storage.clone()
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        child = ctx.Process(target=_sender_process, args=(r.descriptors()[0], GEOMETRY, 7, results))
        child.start()
        try:
            src_checksum = results.get(timeout=120)
            child.join(timeout=30)
        finally:
            if child.is_alive():
                child.kill()
                child.join()
        yield {
            "receiver": r,
            "before": before,
            "src_checksum": src_checksum,
            "exitcode": child.exitcode,
        }
    finally:
        r.close()


def test_rows_written_by_another_process_are_bit_exact(cross_process: dict[str, Any]) -> None:
    assert cross_process["exitcode"] == 0
    expected = cross_process["before"].clone()
    copy_rows(p_pool(7), torch.from_numpy(SRC_SLOTS), expected, torch.from_numpy(DST_SLOTS))
    # Equal bit patterns everywhere: the written rows, and every row outside dst_slots.
    assert torch.equal(bits(cross_process["receiver"].storage), bits(expected))


def test_checksum_over_destination_equals_senders_source_checksum(
    cross_process: dict[str, Any],
) -> None:
    storage = cross_process["receiver"].storage
    assert kv_checksum(storage, DST_SLOTS) == cross_process["src_checksum"]
    assert kv_checksum(storage, DST_SLOTS[::-1]) != cross_process["src_checksum"]


def test_segment_survives_the_sender_process_exit(cross_process: dict[str, Any]) -> None:
    r: HostReceiver = cross_process["receiver"]
    assert cross_process["exitcode"] == 0
    assert os.path.exists(r.path)
    again = HostSender(r.descriptors()[0], GEOMETRY)  # a restarted P attaches again
    kept = r.storage[:, :, 95].clone()
    try:
        again.write(2, p_pool(8), np.array([0]), np.array([95]), far_deadline(), capability=NO_CAPABILITY)
        assert torch.equal(bits(r.storage[:, :, 95]), bits(p_pool(8)[:, :, 0]))
    finally:
        # the pool is the module's: the bit-exact test compares every row, in any order
        r.storage[:, :, 95] = kept


def test_receiver_pool_starts_zeroed_and_close_unlinks_it() -> None:
    r = HostReceiver(GEOMETRY)
    assert r.storage.shape == GEOMETRY.shape() and r.storage.dtype == GEOMETRY.dtype
    assert not r.storage.any()
    d = r.descriptors()
    assert [x.mode for x in d] == ["host"] and d[0].params["dtype"] == "bfloat16"
    assert os.path.exists(f"/dev/shm/{d[0].params['shm_name']}")
    r.close()
    assert not os.path.exists(r.path)
    with pytest.raises(TransferError, match="not found"):
        HostSender(d[0], GEOMETRY)


def test_a_second_receiver_with_the_same_name_is_refused(receiver: HostReceiver) -> None:
    with pytest.raises(TransferError, match="already exists"):
        HostReceiver(GEOMETRY, name=receiver.name)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_slots": 64}, "shape"),
        ({"head_dim": 8}, "shape"),
        ({"dtype": torch.float32}, "dtype bfloat16 but P's KV is float32"),
    ],
)
def test_sender_refuses_a_pool_of_another_geometry(
    receiver: HostReceiver, change: dict[str, Any], message: str
) -> None:
    import dataclasses

    with pytest.raises(TransferError, match=message):
        HostSender(receiver.descriptors()[0], dataclasses.replace(GEOMETRY, **change))


def test_sender_refuses_a_descriptor_of_another_mode(receiver: HostReceiver) -> None:
    with pytest.raises(TransferError, match="'fabric'"):
        HostSender(Descriptor("fabric", receiver.descriptors()[0].params), GEOMETRY)


def test_write_after_the_deadline_is_refused_and_writes_nothing(receiver: HostReceiver) -> None:
    sender = HostSender(receiver.descriptors()[0], GEOMETRY)
    past = int(time.time() * 1000) - 5
    with pytest.raises(TransferError, match="deadline passed"):
        sender.write(1, p_pool(1), SRC_SLOTS, DST_SLOTS, past, capability=NO_CAPABILITY)
    assert not receiver.storage.any()
    assert sender.in_flight() == []


def test_a_deadline_passing_mid_transfer_stops_it_at_a_chunk_boundary(
    receiver: HostReceiver,
) -> None:
    sender = HostSender(receiver.descriptors()[0], GEOMETRY, chunk_tokens=1, chunk_delay_s=0.05)
    deadline = int(time.time() * 1000) + 300
    with pytest.raises(TransferError, match=r"deadline passed .* stopped after \d+ of 12 rows"):
        sender.write(1, p_pool(1), SRC_SLOTS, DST_SLOTS, deadline, capability=NO_CAPABILITY)
    landed = receiver.storage[:, :, torch.from_numpy(DST_SLOTS)].flatten(2).any(dim=(0, 2))
    assert 0 < int(landed.sum()) < 12


def test_quiesce_of_an_idle_request_is_immediate_and_refuses_later_writes(
    receiver: HostReceiver,
) -> None:
    sender = HostSender(receiver.descriptors()[0], GEOMETRY)
    assert sender.quiesce(5) is True
    with pytest.raises(TransferError, match="cancelled"):
        sender.write(5, p_pool(1), SRC_SLOTS, DST_SLOTS, far_deadline(), capability=NO_CAPABILITY)
    assert not receiver.storage.any()
    sender.write(6, p_pool(1), SRC_SLOTS[:2], DST_SLOTS[:2], far_deadline(), capability=NO_CAPABILITY)  # others go on
    assert receiver.storage[:, :, torch.from_numpy(DST_SLOTS[:2])].any()


def test_quiesce_is_false_while_a_write_runs_and_true_once_it_stopped(
    receiver: HostReceiver,
) -> None:
    sender = HostSender(receiver.descriptors()[0], GEOMETRY, chunk_tokens=2, chunk_delay_s=0.05)
    outcome: list[BaseException | None] = []

    def transfer() -> None:
        try:
            sender.write(3, p_pool(2), SRC_SLOTS, DST_SLOTS, far_deadline(), capability=NO_CAPABILITY)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            outcome.append(e)

    thread = threading.Thread(target=transfer)
    thread.start()
    try:
        t0 = time.monotonic()
        while sender.in_flight() != [3]:
            assert time.monotonic() - t0 < 10, "write never started"
            time.sleep(0.001)
        assert sender.quiesce(3) is False  # a write of request 3 is in flight: no proof yet
    finally:
        thread.join(timeout=10)
    assert isinstance(outcome[0], TransferError) and "stopped after" in str(outcome[0])
    landed = receiver.storage[:, :, torch.from_numpy(DST_SLOTS)].flatten(2).any(dim=(0, 2))
    n_landed = int(landed.sum())
    assert 0 < n_landed < 12 and n_landed % 2 == 0  # whole chunks only
    assert sender.in_flight() == []
    assert sender.quiesce(3) is True
    snapshot = receiver.storage.clone()
    with pytest.raises(TransferError, match="cancelled"):
        sender.write(3, p_pool(2), SRC_SLOTS, DST_SLOTS, far_deadline(), capability=NO_CAPABILITY)
    assert torch.equal(bits(receiver.storage), bits(snapshot))


def test_invalid_slots_fail_before_any_row_is_written(receiver: HostReceiver) -> None:
    sender = HostSender(receiver.descriptors()[0], GEOMETRY, chunk_tokens=1)
    bad = DST_SLOTS.copy()
    bad[-1] = GEOMETRY.n_slots
    with pytest.raises(TransferError, match="outside the pool"):
        sender.write(1, p_pool(1), SRC_SLOTS, bad, far_deadline(), capability=NO_CAPABILITY)
    assert not receiver.storage.any()
    assert sender.in_flight() == []
