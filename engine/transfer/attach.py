"""P's sender for exactly one of D's descriptors: no probing, no choice.

Owns the table mode -> sender (`SENDERS`, one per concrete mode: settings.TransferMode
less auto) and the checks that refuse a descriptor D offered as unavailable or for
probing only. Must never choose among descriptors: engine/transfer/auto.py does, with a
verified test transfer each, and calls `attach` for every one it tries. A sender's module
is imported when its mode is attached, so P loads only the transports it uses.
"""

from __future__ import annotations

from collections.abc import Callable

from pdunit.engine.transfer.base import Descriptor, KVSender, PoolGeometry, TransferError
from pdunit.engine.transfer.options import unit_secret

SenderBuilder = Callable[[Descriptor, PoolGeometry, str, dict[str, str]], KVSender]


def _host(descriptor: Descriptor, geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVSender:
    from pdunit.engine.transfer.host import HostSender

    return HostSender(descriptor, geometry, chunk_tokens=int(options.get("chunk_tokens") or 0),
                      chunk_delay_s=float(options.get("chunk_delay_s") or 0.0))


def _proxy(descriptor: Descriptor, geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVSender:
    from pdunit.engine.proto import proxy_pb2 as pb
    from pdunit.engine.transfer.proxy import ProxySender

    methods = {"auto": pb.METHOD_AUTO, "single": pb.SINGLE_KERNEL, "staged": pb.STAGED}
    method = options.get("proxy_method") or "auto"
    if method not in methods:
        raise TransferError(f"proxy_method {method!r}: expected auto, single or staged")
    return ProxySender(descriptor, geometry, device, options.get("proxy_socket") or "", methods[method])


def _ipc(descriptor: Descriptor, geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVSender:
    from pdunit.engine.transfer.ipc import IpcSender

    return IpcSender(descriptor, geometry, device)


def _posix_fd(descriptor: Descriptor, geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVSender:
    from pdunit.engine.transfer.posix_fd import PosixFdSender

    return PosixFdSender(descriptor, geometry, device)


def _fabric(descriptor: Descriptor, geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVSender:
    from pdunit.engine.transfer.fabric import FabricSender

    return FabricSender(descriptor, geometry, device)


def _tcp(descriptor: Descriptor, geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVSender:
    from pdunit.engine.transfer.tcp import TcpSender

    return TcpSender(descriptor, geometry, connections=int(options.get("tcp_connections") or 4),
                     chunk_tokens=int(options.get("tcp_chunk_tokens") or 0),
                     secret=unit_secret(options, "P's tcp sender (D offers tcp)"))


SENDERS: dict[str, SenderBuilder] = {
    "host": _host, "proxy": _proxy, "ipc": _ipc, "posix-fd": _posix_fd, "fabric": _fabric, "tcp": _tcp,
}


def attach(descriptor: Descriptor, geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVSender:
    """P's sender for exactly this descriptor (no probing)."""
    mode = descriptor.mode
    if "unavailable" in descriptor.params:
        raise TransferError(f"D cannot offer {mode}: {descriptor.params['unavailable']}")
    if descriptor.params.get("probe_only") == "1":
        raise TransferError(f"D offers {mode} for probing only: its pool is not exported that way")
    build = SENDERS.get(mode)
    if build is None:
        raise TransferError(f"unknown transfer mode {mode!r} in D's descriptor")
    return build(descriptor, geometry, device, options)
