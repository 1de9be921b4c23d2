"""KEDA external scaler: a real grpcio client speaking KEDA's proto against the real
server, which scrapes fake unit LBs over loopback HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from prometheus_client import REGISTRY

from pdunit.bench.scaler_bench import FakeLBFleet, bench_scaler
from pdunit.engine.ports import free_port
from pdunit.operator import scaler
from pdunit.operator.proto import externalscaler_pb2 as pb
from pdunit.operator.proto import externalscaler_pb2_grpc as pb_grpc

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
NS = "tts"
SET = "voices"


class LoopThread:
    """An asyncio loop in a thread: the scaler server and the fake LBs live there while
    the test thread plays KEDA with a plain (sync) grpcio client."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 20.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class Harness:
    def __init__(self, loop: LoopThread, fleet: FakeLBFleet) -> None:
        self.loop = loop
        self.fleet = fleet
        # What the fake unit source returns per (namespace, set); units as PDUnit status has them.
        self.sets: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.source_calls = 0
        self._servers: list[Any] = []
        self._channels: list[grpc.Channel] = []

    async def source(self, namespace: str, unit_set: str) -> list[dict[str, Any]]:
        self.source_calls += 1
        if (namespace, unit_set) not in self.sets:
            raise scaler.UnitSetNotFound(namespace, unit_set)
        return self.sets[(namespace, unit_set)]

    def scaler(
        self, cache_ttl_s: float = 0.0, stream_period_s: float = 0.05
    ) -> pb_grpc.ExternalScalerStub:
        server, port = self.loop.run(
            scaler.start_scaler(
                0,
                logging.getLogger("pdunit.scaler.test"),
                self.source,
                host="127.0.0.1",
                cache_ttl_s=cache_ttl_s,
                stream_period_s=stream_period_s,
            )
        )
        self._servers.append(server)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self._channels.append(channel)
        return pb_grpc.ExternalScalerStub(channel)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        for server in self._servers:
            self.loop.run(server.stop(grace=None))


@pytest.fixture
def harness() -> Iterator[Harness]:
    loop = LoopThread()
    fleet = loop.run(FakeLBFleet().start([f"u{i}" for i in range(6)]))
    h = Harness(loop, fleet)
    try:
        yield h
    finally:
        h.close()
        loop.run(fleet.stop())
        loop.close()


def ref(**metadata: str) -> pb.ScaledObjectRef:
    md = {"unitSet": SET, "targetInFlightPerUnit": "8"}
    md.update(metadata)
    return pb.ScaledObjectRef(
        name="voices-scaler",
        namespace=NS,
        scalerMetadata={k: v for k, v in md.items() if v is not None},
    )


def metric(stub: pb_grpc.ExternalScalerStub, r: pb.ScaledObjectRef | None = None) -> int:
    resp = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=r or ref(), metricName="s0-m"))
    assert len(resp.metricValues) == 1
    value = resp.metricValues[0]
    assert value.metricName == "s0-m"
    assert value.metricValueFloat == float(value.metricValue)
    return value.metricValue


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


# --- the contract with KEDA ------------------------------------------------------------

KEDA_FIELDS = {  # kedacore/keda pkg/scalers/externalscaler/externalscaler.proto
    "ScaledObjectRef": {
        "name": (1, "string"),
        "namespace": (2, "string"),
        "scalerMetadata": (3, "map"),
    },
    "IsActiveResponse": {"result": (1, "bool")},
    "GetMetricSpecResponse": {"metricSpecs": (1, "MetricSpec")},
    "MetricSpec": {
        "metricName": (1, "string"),
        "targetSize": (2, "int64"),
        "targetSizeFloat": (3, "double"),
    },
    "GetMetricsRequest": {"scaledObjectRef": (1, "ScaledObjectRef"), "metricName": (2, "string")},
    "GetMetricsResponse": {"metricValues": (1, "MetricValue")},
    "MetricValue": {
        "metricName": (1, "string"),
        "metricValue": (2, "int64"),
        "metricValueFloat": (3, "double"),
    },
}


def _type_name(fd: Any) -> str:
    if fd.message_type is not None:
        return "map" if fd.message_type.GetOptions().map_entry else fd.message_type.name
    return {
        fd.TYPE_STRING: "string",
        fd.TYPE_BOOL: "bool",
        fd.TYPE_INT64: "int64",
        fd.TYPE_DOUBLE: "double",
    }.get(fd.type, str(fd.type))


def test_proto_matches_kedas_external_scaler_contract() -> None:
    file = pb.DESCRIPTOR
    assert file.package == "externalscaler"
    for message, fields in KEDA_FIELDS.items():
        desc = file.message_types_by_name[message]
        got = {f.name: (f.number, _type_name(f)) for f in desc.fields}
        assert got == fields, message
    service = file.services_by_name["ExternalScaler"]
    methods = {
        m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods
    }
    assert methods == {
        "IsActive": ("ScaledObjectRef", "IsActiveResponse", False),
        "StreamIsActive": ("ScaledObjectRef", "IsActiveResponse", True),
        "GetMetricSpec": ("ScaledObjectRef", "GetMetricSpecResponse", False),
        "GetMetrics": ("GetMetricsRequest", "GetMetricsResponse", False),
    }


def test_generated_proto_modules_are_current(tmp_path: Path) -> None:
    from pdunit.engine.proto.build import generate

    proto_dir = REPO / "operator" / "proto"
    shutil.copy(proto_dir / "externalscaler.proto", tmp_path)
    for fresh in generate(tmp_path, tmp_path):
        committed = proto_dir / fresh.name
        assert committed.read_text() == fresh.read_text(), (
            f"{committed} is stale: run python -m pdunit.operator.proto.build"
        )


# --- the metric --------------------------------------------------------------------------


def test_metric_sums_decode_in_flight_of_ready_non_draining_units_only(harness: Harness) -> None:
    u = harness.fleet.units
    for name, n in zip(u, (3, 4, 5, 7, 11, 13), strict=True):
        u[name].decode_in_flight = n
    u["u4"].draining = True  # the PDUnit status lags; the LB already drains
    u["u5"].ready = False  # the LB says not ready
    harness.sets[(NS, SET)] = [
        u["u0"].endpoint(),
        u["u1"].endpoint(),
        u["u2"].endpoint(ready=False),
        u["u3"].endpoint(draining=True),
        u["u4"].endpoint(),
        u["u5"].endpoint(),
    ]
    stub = harness.scaler()
    assert metric(stub) == 3 + 4
    # Units the metric leaves out are not even asked (their status says why).
    assert (u["u2"].hits, u["u3"].hits) == (0, 0)
    assert sample("pdunit_scaler_counted_units", namespace=NS, unit_set=SET) == 2
    assert sample("pdunit_scaler_unreachable_units", namespace=NS, unit_set=SET) == 0


def test_metric_spec_names_the_metric_and_the_target_per_unit(harness: Harness) -> None:
    stub = harness.scaler()
    spec = stub.GetMetricSpec(ref(targetInFlightPerUnit="24.5"))
    assert len(spec.metricSpecs) == 1
    assert spec.metricSpecs[0].targetSizeFloat == 24.5
    assert spec.metricSpecs[0].targetSize == 24
    assert SET in spec.metricSpecs[0].metricName and NS in spec.metricSpecs[0].metricName


def test_namespace_metadata_overrides_the_scaled_objects_namespace(harness: Harness) -> None:
    harness.fleet.units["u0"].decode_in_flight = 9
    harness.sets[("other", SET)] = [harness.fleet.units["u0"].endpoint()]
    stub = harness.scaler()
    assert metric(stub, ref(namespace="other")) == 9


def test_scrapes_all_units_concurrently(harness: Harness) -> None:
    u = harness.fleet.units
    for name in ("u0", "u1", "u2", "u3"):
        u[name].behavior = "hang"
    u["u4"].decode_in_flight = 2
    harness.sets[(NS, SET)] = [u[n].endpoint() for n in ("u0", "u1", "u2", "u3", "u4")]
    stub = harness.scaler()
    assert metric(stub, ref(scrapeTimeoutMs="400")) == 2
    # All four slow units were being asked at the same moment: one timeout, not four
    # (counted by the fleet, not timed: a loaded CI machine stretches any wall time).
    assert harness.fleet.peak_concurrent >= 4


def test_unreachable_units_are_excluded_logged_and_counted(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    u = harness.fleet.units
    u["u0"].decode_in_flight = 5
    u["u1"].behavior = "hang"
    u["u2"].behavior = "http_500"
    u["u3"].behavior = "garbage"
    closed = {
        "name": "gone",
        "podIP": "127.0.0.1",
        "lbPort": free_port(),  # nothing listens there
        "ready": True,
        "draining": False,
    }
    no_ip = {"name": "unscheduled", "ready": True, "draining": False}
    harness.sets[(NS, SET)] = [u[n].endpoint() for n in ("u0", "u1", "u2", "u3")] + [closed, no_ip]
    before = (
        sample(
            "pdunit_scaler_unit_scrape_failures_total", namespace=NS, unit_set=SET, reason="timeout"
        )
        or 0
    )
    stub = harness.scaler()
    with caplog.at_level(logging.WARNING, logger="pdunit.scaler.test"):
        assert metric(stub, ref(scrapeTimeoutMs="300")) == 5
    assert sample("pdunit_scaler_unreachable_units", namespace=NS, unit_set=SET) == 5
    assert sample("pdunit_scaler_counted_units", namespace=NS, unit_set=SET) == 1
    after = sample(
        "pdunit_scaler_unit_scrape_failures_total", namespace=NS, unit_set=SET, reason="timeout"
    )
    assert after == before + 1
    warnings = [r for r in caplog.records if "excluded from the scaling metric" in r.getMessage()]
    assert len(warnings) == 1
    unreachable = warnings[0].unreachable  # type: ignore[attr-defined]
    assert set(unreachable) == {"u1", "u2", "u3", "gone", "unscheduled"}
    assert "timed out" in unreachable["u1"] and "HTTP 500" in unreachable["u2"]


def test_no_unit_answering_is_an_error_not_zero_load(harness: Harness) -> None:
    u = harness.fleet.units
    u["u0"].behavior = "http_500"
    u["u1"].behavior = "garbage"
    harness.sets[(NS, SET)] = [u["u0"].endpoint(), u["u1"].endpoint()]
    stub = harness.scaler()
    for call in (lambda: metric(stub), lambda: stub.IsActive(ref())):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "u0" in err.value.details() and "u1" in err.value.details()


def test_a_unit_whose_load_document_lacks_a_field_or_has_a_wrong_type_is_excluded_naming_it(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    u = harness.fleet.units
    u["u0"].decode_in_flight = 4
    u["u1"].decode_in_flight = None  # type: ignore[assignment]  # the field left out
    u["u2"].headroom_streams = "lots"  # type: ignore[assignment]
    harness.sets[(NS, SET)] = [u[n].endpoint() for n in ("u0", "u1", "u2")]
    labels = {"namespace": NS, "unit_set": SET, "reason": "bad_body"}
    before = sample("pdunit_scaler_unit_scrape_failures_total", **labels) or 0
    stub = harness.scaler()
    with caplog.at_level(logging.WARNING, logger="pdunit.scaler.test"):
        assert metric(stub) == 4
    assert sample("pdunit_scaler_unit_scrape_failures_total", **labels) == before + 2
    warning = next(r for r in caplog.records if "excluded from the scaling metric" in r.getMessage())
    unreachable = warning.unreachable  # type: ignore[attr-defined]
    assert set(unreachable) == {"u1", "u2"}
    assert "field decode_in_flight is missing" in unreachable["u1"]
    assert "field headroom_streams is 'lots'" in unreachable["u2"]


def test_a_set_with_no_ready_unit_has_zero_load_and_is_inactive(harness: Harness) -> None:
    harness.sets[(NS, SET)] = [harness.fleet.units["u0"].endpoint(ready=False)]
    stub = harness.scaler()
    assert metric(stub) == 0
    assert stub.IsActive(ref()).result is False


def test_unknown_unit_set_is_not_found_naming_the_key(harness: Harness) -> None:
    stub = harness.scaler()
    with pytest.raises(grpc.RpcError) as err:
        metric(stub, ref(unitSet="nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "tts/nope" in err.value.details() and "unitSet" in err.value.details()


# --- caching -----------------------------------------------------------------------------


def test_scrapes_are_reused_within_the_cache_period(harness: Harness) -> None:
    u = harness.fleet.units
    u["u0"].decode_in_flight = 2
    u["u1"].decode_in_flight = 1
    harness.sets[(NS, SET)] = [u["u0"].endpoint(), u["u1"].endpoint()]
    stub = harness.scaler(cache_ttl_s=3600)
    assert metric(stub) == 3
    u["u0"].decode_in_flight = 50
    assert metric(stub) == 3  # the cached value, not a new scrape
    assert stub.IsActive(ref()).result is True
    assert (u["u0"].hits, u["u1"].hits) == (1, 1)
    assert harness.source_calls == 1


def test_concurrent_polls_share_one_scrape(harness: Harness) -> None:
    u = harness.fleet.units
    u["u0"].decode_in_flight = 4
    harness.sets[(NS, SET)] = [u["u0"].endpoint()]
    stub = harness.scaler(cache_ttl_s=3600)
    futures = [
        stub.GetMetrics.future(pb.GetMetricsRequest(scaledObjectRef=ref(), metricName="m"))
        for _ in range(8)
    ]
    assert [f.result().metricValues[0].metricValue for f in futures] == [4] * 8
    assert u["u0"].hits == 1


def test_cache_expires_after_its_period(harness: Harness) -> None:
    u = harness.fleet.units
    u["u0"].decode_in_flight = 2
    harness.sets[(NS, SET)] = [u["u0"].endpoint()]
    stub = harness.scaler(cache_ttl_s=0.2)
    assert metric(stub) == 2
    u["u0"].decode_in_flight = 6
    time.sleep(0.35)
    assert metric(stub) == 6
    assert u["u0"].hits == 2


# --- activation --------------------------------------------------------------------------


def test_is_active_when_any_stream_is_in_flight_or_above_the_activation_threshold(
    harness: Harness,
) -> None:
    u = harness.fleet.units
    harness.sets[(NS, SET)] = [u["u0"].endpoint(), u["u1"].endpoint()]
    stub = harness.scaler()
    assert stub.IsActive(ref()).result is False
    u["u1"].decode_in_flight = 3
    assert stub.IsActive(ref()).result is True
    assert stub.IsActive(ref(activationInFlight="5")).result is False
    u["u0"].decode_in_flight = 3
    assert stub.IsActive(ref(activationInFlight="5")).result is True


def test_stream_is_active_pushes_the_first_value_then_only_changes(harness: Harness) -> None:
    u = harness.fleet.units
    harness.sets[(NS, SET)] = [u["u0"].endpoint()]
    stub = harness.scaler(stream_period_s=0.05)
    stream = stub.StreamIsActive(ref())
    try:
        first = next(stream)
        assert first.result is False
        polls_before = u["u0"].hits
        time.sleep(0.3)
        # It kept polling (period 50 ms) but pushed nothing while the answer stayed the same.
        assert u["u0"].hits > polls_before
        u["u0"].decode_in_flight = 1
        assert next(stream).result is True
        u["u0"].decode_in_flight = 0
        assert next(stream).result is False
    finally:
        stream.cancel()


# --- bad metadata ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ({"targetInFlightPerUnit": None}, "targetInFlightPerUnit"),
        ({"targetInFlightPerUnit": "0"}, "targetInFlightPerUnit"),
        ({"targetInFlightPerUnit": "-3"}, "targetInFlightPerUnit"),
        ({"targetInFlightPerUnit": "lots"}, "targetInFlightPerUnit"),
        ({"targetInFlightPerUnit": "nan"}, "targetInFlightPerUnit"),
        ({"unitSet": None}, "unitSet"),
        ({"scrapeTimeoutMs": "0"}, "scrapeTimeoutMs"),
        ({"scrapeTimeoutMs": "fast"}, "scrapeTimeoutMs"),
        ({"activationInFlight": "-1"}, "activationInFlight"),
    ],
)
def test_bad_metadata_is_invalid_argument_naming_the_key(
    harness: Harness, metadata: dict[str, Any], key: str
) -> None:
    stub = harness.scaler()
    calls: list[Callable[[], Any]] = [
        lambda: stub.GetMetricSpec(ref(**metadata)),
        lambda: metric(stub, ref(**metadata)),
        lambda: stub.IsActive(ref(**metadata)),
        lambda: next(stub.StreamIsActive(ref(**metadata))),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"scalerMetadata.{key}" in err.value.details()
    assert harness.source_calls == 0  # refused before asking for any unit


def test_requests_are_counted_by_method_and_code(harness: Harness) -> None:
    harness.sets[(NS, SET)] = [harness.fleet.units["u0"].endpoint()]
    stub = harness.scaler()

    def count(code: str) -> float:
        return sample("pdunit_scaler_requests_total", method="GetMetrics", code=code) or 0.0

    ok, bad = count("OK"), count("INVALID_ARGUMENT")
    latency = sample("pdunit_scaler_request_duration_seconds_count", method="GetMetrics") or 0.0
    metric(stub)
    with pytest.raises(grpc.RpcError):
        metric(stub, ref(targetInFlightPerUnit="0"))
    assert (count("OK"), count("INVALID_ARGUMENT")) == (ok + 1, bad + 1)
    assert (
        sample("pdunit_scaler_request_duration_seconds_count", method="GetMetrics") == latency + 2
    )


# --- metric: headroom ----------------------------------------------------------------------


def headroom_ref(**metadata: str) -> pb.ScaledObjectRef:
    md: dict[str, Any] = {"metric": "headroom", "targetHeadroomPerUnit": "8",
                          "targetInFlightPerUnit": None}
    return ref(**{**md, **metadata})


def headroom_value(stub: pb_grpc.ExternalScalerStub, r: pb.ScaledObjectRef) -> tuple[int, float]:
    resp = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=r, metricName="s0-m"))
    (value,) = resp.metricValues
    return value.metricValue, value.metricValueFloat


def test_keda_get_metrics_returns_headroom_for_a_set_as_the_units_it_needs(
    harness: Harness,
) -> None:
    """Three units of 32 streams each at the floor carry 60: to keep 8 free each, the set
    needs 60 / (32 - 8) = 2.5 units; KEDA's AverageValue with target 1 makes that 3."""
    u = harness.fleet.units
    for name, (in_flight, headroom) in {"u0": (20, 12), "u1": (30, 2), "u2": (10, 22)}.items():
        u[name].decode_in_flight, u[name].headroom_streams = in_flight, headroom
    u["u3"].decode_in_flight, u["u3"].headroom_streams = 0, 0  # draining: not counted
    harness.sets[(NS, SET)] = [u[n].endpoint() for n in ("u0", "u1", "u2")] + [
        u["u3"].endpoint(draining=True)
    ]
    stub = harness.scaler()
    (spec,) = stub.GetMetricSpec(headroom_ref()).metricSpecs
    assert (spec.targetSize, spec.targetSizeFloat) == (1, 1.0)
    assert "headroom" in spec.metricName and SET in spec.metricName
    as_int, as_float = headroom_value(stub, headroom_ref())
    assert as_float == 2.5 and as_int == 3
    assert math.ceil(as_float / spec.targetSizeFloat) == 3  # what KEDA's HPA computes
    assert sample("pdunit_scaler_headroom_streams", namespace=NS, unit_set=SET) == 36
    assert sample("pdunit_scaler_desired_units", namespace=NS, unit_set=SET) == 2.5
    # the in-flight metric of the same set is unchanged by the headroom mode
    assert metric(stub) == 60


@pytest.mark.parametrize(
    ("rooms", "want"),
    [
        ((8, 8, 8, 8), 4.0),  # each keeps exactly the target: the size stays
        ((0, 0, 0, 0), 8.0),  # none has room: 16 streams each fit 8 more units holding 8
        ((24, 24, 24, 24), 2.0),  # plenty of room: fewer units
        ((0, 8, 16, 24), 64 / 20),  # uneven: the mean capacity counts
    ],
)
def test_desired_units_keep_the_target_headroom_each(rooms: tuple[int, ...], want: float) -> None:
    # each unit: 12 decoding + 4 reserved (D's headroom is counted beside both)
    counted = {f"u{i}": scaler.UnitLoad(12, 4, room) for i, room in enumerate(rooms)}
    load = scaler.SetLoad(decode_in_flight=48, counted=counted)
    got = scaler.desired_units(load, 8)
    assert got == pytest.approx(want)
    # the promise: that many units of the set's mean capacity keep 8 free each
    capacity = sum(u.held + u.headroom_streams for u in counted.values()) / len(counted)
    assert capacity - 64 / got == pytest.approx(8)


def test_desired_units_are_zero_without_load() -> None:
    load = scaler.SetLoad(decode_in_flight=0, counted={"u0": scaler.UnitLoad(0, 0, 30)})
    assert scaler.desired_units(load, 8) == 0.0


def test_headroom_metric_over_a_unit_without_admission_fails_naming_the_unit(
    harness: Harness,
) -> None:
    u = harness.fleet.units
    u["u0"].decode_in_flight, u["u0"].headroom_streams = 4, 10
    u["u1"].decode_in_flight = 4  # no headroom_streams: an LB of a unit without admission
    u["u2"].decode_in_flight, u["u2"].headroom_streams = 4, -1  # admission off
    harness.sets[(NS, SET)] = [u[n].endpoint() for n in ("u0", "u1", "u2")]
    stub = harness.scaler()
    with pytest.raises(grpc.RpcError) as err:
        headroom_value(stub, headroom_ref())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "u1, u2" in err.value.details() and "--rate-floor" in err.value.details()
    assert metric(stub) == 12  # inFlight still works over the same units


def test_a_headroom_target_no_unit_can_keep_fails_naming_the_key(harness: Harness) -> None:
    u = harness.fleet.units
    u["u0"].decode_in_flight, u["u0"].headroom_streams = 4, 3
    harness.sets[(NS, SET)] = [u["u0"].endpoint()]
    stub = harness.scaler()
    with pytest.raises(grpc.RpcError) as err:
        headroom_value(stub, headroom_ref(targetHeadroomPerUnit="7"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "scalerMetadata.targetHeadroomPerUnit" in err.value.details()


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ({"metric": "headroom", "targetInFlightPerUnit": None}, "targetHeadroomPerUnit"),
        ({"metric": "headroom", "targetHeadroomPerUnit": "0"}, "targetHeadroomPerUnit"),
        ({"metric": "queue"}, "metric"),
    ],
)
def test_bad_headroom_metadata_is_invalid_argument_naming_the_key(
    harness: Harness, metadata: dict[str, Any], key: str
) -> None:
    stub = harness.scaler()
    with pytest.raises(grpc.RpcError) as err:
        stub.GetMetricSpec(ref(**metadata))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"scalerMetadata.{key}" in err.value.details()


# --- the default unit source -------------------------------------------------------------


def test_units_come_from_pdunit_status_and_deleting_or_draining_ones_are_draining() -> None:
    listed = {
        "items": [
            {
                "metadata": {"name": "a"},
                "spec": {},
                "status": {"podIP": "10.0.0.1", "lbPort": 8000, "ready": True},
            },
            {
                "metadata": {"name": "b"},
                "spec": {"draining": True},
                "status": {"podIP": "10.0.0.2", "lbPort": 8000, "ready": True},
            },
            {
                "metadata": {"name": "c", "deletionTimestamp": "2026-01-01T00:00:00Z"},
                "status": {"podIP": "10.0.0.3", "lbPort": 8000, "ready": True},
            },
            {"metadata": {"name": "d"}, "spec": {}, "status": {"ready": True, "draining": True}},
            {"metadata": {"name": "e"}, "spec": {}},
        ]
    }
    units = {u.name: u for u in scaler.units_from_pdunit_list(listed)}
    assert units["a"] == scaler.UnitEndpoint("a", "10.0.0.1", 8000, True, False)
    assert units["b"].draining and units["c"].draining and units["d"].draining
    assert units["e"] == scaler.UnitEndpoint("e", "", 0, False, False)


# --- standalone process and the bench helper ---------------------------------------------


def test_standalone_scaler_serves_from_a_units_file_and_stops_on_sigterm(tmp_path: Path) -> None:
    loop = LoopThread()
    fleet = loop.run(FakeLBFleet().start(["a", "b"]))
    proc = None
    try:
        fleet.units["a"].decode_in_flight = 6
        fleet.units["b"].decode_in_flight = 1
        units_file = tmp_path / "units.json"
        units_file.write_text(
            json.dumps({f"{NS}/{SET}": [u.endpoint() for u in fleet.units.values()]})
        )
        port = free_port()  # nothing listens there
        env = dict(os.environ, PDUNIT_CACHE_TTL_S="0")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdunit.operator.scaler",
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "--units-file",
                str(units_file),
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = pb_grpc.ExternalScalerStub(channel)
        assert metric(stub) == 7
        channel.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert proc.stderr is not None
        logs = [
            json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")
        ]
        config = next(entry["config"] for entry in logs if entry["msg"] == "resolved config")
        assert config["cache_ttl_s"] == 0 and config["units_file"] == str(units_file)
        assert any(entry["msg"] == "KEDA external scaler stopped" for entry in logs)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        loop.run(fleet.stop())
        loop.close()


def test_bench_scaler_reports_getmetrics_latency_percentiles() -> None:
    result = bench_scaler(n_units=5, requests=20)
    assert result["units"] == 5
    assert 0 < result["p50_ms"] <= result["p99_ms"]
    cached, uncached = result["rows"][1], result["rows"][0]
    assert cached["case"] == "cached" and uncached["case"] == "scrape every call"


# --- against the real operator and a real apiserver (envtest) ------------------------------


def test_scaler_reads_units_that_the_operator_runs_from_the_apiserver(
    control_plane: Any, api: Any, kubelet: Any, namespace: str
) -> None:
    """PDUnitSet -> operator -> PDUnits with status -> the default unit source -> the sum."""
    from tests.operator.test_integration import unit_set, wait_ready

    ns = namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=unit_set("voices", 2))
    units = wait_ready(api, ns, "voices", 2)
    for unit, n in zip(units, (3, 4), strict=True):
        kubelet.lb(ns, unit["metadata"]["name"]).in_flight = n
    loop = LoopThread()
    server = None
    try:
        source = scaler.KubernetesUnitSource(kubeconfig=str(control_plane.kubeconfig))
        server, port = loop.run(
            scaler.start_scaler(
                0, logging.getLogger("pdunit.scaler.test"), source, host="127.0.0.1", cache_ttl_s=0
            )
        )
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExternalScalerStub(channel)
            r = pb.ScaledObjectRef(
                name="voices",
                namespace=ns,
                scalerMetadata={"unitSet": "voices", "targetInFlightPerUnit": "4"},
            )
            assert metric(stub, r) == 7
            assert stub.IsActive(r).result is True
            with pytest.raises(grpc.RpcError) as err:
                metric(
                    stub,
                    pb.ScaledObjectRef(
                        name="x",
                        namespace=ns,
                        scalerMetadata={"unitSet": "absent", "targetInFlightPerUnit": "4"},
                    ),
                )
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        if server is not None:
            loop.run(server.stop(grace=None))
        loop.close()
