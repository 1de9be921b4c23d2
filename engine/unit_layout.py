"""The layout of one unit (ARCHITECTURE.md section 3) and the command of each of its processes.

Owns the run dir and socket names, the secret files the commands name, the metrics block
(one Prometheus port per process), the names of the D's, the LB's ports, and
`unit_commands(spec)`: the argv of every process of a unit. The operator's pod
(operator/pod.py) and `pdunit local` (engine/local.py) both build their commands here,
local changing only paths, ports and its own engine options, so the two cannot drift.
Must never start anything, read the environment, or import torch or the operator (engine
sits below operator): it turns a `UnitSpec` into argv lists and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

RUN_DIR = "/run/pdunit"  # the pod's shared emptyDir: every unix socket of the unit
SECRETS_DIR = "/var/run/secrets/pdunit"
# The pod's secret files: P and D read the unit secret, the LB the admin token (each file is
# named as its key of the unit's Secret, the volume's item path) and, with a voice store
# whose writes are allowed, the voices token (key `voices-token` of the Secret the spec names).
UNIT_SECRET_FILE = f"{SECRETS_DIR}/unit/unit-secret"
ADMIN_TOKEN_FILE = f"{SECRETS_DIR}/admin/admin-token"
VOICES_TOKEN_FILE = f"{SECRETS_DIR}/voices/voices-token"
LB_PORT = 8000  # streams, /v1/load, the LB's /metrics
ADMIN_PORT = 8001  # POST /v1/admin/drain, never the stream port
# The transfer modes that run the nvlink-proxy sidecar (auto probes it).
TRANSFERS_WITH_PROXY = ("proxy", "auto")
# A unit's metrics block (a pod's spec.metricsPort, `pdunit local --metrics-port`): one
# Prometheus port per process, from the block's first port on. The LB serves its own
# /metrics on its HTTP port; the monolith on prefill's.
METRICS_OFFSETS = {"prefill": 0, "proxy": 1, "guard": 2, "decode": 3}
# Process name -> the pod's container name, where they differ.
CONTAINER_NAMES = {"proxy": "nvlink-proxy", "guard": "quiesce-guard"}


def metrics_block(base: int, decoders: int) -> range:
    """The ports of a unit's metrics block (empty when `base` is 0)."""
    return range(base, base + METRICS_OFFSETS["decode"] + decoders) if base else range(0)


def metrics_port_of(base: int, role: str, index: int = 0) -> int | None:
    """The port `role`'s process (decode engine `index`) serves /metrics on; None for the
    LB, and for every role when `base` is 0."""
    if not base or role not in METRICS_OFFSETS:
        return None
    return base + METRICS_OFFSETS[role] + (index if role == "decode" else 0)


def process_metrics_port(base: int, process: str) -> int | None:
    """Where one of `unit_commands`' processes serves /metrics in the block (the monolith
    on prefill's port, the guard on its one HTTP port); None for the LB (its /metrics is on
    its stream port) and for every process when `base` is 0."""
    if process == "decode" or process.startswith("decode-"):
        return metrics_port_of(base, "decode", int(process.removeprefix("decode-")) if "-" in process else 0)
    return metrics_port_of(base, "prefill" if process == "monolith" else process)


def decode_names(n: int) -> list[str]:
    """The names of a unit's D's (containers, sockets, logs, metric labels): `decode`
    alone, or `decode-0`, `decode-1`, ... (1PnD)."""
    return ["decode"] if n == 1 else [f"decode-{i}" for i in range(n)]


def container_name(process: str) -> str:
    """The pod's container of one of `unit_commands`' processes."""
    return CONTAINER_NAMES.get(process, process)


UNIX_SOCKET_PATH_MAX = 107  # sun_path's 108 bytes less the terminating NUL (Linux)


@dataclass(frozen=True)
class UnitPaths:
    """Where a unit's sockets and secret files are: the pod's, or a local run dir's."""

    run_dir: str = RUN_DIR
    unit_secret_file: str = UNIT_SECRET_FILE
    admin_token_file: str | None = ADMIN_TOKEN_FILE  # None: the LB takes no token (a loopback admin address)
    voices_token_file: str | None = None  # the bearer token of voice writes; None: a read-only voice store

    def sock(self, name: str) -> str:
        """The unix socket of process `name` (prefill, decode, decode-1, proxy, monolith)."""
        return f"{self.run_dir}/{name}.sock"

    def too_long_socket(self, decoders: int) -> str | None:
        """The longest socket path of a unit of `decoders` D's when it is over what a unix
        socket address holds (a bind would fail with no word of why); None when all fit."""
        longest = max((self.sock(n) for n in ("prefill", "proxy", "monolith", *decode_names(decoders))),
                      key=lambda p: len(p.encode()))
        return longest if len(longest.encode()) > UNIX_SOCKET_PATH_MAX else None


def pod_socket(name: str) -> str:
    """The pod's unix socket of process `name`: the default of every process's socket
    flags (theirs and their peers'), so that a process started bare finds the others."""
    return UnitPaths().sock(name)


@dataclass(frozen=True)
class UnitSpec:
    """What the commands of one unit depend on. A field at its default (None, "", "auto",
    "bf16") adds no flag: the process's own default holds."""

    model: str
    transfer: str = "auto"
    mode: str = "pd"  # pd (a P feeding `decoders` D's) | monolith (P and D in one process)
    device: str = "cuda"  # P's and the monolith's torch device
    decode_devices: tuple[str, ...] = ()  # one per D; empty: `device` for every D
    decoders: int = 1
    kv_cache_dtype: str = "auto"  # every engine alike: P refuses a D of another pool dtype
    dtype: str | None = None
    prefill_gemm: str = "bf16"
    prefill_graphs: bool | None = None
    decode_gemm: str = "bf16"  # D's steps and the depth decoder's passes: P's first frames too
    depth_kernels: str = "auto"  # the depth decoder's passes: every D, the monolith and P alike
    decode_kernel: str = ""
    cache_tokens: int | None = None  # P's and the monolith's prefix cache
    pool_tokens: int | None = None  # D's and the monolith's KV pool
    monolith_policy: str | None = None
    chunk_tokens: int | None = None
    rate_floor: float | None = None  # D's and the monolith's admission
    codec: str = ""  # D's and the monolith's --codec; with it the LB takes text (--model, --codec)
    voices: str = ""  # the LB's voice store (--voices), only with a codec
    audio_first_chunk_frames: int | None = None  # D's and the monolith's codec stage chunking
    audio_chunk_frames: int | None = None
    codec_conv_table: str = ""  # D's and the monolith's conv tiles file (--codec-conv-table)
    step_model: str = ""
    lb_port: int = LB_PORT
    lb_host: str = ""
    admin_port: int = ADMIN_PORT
    admin_host: str = "0.0.0.0"  # the pod's: the operator drains it on the pod IP, behind the token
    unit_name: str = ""  # the LB's --unit-name; empty: its default (the host name)
    metrics_port: int = 0  # first port of the metrics block; 0 = none
    guard: bool = True
    guard_port: int | None = None  # the guard's one HTTP port; None: its metrics port (0: no HTTP)
    guard_host: str = ""
    log_level: str | None = None
    extra_args: Mapping[str, Sequence[str]] = field(default_factory=dict)  # role -> appended flags
    paths: UnitPaths = field(default_factory=UnitPaths)
    program: tuple[str, ...] = ("pdunit",)  # the CLI every command starts with

    @property
    def runs_proxy(self) -> bool:
        return self.mode == "pd" and self.transfer in TRANSFERS_WITH_PROXY

    def decode_sockets(self) -> list[str]:
        return [self.paths.sock(name) for name in decode_names(self.decoders)]

    def device_of_decode(self, index: int) -> str:
        devices = self.decode_devices or (self.device,)
        return devices[index] if len(devices) > 1 else devices[0]


def _opt(flag: str, value: object) -> list[str]:
    """`flag value`, or nothing for a value left to the process's default."""
    return [] if value is None or value == "" else [flag, f"{value:g}" if isinstance(value, float) else str(value)]


def _metrics(spec: UnitSpec, role: str, index: int = 0) -> list[str]:
    return _opt("--metrics-port", metrics_port_of(spec.metrics_port, role, index))


def _model_flags(spec: UnitSpec) -> list[str]:
    return ([] if spec.kv_cache_dtype == "auto" else ["--kv-cache-dtype", spec.kv_cache_dtype]) + \
        _opt("--dtype", spec.dtype)


def _prefill_flags(spec: UnitSpec) -> list[str]:
    """P's and the monolith's forwards: nothing at the defaults (bf16, the engine's graphs)."""
    graphs = [] if spec.prefill_graphs is None else ["--prefill-graphs" if spec.prefill_graphs else
                                                     "--no-prefill-graphs"]
    return (["--prefill-gemm", spec.prefill_gemm] if spec.prefill_gemm != "bf16" else []) + graphs


def _depth_flags(spec: UnitSpec) -> list[str]:
    """The csm depth decoder's passes, the same in D's steps, the monolith's and P's first
    frames (P's first frames are D's): nothing at the defaults (auto, bf16)."""
    return ([] if spec.depth_kernels == "auto" else ["--depth-kernels", spec.depth_kernels]) + \
        (["--decode-gemm", spec.decode_gemm] if spec.decode_gemm != "bf16" else [])


def _decode_flags(spec: UnitSpec) -> list[str]:
    """Every D's and the monolith's decode steps and admission."""
    return (_opt("--rate-floor", spec.rate_floor) + _opt("--step-model", spec.step_model) +
            _opt("--decode-kernel", spec.decode_kernel) + _depth_flags(spec))


def _codec_flags(spec: UnitSpec) -> list[str]:
    """The codec stage of every engine that decodes (D, the monolith)."""
    return [*_opt("--codec", spec.codec), *_opt("--audio-first-chunk-frames", spec.audio_first_chunk_frames),
            *_opt("--audio-chunk-frames", spec.audio_chunk_frames),
            *_opt("--codec-conv-table", spec.codec_conv_table)]


def _lb_speech_flags(spec: UnitSpec) -> list[str]:
    """A unit with a codec speaks: the LB tokenizes text for the model D serves, encodes
    voice clips with D's codec and keeps the voice store, whose writes need the voices
    token (docs/api.md)."""
    if not spec.codec:
        return []
    token = spec.paths.voices_token_file if spec.voices else None
    return ["--model", spec.model, "--codec", spec.codec, *_opt("--voices", spec.voices),
            *_opt("--voices-token-file", token)]


def _extra(spec: UnitSpec, role: str) -> list[str]:
    return list(spec.extra_args.get(role) or [])


def unit_commands(spec: UnitSpec) -> dict[str, list[str]]:
    """Process name -> argv of every process of the unit, in start order (the proxy
    first: P and D register with it at start; the LB last). Names: lb, prefill, decode
    or decode-<i>, proxy, guard, monolith (`container_name` gives the pod's)."""
    if spec.mode not in ("pd", "monolith"):
        raise ValueError(f"mode {spec.mode!r}: expected pd or monolith")
    paths, cli, log = spec.paths, list(spec.program), _opt("--log-level", spec.log_level)
    proxy = ["--proxy-socket", paths.sock("proxy")] if spec.runs_proxy else []
    cmds: dict[str, list[str]] = {}
    if spec.mode == "monolith":
        p_sock = d_sock = paths.sock("monolith")
        cmds["monolith"] = [
            *cli, "monolith", "--socket", p_sock, "--model", spec.model, "--device", spec.device,
            *_model_flags(spec), *_opt("--policy", spec.monolith_policy), *_opt("--chunk-tokens", spec.chunk_tokens),
            *_opt("--pool-tokens", spec.pool_tokens), *_opt("--cache-tokens", spec.cache_tokens), *log,
            *_decode_flags(spec), *_codec_flags(spec), *_prefill_flags(spec), *_metrics(spec, "prefill"),
            *_extra(spec, "monolith"),
        ]
    else:
        p_sock, d_socks = paths.sock("prefill"), spec.decode_sockets()
        d_sock = ",".join(d_socks)
        if spec.runs_proxy:
            cmds["proxy"] = [*cli, "proxy", "--socket", paths.sock("proxy"), *log, *_metrics(spec, "proxy"),
                             *_extra(spec, "proxy")]
        for i, (name, sock) in enumerate(zip(decode_names(spec.decoders), d_socks, strict=True)):
            cmds[name] = [
                *cli, "decode", "--socket", sock, "--prefill-socket", p_sock, "--model", spec.model,
                "--transfer", spec.transfer, "--device", spec.device_of_decode(i),
                "--unit-secret-file", paths.unit_secret_file, *proxy, *_model_flags(spec),
                *_opt("--pool-tokens", spec.pool_tokens), *log, *_decode_flags(spec), *_codec_flags(spec),
                *_metrics(spec, "decode", i),
                *_extra(spec, "decode"),
            ]
        cmds["prefill"] = [
            *cli, "prefill", "--socket", p_sock, "--decode-socket", d_sock, "--model", spec.model,
            "--transfer", spec.transfer, "--device", spec.device, "--unit-secret-file", paths.unit_secret_file,
            *proxy, *_model_flags(spec), *_opt("--cache-tokens", spec.cache_tokens), *log, *_prefill_flags(spec),
            *_depth_flags(spec), *_metrics(spec, "prefill"), *_extra(spec, "prefill"),
        ]
        if spec.guard:  # one HTTP server: /status, /healthz and /metrics, or none at all
            port = spec.guard_port if spec.guard_port is not None else metrics_port_of(spec.metrics_port, "guard")
            cmds["guard"] = [
                *cli, "guard", "--prefill-socket", p_sock, "--decode-socket", d_sock,  # every D is watched
                "--port", str(port or 0), *_opt("--host", spec.guard_host), *log, *_extra(spec, "guard"),
            ]
    token = paths.admin_token_file
    cmds["lb"] = [
        *cli, "lb", "--prefill-socket", p_sock, "--decode-socket", d_sock, "--port", str(spec.lb_port),
        *_opt("--host", spec.lb_host), "--admin-port", str(spec.admin_port), "--admin-host", spec.admin_host,
        *_opt("--admin-token-file", token), *_opt("--unit-name", spec.unit_name), *log,
        *proxy,  # the drain's empty check asks the proxy too
        *_lb_speech_flags(spec), *_extra(spec, "lb"),
    ]
    return cmds
