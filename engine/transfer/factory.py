"""Builds D's KV receiver and P's sender from `--transfer` (settings.TransferMode).

Owns the table mode -> receiver (`RECEIVERS`, every mode of the list, auto included) and
P's one decision: attach to D's only descriptor (engine/transfer/attach.py) or probe
several with verified test transfers (engine/transfer/auto.py). Must never pick a mode
silently: the choice and every rejected mode's reason are logged and returned. The option
keys the transports read are engine/transfer/options.py's.
"""

from __future__ import annotations

from collections.abc import Callable

from pdunit.engine.transfer.attach import attach
from pdunit.engine.transfer.base import (
    Descriptor,
    KVReceiver,
    KVSender,
    PoolGeometry,
    TransferError,
)
from pdunit.engine.transfer.options import proxy_socket, tcp_address, unit_secret

ReceiverBuilder = Callable[[PoolGeometry, str, dict[str, str]], KVReceiver]


def _host(geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVReceiver:
    from pdunit.engine.transfer.host import HostReceiver

    if str(device) != "cpu":
        raise TransferError(f"--transfer host keeps the pool in shared memory on the CPU; "
                            f"D runs on {device}: use proxy, ipc, posix-fd, fabric, tcp or auto")
    return HostReceiver(geometry)


def _proxy(geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVReceiver:
    from pdunit.engine.transfer.proxy import ProxyReceiver

    return ProxyReceiver(geometry, device, proxy_socket(options))


def _ipc(geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVReceiver:
    from pdunit.engine.transfer.ipc import IpcReceiver

    return IpcReceiver(geometry, device)


def _posix_fd(geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVReceiver:
    from pdunit.engine.transfer.posix_fd import PosixFdReceiver

    return PosixFdReceiver(geometry, device)


def _fabric(geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVReceiver:
    from pdunit.engine.transfer.fabric import FabricReceiver

    return FabricReceiver(geometry, device)


def _tcp(geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVReceiver:
    from pdunit.engine.transfer.tcp import TcpReceiver

    host, port, advertise = tcp_address(options)
    return TcpReceiver(geometry, device, host, port, advertise_host=advertise,
                       secret=unit_secret(options, "--transfer tcp: D's tcp KV listener"))


def _auto(geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVReceiver:
    from pdunit.engine.transfer.auto import AutoReceiver

    return AutoReceiver(geometry, device, options)


RECEIVERS: dict[str, ReceiverBuilder] = {
    "host": _host, "proxy": _proxy, "ipc": _ipc, "posix-fd": _posix_fd, "fabric": _fabric, "tcp": _tcp,
    "auto": _auto,
}
MODES = tuple(RECEIVERS)  # what this module builds; tests/test_cli.py: exactly settings.TransferMode


def make_receiver(mode: str, geometry: PoolGeometry, device: str, options: dict[str, str]) -> KVReceiver:
    """D's receiver for `mode` (it allocates D's pool storage)."""
    build = RECEIVERS.get(mode)
    if build is None:
        raise TransferError(f"unknown transfer mode {mode!r}: expected one of {', '.join(MODES)}")
    return build(geometry, device, options or {})


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
