"""Picking a TCP port for a server that another process will bind later.

The usual trick (bind port 0, read the port, close, hand it on) picks from the kernel's
ephemeral range, the same range the kernel draws every outgoing connection's source port
from. Between the probe's close and the server's bind, any client on the host (an httpx
pool, grpc, kubectl) can be given that port, and the server dies with EADDRINUSE: CI saw
exactly that when D's debug server lost its port in the fault suite. Ports below the
ephemeral range are never handed out implicitly, so only another explicit bind can take
one; picking at random there, and never twice in one process, makes that unlikely too.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Lowest port we pick: above the registered services most hosts run (<= ~10000).
_FLOOR = 10000
_handed_out: set[int] = set()
_lock = threading.Lock()
_rng = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems have no such file


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and outside the ephemeral range."""
    low = _ephemeral_low()
    with _lock:
        if low - _FLOOR >= 1000:
            for _ in range(500):
                port = _rng.randrange(_FLOOR, low)
                if port not in _handed_out and _bindable(port):
                    _handed_out.add(port)
                    return port
        # A host whose ephemeral range starts low leaves no such ports: fall back to the
        # kernel's pick (the race above is back, but only there).
        for _ in range(100):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError("free_port: no free TCP port on 127.0.0.1")


def free_port_block(n: int) -> int:
    """The first of `n` consecutive ports free now (a unit's metrics block), picked as
    `free_port` picks one."""
    for _ in range(200):
        base = free_port()
        rest = range(base + 1, base + n)
        with _lock:
            if any(port in _handed_out for port in rest) or not all(_bindable(port) for port in rest):
                continue
            _handed_out.update(rest)
        return base
    raise RuntimeError(f"free_port_block: no {n} consecutive free TCP ports on 127.0.0.1")
