"""kopf handlers: the thin I/O shell around reconcile.py.

Each handler reads what reconcile.py needs (the object, its pod, its Secret, its PDUnits,
the LB's `/v1/load`), calls the pure functions, executes the returned actions through kube.py /
lbapi.py, posts one Kubernetes Event per decision, and writes status. Level-based:
timers re-run every `resync_seconds`, so a missed event or an operator restart only
delays a decision. PDUnits carry the finalizer `pdunit.dev/drain`: deleting a unit
drains it first.

Must never: decide anything reconcile.py could decide; let an exception escape a
reconcile (a malformed object gets a status condition naming the field, the operator
keeps running); delete a pod that is not owned by its PDUnit; use a unit Secret another made; log a
secret's value.
"""

from __future__ import annotations

import copy
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

import kopf
from kubernetes_asyncio.client.exceptions import ApiException
from prometheus_client import Counter, Histogram
from pydantic import ValidationError

from pdunit.operator import models as m
from pdunit.operator import reconcile as r
from pdunit.operator.kube import Kube
from pdunit.operator.lbapi import LbApi

if TYPE_CHECKING:
    from pdunit.operator.main import OperatorConfig

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
    """A deep plain-dict copy of a kopf Body (reconcile.py works on plain dicts)."""
    return copy.deepcopy({k: body[k] for k in body})


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(
        ref.get("uid") == uid and ref.get("controller")
        for ref in (obj.get("metadata") or {}).get("ownerReferences") or []
    )


def _has_controller(obj: dict[str, Any]) -> bool:
    return any(
        ref.get("controller") for ref in (obj.get("metadata") or {}).get("ownerReferences") or []
    )


def _terminating(obj: dict[str, Any] | None) -> bool:
    return bool(obj and (obj.get("metadata") or {}).get("deletionTimestamp"))


# ---------------------------------------------------------------------------- PDUnit


async def reconcile_unit(
    ctx: Context, body: dict[str, Any], *, deleting: bool, logger: logging.Logger
) -> bool:
    """One pass over a PDUnit. Returns True when a deleted unit may lose its finalizer."""
    now = datetime.now(UTC)
    meta = body["metadata"]
    name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
    old = body.get("status") or {}

    try:
        spec = r.unit_defaults(body.get("spec") or {})
    except ValidationError as exc:
        msg = m.validation_message(exc)
        status = r.invalid_status(body, msg, now)
        if old.get("message") != status["message"]:
            _warn(body, reason="InvalidSpec", message=msg)
        logger.warning("invalid PDUnit spec", extra={"unit": name, "error": msg})
        await ctx.kube.patch_status(m.UNIT_PLURAL, ns, name, status)
        if deleting:
            pod = await ctx.kube.get_pod(ns, name)
            if pod and _owned_by(pod, uid):
                await ctx.kube.delete_pod(ns, name, uid=pod["metadata"]["uid"])
            return True
        return False
    unit = {**body, "spec": spec}

    pod = await ctx.kube.get_pod(ns, name)
    if pod is not None and not _owned_by(pod, uid):
        labels = pod["metadata"].get("labels") or {}
        if labels.get(m.LABEL_UNIT) == name and not _has_controller(pod):
            owner = r.desired_pod(unit)["metadata"]["ownerReferences"]
            pod = await ctx.kube.patch_pod(ns, name, {"metadata": {"ownerReferences": owner}})
            _info(body, reason="PodAdopted", message=f"adopted existing pod {name}")
        else:
            msg = (
                f"pod {ns}/{name} exists and is not this unit's (no {m.LABEL_UNIT}={name} label "
                "or another controller owns it); delete or rename that pod"
            )
            await _conflict(ctx, body, "PodConflict", msg, now)
            return deleting

    port = r.lb_port(spec, pod, ctx.cfg.allow_lb_port_override)
    ip = (pod or {}).get("status", {}).get("podIP")
    load, load_error = None, None
    if r.pod_running(pod) and ip and not _terminating(pod):
        load, load_error = await ctx.lb.load(ip, port)
        if load_error:
            LOAD_ERRORS.inc()

    draining = bool(spec.get("draining")) or deleting
    drain = old.get("drain")
    if draining:
        drain = await _drain(ctx, body, pod, ip, port, load, drain, spec, now, logger)
        if drain.get("completedAt"):
            pod = None if pod is None or _terminating(pod) or drain.get("podDeleted") else pod
            drain.pop("podDeleted", None)
    else:
        if drain:
            if drain.get("requested") and r.pod_running(pod) and ip:
                err = await _post_drain(ctx, body, pod, ip, port, draining=False)
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

    status = r.unit_status(
        unit, pod, load, load_error, now, port=port, drain=drain, deleting=deleting
    )
    fallback = r.tcp_fallback(spec, status["transferMode"])
    if fallback and not r.tcp_fallback(spec, old.get("transferMode")):
        _warn(body, reason="TcpFallback", message=fallback)
        logger.warning("unit transfer fell back to tcp", extra={"unit": name, "mode": status["transferMode"]})
    if pod and not draining:
        current = (pod["metadata"].get("annotations") or {}).get(m.ANNOTATION_SPEC_HASH)
        fresh = current in r.spec_hashes(spec)
        status["conditions"] = r.set_condition(
            status["conditions"],
            "PodUpToDate",
            fresh,
            "UpToDate" if fresh else "SpecChanged",
            ""
            if fresh
            else "the spec changed after the pod was created; PDUnitSets roll units "
            "automatically, for a standalone PDUnit delete its pod (it drains first) to apply",
            now,
        )
    if old.get("phase") != status["phase"]:
        logger.info(
            "unit phase",
            extra={
                "unit": name,
                "phase": status["phase"],
                "from": old.get("phase"),
                "why": status["message"],
            },
        )
    await ctx.kube.patch_status(m.UNIT_PLURAL, ns, name, status)
    return deleting and bool(drain and drain.get("completedAt"))


async def _conflict(ctx: Context, body: dict[str, Any], reason: str, msg: str, now: datetime) -> None:
    """A unit that cannot get its pod because of an object that is not its own: Failed,
    an Event once, the fix in the message."""
    meta, old = body["metadata"], body.get("status") or {}
    if old.get("message") != msg:
        _warn(body, reason=reason, message=msg)
    await ctx.kube.patch_status(
        m.UNIT_PLURAL,
        meta["namespace"],
        meta["name"],
        {
            "phase": "Failed",
            "ready": False,
            "message": msg,
            "conditions": r.set_condition(old.get("conditions"), "Ready", False, reason, msg, now),
        },
    )


async def _ensure_secret(ctx: Context, body: dict[str, Any], logger: logging.Logger) -> str | None:
    """Create the unit's Secret once (its values drawn here, 32 random bytes each, never a
    default); None when it exists and is the unit's own, else what is wrong and the fix.
    A Secret someone else made is never used: its values would be known to them."""
    meta = body["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
    secret_name = r.secret_name(name)
    secret = await ctx.kube.get_secret(ns, secret_name)
    if secret is None:
        manifest = r.desired_secret(body, secrets.token_hex(32), secrets.token_hex(32))
        if await ctx.kube.create_secret(ns, manifest) is not None:
            _info(body, reason="SecretCreated", message=f"created secret {secret_name}")
            logger.info("unit secret created", extra={"unit": name, "secret": secret_name})
            return None
        secret = await ctx.kube.get_secret(ns, secret_name)  # made between our read and create
        if secret is None:
            return f"secret {ns}/{secret_name} was created and deleted at once; retrying"
    if not _owned_by(secret, uid):
        return (
            f"secret {ns}/{secret_name} exists and is not this unit's (no controller ownerReference to "
            f"PDUnit {name} uid {uid}): delete it, the operator then creates the unit's own"
        )
    bad = [k for k in (r.UNIT_SECRET_KEY, r.ADMIN_TOKEN_KEY) if r.secret_value(secret, k) is None]
    if bad:
        return (
            f"secret {ns}/{secret_name} has no valid {' or '.join(bad)} (base64 of at least "
            f"{r.SECRET_MIN_CHARS} characters): delete it, the operator then creates a new one"
        )
    return None


async def _post_drain(
    ctx: Context, body: dict[str, Any], pod: dict[str, Any] | None, ip: str, port: int, draining: bool = True
) -> str | None:
    """POST /v1/admin/drain to the pod's admin port with the token of the unit's Secret
    (read through the API, never logged); None on success, else why not."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    admin = r.admin_port(pod, ctx.cfg.allow_lb_port_override)
    if admin is None:  # a pod from before the admin port: its drain is on lbPort, no token
        return await ctx.lb.drain(ip, port, None, draining=draining)
    secret = await ctx.kube.get_secret(ns, r.secret_name(name))
    token = r.secret_value(secret, r.ADMIN_TOKEN_KEY) if secret else None
    if token is None:
        return (
            f"secret {ns}/{r.secret_name(name)} is missing or has no valid {r.ADMIN_TOKEN_KEY}: the LB "
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
        pod = await ctx.kube.create_pod(ns, r.desired_pod(unit))
        _info(body, reason="PodCreated", message=f"created pod {name}")
        logger.info("pod created", extra={"unit": name})
        return pod
    phase = (pod.get("status") or {}).get("phase")
    if phase in ("Failed", "Succeeded") and not _terminating(pod):
        # restartPolicy Always: only eviction or node loss ends here; replace the pod.
        why = r.pod_problem(pod) or (pod.get("status") or {}).get("reason") or phase
        await ctx.kube.delete_pod(ns, name, uid=pod["metadata"]["uid"])
        _warn(body, reason="PodReplaced", message=f"pod {name} is {phase} ({why}); recreating it")
    return pod


async def _drain(
    ctx: Context,
    body: dict[str, Any],
    pod: dict[str, Any] | None,
    ip: str | None,
    port: int,
    load: dict[str, Any] | None,
    drain: dict[str, Any] | None,
    spec: dict[str, Any],
    now: datetime,
    logger: logging.Logger,
) -> dict[str, Any]:
    """Advance the drain state machine one step and carry out its decision."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    if drain and drain.get("completedAt"):
        return dict(drain)
    first = not drain
    step = r.drain_step(
        drain,
        now=now,
        load=load,
        pod_may_hold_streams=r.pod_running(pod) and not _terminating(pod),
        timeout_s=spec["drainTimeoutSeconds"],
        check_interval_s=ctx.cfg.drain_check_interval_seconds,
        last_in_flight=int((body.get("status") or {}).get("inFlight") or 0),
    )
    state = step.state
    if first:
        logger.info("drain started", extra={"unit": name})
    if step.request_drain and ip:
        err = await _post_drain(ctx, body, pod, ip, port)
        if err is None:
            state["requested"] = True
            _info(
                body,
                reason="DrainStarted",
                message=f"LB stopped taking streams; waiting up to {spec['drainTimeoutSeconds']}s "
                "for those in flight",
            )
        else:
            logger.warning("drain request failed", extra={"unit": name, "error": err})
    if step.action == "wait":
        return state
    pod_uid = (pod or {}).get("metadata", {}).get("uid")
    if step.action == "force":
        if pod is not None:
            await ctx.kube.delete_pod(
                ns, name, grace_period_seconds=r.GRACE_MARGIN_SECONDS, uid=pod_uid
            )
        DRAINS.labels("forced").inc()
        STREAMS_CUT.inc(step.streams_cut)
        _warn(
            body,
            reason="DrainForced",
            message=f"drain timeout of {spec['drainTimeoutSeconds']}s passed with "
            f"{step.streams_cut} streams in flight; pod deleted, "
            f"{step.streams_cut} streams cut",
        )
    else:
        if pod is not None and not _terminating(pod):
            await ctx.kube.delete_pod(ns, name, uid=pod_uid)
        DRAINS.labels("clean").inc()
        _info(body, reason="Drained", message=f"pod deleted: {step.reason}")
    logger.info(
        "drain finished",
        extra={
            "unit": name,
            "action": step.action,
            "why": step.reason,
            "streams_cut": step.streams_cut,
        },
    )
    state["completedAt"] = r.iso_us(now)
    state["podDeleted"] = True  # internal marker for this pass only, popped by the caller
    return state


# ------------------------------------------------------------------------ PDUnitSet


async def reconcile_set(ctx: Context, body: dict[str, Any], logger: logging.Logger) -> None:
    now = datetime.now(UTC)
    meta = body["metadata"]
    name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
    old = body.get("status") or {}
    try:
        m.set_spec(body.get("spec") or {})
    except ValidationError as exc:
        msg = m.validation_message(exc)
        conditions = r.set_condition(
            old.get("conditions"), "SpecValid", False, "InvalidSpec", msg, now
        )
        if (old.get("conditions") or []) != conditions:
            _warn(body, reason="InvalidSpec", message=msg)
        await ctx.kube.patch_status(
            m.SET_PLURAL,
            ns,
            name,
            {
                "conditions": conditions,
                "observedGeneration": meta.get("generation"),
                "selector": f"{m.LABEL_SET}={name}",
            },
        )
        return

    units = [u for u in await ctx.kube.list_units(ns, f"{m.LABEL_SET}={name}") if _owned_by(u, uid)]
    plan = r.plan_units(body, units)
    for action in plan.actions:
        DECISIONS.labels(action.kind).inc()
        if action.kind == "create":
            created = await ctx.kube.create_unit(ns, r.new_unit(body, plan.template_hash))
            message = f"created unit {created['metadata']['name']}: {action.reason}"
            _info(body, reason="UnitCreated", message=message)
        elif action.kind in ("drain", "undrain"):
            assert action.unit
            await ctx.kube.patch_unit(
                ns, action.unit, {"spec": {"draining": action.kind == "drain"}}
            )
            verb = "draining" if action.kind == "drain" else "keeping"
            message = f"{verb} unit {action.unit}: {action.reason}"
            _info(
                body,
                reason="UnitDraining" if action.kind == "drain" else "UnitUndrained",
                message=message,
            )
        elif action.kind == "relabel":
            assert action.unit and action.template_hash
            await ctx.kube.patch_unit(
                ns, action.unit, {"metadata": {"labels": {m.LABEL_TEMPLATE_HASH: action.template_hash}}}
            )
            message = f"unit {action.unit}: {action.reason}"
            _info(body, reason="UnitRelabelled", message=message)
        elif action.kind == "delete":
            assert action.unit
            await ctx.kube.delete_unit(ns, action.unit)
            message = f"deleted unit {action.unit}: {action.reason}"
            _info(body, reason="UnitDeleted", message=message)
        else:
            raise ValueError(f"unknown action {action.kind!r}")
        logger.info(
            "set decision",
            extra={"set": name, "action": action.kind, "unit": action.unit, "why": action.reason},
        )
    await ctx.kube.patch_status(m.SET_PLURAL, ns, name, r.set_status(body, units, now))


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
        old = body.get("status") or {}
        conditions = r.set_condition(
            old.get("conditions"), "Reconciled", False, "Error", message, datetime.now(UTC)
        )
        where = {
            "kind": kind,
            "object": f"{meta.get('namespace')}/{meta.get('name')}",
            "error": message,
        }
        if conditions != old.get("conditions"):
            # A new error: traceback and Event once; a persisting one: one line per tick.
            logger.exception("reconcile failed", extra=where)
            _warn(body, reason="ReconcileError", message=message)
        else:
            logger.warning("reconcile still failing", extra=where)
        try:
            patch: dict[str, Any] = {"conditions": conditions}
            if plural == m.UNIT_PLURAL:
                patch["message"] = f"reconcile failed: {message}"
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
