"""engine/packing.py is the one encoding of rows and ids in wire bytes: each encoding the
LB, the load generator, the proxy client and tcp route through it round-trips, and the
bytes are the ones those modules built by hand before (struct / astype().tobytes())."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from pdunit.engine.lb.validate import Limits, parse_request
from pdunit.engine.loadgen.workload import StreamSpec
from pdunit.engine.packing import pack, unpack, view


def test_a_binary_frame_row_is_little_endian_int32_and_reads_back():
    row = [0, 1, 2047, -1, 2**31 - 1]
    data = pack(row, "i4")
    assert data == struct.pack("<5i", *row)  # the LB's binary frames before packing.py
    assert view(data, "i4", 5).tolist() == [row]


def test_a_binary_int32_prompt_body_parses_back_to_its_prompt():
    prompt = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32)
    spec = StreamSpec(index=0, voice="v", reused=False, prompt=prompt, frames=4, seed=7)
    body, headers = spec.body("binary")
    assert body == prompt.astype("<i4").tobytes()
    req = parse_request(headers["Content-Type"], {k.lower(): v for k, v in headers.items()}, body,
                        Limits(n_codebooks=3, vocab_sizes=(8, 8, 8)))
    assert req.prompt.tolist() == prompt.tolist()
    assert req.prompt_bytes == prompt.astype("<i8").tobytes()
    assert unpack(req.prompt_bytes, "i8", 3).tolist() == prompt.tolist()


def test_a_binary_int64_prompt_body_is_forwarded_as_it_came():
    prompt = np.array([[1, 2], [3, 4]], dtype=np.int64)
    body = pack(prompt, "i8")
    headers = {"x-pdunit-dtype": "int64", "x-pdunit-row-width": "2"}
    req = parse_request("application/octet-stream", headers, body, Limits(n_codebooks=2, vocab_sizes=(8, 8)))
    assert req.prompt_bytes is body
    assert req.prompt.tolist() == prompt.tolist()


@pytest.mark.parametrize(("values", "dtype"), [
    ([0, 1, 2**64 - 1], "u8"),  # request ids (StepFrames, InfoReply, the proxy's Quiesce/InFlight)
    ([-1, 0, 2**40], "i8"),  # slot lists (proxy Grant/Copy, tcp BEGIN), vocab sizes
    ([0, 1, 0], "u1"),  # StepFrames.finished
])
def test_id_and_slot_lists_round_trip(values, dtype):
    data = pack(values, dtype)
    assert data == np.array(values, dtype="<" + dtype).tobytes()
    assert view(data, dtype).tolist() == values
    assert unpack(data, dtype).tolist() == values


def test_view_shares_the_bytes_read_only_and_unpack_copies():
    data = pack([1, 2, 3, 4], "i8")
    v = view(data, "i8", 2)
    assert not v.flags.writeable and np.shares_memory(v, np.frombuffer(data, dtype=np.uint8))
    u = unpack(data, "i8", 2)
    assert u.flags.writeable and u.dtype == np.dtype(np.int64)
    with pytest.raises(ValueError, match="not a multiple of 3 columns"):
        view(data, "i8", 3)
