"""KEDA external scaler for PDUnitSets: decode streams in flight, or the units needed to
keep rate-floor headroom, per set (the trigger's `metric`: inFlight | headroom).

Owns KEDA's external-scaler gRPC service (operator/proto/externalscaler.proto), the
parsing of a ScaledObject's `scalerMetadata`, the concurrent scrape of each ready,
non-draining unit's `GET /v1/load` (a LoadDocument) with a short timeout and cache, and
its Prometheus metrics. Must never write to the Kubernetes API, count a unit it could
not scrape as zero load (it is excluded, logged, counted; when none answered the RPC
fails UNAVAILABLE, so KEDA keeps the size), or let one slow unit hold a poll past the
scrape timeout. Also standalone: `python -m pdunit.operator.scaler --port 9090`."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel, Field

from pdunit.engine.lb.load import LoadDocumentError, read_load_document
from pdunit.operator.proto import externalscaler_pb2 as pb
from pdunit.operator.proto import externalscaler_pb2_grpc as pb_grpc

GROUP = "pdunit.dev"
VERSION = "v1alpha1"
SET_LABEL = "pdunit.dev/set"

T = TypeVar("T")

# scalerMetadata keys (the ScaledObject's trigger metadata).
KEY_UNIT_SET = "unitSet"
KEY_NAMESPACE = "namespace"
KEY_TARGET = "targetInFlightPerUnit"
KEY_METRIC = "metric"
KEY_TARGET_HEADROOM = "targetHeadroomPerUnit"
METRIC_IN_FLIGHT = "inFlight"
METRIC_HEADROOM = "headroom"
KEY_ACTIVATION = "activationInFlight"
KEY_TIMEOUT = "scrapeTimeoutMs"

DEFAULT_SCRAPE_TIMEOUT_MS = 500
MAX_SCRAPE_TIMEOUT_MS = 10_000  # KEDA's own gRPC deadline is a few seconds; stay under it.

# Repeat an unchanged "units unreachable" warning at most this often (StreamIsActive
# re-scrapes every few seconds; one line per change is enough, plus a reminder).
UNREACHABLE_LOG_REPEAT_S = 60.0

REQUESTS = Counter(
    "pdunit_scaler_requests_total",
    "KEDA external-scaler RPCs by method and gRPC code",
    ["method", "code"],
)
REQUEST_SECONDS = Histogram(
    "pdunit_scaler_request_duration_seconds",
    "Time to answer a KEDA RPC (unary ones)",
    ["method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
SCRAPE_SECONDS = Histogram(
    "pdunit_scaler_scrape_duration_seconds",
    "Time to scrape every unit of one set",
    ["namespace", "unit_set"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)
UNIT_SCRAPE_FAILURES = Counter(
    "pdunit_scaler_unit_scrape_failures_total",
    "Unit /v1/load scrapes that failed, by reason",
    ["namespace", "unit_set", "reason"],
)
UNREACHABLE_UNITS = Gauge(
    "pdunit_scaler_unreachable_units",
    "Ready, non-draining units whose /v1/load did not answer at the last scrape (excluded)",
    ["namespace", "unit_set"],
)
COUNTED_UNITS = Gauge(
    "pdunit_scaler_counted_units",
    "Units whose decode in-flight made up the last metric",
    ["namespace", "unit_set"],
)
DECODE_IN_FLIGHT = Gauge(
    "pdunit_scaler_decode_in_flight",
    "Decode streams in flight over the counted units at the last scrape (metric: inFlight's value)",
    ["namespace", "unit_set"],
)
HEADROOM_STREAMS = Gauge(
    "pdunit_scaler_headroom_streams",
    "Rate-floor headroom summed over the counted units at the last scrape (-1: a counted "
    "unit has no rate-floor admission)",
    ["namespace", "unit_set"],
)
DESIRED_UNITS = Gauge(
    "pdunit_scaler_desired_units",
    "Units the set needs to keep targetHeadroomPerUnit each (metric: headroom), last served",
    ["namespace", "unit_set"],
)


class ScalerError(Exception):
    """An error that reaches KEDA as a gRPC status with this message."""

    code = grpc.StatusCode.INTERNAL


class MetadataError(ScalerError):
    """A ScaledObject's scalerMetadata is missing a key or has a bad value."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"scalerMetadata.{key} {problem}")
        self.key = key


class UnitSetNotFound(ScalerError):
    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, namespace: str, unit_set: str) -> None:
        super().__init__(
            f"PDUnitSet {namespace}/{unit_set} not found: check scalerMetadata.{KEY_UNIT_SET}"
            f" and scalerMetadata.{KEY_NAMESPACE} (default: the ScaledObject's namespace)"
        )


class NoUnitAnswered(ScalerError):
    code = grpc.StatusCode.UNAVAILABLE


class UnitSourceFailed(ScalerError):
    code = grpc.StatusCode.UNAVAILABLE


class HeadroomUnknown(ScalerError):
    """metric: headroom over units that cannot give it (admission off, or a target
    beyond what a unit holds at all)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


@dataclass(frozen=True)
class UnitEndpoint:
    """What the scaler needs to know about one PDUnit (from its status)."""

    name: str
    pod_ip: str
    lb_port: int
    ready: bool
    draining: bool

    @classmethod
    def from_mapping(cls, unit: Mapping[str, Any]) -> UnitEndpoint:
        """`{name, podIP, lbPort, ready, draining}`; podIP/lbPort may be absent before the pod runs."""
        return cls(
            name=str(unit["name"]),
            pod_ip=str(unit.get("podIP") or ""),
            lb_port=int(unit.get("lbPort") or 0),
            ready=bool(unit.get("ready", False)),
            draining=bool(unit.get("draining", False)),
        )


UnitLike = UnitEndpoint | Mapping[str, Any]
# async (namespace, unit set name) -> the set's units; raises UnitSetNotFound.
UnitSource = Callable[[str, str], Awaitable[Sequence[UnitLike]]]


_REQUIRED_BECAUSE = {
    KEY_TARGET: "the decode streams one unit should carry (e.g. 50-60% of its measured capacity)",
    KEY_TARGET_HEADROOM: "the streams of rate-floor headroom each unit should keep free "
    "(what one burst adds to a unit)",
}


def _positive_number(metadata: Mapping[str, str], key: str) -> float:
    raw = metadata.get(key, "").strip()
    if not raw:
        raise MetadataError(key, f"is required with {KEY_METRIC}: "
                            f"{metadata.get(KEY_METRIC, '').strip() or METRIC_IN_FLIGHT}: "
                            f"{_REQUIRED_BECAUSE[key]}")
    try:
        value = float(raw)
    except ValueError:
        raise MetadataError(key, f"must be a positive number, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise MetadataError(key, f"must be a positive number, got {raw!r}")
    return value


@dataclass(frozen=True)
class Trigger:
    """One ScaledObject trigger's scalerMetadata, validated."""

    namespace: str
    unit_set: str
    target_in_flight_per_unit: float  # metric inFlight (0 with headroom)
    activation_in_flight: float
    scrape_timeout_s: float
    metric: str = METRIC_IN_FLIGHT
    target_headroom_per_unit: float = 0.0  # metric headroom (0 with inFlight)

    @classmethod
    def from_ref(cls, ref: pb.ScaledObjectRef) -> Trigger:
        md = dict(ref.scalerMetadata)
        unit_set = md.get(KEY_UNIT_SET, "").strip()
        if not unit_set:
            raise MetadataError(KEY_UNIT_SET, "is required: the name of the PDUnitSet to scale")
        namespace = md.get(KEY_NAMESPACE, "").strip() or ref.namespace
        if not namespace:
            raise MetadataError(
                KEY_NAMESPACE, "is required when the ScaledObject's namespace is empty"
            )
        metric = md.get(KEY_METRIC, "").strip() or METRIC_IN_FLIGHT
        if metric not in (METRIC_IN_FLIGHT, METRIC_HEADROOM):
            raise MetadataError(
                KEY_METRIC, f"must be {METRIC_IN_FLIGHT!r} or {METRIC_HEADROOM!r}, got {metric!r}"
            )
        target = headroom = 0.0
        if metric == METRIC_IN_FLIGHT:
            target = _positive_number(md, KEY_TARGET)
        else:
            headroom = _positive_number(md, KEY_TARGET_HEADROOM)
        activation = 0.0
        if md.get(KEY_ACTIVATION, "").strip():
            raw = md[KEY_ACTIVATION].strip()
            try:
                activation = float(raw)
            except ValueError:
                raise MetadataError(KEY_ACTIVATION, f"must be a number >= 0, got {raw!r}") from None
            if not math.isfinite(activation) or activation < 0:
                raise MetadataError(KEY_ACTIVATION, f"must be a number >= 0, got {raw!r}")
        timeout_ms = DEFAULT_SCRAPE_TIMEOUT_MS
        if md.get(KEY_TIMEOUT, "").strip():
            raw = md[KEY_TIMEOUT].strip()
            try:
                timeout_ms = int(raw)
            except ValueError:
                raise MetadataError(
                    KEY_TIMEOUT, f"must be an integer number of ms, got {raw!r}"
                ) from None
            if not 1 <= timeout_ms <= MAX_SCRAPE_TIMEOUT_MS:
                raise MetadataError(
                    KEY_TIMEOUT, f"must be in 1..{MAX_SCRAPE_TIMEOUT_MS} ms, got {raw!r}"
                )
        return cls(namespace, unit_set, target, activation, timeout_ms / 1000.0, metric, headroom)

    @property
    def metric_name(self) -> str:
        # KEDA prefixes its own "s<index>-"; the name only has to be stable and readable.
        what = "decode-in-flight" if self.metric == METRIC_IN_FLIGHT else "headroom-units"
        return f"pdunit-{what}-{self.namespace}-{self.unit_set}"

    @property
    def target(self) -> float:
        """The per-replica target KEDA divides the metric by (AverageValue): inFlight's
        `decode_in_flight` sum over `targetInFlightPerUnit`; headroom's `desired_units`
        over 1, so that KEDA's replicas = ceil(value / target) is that count."""
        return self.target_in_flight_per_unit if self.metric == METRIC_IN_FLIGHT else 1.0


@dataclass(frozen=True)
class UnitLoad:
    """What one unit's LB said: D's streams (decoding; reserved, about to) and its headroom."""

    decode_in_flight: int
    decode_reserved: int
    headroom_streams: int  # -1: no rate-floor admission (or an LB without the field)

    @property
    def held(self) -> int:
        """The streams D's headroom is counted beside (decoding, waiting, reserved)."""
        return self.decode_in_flight + self.decode_reserved


@dataclass
class SetLoad:
    """One scrape of a set: the metric and how each unit was treated."""

    decode_in_flight: int
    counted: dict[str, UnitLoad] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)  # unit -> why (not ready, draining)
    unreachable: dict[str, str] = field(default_factory=dict)  # unit -> why the scrape failed

    @property
    def headroom_streams(self) -> int:
        """Summed over the counted units; -1 when any of them has no admission."""
        rooms = [u.headroom_streams for u in self.counted.values()]
        return -1 if any(r < 0 for r in rooms) else sum(rooms)


def desired_units(load: SetLoad, target_headroom_per_unit: float) -> float:
    """Units needed so that each keeps `target_headroom_per_unit` streams of headroom.

    Counted unit i holds f_i streams in D (decoding, waiting, reserved: `UnitLoad.held`,
    the streams D's headroom is counted beside) and would admit h_i more at its rate
    floor, so it carries c_i = f_i + h_i at the floor. With the load F = sum f_i spread
    evenly over N units of the mean capacity c = sum c_i / n, each keeps c - F / N
    free; that is at least H (the target) from

        N = F / (c - H)

    (N = 0 when F = 0: KEDA's minReplicaCount and activation decide). Served as the
    metric with a target of 1, KEDA's AverageValue gives replicas = ceil(N). Check: n
    units each with exactly H free (h_i = H) give N = n.

    Raises HeadroomUnknown when a counted unit has no admission (headroom -1) or when c
    is not above H (no number of units keeps that much free).
    """
    off = sorted(n for n, u in load.counted.items() if u.headroom_streams < 0)
    if off:
        raise HeadroomUnknown(
            f"{KEY_METRIC}: {METRIC_HEADROOM} needs every unit's headroom_streams, but "
            f"{', '.join(off)} report none (rate-floor admission off): start their D with "
            f"--rate-floor, or use {KEY_METRIC}: {METRIC_IN_FLIGHT}"
        )
    in_flight = sum(u.held for u in load.counted.values())
    if in_flight == 0:
        return 0.0
    n = len(load.counted)
    capacity = sum(u.held + u.headroom_streams for u in load.counted.values()) / n
    if capacity <= target_headroom_per_unit:
        raise HeadroomUnknown(
            f"scalerMetadata.{KEY_TARGET_HEADROOM} ({target_headroom_per_unit:g}) is not below "
            f"what one unit holds at its rate floor now ({capacity:.1f} streams, mean over {n} "
            f"units): no number of units keeps that much free; lower it"
        )
    return in_flight / (capacity - target_headroom_per_unit)


class LoadScraper:
    """Scrapes the units of a set concurrently; caches each set's result for `cache_ttl_s`.

    Callers that arrive while a scrape of the same set runs share it (KEDA asks IsActive
    and GetMetrics at the same moment; neither may double the load on the units).
    """

    def __init__(
        self, unit_source: UnitSource, logger: logging.Logger, cache_ttl_s: float = 1.0
    ) -> None:
        self._unit_source = unit_source
        self._logger = logger
        self._cache_ttl_s = cache_ttl_s
        self._cache: dict[tuple[str, str, float], tuple[float, SetLoad | ScalerError]] = {}
        self._inflight: dict[tuple[str, str, float], asyncio.Task[SetLoad]] = {}
        self._last_warning: dict[tuple[str, str], tuple[frozenset[str], float]] = {}

    async def load(self, trigger: Trigger) -> SetLoad:
        """The set's load, at most `cache_ttl_s` old; a failed scrape is cached as long
        (a set whose units do not answer is not re-scraped on every poll either)."""
        key = (trigger.namespace, trigger.unit_set, trigger.scrape_timeout_s)
        cached = self._cache.get(key)
        if cached is not None and time.monotonic() - cached[0] < self._cache_ttl_s:
            return _result(cached[1])
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._scrape(trigger))
            self._inflight[key] = task
            task.add_done_callback(lambda t: self._finish(key, t))
        # shield: one caller giving up (KEDA's deadline) must not cancel the others' scrape.
        return await asyncio.shield(task)

    def _finish(self, key: tuple[str, str, float], task: asyncio.Task[SetLoad]) -> None:
        self._inflight.pop(key, None)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            self._cache[key] = (time.monotonic(), task.result())
        elif isinstance(exc, ScalerError):
            self._cache[key] = (time.monotonic(), exc)

    async def _list_units(self, trigger: Trigger) -> list[UnitEndpoint]:
        try:
            units = await self._unit_source(trigger.namespace, trigger.unit_set)
        except ScalerError:
            raise
        except Exception as exc:
            raise UnitSourceFailed(
                f"listing the units of PDUnitSet {trigger.namespace}/{trigger.unit_set} failed: {exc}"
            ) from exc
        return [u if isinstance(u, UnitEndpoint) else UnitEndpoint.from_mapping(u) for u in units]

    async def _scrape(self, trigger: Trigger) -> SetLoad:
        start = time.perf_counter()
        units = await self._list_units(trigger)
        load = SetLoad(decode_in_flight=0)
        candidates = []
        for unit in units:
            if not unit.ready:
                load.excluded[unit.name] = "not ready"
            elif unit.draining:
                load.excluded[unit.name] = "draining"
            elif not unit.pod_ip or not unit.lb_port:
                load.unreachable[unit.name] = "no podIP/lbPort in its status"
            else:
                candidates.append(unit)
        if candidates:
            # One client per scrape (at most one a cache period per set): its lifetime is
            # this function's, so nothing is left open when the gRPC server stops. No
            # connection limit, none kept open; plain HTTP to pod IPs, so no CA bundle to
            # load (verify=False: loading it costs tens of ms per client).
            async with httpx.AsyncClient(
                timeout=httpx.Timeout(trigger.scrape_timeout_s),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
                trust_env=False,
                verify=False,
            ) as client:
                answers = await asyncio.gather(
                    *(self._scrape_unit(client, u, trigger.scrape_timeout_s) for u in candidates)
                )
            for unit, (answer, problem) in zip(candidates, answers, strict=True):
                if problem is not None and answer is None:
                    load.unreachable[unit.name] = problem
                elif problem is not None:
                    load.excluded[unit.name] = problem
                else:
                    assert answer is not None
                    load.counted[unit.name] = answer
                    load.decode_in_flight += answer.decode_in_flight
        self._report(trigger, load, time.perf_counter() - start)
        if load.unreachable and not load.counted:
            raise NoUnitAnswered(
                f"no unit of PDUnitSet {trigger.namespace}/{trigger.unit_set} answered /v1/load: "
                + "; ".join(f"{n}: {why}" for n, why in sorted(load.unreachable.items()))
                + " (refusing to report zero load for units that did not answer)"
            )
        return load

    async def _scrape_unit(
        self, client: httpx.AsyncClient, unit: UnitEndpoint, timeout_s: float
    ) -> tuple[UnitLoad | None, str | None]:
        """(load, None) when counted; (None, why) when unreachable; (load, why) when the LB
        answered but says it is draining or not ready (excluded, not unreachable).

        `timeout_s` bounds the whole call (httpx's timeouts are per phase)."""
        url = f"http://{_host(unit.pod_ip)}:{unit.lb_port}/v1/load"
        try:
            async with asyncio.timeout(timeout_s):
                resp = await client.get(url)
        except (TimeoutError, httpx.TimeoutException):
            return None, f"GET {url} timed out"
        except (httpx.HTTPError, OSError) as exc:
            return None, f"GET {url} failed: {exc.__class__.__name__}: {exc}"
        if resp.status_code != 200:
            return None, f"GET {url} answered HTTP {resp.status_code}"
        try:
            doc = read_load_document(resp.content)
        except LoadDocumentError as exc:
            return None, f"GET {url} returned {exc}"
        answer = UnitLoad(doc.decode_in_flight, doc.decode_reserved, doc.headroom_streams)
        if doc.draining:
            return answer, "draining (its LB says so)"
        if not doc.ready:
            return answer, "not ready (its LB says so)"
        return answer, None

    def _report(self, trigger: Trigger, load: SetLoad, seconds: float) -> None:
        labels = (trigger.namespace, trigger.unit_set)
        SCRAPE_SECONDS.labels(*labels).observe(seconds)
        UNREACHABLE_UNITS.labels(*labels).set(len(load.unreachable))
        COUNTED_UNITS.labels(*labels).set(len(load.counted))
        if load.counted or not load.unreachable:
            DECODE_IN_FLIGHT.labels(*labels).set(load.decode_in_flight)
            HEADROOM_STREAMS.labels(*labels).set(load.headroom_streams)
        for why in load.unreachable.values():
            UNIT_SCRAPE_FAILURES.labels(*labels, _reason_class(why)).inc()
        names = frozenset(load.unreachable)
        last = self._last_warning.get(labels)
        now = time.monotonic()
        if names and (last is None or last[0] != names or now - last[1] > UNREACHABLE_LOG_REPEAT_S):
            self._logger.warning(
                "units excluded from the scaling metric: their /v1/load did not answer",
                extra={
                    "namespace": trigger.namespace,
                    "unit_set": trigger.unit_set,
                    "unreachable": dict(sorted(load.unreachable.items())),
                    "counted_units": len(load.counted),
                    "decode_in_flight_counted": load.decode_in_flight,
                },
            )
            self._last_warning[labels] = (names, now)
        elif not names and last is not None and last[0]:
            self._logger.info(
                "every unit answers /v1/load again",
                extra={"namespace": trigger.namespace, "unit_set": trigger.unit_set},
            )
            self._last_warning[labels] = (names, now)


def _result(value: SetLoad | ScalerError) -> SetLoad:
    if isinstance(value, ScalerError):
        raise value
    return value


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _reason_class(why: str) -> str:
    for needle, reason in (
        ("timed out", "timeout"),
        ("HTTP", "http_status"),
        ("failed", "connect"),
        ("no podIP", "no_address"),
    ):
        if needle in why:
            return reason
    return "bad_body"


class ExternalScalerService(pb_grpc.ExternalScalerServicer):
    """KEDA's four RPCs over a LoadScraper."""

    def __init__(
        self, scraper: LoadScraper, logger: logging.Logger, stream_period_s: float = 2.0
    ) -> None:
        self._scraper = scraper
        self._logger = logger
        self._stream_period_s = stream_period_s

    async def _answer(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        ref: pb.ScaledObjectRef,
        compute: Callable[[], Awaitable[T]],
    ) -> T:
        """Run one unary RPC: count it, time it, and turn errors into gRPC statuses.

        Counted before the status goes out, so a client that sees the answer also sees it
        in /metrics."""
        start = time.perf_counter()

        def done(code: grpc.StatusCode) -> None:
            REQUESTS.labels(method, code.name).inc()
            REQUEST_SECONDS.labels(method).observe(time.perf_counter() - start)

        try:
            result = await compute()
        except ScalerError as exc:
            done(exc.code)
            await self._abort(method, context, ref, exc.code, str(exc))
            raise  # not reached: abort raises
        except asyncio.CancelledError:
            done(grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:
            done(grpc.StatusCode.INTERNAL)
            self._logger.exception("scaler request crashed", extra={"method": method})
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"internal error in {method}: {exc.__class__.__name__}: {exc}",
            )
            raise  # not reached: abort raises
        done(grpc.StatusCode.OK)
        return result

    async def _abort(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        ref: pb.ScaledObjectRef,
        code: grpc.StatusCode,
        message: str,
    ) -> None:
        self._logger.warning(
            "scaler request failed",
            extra={
                "method": method,
                "code": code.name,
                "error": message,
                "scaled_object": f"{ref.namespace}/{ref.name}",
            },
        )
        await context.abort(code, message)

    async def IsActive(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> pb.IsActiveResponse:  # noqa: N802
        async def compute() -> pb.IsActiveResponse:
            trigger = Trigger.from_ref(request)
            load = await self._scraper.load(trigger)
            return pb.IsActiveResponse(result=load.decode_in_flight > trigger.activation_in_flight)

        return await self._answer("IsActive", context, request, compute)

    async def GetMetricSpec(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> pb.GetMetricSpecResponse:  # noqa: N802
        async def compute() -> pb.GetMetricSpecResponse:
            trigger = Trigger.from_ref(request)
            target = trigger.target
            return pb.GetMetricSpecResponse(
                metricSpecs=[
                    pb.MetricSpec(
                        metricName=trigger.metric_name,
                        targetSize=max(1, round(target)),
                        targetSizeFloat=target,
                    )
                ]
            )

        return await self._answer("GetMetricSpec", context, request, compute)

    async def GetMetrics(
        self, request: pb.GetMetricsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetMetricsResponse:  # noqa: N802
        async def compute() -> pb.GetMetricsResponse:
            trigger = Trigger.from_ref(request.scaledObjectRef)
            load = await self._scraper.load(trigger)
            if trigger.metric == METRIC_HEADROOM:
                value = desired_units(load, trigger.target_headroom_per_unit)
                DESIRED_UNITS.labels(trigger.namespace, trigger.unit_set).set(value)
            else:
                value = float(load.decode_in_flight)
            return pb.GetMetricsResponse(
                metricValues=[
                    pb.MetricValue(
                        metricName=request.metricName or trigger.metric_name,
                        # the int field rounds up: a client reading only it still gets
                        # enough units; KEDA reads the float
                        metricValue=math.ceil(value),
                        metricValueFloat=value,
                    )
                ]
            )

        return await self._answer("GetMetrics", context, request.scaledObjectRef, compute)

    async def StreamIsActive(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.IsActiveResponse]:  # noqa: N802
        """Pushes the first value at once, then only changes, re-checking every period."""
        try:
            trigger = Trigger.from_ref(request)
        except MetadataError as exc:
            REQUESTS.labels("StreamIsActive", exc.code.name).inc()
            await self._abort("StreamIsActive", context, request, exc.code, str(exc))
            return
        REQUESTS.labels("StreamIsActive", grpc.StatusCode.OK.name).inc()
        last: bool | None = None
        while True:
            try:
                load = await self._scraper.load(trigger)
                active: bool | None = load.decode_in_flight > trigger.activation_in_flight
            except ScalerError as exc:
                # Keep the stream and the last pushed value: KEDA's polling path (IsActive,
                # GetMetrics) reports the error; pushing "inactive" here would be a guess.
                self._logger.warning(
                    "StreamIsActive: no fresh value, keeping the last one",
                    extra={"error": str(exc), "last": last},
                )
                active = last
            if active is not None and active != last:
                yield pb.IsActiveResponse(result=active)
                last = active
            await asyncio.sleep(self._stream_period_s)


def units_from_pdunit_list(pdunits: Mapping[str, Any]) -> list[UnitEndpoint]:
    """A PDUnitList (as the API returns it) -> endpoints, from each unit's status.

    Draining counts when either the spec asks for it (the operator decided) or the status
    reports it (the unit acted): a unit on its way out carries no new streams.
    """
    units = []
    for item in pdunits.get("items") or []:
        meta = item.get("metadata") or {}
        spec = item.get("spec") or {}
        status = item.get("status") or {}
        if meta.get("deletionTimestamp"):
            draining = True
        else:
            draining = bool(spec.get("draining")) or bool(status.get("draining"))
        units.append(
            UnitEndpoint(
                name=str(meta.get("name", "?")),
                pod_ip=str(status.get("podIP") or ""),
                lb_port=int(status.get("lbPort") or 0),
                ready=bool(status.get("ready", False)),
                draining=draining,
            )
        )
    return units


class KubernetesUnitSource:
    """Default unit source: the PDUnitSet must exist; its PDUnits are selected by label.

    Credentials: the pod's service account in a cluster, else `kubeconfig` (default:
    $KUBECONFIG or ~/.kube/config). It keeps its own client configuration, so it never
    changes the process-wide default another component (kopf, the operator) relies on.
    """

    def __init__(self, kubeconfig: str | None = None) -> None:
        self._kubeconfig = kubeconfig
        self._configuration: Any = None

    async def _client_configuration(self) -> Any:
        from kubernetes_asyncio import client, config

        if self._configuration is None:
            configuration = client.Configuration()
            if self._kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=configuration)
            else:
                await config.load_kube_config(
                    config_file=self._kubeconfig, client_configuration=configuration
                )
            self._configuration = configuration
        return self._configuration

    async def __call__(self, namespace: str, unit_set: str) -> list[UnitEndpoint]:
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        configuration = await self._client_configuration()
        async with client.ApiClient(configuration) as api:
            custom = client.CustomObjectsApi(api)
            try:
                await custom.get_namespaced_custom_object(
                    GROUP, VERSION, namespace, "pdunitsets", unit_set
                )
            except ApiException as exc:
                if exc.status == 404:
                    raise UnitSetNotFound(namespace, unit_set) from None
                raise
            listed = await custom.list_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                "pdunits",
                label_selector=f"{SET_LABEL}={unit_set}",
            )
        return units_from_pdunit_list(listed)


class FileUnitSource:
    """Units from a JSON file `{"<namespace>/<set>": [{name, podIP, lbPort, ready, draining}]}`,
    re-read on every scrape: the standalone scaler's source for tests and debugging."""

    def __init__(self, path: Path) -> None:
        self._path = path

    async def __call__(self, namespace: str, unit_set: str) -> list[UnitLike]:
        data = json.loads(self._path.read_text())
        key = f"{namespace}/{unit_set}"
        if key not in data:
            raise UnitSetNotFound(namespace, unit_set)
        return list(data[key])


async def start_scaler(
    port: int,
    logger: logging.Logger,
    unit_source: UnitSource | None = None,
    *,
    host: str = "0.0.0.0",
    cache_ttl_s: float = 1.0,
    stream_period_s: float = 2.0,
) -> tuple[grpc.aio.Server, int]:
    """Start the scaler's gRPC server; returns it and the bound port (port 0 = any free)."""
    source: UnitSource = unit_source if unit_source is not None else KubernetesUnitSource()
    scraper = LoadScraper(source, logger, cache_ttl_s=cache_ttl_s)
    server = grpc.aio.server()
    pb_grpc.add_ExternalScalerServicer_to_server(
        ExternalScalerService(scraper, logger, stream_period_s=stream_period_s), server
    )
    bound = server.add_insecure_port(f"{_host(host)}:{port}")
    if bound == 0:
        raise OSError(f"KEDA scaler: cannot listen on {host}:{port} (in use? set --port)")
    await server.start()
    logger.info(
        "KEDA external scaler listening",
        extra={
            "port": bound,
            "host": host,
            "cache_ttl_s": cache_ttl_s,
            "unit_source": type(source).__name__,
        },
    )
    return server, bound


async def serve_scaler(
    port: int, logger: logging.Logger, unit_source: UnitSource | None = None
) -> grpc.aio.Server:
    """The operator's entry: KEDA's external scaler on `port` (9090 in the chart).

    The caller owns the returned server: `await server.stop(grace)` on shutdown.
    """
    server, _ = await start_scaler(port, logger, unit_source)
    return server


class ScalerConfig(BaseModel):
    """Standalone KEDA external scaler (the operator runs the same server in-process)."""

    port: int = Field(9090, ge=0, le=65535, description="gRPC port KEDA connects to")
    host: str = Field("0.0.0.0", description="address to listen on")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port (0 = off)")
    cache_ttl_s: float = Field(
        1.0, ge=0, le=60, description="how long one scrape of a set is reused"
    )
    stream_period_s: float = Field(2.0, gt=0, le=300, description="StreamIsActive re-check period")
    units_file: str = Field(
        "", description="JSON file of units per '<namespace>/<set>' instead of the Kubernetes API"
    )
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$", description="log level")


async def _run(cfg: ScalerConfig, logger: logging.Logger) -> int:
    from pdunit.engine.observability import shutdown_event

    stop = shutdown_event(logger)
    source: UnitSource | None = FileUnitSource(Path(cfg.units_file)) if cfg.units_file else None
    server, _ = await start_scaler(
        cfg.port,
        logger,
        source,
        host=cfg.host,
        cache_ttl_s=cfg.cache_ttl_s,
        stream_period_s=cfg.stream_period_s,
    )
    await stop.wait()
    # StreamIsActive streams never end by themselves; a short grace lets unary calls finish.
    await server.stop(grace=2.0)
    logger.info("KEDA external scaler stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    from pdunit.engine.observability import log_config, serve_metrics, setup_logging
    from pdunit.engine.settings import parse_config

    cfg = parse_config(ScalerConfig, argv, prog="python -m pdunit.operator.scaler")
    logger = setup_logging("scaler", cfg.log_level)
    log_config(logger, cfg)
    serve_metrics(cfg.metrics_port)
    return asyncio.run(_run(cfg, logger))


if __name__ == "__main__":
    sys.exit(main())
