"""Security events: one way for every process of a unit to refuse something as an
attack (a write without its capability, a forged restart proof, a copy into another's
region, an unauthenticated peer, an admin call without its token).

`security_event(what, **fields)` logs one warning with `security_event` set and counts
it in `pdunit_security_events_total{what}` of the default registry, which every
process serves. It must never raise and never decide anything: the caller refuses;
this only makes the refusal loud (PROTOCOL.md: refused, counted and logged).
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from pathlib import Path

from prometheus_client import Counter

log = logging.getLogger("pdunit.security")

SECURITY_EVENTS = Counter(
    "pdunit_security_events_total",
    "Requests refused as attacks or forgeries, by what was refused",
    ["what"],
)


def security_event(what: str, **fields: object) -> None:
    """A refusal that only an attacker or a bug produces: logged and counted."""
    SECURITY_EVENTS.labels(what=what).inc()
    log.warning("security event: %s", what, extra={"security_event": what, **fields})


def same_bytes(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two secrets (capabilities, tokens, MACs)."""
    return hmac.compare_digest(a, b)


class SecretFileError(ValueError):
    """A secret file that cannot be used; the message names the path and the fix."""


def read_secret_file(path: str, min_bytes: int = 16) -> bytes:
    """The bytes of a secret file (surrounding whitespace removed): refused when it is
    missing, shorter than `min_bytes`, or readable by other users (a secret anyone can
    read authenticates no one)."""
    p = Path(path)
    try:
        st = p.stat()
        data = p.read_bytes().strip()
    except OSError as exc:
        raise SecretFileError(f"secret file {path}: {exc.strerror or exc}") from exc
    if st.st_mode & (stat.S_IRWXO | stat.S_IWGRP):
        raise SecretFileError(f"secret file {path} is readable or writable by others "
                              f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it")
    if len(data) < min_bytes:
        raise SecretFileError(f"secret file {path} holds {len(data)} bytes, at least {min_bytes} needed")
    return data


def write_secret_file(path: str, n_bytes: int = 32) -> bytes:
    """Creates `path` (mode 0600, never world-readable even for a moment) holding a new
    random hex secret; returns its bytes as `read_secret_file` would."""
    data = os.urandom(n_bytes).hex().encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data + b"\n")
    finally:
        os.close(fd)
    return data


def check_unit_secret_file(path: str, transfer: str, needs_it: str) -> str:
    """`--unit-secret-file` of P or D: required with `--transfer tcp` (`needs_it` says
    why, for the message), and when given a usable secret file. Raises ValueError
    naming the flag."""
    if not path:
        if transfer == "tcp":
            raise ValueError(f"--transfer tcp: {needs_it} with the unit's secret: give --unit-secret-file "
                             "(env PDUNIT_UNIT_SECRET_FILE)")
        return path
    try:
        read_secret_file(path)
    except SecretFileError as exc:
        raise ValueError(f"--unit-secret-file: {exc}") from None
    return path
