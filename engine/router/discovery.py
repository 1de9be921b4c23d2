"""Where the router learns which units exist: a static list, or PDUnits in Kubernetes.

Owns parsing of `--units` (`name=http://host:port,...`), the translation of a PDUnit
object (group pdunit.dev, v1alpha1, plural pdunits, label pdunit.dev/set=<set>) into a
`DiscoveredUnit`, and the list+watch loop that keeps the table equal to the cluster.
Discovery only says what exists and what its status claims; whether a unit answers is
the poller's job (table.py). This module must never route or proxy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from pdunit.engine.router.table import DiscoveredUnit, RoutingTable
from pdunit.engine.unit_layout import LB_PORT

GROUP = "pdunit.dev"
VERSION = "v1alpha1"
PLURAL = "pdunits"
SET_LABEL = "pdunit.dev/set"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def parse_static_units(items: list[str]) -> list[DiscoveredUnit]:
    """`["a=http://127.0.0.1:8000", ...]` -> units; raises ValueError naming the bad item."""
    units: list[DiscoveredUnit] = []
    seen: set[str] = set()
    for item in items:
        name, sep, url = item.partition("=")
        name, url = name.strip(), url.strip().rstrip("/")
        if not sep or not name or not url:
            raise ValueError(f"unit {item!r} must be name=http://host:port")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"unit {name!r} has URL {url!r}; expected http://host:port")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"unit {name!r} has URL {url!r} with a bad port: {exc}") from None
        if port is None:
            raise ValueError(f"unit {name!r} has URL {url!r} without a port; add :{LB_PORT} (the LB's)")
        if parts.path or parts.query:
            raise ValueError(f"unit {name!r} has URL {url!r} with a path; give only host:port")
        if name in seen:
            raise ValueError(f"unit name {name!r} appears twice")
        seen.add(name)
        units.append(DiscoveredUnit(name=name, url=url))
    return units


def unit_from_pdunit(obj: dict[str, Any]) -> DiscoveredUnit:
    """A PDUnit object -> what its status says. No address yet -> url "" (not routable)."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    ip = status.get("podIP") or ""
    port = status.get("lbPort")
    url = ""
    if ip and port:
        host = f"[{ip}]" if ":" in ip else ip  # IPv6 pod IPs need brackets in a URL
        url = f"http://{host}:{int(port)}"
    # A unit being deleted takes no new sessions even before the operator sets draining.
    deleting = bool(meta.get("deletionTimestamp"))
    return DiscoveredUnit(
        name=str(meta.get("name", "")),
        url=url,
        ready=bool(status.get("ready", False)),
        draining=bool(status.get("draining", False)) or deleting,
        phase=str(status.get("phase", "")),
    )


class StaticDiscovery:
    """A fixed list of units (`pdunit local` with several units, tests)."""

    def __init__(self, units: list[DiscoveredUnit]) -> None:
        self.units = units

    async def run(self, table: RoutingTable) -> None:
        table.replace_all(self.units)


class KubernetesDiscovery:
    """List PDUnits of one set, then watch them; relist on 410 Gone or any break."""

    def __init__(
        self,
        namespace: str,
        unit_set: str,
        logger: logging.Logger,
        watch_timeout_s: int = 300,
        retry_s: float = 2.0,
    ) -> None:
        self.namespace = namespace
        self.unit_set = unit_set
        self.log = logger
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self.selector = f"{SET_LABEL}={unit_set}"
        self._api: Any = None

    async def _connect(self) -> Any:
        from kubernetes_asyncio import client, config
        from kubernetes_asyncio.config import ConfigException

        try:
            config.load_incluster_config()
        except ConfigException:
            await config.load_kube_config()
        return client.CustomObjectsApi(client.ApiClient())

    async def list_units(self) -> tuple[list[dict[str, Any]], str]:
        """Every PDUnit of the set and the list's resourceVersion."""
        doc = await self._api.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, label_selector=self.selector
        )
        return list(doc.get("items", [])), str(doc["metadata"]["resourceVersion"])

    async def watch_units(self, resource_version: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(event type, object) from resource_version on, until the server ends the watch."""
        from kubernetes_asyncio import watch

        w = watch.Watch()
        stream = w.stream(
            self._api.list_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            label_selector=self.selector,
            resource_version=resource_version,
            timeout_seconds=self.watch_timeout_s,
        )
        try:
            async for event in stream:
                yield str(event["type"]), event["raw_object"]
        finally:
            w.stop()
            await w.close()

    def apply_event(self, table: RoutingTable, kind: str, obj: dict[str, Any]) -> None:
        if kind == "ERROR":
            code = obj.get("code")
            raise WatchExpired(f"watch error {code}: {obj.get('message', '')}")
        found = unit_from_pdunit(obj)
        if not found.name:
            return
        if kind == "DELETED":
            table.remove(found.name)
        elif kind in ("ADDED", "MODIFIED"):
            table.upsert(found)

    async def sync_once(self, table: RoutingTable) -> None:
        """One list, then one watch until it ends. Raises when the watch breaks."""
        items, rv = await self.list_units()
        table.replace_all([u for u in map(unit_from_pdunit, items) if u.name])
        self.log.info(
            "listed units",
            extra={"unit_set": self.unit_set, "namespace": self.namespace, "units": len(items)},
        )
        async for kind, obj in self.watch_units(rv):
            self.apply_event(table, kind, obj)

    async def run(self, table: RoutingTable) -> None:
        if self._api is None:
            self._api = await self._connect()
        while True:
            try:
                await self.sync_once(table)
            except asyncio.CancelledError:
                raise
            except WatchExpired as exc:
                self.log.info("watch expired; relisting", extra={"error": str(exc)})
            except Exception as exc:  # noqa: BLE001 - any API failure: keep units, relist
                if getattr(exc, "status", None) == 410:  # ApiException: resourceVersion too old
                    self.log.info("watch expired; relisting", extra={"error": str(exc)})
                    continue
                # Units stay in the table (their polls still decide routability); a
                # router that forgot all units on an API hiccup would drop all traffic.
                self.log.warning(
                    "PDUnit list/watch failed; retrying",
                    extra={"error": repr(exc), "retry_s": self.retry_s},
                )
                await asyncio.sleep(self.retry_s)


class WatchExpired(Exception):
    """The API server ended the watch (410 Gone): relist."""


def read_incluster_namespace() -> str:
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read().strip()
    except OSError:
        return ""
