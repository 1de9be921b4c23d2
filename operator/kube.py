"""The operator's Kubernetes API calls, as plain dicts in and out.

A thin adapter over kubernetes_asyncio (raw JSON, no generated model classes) so that
the pure modules see exactly what the API serves. Owns the API client's
lifetime. Never decides anything: callers (handlers.py) decide, this module executes.
Every method the operator uses is here, which is also the RBAC it needs:
pods get/create/patch/delete; secrets get/create (each unit's own Secret, by name);
resourceclaimtemplates create (a gpuAllocation dra unit's own, by name);
pdunits list/create/patch/delete, pdunits/status patch; pdunitsets/status patch;
the leader-election Lease get/create/update (events are posted by kopf).
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable
from typing import Any, cast

import aiohttp
import yaml
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

from pdunit.operator import models as m

MERGE = "application/merge-patch+json"
# Passed as **kwargs: the generated signatures do not declare `_content_type`, but every
# API method accepts it (without it a dict body is sent as a strategic merge patch,
# which custom resources do not support).
_AS_MERGE: dict[str, Any] = {"_content_type": MERGE}


class NoCluster(Exception):
    """No Kubernetes API to talk to; the message says which source was tried and the fix."""


class Kube:
    """Async Kubernetes API access for the operator (one instance per process)."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.coordination = client.CoordinationV1Api(api)
        self.resource = client.ResourceV1Api(api)

    @classmethod
    async def connect(cls) -> Kube:
        """In-cluster service account when running in a pod, else $KUBECONFIG / ~/.kube/config;
        then one GET /version. NoCluster names the source and the fix when either fails."""
        cfg = client.Configuration()
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            source = "the pod's service account"
            try:
                config.load_incluster_config(client_configuration=cfg)
            except ConfigException as exc:
                raise NoCluster(f"no Kubernetes cluster: {source} is unusable ({exc})") from None
        else:
            path = os.environ.get("KUBECONFIG") or os.path.expanduser(config.KUBE_CONFIG_DEFAULT_LOCATION)
            source = f"kubeconfig {path}"
            if not any(os.path.exists(p) for p in path.split(os.pathsep) if p):
                raise NoCluster(
                    f"no Kubernetes cluster: not in a pod and {source} does not exist; "
                    "set KUBECONFIG to a cluster's kubeconfig"
                )
            try:
                await config.load_kube_config(client_configuration=cfg)
            except (ConfigException, OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as exc:
                raise NoCluster(
                    f"no Kubernetes cluster: {source} is unusable ({exc}); set KUBECONFIG to a "
                    "cluster's kubeconfig"
                ) from None
        kube = cls(client.ApiClient(configuration=cfg))
        try:
            await cls._json(
                client.VersionApi(kube.api).get_code(_preload_content=False, _request_timeout=10)
            )
        except (ApiException, aiohttp.ClientError, OSError, TimeoutError) as exc:
            await kube.close()
            why = f"API {exc.status}: {exc.reason}" if isinstance(exc, ApiException) else str(exc) or repr(exc)
            raise NoCluster(
                f"no Kubernetes cluster: the API server {cfg.host} (from {source}) does not answer "
                f"GET /version ({why}); check that the cluster is up and the kubeconfig points at it"
            ) from None
        return kube

    async def close(self) -> None:
        await self.api.close()

    @staticmethod
    async def _json(call: Awaitable[Any]) -> dict[str, Any]:
        """Await a `_preload_content=False` call: JSON body on 2xx, else ApiException.

        (kubernetes_asyncio checks the status only when it preloads and deserialises
        into its model classes, which this module avoids.)"""
        resp = await call
        data = await resp.read()
        if not 200 <= resp.status <= 299:
            text = data.decode(errors="replace")
            try:  # a Status object: its message names the field (e.g. spec.nodeSelector)
                text = json.loads(text).get("message") or text
            except (ValueError, AttributeError):
                pass
            raise ApiException(status=resp.status, reason=text[:2000])
        return json.loads(data) if data else {}

    # -- pods

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._json(
                self.core.read_namespaced_pod(name, namespace, _preload_content=False)
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def create_pod(self, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
        resp = self.core.create_namespaced_pod(namespace, cast(Any, pod), _preload_content=False)
        return await self._json(resp)

    async def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        resp = self.core.patch_namespaced_pod(
            name, namespace, patch, **_AS_MERGE, _preload_content=False
        )
        return await self._json(resp)

    async def delete_pod(
        self,
        namespace: str,
        name: str,
        grace_period_seconds: int | None = None,
        uid: str | None = None,
    ) -> bool:
        """Delete (with a UID precondition when given); False when it was already gone."""
        body: dict[str, Any] = {}
        if grace_period_seconds is not None:
            body["gracePeriodSeconds"] = grace_period_seconds
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self._json(
                self.core.delete_namespaced_pod(
                    name, namespace, body=cast(Any, body), _preload_content=False
                )
            )
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    # -- secrets (a unit's own, by name: never listed or watched)

    async def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._json(
                self.core.read_namespaced_secret(name, namespace, _preload_content=False)
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def create_secret(self, namespace: str, secret: dict[str, Any]) -> dict[str, Any] | None:
        """Create; None when one of that name already exists (read it again)."""
        try:
            resp = self.core.create_namespaced_secret(namespace, cast(Any, secret), _preload_content=False)
            return await self._json(resp)
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise

    async def create_claim_template(self, namespace: str, template: dict[str, Any]) -> dict[str, Any] | None:
        """Create a ResourceClaimTemplate; None when one of that name already exists."""
        try:
            resp = self.resource.create_namespaced_resource_claim_template(
                namespace, cast(Any, template), _preload_content=False)
            return await self._json(resp)
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise

    # -- PDUnits

    async def list_units(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        resp = self.custom.list_namespaced_custom_object(
            m.GROUP,
            m.VERSION,
            namespace,
            m.UNIT_PLURAL,
            label_selector=selector,
            _preload_content=False,
        )
        return list((await self._json(resp)).get("items") or [])

    async def create_unit(self, namespace: str, unit: dict[str, Any]) -> dict[str, Any]:
        resp = self.custom.create_namespaced_custom_object(
            m.GROUP, m.VERSION, namespace, m.UNIT_PLURAL, unit, _preload_content=False
        )
        return await self._json(resp)

    async def patch_unit(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        resp = self.custom.patch_namespaced_custom_object(
            m.GROUP,
            m.VERSION,
            namespace,
            m.UNIT_PLURAL,
            name,
            patch,
            **_AS_MERGE,
            _preload_content=False,
        )
        return await self._json(resp)

    async def delete_unit(self, namespace: str, name: str) -> bool:
        try:
            await self._json(
                self.custom.delete_namespaced_custom_object(
                    m.GROUP, m.VERSION, namespace, m.UNIT_PLURAL, name, _preload_content=False
                )
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def patch_status(
        self, plural: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Merge-patch `.status` through the status subresource (None if the object is gone)."""
        try:
            return await self._json(
                self.custom.patch_namespaced_custom_object_status(
                    m.GROUP,
                    m.VERSION,
                    namespace,
                    plural,
                    name,
                    {"status": status},
                    **_AS_MERGE,
                    _preload_content=False,
                )
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # -- the leader-election Lease

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._json(
                self.coordination.read_namespaced_lease(name, namespace, _preload_content=False)
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def create_lease(self, namespace: str, lease: dict[str, Any]) -> dict[str, Any] | None:
        """Create; None when one of that name already exists."""
        try:
            return await self._json(
                self.coordination.create_namespaced_lease(
                    namespace, cast(Any, lease), _preload_content=False
                )
            )
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise

    async def replace_lease(
        self, namespace: str, name: str, lease: dict[str, Any]
    ) -> dict[str, Any] | None:
        """PUT with the read metadata.resourceVersion; None when the Lease changed since (409)."""
        try:
            return await self._json(
                self.coordination.replace_namespaced_lease(
                    name, namespace, cast(Any, lease), _preload_content=False
                )
            )
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise
