"""The operator's calls to one unit's LB (docs/api.md): GET /v1/load on the stream port,
POST /v1/admin/drain on the admin port with the unit's bearer token.

Short timeouts, one shared httpx client, and errors returned as values: an unreachable
LB, or an answer that is not a LoadDocument, is a fact the drain state machine must see
(it proves nothing), never an exception that aborts a reconcile. Owns no state and no
decisions.
"""

from __future__ import annotations

import httpx

from pdunit.engine.lb.load import LoadDocument, LoadDocumentError, read_load_document


class LbApi:
    def __init__(self, timeout_s: float) -> None:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), trust_env=False)

    async def close(self) -> None:
        await self.client.aclose()

    async def load(self, ip: str, port: int) -> tuple[LoadDocument | None, str | None]:
        """(the /v1/load document, None) or (None, why it could not be read)."""
        url = f"http://{ip}:{port}/v1/load"
        try:
            resp = await self.client.get(url)
        except httpx.HTTPError as exc:
            return None, f"GET {url}: {type(exc).__name__}: {exc}".rstrip(": ")
        if resp.status_code != 200:
            return None, f"GET {url}: HTTP {resp.status_code}"
        try:
            doc = read_load_document(resp.content)
        except LoadDocumentError as exc:
            return None, f"GET {url}: {exc} (not a pdunit LB, or another version?)"
        return doc, None

    async def drain(self, ip: str, port: int, token: str | None, draining: bool = True) -> str | None:
        """POST /v1/admin/drain on the LB's admin port with its bearer token (None: a pod
        from before the admin port, whose LB takes the drain on lbPort without one);
        None on success, else why it failed (never the token)."""
        url = f"http://{ip}:{port}/v1/admin/drain"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            resp = await self.client.post(url, json={"draining": draining}, headers=headers)
        except httpx.HTTPError as exc:
            return f"POST {url}: {type(exc).__name__}: {exc}".rstrip(": ")
        if resp.status_code in (401, 403):
            return (f"POST {url}: HTTP {resp.status_code}: the LB refused the admin token of the unit's "
                    "Secret (was the Secret deleted and recreated after the pod started?)")
        if resp.status_code >= 300:
            return f"POST {url}: HTTP {resp.status_code}"
        return None
