"""Request bodies at pdunit's HTTP doors (the LB's routes, the router): read one up to a
byte limit; after refusing it, discard a bounded rest before answering.

Owns `read_limited`: a declared Content-Length over the limit is refused before a byte is
kept, any body the moment it passes. Before `BodyTooLarge` it drops what the client still
sends (a lingering close): closing on unread bytes resets the connection, and a client
that writes its whole body first would read ECONNRESET instead of its 413.
Never: parse a body or shape an error (callers map the exceptions), or linger past
LINGER_BYTES / LINGER_S / LINGER_IDLE_S or after `Expect: 100-continue`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.requests import ClientDisconnect, Request

LINGER_BYTES = 16 << 20
LINGER_S = 5.0
LINGER_IDLE_S = 1.0


class BodyTooLarge(Exception):
    """The body passed `limit`: `size` bytes were declared (Content-Length) or seen."""

    def __init__(self, size: int, limit: int, declared: bool) -> None:
        super().__init__(f"request body {'declares' if declared else 'passed'} {size} bytes, "
                         f"the limit is {limit}")
        self.size = size
        self.limit = limit
        self.declared = declared


class BadContentLength(Exception):
    """Content-Length is not a non-negative integer."""

    def __init__(self, value: str) -> None:
        super().__init__(f"Content-Length is {value!r}, expected an integer")
        self.value = value


async def read_limited(request: Request, limit: int) -> bytes:
    """The whole body; `BodyTooLarge` past `limit` (after the bounded discard of the rest),
    `BadContentLength` for a malformed header, starlette's ClientDisconnect if the client
    leaves."""
    declared_text = request.headers.get("content-length")
    declared: int | None = None
    if declared_text is not None:
        if not declared_text.isdigit():
            raise BadContentLength(declared_text)
        declared = int(declared_text)
    chunks = request.stream()
    if declared is not None and declared > limit:
        if "100-continue" not in request.headers.get("expect", "").lower():
            await _discard(chunks, declared)
        raise BodyTooLarge(declared, limit, declared=True)
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            await _discard(chunks, None if declared is None else declared - size)
            raise BodyTooLarge(size, limit, declared=False)
        parts.append(chunk)
    return b"".join(parts)


async def _discard(chunks: AsyncIterator[bytes], left: int | None) -> None:
    """Read and drop the rest of a refused body within the LINGER_* bounds; `left`: the
    bytes still declared (None when unknown)."""
    if left is not None and left > LINGER_BYTES:
        return
    dropped = 0
    end = time.monotonic() + LINGER_S
    try:
        while dropped <= LINGER_BYTES:
            wait = min(LINGER_IDLE_S, end - time.monotonic())
            if wait <= 0:
                return
            dropped += len(await asyncio.wait_for(anext(chunks), wait))
    except (TimeoutError, StopAsyncIteration, ClientDisconnect):
        return
