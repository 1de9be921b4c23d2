"""The option keys P and D pass to their transports, and reading them.

All values are strings, as the workers pass them:
- D: `proxy_socket`, `tcp_host`, `tcp_port`, `tcp_advertise_host`, `unit_secret`
- P: `proxy_socket`, `tcp_connections`, `tcp_chunk_tokens`, `chunk_tokens`,
  `chunk_delay_s` (host fault injection), `proxy_method` (auto|single|staged),
  `probe_all` ("1": probe every offered mode, for the harness), `unit_secret`
`unit_secret` is the unit's secret as read from `--unit-secret-file` (its bytes as latin-1
text, `unit_secret_option`); tcp needs it on both sides and has no default. Must never
build a transport: engine/transfer/factory.py and attach.py do.
"""

from __future__ import annotations

from pdunit.engine.transfer.base import TransferError


def proxy_socket(options: dict[str, str]) -> str:
    from pdunit.engine.transfer.proxy import DEFAULT_SOCKET

    return options.get("proxy_socket") or DEFAULT_SOCKET


def unit_secret_option(secret: bytes) -> str:
    """The secret as an option value (every byte kept)."""
    return secret.decode("latin-1")


def unit_secret(options: dict[str, str], who: str) -> bytes:
    """The unit's secret from the options, or TransferError naming the flag (`who` says
    which side needs it)."""
    secret = (options.get("unit_secret") or "").encode("latin-1")
    if not secret:
        raise TransferError(f"{who} authenticates with the unit's shared secret and none was given: "
                            "pass --unit-secret-file (env PDUNIT_UNIT_SECRET_FILE)")
    return secret


def tcp_address(options: dict[str, str]) -> tuple[str, int, str]:
    host = options.get("tcp_host") or "127.0.0.1"
    return host, int(options.get("tcp_port") or 0), options.get("tcp_advertise_host") or ""
