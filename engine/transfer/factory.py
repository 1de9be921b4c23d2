"""Builds KV transports from `--transfer proxy|ipc|posix-fd|fabric|tcp|auto|host`.

Owns the mapping mode -> receiver/sender class and the option keys they read (all
string values, as the workers pass them):
- D: `proxy_socket`, `tcp_host`, `tcp_port`, `tcp_advertise_host`, `unit_secret`
- P: `proxy_socket`, `tcp_connections`, `tcp_chunk_tokens`, `chunk_tokens`,
  `chunk_delay_s` (host fault injection), `proxy_method` (auto|single|staged),
  `probe_all` ("1": probe every offered mode, for the harness), `unit_secret`
`unit_secret` is the unit's shared secret as read from `--unit-secret-file` (its bytes
as latin-1 text, `unit_secret_option`); tcp needs it on both sides and has no default.
`make_sender` with more than one descriptor (P's `--transfer auto`) probes them with
verified test transfers (engine/transfer/auto.py). Must never pick a mode silently:
the choice and every rejected mode's reason are logged and returned.
"""

from __future__ import annotations

from pdunit.engine.transfer.base import (
    Descriptor,
    KVReceiver,
    KVSender,
    PoolGeometry,
    TransferError,
)

MODES = ("host", "proxy", "ipc", "posix-fd", "fabric", "tcp", "auto")


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


def make_receiver(mode: str, geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVReceiver:
    """D's receiver for `mode` (it allocates D's pool storage)."""
    options = options or {}
    if mode == "host":
        from pdunit.engine.transfer.host import HostReceiver

        if str(device) != "cpu":
            raise TransferError(f"--transfer host keeps the pool in shared memory on the CPU; "
                                f"D runs on {device}: use proxy, ipc, posix-fd, fabric, tcp or auto")
        return HostReceiver(geometry)
    if mode == "proxy":
        from pdunit.engine.transfer.proxy import ProxyReceiver

        return ProxyReceiver(geometry, device, proxy_socket(options))
    if mode == "ipc":
        from pdunit.engine.transfer.ipc import IpcReceiver

        return IpcReceiver(geometry, device)
    if mode == "posix-fd":
        from pdunit.engine.transfer.posix_fd import PosixFdReceiver

        return PosixFdReceiver(geometry, device)
    if mode == "fabric":
        from pdunit.engine.transfer.fabric import FabricReceiver

        return FabricReceiver(geometry, device)
    if mode == "tcp":
        from pdunit.engine.transfer.tcp import TcpReceiver

        host, port, advertise = tcp_address(options)
        return TcpReceiver(geometry, device, host, port, advertise_host=advertise,
                           secret=unit_secret(options, "--transfer tcp: D's tcp KV listener"))
    if mode == "auto":
        from pdunit.engine.transfer.auto import AutoReceiver

        return AutoReceiver(geometry, device, options)
    raise TransferError(f"unknown transfer mode {mode!r}: expected one of {', '.join(MODES)}")


def attach(descriptor: Descriptor, geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVSender:
    """P's sender for exactly this descriptor (no probing)."""
    mode = descriptor.mode
    if "unavailable" in descriptor.params:
        raise TransferError(f"D cannot offer {mode}: {descriptor.params['unavailable']}")
    if descriptor.params.get("probe_only") == "1":
        raise TransferError(f"D offers {mode} for probing only: its pool is not exported that way")
    if mode == "host":
        from pdunit.engine.transfer.host import HostSender

        return HostSender(descriptor, geometry, chunk_tokens=int(options.get("chunk_tokens") or 0),
                          chunk_delay_s=float(options.get("chunk_delay_s") or 0.0))
    if mode == "proxy":
        from pdunit.engine.transfer.proxy import ProxySender
        from pdunit.sidecars.nvlink_proxy import proxy_pb2 as pb

        methods = {"auto": pb.METHOD_AUTO, "single": pb.SINGLE_KERNEL, "staged": pb.STAGED}
        method = options.get("proxy_method") or "auto"
        if method not in methods:
            raise TransferError(f"proxy_method {method!r}: expected auto, single or staged")
        return ProxySender(descriptor, geometry, device, options.get("proxy_socket") or "", methods[method])
    if mode == "ipc":
        from pdunit.engine.transfer.ipc import IpcSender

        return IpcSender(descriptor, geometry, device)
    if mode == "posix-fd":
        from pdunit.engine.transfer.posix_fd import PosixFdSender

        return PosixFdSender(descriptor, geometry, device)
    if mode == "fabric":
        from pdunit.engine.transfer.fabric import FabricSender

        return FabricSender(descriptor, geometry, device)
    if mode == "tcp":
        from pdunit.engine.transfer.tcp import TcpSender

        return TcpSender(descriptor, geometry, connections=int(options.get("tcp_connections") or 4),
                         chunk_tokens=int(options.get("tcp_chunk_tokens") or 0),
                         secret=unit_secret(options, "P's tcp sender (D offers tcp)"))
    raise TransferError(f"unknown transfer mode {mode!r} in D's descriptor")


def make_sender(descriptors: list[Descriptor], geometry: PoolGeometry, device: str,
                options: dict[str, str]) -> KVSender:
    """P's sender. One descriptor: attach to it. Several (auto): verified probing in the
    order fabric -> posix-fd -> ipc -> host -> proxy -> tcp; the report is on
    `sender.auto_report`."""
    options = options or {}
    if not descriptors:
        raise TransferError("D offered no transport descriptors")
    if len(descriptors) == 1 and options.get("probe_all") != "1":
        return attach(descriptors[0], geometry, device, options)
    from pdunit.engine.transfer.auto import probe_auto

    sender, _ = probe_auto(descriptors, geometry, device, options)
    return sender
