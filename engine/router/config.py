"""Configuration of `pdunit router` (flags `--field-name`, env `PDUNIT_FIELD_NAME`).

Owns the fields, their defaults and their validation, including the rules that tie
fields together (a static list needs `--units`, Kubernetes needs `--unit-set`). It never
starts anything.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, field_validator

from pdunit.engine.edge import EdgeLimits
from pdunit.engine.router.discovery import parse_static_units
from pdunit.engine.tracing import TracingFields

LB_MAX_BODY_BYTES = 4 << 20  # the LB's --max-body-bytes default: a larger body is refused there


class RouterConfig(EdgeLimits, TracingFields):
    """pdunit router: the cluster entry point; picks a unit by session affinity."""

    host: str = Field(
        "",
        description="address to listen on; empty = the pod's IP and 127.0.0.1 with "
        "$PDUNIT_POD_IP, 0.0.0.0 in another pod (its own network), else 127.0.0.1",
    )
    port: int = Field(8080, ge=0, le=65535, description="HTTP port (0 = any free port)")
    keep_alive_timeout_s: float = Field(
        75.0,
        gt=0,
        description="an idle client connection is closed after this (longer than a cloud "
        "load balancer's 60 s idle timeout, so the router never closes one it reuses)",
    )
    max_connections: int = Field(
        4096, ge=1, le=65536, description="open client connections at most; one more is answered 503"
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="CIDRs of proxies in front of the router, comma separated; only their "
        "X-Forwarded-For / Forwarded headers are kept (everyone else's are dropped)",
    )
    admin_token_file: str = Field(
        "",
        description="file holding the bearer token /v1/units needs (mode 0600, e.g. a mounted "
        "Secret); without it /v1/units answers loopback clients only",
    )
    discovery: Literal["static", "kubernetes"] = Field(
        "static", description="where units come from: static (--units) or kubernetes (PDUnits)"
    )
    units: list[str] = Field(
        default_factory=list,
        description="static units, comma separated: name=http://host:port,...",
    )
    namespace: str = Field(
        "", description="namespace of the PDUnits (default: the router pod's own namespace)"
    )
    unit_set: str = Field("", description="PDUnitSet name: units labelled pdunit.dev/set=<name>")
    load_bound_factor: float = Field(
        1.25, gt=1.0, le=10.0, description="c: a unit takes a key only below ceil(c * average)"
    )
    vnodes: int = Field(160, ge=1, le=4096, description="ring points per unit")
    session_header: str = Field(
        "X-Session-Id", min_length=1, description="request header holding the affinity key"
    )
    poll_interval_s: float = Field(
        1.0, gt=0.0, le=60.0, description="seconds between /v1/load polls of every unit"
    )
    poll_timeout_s: float = Field(
        0.5,
        gt=0.0,
        le=30.0,
        description="a unit that does not answer /v1/load in this is unreachable",
    )
    max_attempts: int = Field(
        3, ge=1, le=20, description="units tried per request (retries happen only before streaming)"
    )
    connect_timeout_s: float = Field(1.0, gt=0.0, description="TCP connect timeout to a unit")
    stream_read_timeout_s: float = Field(
        30.0, gt=0.0, description="longest silence from a unit before the stream is failed"
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After of the router's own 503")
    max_body_bytes: int = Field(
        LB_MAX_BODY_BYTES,
        ge=1,
        description="largest request body the router reads and forwards (413 as soon as a "
        "body exceeds it); default: the LB's --max-body-bytes",
    )
    max_tracked_sessions: int = Field(
        100_000, ge=1, description="sessions remembered for /v1/units and move counting"
    )
    shutdown_grace_s: int = Field(
        30, ge=0, description="on SIGTERM, seconds open streams may take to finish"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")

    @field_validator("trusted_proxies")
    @classmethod
    def _trusted_proxies_are_networks(cls, value: list[str]) -> list[str]:
        out = []
        for item in value:
            try:
                out.append(str(ipaddress.ip_network(item.strip(), strict=False)))
            except ValueError:
                raise ValueError(
                    f"trusted_proxies item {item!r} is not an address or CIDR (e.g. 10.0.0.0/8)"
                ) from None
        return out

    @field_validator("units")
    @classmethod
    def _units_parse(cls, value: list[str]) -> list[str]:
        parse_static_units(value)  # raises ValueError naming the bad item
        return value


def check_discovery(config: RouterConfig) -> str | None:
    """The cross-field rules, as one message naming the flags and the fix (None = fine)."""
    if config.discovery == "static":
        if not config.units:
            return (
                "pdunit router: --units (PDUNIT_UNITS) is empty; give name=http://host:port,... "
                "or use --discovery kubernetes --unit-set NAME"
            )
        if config.unit_set:
            return "pdunit router: --unit-set only applies with --discovery kubernetes"
    else:
        if not config.unit_set:
            return (
                "pdunit router: --discovery kubernetes needs --unit-set (PDUNIT_UNIT_SET), "
                "the PDUnitSet whose units to route to"
            )
        if config.units:
            return "pdunit router: --units only applies with --discovery static"
    return None
