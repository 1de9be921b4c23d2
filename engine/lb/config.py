"""Configuration of `pdunit lb` (flags `--field-name`, env `PDUNIT_FIELD_NAME`).

Owns only the fields, their defaults and their checks; never starts anything.
"""

from __future__ import annotations

import socket

from pydantic import Field, field_validator, model_validator

from pdunit.engine.edge import EdgeLimits, is_loopback
from pdunit.engine.tracing import TracingFields
from pdunit.engine.unit_layout import ADMIN_PORT, LB_PORT, pod_socket


class LBConfig(EdgeLimits, TracingFields):
    """pdunit lb: the HTTP streaming API of one unit (docs/api.md)."""

    host: str = Field(
        "",
        description="listen address of the stream port; empty = the pod's IP and 127.0.0.1 in "
        "a unit's pod ($PDUNIT_POD_IP), 0.0.0.0 in another pod, else 127.0.0.1",
    )
    port: int = Field(LB_PORT, ge=0, le=65535, description="HTTP port (0 = any free port)")
    admin_host: str = Field(
        "127.0.0.1",
        description="listen address of the admin port (POST /v1/admin/drain); an address other "
        "than loopback needs --admin-token-file",
    )
    admin_port: int = Field(
        ADMIN_PORT, ge=0, le=65535, description="admin HTTP port, never the stream port (0 = any free port)"
    )
    admin_token_file: str = Field(
        "",
        description="file holding the admin bearer token (mode 0600, e.g. a mounted Secret); "
        "when set, every admin call needs 'Authorization: Bearer <token>'",
    )
    prefill_socket: str = Field(pod_socket("prefill"), description="P's gRPC unix socket")
    decode_socket: str = Field(
        pod_socket("decode"),
        description="D's gRPC unix socket, or a comma list of them for a unit with several D's "
        "(1P2D: one frames subscription per D); monolith: the same socket as --prefill-socket",
    )
    proxy_socket: str = Field("", description="nvlink-proxy's gRPC unix socket; empty = no proxy")
    unit_name: str = Field("", description="unit name in /v1/load (default: the host name)")
    n_codebooks: int | None = Field(
        None,
        ge=1,
        description="ids per prompt row; default: what D's Hello reports (must match it)",
    )
    vocab_sizes: str = Field(
        "",
        description="id range per column (one size, or a comma list); default: what D's Hello "
        "reports (must match it)",
    )
    eos_id: int | None = Field(None, description="the model's EOS id, reported by /v1/model")
    model: str = Field(
        "",
        description="the model spec D serves (its --model), which D's Hello must name; a CSM (a "
        "checkpoint directory, or random:csm-tiny:<seed>) gives POST /v1/audio/speech its tokenizer",
    )
    codec: str = Field(
        "",
        description="the codec spec D decodes with (its --codec), which D's Hello must name; encodes "
        "the clips uploaded to /v1/voices; needs --model",
    )
    voices: str = Field(
        "",
        description="the voice store's directory (/v1/voices; the voices POST /v1/audio/speech "
        "speaks with); needs --model and --codec",
    )
    voices_token_file: str = Field(
        "",
        description="file holding the bearer token (mode 0600, e.g. a mounted Secret; read once at "
        "start) that creating, replacing and deleting a voice needs ('Authorization: Bearer <token>'); "
        "unset: the voice store is read-only (every write 403). Listing and reading voices stay open",
    )
    max_rows: int = Field(4096, ge=1, description="most prompt rows accepted (413 above)")
    max_body_bytes: int = Field(4 << 20, ge=1024, description="largest request body (413 above)")
    default_max_frames: int = Field(630, ge=1, description="max_frames when a request gives none")
    max_frames_limit: int = Field(4096, ge=1, description="largest max_frames accepted (422 above)")
    probe_interval_s: float = Field(
        1.0, gt=0, description="how often P, D (and proxy) Info is probed"
    )
    load_cache_ms: int = Field(200, ge=0, description="how long /v1/load may reuse a probe")
    request_deadline_ms: int = Field(
        30000,
        ge=1,
        description="LB receive -> first frame; past it the client gets 504",
    )
    frame_timeout_ms: int = Field(
        5000,
        ge=1,
        description="longest silence between two frames of a stream before it fails",
    )
    cancel_timeout_ms: int = Field(1000, ge=1, description="deadline of Cancel RPCs to P and D")
    start_frames: int = Field(9, ge=1, description="frames before playback starts (TTFA, stutter metrics)")
    retry_after_s: int = Field(1, ge=0, description="Retry-After of 503/429 answers")
    shutdown_timeout_s: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM: how long streams in flight may finish before they are cut",
    )
    log_level: str = Field("info", description="debug | info | warning | error")

    @model_validator(mode="after")
    def _admin_port_is_guarded(self) -> LBConfig:
        if self.admin_port and self.admin_port == self.port:
            raise ValueError(
                f"admin_port {self.admin_port} is the stream port: give --admin-port another port"
            )
        if not self.admin_token_file and not is_loopback(self.admin_host):
            raise ValueError(
                f"admin_host {self.admin_host!r} is not a loopback address: give "
                f"--admin-token-file (a bearer token file) or --admin-host 127.0.0.1"
            )
        return self

    @model_validator(mode="after")
    def _speech_flags_complete(self) -> LBConfig:
        if self.codec and not self.model:
            raise ValueError("--codec needs --model (the codec's codebooks are the model's)")
        if self.voices and not self.codec:
            raise ValueError("--voices needs --codec (the store encodes clips with it) and --model")
        if self.voices_token_file and not self.voices:
            raise ValueError("--voices-token-file needs --voices (the token guards the store's writes)")
        return self

    @field_validator("decode_socket")
    @classmethod
    def _decode_sockets_listed_once(cls, v: str) -> str:
        sockets = [s.strip() for s in v.split(",") if s.strip()]
        if not sockets:
            raise ValueError("decode_socket is empty: give D's socket, or a comma list of D sockets")
        if len(set(sockets)) != len(sockets):
            raise ValueError(f"decode_socket {v!r} names a socket twice: list each D once")
        return ",".join(sockets)

    def decode_sockets(self) -> list[str]:
        """Every D of the unit, in --decode-socket order (index i is `decode-i`)."""
        return self.decode_socket.split(",")

    @field_validator("vocab_sizes")
    @classmethod
    def _vocab_sizes_are_ints(cls, v: str) -> str:
        if v.strip():
            parse_vocab_sizes(v, None)
        return v.strip()

    def resolved_unit_name(self) -> str:
        return self.unit_name or socket.gethostname()


def parse_vocab_sizes(raw: str, n_codebooks: int | None) -> tuple[int, ...]:
    """ "1024" -> that size for every column; "a,b,..." -> one per column (n_codebooks of them)."""
    try:
        sizes = tuple(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"vocab_sizes {raw!r} must be integers separated by commas") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"vocab_sizes {raw!r} must be positive integers")
    if n_codebooks is None:
        return sizes
    if len(sizes) == 1:
        return sizes * n_codebooks
    if len(sizes) != n_codebooks:
        raise ValueError(
            f"vocab_sizes has {len(sizes)} entries but the model has {n_codebooks} codebooks: "
            f"give one size for all columns or {n_codebooks} sizes"
        )
    return sizes
