"""kopf handlers: the thin I/O shell around the operator's pure modules.

Each handler reads what the decisions need (the object, its pod, its Secret, its PDUnits,
the LB's `/v1/load`), calls pure functions (pod.py, unit_status.py, drain.py, rollout.py),
carries out what they return through kube.py / lbapi.py, posts one Event per decision and
writes status. Level-based: timers re-run every `resync_seconds`, so a missed event or an
operator restart only delays a decision. PDUnits carry the finalizer `pdunit.dev/drain`.
Must never: decide what a pure function could; let an exception escape a reconcile (it
becomes a condition naming the error); delete a pod its PDUnit does not own; use a unit
Secret another made; log a secret's value.
"""

from __future__ import annotations

import copy
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import kopf
from kubernetes_asyncio.client.exceptions import ApiException
from prometheus_client import Counter, Histogram
from pydantic import ValidationError

from pdunit.engine.lb.load import LoadDocument
from pdunit.operator import drain as dr
from pdunit.operator import models as m
from pdunit.operator import pod as pod_
from pdunit.operator import rollout as ro
from pdunit.operator import unit_status as us
from pdunit.operator.config import OperatorConfig
from pdunit.operator.kube import Kube
from pdunit.operator.lbapi import LbApi
from pdunit.operator.objects import owned_by, status_of, terminating

# Our own logger, not kopf's per-object one: main.py keeps kopf.objects at WARNING.
log = logging.getLogger("pdunit.operator")

RECONCILES = Counter(
    "pdunit_operator_reconciles_total", "Reconcile passes by kind and result", ["kind", "result"]
)
RECONCILE_SECONDS = Histogram(
    "pdunit_operator_reconcile_seconds", "Duration of one reconcile pass", ["kind"]
)
DECISIONS = Counter(
    "pdunit_operator_decisions_total",
    "Set controller decisions (create/drain/undrain/delete)",
    ["action"],
)
DRAINS = Counter("pdunit_operator_drains_total", "Finished unit drains", ["result"])
STREAMS_CUT = Counter(
    "pdunit_operator_streams_cut_total", "Streams still in flight when a drain timed out"
)
LOAD_ERRORS = Counter(
    "pdunit_operator_load_errors_total", "Failed GET /v1/load of a running unit pod"
)


DRAIN_RETRY = "draining before deletion"


@dataclass
class Context:
    cfg: OperatorConfig
    kube: Kube
    lb: LbApi


def _info(obj: dict[str, Any], *, reason: str, message: str) -> None:
    """A Normal Event on `obj` (kopf posts it in the background)."""
    kopf.info(cast(kopf.Body, obj), reason=reason, message=message)


def _warn(obj: dict[str, Any], *, reason: str, message: str) -> None:
    """A Warning Event on `obj`."""
    kopf.warn(cast(kopf.Body, obj), reason=reason, message=message)


def plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """A deep plain-dict copy of a kopf Body (the pure modules work on plain dicts)."""
    return copy.deepcopy({k: body[k] for k in body})


# ---------------------------------------------------------------------------- PDUnit


async def reconcile_unit(
    ctx: Context, body: dict[str, Any], *, deleting: bool, logger: logging.Logger
) -> bool:
    """One pass over a PDUnit. Returns True when a deleted unit may lose its finalizer."""
    now = datetime.now(UTC)
    meta = body["metadata"]
    name, ns = meta["name"], meta["namespace"]
    old = body.get("status") or {}

    try:
        spec = pod_.unit_defaults(body.get("spec") or {})
    except ValidationError as exc:
        return await _invalid_unit(ctx, body, m.validation_message(exc), now, deleting=deleting, logger=logger)
    unit = {**body, "spec": spec}

    pod = await ctx.kube.get_pod(ns, name)
    claim = pod_.claim_pod(body, pod)
    if claim.kind == "conflict":
        await _conflict(ctx, body, "PodConflict", claim.message, now)
        return deleting
    if claim.kind == "adopt":
        pod = await ctx.kube.patch_pod(ns, name, claim.patch or {})
        _info(body, reason="PodAdopted", message=claim.message)

    port = pod_.lb_port(spec, pod, ctx.cfg.allow_lb_port_override)
    ip = status_of(pod).get("podIP")
    load, load_error = None, None
    if us.pod_may_hold_streams(pod) and ip:
        load, load_error = await ctx.lb.load(ip, port)
        if load_error:
            LOAD_ERRORS.inc()

    draining = bool(spec.get("draining")) or deleting
    drain = old.get("drain")
    if draining:
        drain, pod_deleted = await _drain(ctx, body, pod, ip, port, load, drain, spec, now, logger)
        if drain.get("completedAt") and (pod_deleted or terminating(pod)):
            pod = None
    else:
        if drain:
            if dr.undrain_needed(drain, us.pod_running(pod), ip):
                err = await _post_drain(ctx, body, pod, ip or "", port, draining=False)
                if err:
                    _warn(body, reason="DrainCancelFailed", message=err)
            _info(body, reason="DrainCancelled", message="spec.draining set back to false")
            drain = None
        if pod is None:
            problem = await _ensure_secret(ctx, body, logger)
            if problem:
                await _conflict(ctx, body, "SecretConflict", problem, now)
                return False
        pod = await _ensure_pod(ctx, body, unit, pod, logger)

    status = us.unit_status(unit, pod, load, load_error, now, port=port, drain=drain, deleting=deleting)
    fallback = us.tcp_fallback_news(spec, old.get("transferMode"), status["transferMode"])
    if fallback:
        _warn(body, reason="TcpFallback", message=fallback)
        logger.warning("unit transfer fell back to tcp", extra={"unit": name, "mode": status["transferMode"]})
    if pod and not draining:
        status = us.with_pod_up_to_date(status, pod, spec, now)
    if old.get("phase") != status["phase"]:
        logger.info(
            "unit phase",
            extra={"unit": name, "phase": status["phase"], "from": old.get("phase"), "why": status["message"]},
        )
    await ctx.kube.patch_status(m.UNIT_PLURAL, ns, name, status)
    return deleting and bool(drain and drain.get("completedAt"))


async def _invalid_unit(
    ctx: Context, body: dict[str, Any], msg: str, now: datetime, *, deleting: bool, logger: logging.Logger
) -> bool:
    """A unit whose spec the operator cannot use: Failed naming the field; a deleted one
    loses its pod (nothing can drain it) and its finalizer."""
    meta = body["metadata"]
    status = us.invalid_status(body, msg, now)
    if status_of(body).get("message") != status["message"]:
        _warn(body, reason="InvalidSpec", message=msg)
    logger.warning("invalid PDUnit spec", extra={"unit": meta["name"], "error": msg})
    await ctx.kube.patch_status(m.UNIT_PLURAL, meta["namespace"], meta["name"], status)
    if not deleting:
        return False
    pod = await ctx.kube.get_pod(meta["namespace"], meta["name"])
    if pod and owned_by(pod, meta["uid"]):
        await ctx.kube.delete_pod(meta["namespace"], meta["name"], uid=pod["metadata"]["uid"])
    return True


async def _conflict(ctx: Context, body: dict[str, Any], reason: str, msg: str, now: datetime) -> None:
    """A unit that cannot get its pod because of an object that is not its own: Failed,
    an Event once, the fix in the message."""
    meta = body["metadata"]
    if status_of(body).get("message") != msg:
        _warn(body, reason=reason, message=msg)
    await ctx.kube.patch_status(
        m.UNIT_PLURAL, meta["namespace"], meta["name"], us.conflict_status(body, reason, msg, now)
    )


async def _ensure_secret(ctx: Context, body: dict[str, Any], logger: logging.Logger) -> str | None:
    """Create the unit's Secret once (its values drawn here, 32 random bytes each, never a
    default); None when it exists and is the unit's own, else what is wrong and the fix."""
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    secret_name = pod_.secret_name(name)
    secret = await ctx.kube.get_secret(ns, secret_name)
    if secret is None:
        manifest = pod_.desired_secret(body, secrets.token_hex(32), secrets.token_hex(32))
        if await ctx.kube.create_secret(ns, manifest) is not None:
            _info(body, reason="SecretCreated", message=f"created secret {secret_name}")
            logger.info("unit secret created", extra={"unit": name, "secret": secret_name})
            return None
        secret = await ctx.kube.get_secret(ns, secret_name)  # made between our read and create
        if secret is None:
            return f"secret {ns}/{secret_name} was created and deleted at once; retrying"
    return pod_.secret_problem(body, secret)


async def _post_drain(
    ctx: Context, body: dict[str, Any], pod: dict[str, Any] | None, ip: str, port: int, draining: bool = True
) -> str | None:
    """POST /v1/admin/drain to the pod's admin port with the token of the unit's Secret
    (read through the API, never logged); None on success, else why not."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    admin = pod_.admin_port(pod, ctx.cfg.allow_lb_port_override)
    if admin is None:  # a pod from before the admin port: its drain is on lbPort, no token
        return await ctx.lb.drain(ip, port, None, draining=draining)
    secret = await ctx.kube.get_secret(ns, pod_.secret_name(name))
    token = pod_.secret_value(secret, pod_.ADMIN_TOKEN_KEY) if secret else None
    if token is None:
        return (
            f"secret {ns}/{pod_.secret_name(name)} is missing or has no valid {pod_.ADMIN_TOKEN_KEY}: the LB "
            "takes no drain without it (its preStop hook still drains when the pod is deleted)"
        )
    return await ctx.lb.drain(ip, admin, token, draining=draining)


async def _ensure_pod(
    ctx: Context,
    body: dict[str, Any],
    unit: dict[str, Any],
    pod: dict[str, Any] | None,
    logger: logging.Logger,
) -> dict[str, Any] | None:
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    if pod is None:
        claims = pod_.desired_claim_template(unit)  # gpuAllocation dra: the pod's claim needs it first
        if claims is not None:
            await ctx.kube.create_claim_template(ns, claims)
        pod = await ctx.kube.create_pod(ns, pod_.desired_pod(unit, ctx.cfg.unit_image_pull_secrets))
        _info(body, reason="PodCreated", message=f"created pod {name}")
        logger.info("pod created", extra={"unit": name})
        return pod
    why = pod_.replacement_reason(pod)
    if why:
        await ctx.kube.delete_pod(ns, name, uid=pod["metadata"]["uid"])
        _warn(body, reason="PodReplaced", message=why)
    return pod


async def _drain(
    ctx: Context,
    body: dict[str, Any],
    pod: dict[str, Any] | None,
    ip: str | None,
    port: int,
    load: LoadDocument | None,
    drain: dict[str, Any] | None,
    spec: dict[str, Any],
    now: datetime,
    logger: logging.Logger,
) -> tuple[dict[str, Any], bool]:
    """Advance the drain state machine one step and carry out its decision: the drain's
    new state, and whether this pass deleted the pod."""
    name = body["metadata"]["name"]
    if drain and drain.get("completedAt"):
        return dict(drain), False
    timeout_s = spec["drainTimeoutSeconds"]
    step = dr.drain_step(
        drain,
        now=now,
        load=load,
        pod_may_hold_streams=us.pod_may_hold_streams(pod),
        timeout_s=timeout_s,
        check_interval_s=ctx.cfg.drain_check_interval_seconds,
        last_in_flight=int(status_of(body).get("inFlight") or 0),
    )
    state = step.state
    if not drain:
        logger.info("drain started", extra={"unit": name})
    if step.request_drain and ip:
        err = await _post_drain(ctx, body, pod, ip, port)
        if err is None:
            state["requested"] = True
            _info(body, reason="DrainStarted", message=dr.drain_started_message(timeout_s))
        else:
            logger.warning("drain request failed", extra={"unit": name, "error": err})
    if step.action == "wait":
        return state, False
    end = dr.drain_end(step, pod=pod, pod_terminating=terminating(pod), now=now, timeout_s=timeout_s,
                       grace_margin_s=pod_.GRACE_MARGIN_SECONDS)
    if end.delete_pod and pod is not None:
        grace = {} if end.grace_period_seconds is None else {"grace_period_seconds": end.grace_period_seconds}
        await ctx.kube.delete_pod(body["metadata"]["namespace"], name, uid=pod["metadata"]["uid"], **grace)
    DRAINS.labels(end.result).inc()
    if step.streams_cut:
        STREAMS_CUT.inc(step.streams_cut)
    (_warn if end.warning else _info)(body, reason=end.event_reason, message=end.event_message)
    logger.info(
        "drain finished",
        extra={"unit": name, "action": step.action, "why": step.reason, "streams_cut": step.streams_cut},
    )
    return end.state, True


# ------------------------------------------------------------------------ PDUnitSet


async def reconcile_set(ctx: Context, body: dict[str, Any], logger: logging.Logger) -> None:
    now = datetime.now(UTC)
    meta = body["metadata"]
    name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
    try:
        m.set_spec(body.get("spec") or {})
    except ValidationError as exc:
        msg = m.validation_message(exc)
        status = ro.invalid_set_status(body, msg, now)
        if (status_of(body).get("conditions") or []) != status["conditions"]:
            _warn(body, reason="InvalidSpec", message=msg)
        await ctx.kube.patch_status(m.SET_PLURAL, ns, name, status)
        return

    units = [u for u in await ctx.kube.list_units(ns, f"{m.LABEL_SET}={name}") if owned_by(u, uid)]
    plan = ro.plan_units(body, units)
    for action in plan.actions:
        DECISIONS.labels(action.kind).inc()
        unit_name = action.unit
        if action.kind == "create":
            created = await ctx.kube.create_unit(ns, ro.new_unit(body, plan.template_hash))
            unit_name = created["metadata"]["name"]
        elif action.kind == "delete":
            assert action.unit
            await ctx.kube.delete_unit(ns, action.unit)
        else:
            assert action.unit
            await ctx.kube.patch_unit(ns, action.unit, ro.unit_patch(action))
        reason, message = ro.action_event(action, unit_name)
        _info(body, reason=reason, message=message)
        logger.info(
            "set decision",
            extra={"set": name, "action": action.kind, "unit": action.unit, "why": action.reason},
        )
    await ctx.kube.patch_status(m.SET_PLURAL, ns, name, ro.set_status(body, units, now))


# ------------------------------------------------------------------------- wiring


def _error_text(exc: Exception) -> str:
    if isinstance(exc, ApiException):
        return f"Kubernetes API {exc.status}: {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


async def _guarded(
    ctx: Context, plural: str, body: dict[str, Any], logger: logging.Logger, coro: Any
) -> Any:
    """Run one reconcile; an unexpected error becomes a Reconciled=False condition, an
    Event and a log line, never a crash. The next timer tick retries."""
    kind = m.UNIT_KIND if plural == m.UNIT_PLURAL else m.SET_KIND
    start = time.perf_counter()
    try:
        result = await coro
    except Exception as exc:  # the operator must survive any one object
        RECONCILES.labels(kind, "error").inc()
        meta = body["metadata"]
        message = _error_text(exc)[:2000]
        patch = us.reconcile_error_patch(body, message, datetime.now(UTC), unit=plural == m.UNIT_PLURAL)
        where = {
            "kind": kind,
            "object": f"{meta.get('namespace')}/{meta.get('name')}",
            "error": message,
        }
        if patch["conditions"] != status_of(body).get("conditions"):
            # A new error: traceback and Event once; a persisting one: one line per tick.
            logger.exception("reconcile failed", extra=where)
            _warn(body, reason="ReconcileError", message=message)
        else:
            logger.warning("reconcile still failing", extra=where)
        try:
            await ctx.kube.patch_status(plural, meta["namespace"], meta["name"], patch)
        except Exception:  # the API itself may be what failed; the log line has it
            logger.warning("could not record the reconcile error in status", exc_info=True)
        return None
    finally:
        RECONCILE_SECONDS.labels(kind).observe(time.perf_counter() - start)
    RECONCILES.labels(kind, "ok").inc()
    return result


def register(
    registry: kopf.OperatorRegistry, ctx_holder: dict[str, Context], cfg: OperatorConfig
) -> None:
    """Attach the handlers to `registry`. `ctx_holder["ctx"]` is filled at operator startup."""
    interval = cfg.resync_seconds

    @kopf.timer(
        m.GROUP, m.VERSION, m.UNIT_PLURAL, interval=interval, registry=registry, id="reconcile-unit"
    )
    async def unit_timer(body: kopf.Body, **_: Any) -> None:
        obj = plain(body)
        ctx = ctx_holder["ctx"]
        await _guarded(
            ctx, m.UNIT_PLURAL, obj, log, reconcile_unit(ctx, obj, deleting=False, logger=log)
        )

    @kopf.on.delete(m.GROUP, m.VERSION, m.UNIT_PLURAL, registry=registry, id="drain-unit")
    async def unit_deleted(body: kopf.Body, **_: Any) -> None:
        obj = plain(body)
        ctx = ctx_holder["ctx"]
        done = await _guarded(
            ctx, m.UNIT_PLURAL, obj, log, reconcile_unit(ctx, obj, deleting=True, logger=log)
        )
        if not done:
            # Re-run until the drain finished; the finalizer holds the object meanwhile.
            raise kopf.TemporaryError(DRAIN_RETRY, delay=interval)

    @kopf.timer(
        m.GROUP, m.VERSION, m.SET_PLURAL, interval=interval, registry=registry, id="reconcile-set"
    )
    async def set_timer(body: kopf.Body, **_: Any) -> None:
        obj = plain(body)
        ctx = ctx_holder["ctx"]
        await _guarded(ctx, m.SET_PLURAL, obj, log, reconcile_set(ctx, obj, log))
