"""The copy lane's framing, for both ends (the proxy's CopyLane and P's ProxySender):
a frame is a little-endian uint32 length, then that many bytes of one protobuf message
(CopyRequest towards the proxy, LaneReply back; see proxy.proto)."""

from __future__ import annotations

import socket
import struct

MAX_FRAME = 64 << 20


def send_frame(conn: socket.socket, payload: bytes) -> None:
    conn.sendall(struct.pack("<I", len(payload)) + payload)


def recv_frame(conn: socket.socket, limit: int = MAX_FRAME) -> bytes | None:
    """One frame's payload; None when the peer closed the connection between frames.
    Raises EOFError when it closed in the middle of one, OSError when a frame is larger
    than `limit`."""
    head = _recv_exact(conn, 4, at_boundary=True)
    if head is None:
        return None
    (size,) = struct.unpack("<I", head)
    if size > limit:
        raise OSError(f"copy lane frame of {size} bytes exceeds {limit}")
    return _recv_exact(conn, size, at_boundary=False) if size else b""


def _recv_exact(conn: socket.socket, n: int, at_boundary: bool) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if k == 0:
            if at_boundary and got == 0:
                return None
            raise EOFError(f"the copy lane closed after {got} of {n} bytes")
        got += k
    return bytes(buf)
