"""Raw-socket HTTP clients for the edge's tests: what an attacker sends, byte by byte.

httpx would refuse to send most of this (a 32 MiB header, a body shorter than its
Content-Length, a header that never ends), so these talk TCP directly. Every wait is
bounded by a generous deadline: the tests assert "answered or closed within it", never
how fast.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

DEADLINE_S = 10.0


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=DEADLINE_S)
    return sock


@dataclass
class Outcome:
    """What came back before the server closed (or the deadline passed)."""

    data: bytes
    closed: bool  # the server closed (or reset) the connection
    sent: int = 0  # bytes of the request that the socket accepted

    @property
    def status(self) -> int | None:
        if not self.data.startswith(b"HTTP/1.1 "):
            return None
        return int(self.data[9:12])

    @property
    def body(self) -> bytes:
        return self.data.partition(b"\r\n\r\n")[2]

    def header(self, name: str) -> str | None:
        head = self.data.partition(b"\r\n\r\n")[0].decode("latin-1")
        for line in head.split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None


def read_until_closed(sock: socket.socket, deadline_s: float = DEADLINE_S) -> Outcome:
    """Everything the server sends until it closes, or what came until the deadline."""
    end = time.monotonic() + deadline_s
    chunks: list[bytes] = []
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return Outcome(b"".join(chunks), closed=False)
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return Outcome(b"".join(chunks), closed=False)
        except ConnectionResetError:
            return Outcome(b"".join(chunks), closed=True)
        if not chunk:
            return Outcome(b"".join(chunks), closed=True)
        chunks.append(chunk)


def send_all_or_broken(sock: socket.socket, parts: list[bytes] | bytes) -> int:
    """Sends the parts until the server breaks the connection; the bytes it accepted."""
    sent = 0
    for part in [parts] if isinstance(parts, bytes) else parts:
        try:
            sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            return sent
        sent += len(part)
    return sent


def oversized_header(url: str, size: int, chunk: int = 1 << 16) -> Outcome:
    """A request whose one header value is `size` bytes (sent as fast as accepted)."""
    with connect(url) as sock:
        head = b"POST /v1/tts/stream HTTP/1.1\r\nHost: x\r\nX-Big: "
        parts = [head] + [b"a" * chunk] * (size // chunk) + [b"\r\n\r\n"]
        sent = send_all_or_broken(sock, parts)
        out = read_until_closed(sock)
        out.sent = sent
        return out


def slowloris(url: str, interval_s: float = 0.2, deadline_s: float = DEADLINE_S) -> Outcome:
    """Headers that never end: one byte every `interval_s` until the server gives up."""
    with connect(url) as sock:
        sock.sendall(b"POST /v1/tts/stream HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        end = time.monotonic() + deadline_s
        sent = 0
        while time.monotonic() < end:
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
            sock.settimeout(interval_s)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                return Outcome(b"", closed=True, sent=sent)
            rest = read_until_closed(sock, max(0.1, end - time.monotonic()))
            return Outcome(data + rest.data, closed=not data or rest.closed, sent=sent)
        out = read_until_closed(sock, 0.5)
        out.sent = sent
        return out


def short_body(url: str, path: str, declared: int, body: bytes) -> Outcome:
    """A body shorter than its Content-Length: the rest never comes."""
    with connect(url) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n".encode() + body
        )
        return read_until_closed(sock)


def request(url: str, raw: bytes) -> Outcome:
    with connect(url) as sock:
        sock.sendall(raw)
        return read_until_closed(sock)


def post_whole(url: str, path: str, body: bytes, headers: str = "Content-Type: application/json",
               chunked: bool = False) -> Outcome:
    """A client that writes its whole request before reading (as httpx does): `sent` is
    what the socket accepted before the server reset it, then whatever came back."""
    with connect(url) as sock:
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n{framing}\r\n\r\n".encode()
        step = 1 << 16
        pieces = [body[i:i + step] for i in range(0, len(body), step)]
        if chunked:
            pieces = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]
        sent = send_all_or_broken(sock, [head, *pieces])
        out = read_until_closed(sock)
        out.sent = sent - len(head)
        return out
