"""Packed little-endian arrays: the one encoding of rows and ids in wire bytes.

Owns turning numpy arrays into bytes and back wherever they cross a process: protobuf
`bytes` fields of the in-pod RPC (never repeated scalars), the HTTP API's binary prompt
bodies and binary frame rows, and the proxy's slot and request-id lists. Nothing else
builds such bytes by hand (`struct`, `tobytes`, `frombuffer`), so the byte order and
widths are decided once. Transport framing (engine/transfer/tcp.py's header,
engine/proto/lane_framing.py's length prefix) and audio (engine/audio/pcm.py) are not
arrays of rows and keep their own wire modules.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pack(array: np.ndarray | Sequence[int], dtype: str) -> bytes:
    """`array` as contiguous little-endian `dtype` bytes (a copy)."""
    return np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def view(data: bytes | memoryview, dtype: str, cols: int | None = None) -> np.ndarray:
    """A read-only array over `data` (no copy), `cols` wide when given."""
    arr = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"))
    if cols:
        if arr.size % cols:
            raise ValueError(f"packed array of {arr.size} items is not a multiple of {cols} columns")
        arr = arr.reshape(-1, cols)
    return arr


def unpack(data: bytes | memoryview, dtype: str, cols: int | None = None) -> np.ndarray:
    """A writable native-order copy of `data` (torch.from_numpy needs one)."""
    return view(data, dtype, cols).astype(np.dtype(dtype))
