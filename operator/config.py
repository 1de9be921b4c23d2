"""The operator's configuration (`pdunit operator`'s flags and PDUNIT_* env).

Owns the fields and their bounds only; never reads the environment or starts anything
itself (engine/settings.py's parse_config does, from main.py), so that handlers.py and
main.py both import it without importing each other.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from pdunit.operator import models as m


class OperatorConfig(BaseModel):
    """Kubernetes operator for PDUnit / PDUnitSet, with the KEDA external scaler."""

    namespaces: list[str] = Field(
        default_factory=list,
        description="namespaces to watch, comma-separated (empty = the whole cluster)",
    )
    unit_image_pull_secrets: list[str] = Field(
        default_factory=list,
        description="Secrets every unit pod is pulled with, comma-separated, before the PDUnit's own "
        "spec.imagePullSecrets (the chart passes its imagePullSecrets)",
    )
    resync_seconds: float = Field(5.0, gt=0, le=600, description="reconcile period of every object")
    drain_check_interval_seconds: float = Field(
        5.0, ge=0, le=600, description="min seconds between the two empty checks of a drain"
    )
    load_timeout_seconds: float = Field(1.0, gt=0, le=30, description="timeout of GET /v1/load")
    liveness_port: int = Field(
        8080, ge=0, le=65535, description="kopf liveness /healthz port (0 = off)"
    )
    metrics_port: int = Field(
        9100, ge=0, le=65535, description="Prometheus /metrics port (0 = off)"
    )
    scaler_port: int = Field(
        9090, ge=0, le=65535, description="KEDA external scaler gRPC port (0 = off)"
    )
    allow_lb_port_override: bool = Field(
        False,
        description=f"honour the test-only pod annotation {m.ANNOTATION_LB_PORT_OVERRIDE} "
        "(envtest suites; never in production)",
    )
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$", description="log level")
    leader_election: bool = Field(
        True,
        description="act only while holding the Lease, so that one of several replicas acts "
        "(--no-leader-election: act at once, for one replica that is alone by construction)",
    )
    lease_name: str = Field("pdunit-operator", min_length=1, max_length=253, description="Lease name")
    lease_namespace: str = Field(
        "",
        description="namespace of the Lease (empty = the pod's own namespace, outside a pod 'default')",
    )
    lease_seconds: float = Field(
        15.0, gt=0, le=600, description="a leader that stops renewing is replaced after this long"
    )
    renew_deadline_seconds: float = Field(
        10.0, gt=0, le=600, description="a leader that cannot renew this long stops acting (< lease)"
    )
    lease_retry_seconds: float = Field(
        2.0, gt=0, le=60, description="renewal period of the leader, and retry period of a standby"
    )
    leader_identity: str = Field(
        "", max_length=128, description="this replica's holder identity (empty = hostname_random)"
    )
