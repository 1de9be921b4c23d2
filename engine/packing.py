"""Packed little-endian arrays in protobuf `bytes` fields (never repeated scalars).

The only place that turns numpy arrays into wire bytes and back for the in-pod RPC.
"""

from __future__ import annotations

import numpy as np


def pack(array: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def unpack(data: bytes, dtype: str, cols: int | None = None) -> np.ndarray:
    arr = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"))
    if cols:
        if arr.size % cols:
            raise ValueError(f"packed array of {arr.size} items is not a multiple of {cols} columns")
        arr = arr.reshape(-1, cols)
    return arr.astype(np.dtype(dtype))  # a writable copy: torch.from_numpy needs one
