"""The unit's load document (docs/api.md `GET /v1/load`): its type, its build, its parse.

Owns `LoadDocument`, the one record the LB serves and its three readers (the operator's
lbapi.py, the KEDA scaler, the router's table) parse with `read_load_document`, and
`build_load_document`, the LB's summary of one probe round. Must never let a reader
guess: a missing field or a wrong type is a `LoadDocumentError` naming the field (an
unknown extra field is ignored, so a newer LB stays readable). Readers import this
module without grpc, protobuf or numpy: the builder imports those only when it runs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from pdunit.engine.lb.streams import StreamTable
    from pdunit.engine.lb.unit import InfoSnapshot, UnitClient

Count = Annotated[int, Field(ge=0)]
# Streams a unit would still admit at its rate floor; -1: admission off (no limit but the pool).
Headroom = Annotated[int, Field(ge=-1)]


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class DecoderLoad(_Record):
    """One D of the unit (a 1P2D unit has two)."""

    name: str
    instance: str
    answered: bool
    draining: bool
    streams_in_flight: Count
    decode_reserved: Count
    decode_in_flight: Count
    held_pages: Count
    pool_pages: Count
    free_pages: Count
    kv_checks_total: Count
    kv_mismatch_total: Count
    headroom_streams: Headroom
    requests: list[str]


class HeldRequests(_Record):
    """The request ids (16 hex digits) each part of the unit still holds."""

    lb: list[str]
    prefill: list[str]
    decode: list[str]
    proxy: list[str]

    def any(self) -> bool:
        return bool(self.lb or self.prefill or self.decode or self.proxy)


class LoadDocument(_Record):
    """`GET /v1/load`: sums over the unit's D's, P's queue, what each part holds, and
    `empty` (true only when every part answered and holds nothing)."""

    unit: str
    ready: bool
    reason: str
    draining: bool
    transfer_mode: str
    streams_in_flight: Count
    prefill_queue: Count
    transfers_in_flight: Count
    decode_reserved: Count
    decode_in_flight: Count
    held_pages: Count
    held_aborts: Count
    pool_pages: Count
    free_pages: Count
    kv_checks_total: Count
    kv_mismatch_total: Count
    headroom_streams: Headroom = -1  # an LB from before rate-floor admission has no field
    requests: HeldRequests
    empty: bool
    prefill_instance: str
    decode_instance: str
    decoders: list[DecoderLoad]
    lb_instance: str
    probe_age_ms: float | None
    errors: dict[str, str]  # part ("prefill", a D's name, "proxy") -> why it did not answer


class LoadDocumentError(ValueError):
    """A `/v1/load` answer that is not a LoadDocument; the message names each bad field."""


def read_load_document(raw: bytes | str | Mapping[str, Any]) -> LoadDocument:
    """Parse a `/v1/load` body (JSON text, or the object already decoded)."""
    try:
        if isinstance(raw, bytes | str):
            return LoadDocument.model_validate_json(raw)
        return LoadDocument.model_validate(raw)
    except ValidationError as exc:
        raise LoadDocumentError(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    problems = []
    for err in exc.errors(include_url=False):
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        if err["type"] == "missing":
            problems.append(f"field {where or '(document)'} is missing")
        elif err["type"].startswith("json"):
            problems.append(f"the body is not JSON: {err['msg']}")
        else:
            problems.append(f"field {where or '(document)'} is {err['input']!r}: {err['msg']}")
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "not a load document: " + "; ".join(problems[:3]) + more


class LoadSource(Protocol):
    """What `build_load_document` reads of the LB (balancer.py's LoadBalancer), so that
    this module needs nothing of balancer.py, not even for its types."""

    @property
    def unit(self) -> UnitClient | None: ...
    @property
    def table(self) -> StreamTable: ...
    @property
    def decode_names(self) -> list[str]: ...
    @property
    def unit_name(self) -> str: ...
    @property
    def instance_id(self) -> str: ...
    @property
    def draining(self) -> bool: ...
    @property
    def shutting_down(self) -> bool: ...


def build_load_document(
    lb: LoadSource, snap: InfoSnapshot, ready: bool, reason: str
) -> LoadDocument:
    """The document of one probe round; `empty` only when every part answered and holds nothing.

    A part that did not answer reads as zeros (consumers do arithmetic on these fields);
    `errors` names it, and `empty` stays false: nothing is proven about it.
    """
    from pdunit.engine.lb.streams import hex_id
    from pdunit.engine.lb.unit import request_ids_of
    from pdunit.engine.proto import pdunit_pb2 as pb

    has_proxy = lb.unit is not None and lb.unit.has_proxy
    decodes = snap.decodes
    answered = snap.prefill is not None and all(d is not None for d in decodes)
    answered = answered and (snap.proxy is not None or not has_proxy)
    p = snap.prefill or pb.InfoReply()
    ds = [d or pb.InfoReply() for d in decodes]
    x = snap.proxy or pb.InfoReply()
    lb_ids = lb.table.ids()
    decode_ids = [request_ids_of(d) for d in ds]
    requests = HeldRequests(
        lb=[hex_id(i) for i in lb_ids],
        prefill=[hex_id(i) for i in request_ids_of(p)],
        decode=[hex_id(i) for i in dict.fromkeys(i for ids in decode_ids for i in ids)],
        proxy=[hex_id(i) for i in request_ids_of(x)],
    )
    holds_nothing = (
        p.queue == p.in_flight == p.held_aborts == 0
        and all(d.queue == d.in_flight == d.held_pages == 0 for d in ds)
        and x.in_flight == 0
    )
    streams_of = dict.fromkeys(range(len(ds)), 0)
    for stream in lb.table:
        if stream.decode is not None and stream.decode in streams_of:
            streams_of[stream.decode] += 1
    decoders = [
        DecoderLoad(
            name=name,
            instance=d.instance_id,
            answered=reply is not None,
            draining=d.draining,
            streams_in_flight=streams_of[i],
            decode_reserved=d.queue,
            decode_in_flight=d.in_flight,
            held_pages=d.held_pages,
            pool_pages=d.pool_pages,
            free_pages=d.free_pages,
            kv_checks_total=d.kv_checks_total,
            kv_mismatch_total=d.kv_mismatch_total,
            headroom_streams=d.headroom_streams,
            requests=[hex_id(r) for r in decode_ids[i]],
        )
        for i, (name, d, reply) in enumerate(zip(lb.decode_names, ds, decodes, strict=True))
    ]
    return LoadDocument(
        unit=lb.unit_name,
        ready=ready,
        reason=reason,
        draining=lb.draining or lb.shutting_down,
        transfer_mode=p.transfer_mode or ds[0].transfer_mode,
        streams_in_flight=len(lb_ids),
        prefill_queue=p.queue,
        transfers_in_flight=p.in_flight,
        decode_reserved=sum(d.queue for d in ds),
        decode_in_flight=sum(d.in_flight for d in ds),
        held_pages=sum(d.held_pages for d in ds),
        held_aborts=p.held_aborts,
        pool_pages=sum(d.pool_pages for d in ds),
        free_pages=sum(d.free_pages for d in ds),
        kv_checks_total=sum(d.kv_checks_total for d in ds),
        kv_mismatch_total=sum(d.kv_mismatch_total for d in ds),
        headroom_streams=sum(d.headroom_streams for d in ds)
        if all(d.headroom_streams >= 0 for d in ds)
        else -1,
        requests=requests,
        empty=answered and holds_nothing and not requests.any(),
        prefill_instance=p.instance_id,
        decode_instance=",".join(d.instance_id for d in ds),
        decoders=decoders,
        lb_instance=lb.instance_id,
        probe_age_ms=round((time.monotonic() - snap.at) * 1000, 1)
        if snap.at > float("-inf")
        else None,
        errors=dict(snap.errors),
    )
