"""The LB's HTTP routes (docs/api.md): the stream app and the admin app of one unit.

Owns the translation between HTTP and the LoadBalancer: POST /v1/tts/stream, POST
/v1/audio/speech and /v1/voices (speech.py: its writes behind the bearer token of
--voices-token-file, its reads open), /v1/models, /healthz, /readyz, /v1/load,
/v1/model, /metrics on the stream port; POST /v1/admin/drain only on
the admin port, behind a bearer token when one is configured. Must never hold state or
decide anything about a stream: the LoadBalancer (balancer.py) does, so a route is a
few lines a reader can check against docs/api.md.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from pdunit.engine.edge import bearer_matches
from pdunit.engine.http_body import BadContentLength, BodyTooLarge, read_limited
from pdunit.engine.lb import speech
from pdunit.engine.lb.balancer import LoadBalancer
from pdunit.engine.lb.validate import RequestError, check_json_depth
from pdunit.engine.security import security_event


def create_app(lb: LoadBalancer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await lb.start()
        try:
            yield
        finally:
            await lb.stop()

    app = FastAPI(
        title="pdunit LB", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )

    @app.post("/v1/tts/stream")
    async def tts_stream(request: Request) -> Response:
        return await lb.handle_stream(request)

    @app.post("/v1/audio/speech")
    async def audio_speech(request: Request) -> Response:
        return await speech.handle_speech(lb, request)

    # Writes need the voices token (a changed voice changes every client's speech with it);
    # reads stay open to stream clients, who pick their voice by name (speech.py).
    @app.post("/v1/voices")
    async def create_voice(request: Request) -> Response:
        return await speech.create_voice(lb, request)

    @app.get("/v1/voices")
    async def list_voices() -> Response:
        return await speech.list_voices(lb)

    @app.get("/v1/voices/{name}")
    async def get_voice(name: str) -> Response:
        return await speech.get_voice(lb, name)

    @app.delete("/v1/voices/{name}")
    async def delete_voice(name: str, request: Request) -> Response:
        return await speech.delete_voice(lb, request, name)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        served = [lb.config.model] if lb.config.model else []
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "pdunit"} for m in served]}

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        ready, reason = lb.readiness()
        return JSONResponse({"ready": ready, "reason": reason}, status_code=200 if ready else 503)

    @app.get("/v1/load")
    async def load() -> dict[str, Any]:
        return (await lb.load_document()).model_dump()

    @app.get("/v1/model")
    async def model() -> JSONResponse:
        doc = lb.model_document()
        if doc is None:
            return JSONResponse(
                {"error": {"code": "not_ready", "message": lb.config_error or lb.hello_error}},
                status_code=503,
                headers={"Retry-After": str(lb.config.retry_after_s)},
            )
        return JSONResponse(doc)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(lb.registry), media_type=CONTENT_TYPE_LATEST)

    return app


ADMIN_BODY_LIMIT = 4096


def create_admin_app(lb: LoadBalancer, token: bytes | None) -> FastAPI:
    """The admin routes (POST /v1/admin/drain), served on --admin-port, never on the
    stream port. With a token every call needs `Authorization: Bearer <token>`; a call
    without it is a 401 and a security event. The app has no lifespan: the stream app
    starts and stops the LB."""
    app = FastAPI(title="pdunit LB admin", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Response:
        if token is not None and not bearer_matches(request.headers, token):
            client = request.client.host if request.client else ""
            security_event("admin_unauthorized", path=request.url.path, client=client)
            return JSONResponse(
                {"error": {"code": "unauthorized", "field": "Authorization",
                           "message": "admin calls need 'Authorization: Bearer <token>', the "
                           "token of --admin-token-file"}},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        response: Response = await call_next(request)
        return response

    @app.post("/v1/admin/drain")
    async def drain(request: Request) -> JSONResponse:
        try:
            raw = await read_limited(request, ADMIN_BODY_LIMIT)
        except BadContentLength as exc:
            return JSONResponse(
                {"error": {"code": "bad_header", "field": "Content-Length", "message": str(exc)}},
                status_code=400, headers={"Connection": "close"},
            )
        except BodyTooLarge:
            return JSONResponse(
                {"error": {"code": "body_too_large", "field": "body",
                           "message": f"an admin body holds at most {ADMIN_BODY_LIMIT} bytes"}},
                status_code=413,
                headers={"Connection": "close"},
            )
        draining = True
        if raw.strip():
            try:
                check_json_depth(raw)
                doc = json.loads(raw)
            except RequestError as exc:
                return JSONResponse(exc.body(), status_code=exc.status)
            except ValueError as exc:
                return JSONResponse(
                    {"error": {"code": "malformed_json", "message": f"body is not JSON: {exc}"}},
                    status_code=400,
                )
            if (
                type(doc) is not dict
                or type(doc.get("draining", True)) is not bool
                or set(doc) - {"draining"}
            ):
                return JSONResponse(
                    {
                        "error": {
                            "code": "invalid_field",
                            "field": "draining",
                            "message": 'body must be {"draining": true|false}',
                        }
                    },
                    status_code=400,
                )
            draining = doc.get("draining", True)
        lb.set_draining(draining)
        return JSONResponse((await lb.load_document()).model_dump())

    return app
