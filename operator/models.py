"""The PDUnit and PDUnitSet API (group pdunit.dev, version v1alpha1) as pydantic models.

These models are the single source of the custom resources: `crdgen` turns them into
the CRDs in crds/ (OpenAPI v3 structural schema, defaults, enums, CEL rules), and the
operator validates what it reads from the apiserver with them (a stored object the
models refuse becomes a status condition naming the field, never a crash).
Field names are the camelCase names of the Kubernetes API (aliases); Python code may
use either. This module holds no logic beyond validation and must never do I/O.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from pdunit.engine.settings import (
    DepthKernels,
    GemmPrecision,
    TransferMode,
    canonical_decode_kernel,
)
from pdunit.engine.unit_layout import (
    ADMIN_PORT,
    LB_PORT,
    METRICS_OFFSETS,
    RUN_DIR,
    SECRETS_DIR,
    metrics_block,
)
from pdunit.kernels.kv_dtype_names import KvCacheDtype

GROUP = "pdunit.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
UNIT_KIND, UNIT_PLURAL, UNIT_SHORT = "PDUnit", "pdunits", "pdu"
SET_KIND, SET_PLURAL, SET_SHORT = "PDUnitSet", "pdunitsets", "pdus"
# `kubectl get pdunit-all` lists both kinds. Never a kind's singular, plural or short name:
# kubectl expands a category before it resolves a kind, so `kubectl get pdunit NAME` would
# mean both kinds and refuse the NAME ("you must specify only one resource").
CATEGORY = "pdunit-all"

# Labels other components select on (router, scaler, chart): keep these names stable.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_UNIT = f"{GROUP}/unit"
LABEL_SET = f"{GROUP}/set"
LABEL_TEMPLATE_HASH = f"{GROUP}/template-hash"
ANNOTATION_SPEC_HASH = f"{GROUP}/spec-hash"
# Test-only: the envtest suite runs every fake pod on 127.0.0.1, so each fake LB listens
# on its own port and the stand-in kubelet writes it here. The operator honours it only
# when started with --allow-lb-port-override (off by default, never on in the chart).
ANNOTATION_LB_PORT_OVERRIDE = f"{GROUP}/lb-port-override"
# Test-only as well, the same way: the fake LB's admin port.
ANNOTATION_ADMIN_PORT_OVERRIDE = f"{GROUP}/admin-port-override"
FINALIZER = f"{GROUP}/drain"

# --decode-kernel of every D: its syntax checked by the apiserver (the pattern: KEY=VALUE,...
# or empty), its keys and values by the operator (kernels/decode_settings.py, torch-free),
# whose refusal is an InvalidSpec condition naming the field. The constraints go before the
# validator: after it, pydantic checks them in Python and leaves them out of the schema.
DecodeKernelSpec = Annotated[
    str,
    StringConstraints(max_length=256, pattern=r"^$|^[a-z0-9_]+=-?[0-9]+(,[a-z0-9_]+=-?[0-9]+)*$"),
    AfterValidator(canonical_decode_kernel),
]

Phase = Literal["Pending", "Starting", "Ready", "Draining", "Drained", "Failed"]
Device = Literal["cuda", "cpu"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
Role = Literal["lb", "prefill", "decode", "proxy", "guard"]
ROLES: tuple[str, ...] = ("lb", "prefill", "decode", "proxy", "guard")


class _Api(BaseModel):
    """camelCase on the wire, snake_case or camelCase in Python; unknown keys refused."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=False
    )


# Fault injection (torn writes, stalls, corrupted KV, the pool's debug map) is for test
# runs only: `pdunit prefill` has its `--fault-*` switches only when started with
# PDUNIT_FAULT_INJECTION=1 (bench/fault_injection.py), and no pod ever is. Older images
# took them (and --transfer-chunk-*) always; decode's --debug-port is "never in a pod"
# too. A flag counts with its abbreviations (argparse resolves a unique prefix:
# `--fault-w 1` is --fault-wedge-id), so every token starting with one of these prefixes
# is refused, which only ever hits such flags (tests/operator check this against every
# process's real flags, the fault suite's included). Their env variables (PDUNIT_<FIELD>,
# engine/settings.py) and the switch itself are refused in spec.env.
FAULT_FLAGS = "--fault-*, --transfer-chunk-*, --debug-port"
FAULT_FLAG_PREFIXES = ("--fa", "--transfer-c", "--deb")
FAULT_FLAG_PATTERN = "^(" + "|".join(FAULT_FLAG_PREFIXES) + ")"  # only [a-z-]: the same in RE2 (CEL)
FAULT_ENV_PATTERN = "^PDUNIT_(FAULT_|TRANSFER_CHUNK_|DEBUG_PORT$)"
_FAULT_WHY = "fault injection is for test runs (PDUNIT_FAULT_INJECTION=1), never in a unit pod: remove it"


def _no_fault_flag(arg: str) -> str:
    if re.match(FAULT_FLAG_PATTERN, arg):
        raise ValueError(f"{arg!r} is a fault-injection flag or an abbreviation of one ({FAULT_FLAGS}): "
                         f"{_FAULT_WHY}")
    return arg


def _no_fault_env(name: str) -> str:
    if re.match(FAULT_ENV_PATTERN, name):
        raise ValueError(f"{name} turns on fault injection or sets one of its flags: {_FAULT_WHY}")
    return name


# The constraints go before the validator (as DecodeKernelSpec's); the CEL rule makes the
# apiserver refuse what the operator refuses, naming the list item.
ExtraArg = Annotated[
    str,
    StringConstraints(max_length=4096),
    AfterValidator(_no_fault_flag),
    Field(json_schema_extra={"x-kubernetes-validations": [{
        "rule": f"!self.matches('{FAULT_FLAG_PATTERN}')",
        "messageExpression": f"self + ' is a fault-injection flag or an abbreviation of one: {_FAULT_WHY}'",
    }]}),
]


class EnvVar(_Api):
    name: Annotated[str, AfterValidator(_no_fault_env)] = Field(
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$",
        description="Environment variable name (not PDUNIT_FAULT_*, PDUNIT_TRANSFER_CHUNK_* or "
        "PDUNIT_DEBUG_PORT: fault injection never runs in a pod).",
        json_schema_extra={"x-kubernetes-validations": [{
            "rule": f"!self.matches('{FAULT_ENV_PATTERN}')",
            "messageExpression": f"self + ' turns on fault injection or sets one of its flags: {_FAULT_WHY}'",
        }]},
    )
    value: str | None = Field(default=None, max_length=32768, description="Literal value (or valueFrom).")
    value_from: dict[str, Any] | None = Field(
        default=None,
        description="A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef), "
        "validated by the apiserver when the pod is created.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name} has both value and valueFrom: keep one")
        return self


class Toleration(_Api):
    key: str | None = Field(default=None, description="Taint key; empty with Exists = all.")
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0)


Quantity = int | str


class ContainerResources(_Api):
    """Requests and limits of one container (Kubernetes quantities: 2, "500m", "4Gi")."""

    requests: dict[str, Quantity] | None = Field(default=None, max_length=16)
    limits: dict[str, Quantity] | None = Field(default=None, max_length=16)


class RoleResources(_Api):
    """Per-container resources. prefill and decode always get one `gpuResource` limit."""

    lb: ContainerResources | None = None
    prefill: ContainerResources | None = None
    decode: ContainerResources | None = None
    proxy: ContainerResources | None = None
    guard: ContainerResources | None = None


class RoleArgs(_Api):
    """Extra command-line flags appended to one role's `pdunit <role>` command (no fault-injection flag)."""

    lb: list[ExtraArg] | None = Field(default=None, max_length=64)
    prefill: list[ExtraArg] | None = Field(default=None, max_length=64)
    decode: list[ExtraArg] | None = Field(default=None, max_length=64)
    proxy: list[ExtraArg] | None = Field(default=None, max_length=64)
    guard: list[ExtraArg] | None = Field(default=None, max_length=64)


# --------------------------------------------------------------- pod adaptation
# A core/v1 object the CRD keeps whole (x-kubernetes-preserve-unknown-fields): the
# apiserver validates it against the Pod schema when the operator creates the pod, and a
# refusal there reaches the PDUnit's status naming the pod field. Embedding the core
# schemas instead would copy ~4000 lines of Kubernetes' OpenAPI into each CRD, pinned to
# one Kubernetes minor, for errors that name the same field one step earlier.
KubeObject = Annotated[dict[str, Any], Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})]

# What the operator owns in the pod: its volumes (sockets, scratch, shared memory, the
# unit's Secret, the voice store) and the paths they are mounted at. Refused by name.
VOICES_MOUNT_PATH = "/var/lib/pdunit/voices"
# proxyDeviceAccess volumeMounts: the NVIDIA container runtime reads the GPUs a container
# gets from the mounts under this folder (`all`: every GPU of the node).
NVIDIA_DEVICES_DIR = "/var/run/nvidia-container-devices"
# spec.codecConvTable: the ConfigMap key mounted read-only into every decode engine as this
# one file (whatever the key's name), the path their --codec-conv-table names.
CODEC_CONV_TABLE_VOLUME = "codec-conv-table"
CODEC_CONV_TABLE_DIR = "/etc/pdunit/codec-conv"
CODEC_CONV_TABLE_FILE = f"{CODEC_CONV_TABLE_DIR}/codec-conv.json"
OPERATOR_VOLUMES: tuple[str, ...] = ("run", "tmp", "shm", "unit-secret", "admin-token", "voices-token",
                                     "nvidia-all-gpus", "pdunit-voices", CODEC_CONV_TABLE_VOLUME)
OPERATOR_MOUNT_PATHS: tuple[str, ...] = (RUN_DIR, "/tmp", "/dev/shm", SECRETS_DIR, VOICES_MOUNT_PATH,
                                         NVIDIA_DEVICES_DIR, CODEC_CONV_TABLE_DIR)
# Labels the router, the scaler and the chart select unit pods on.
OPERATOR_LABEL_KEYS: tuple[str, ...] = (LABEL_NAME, LABEL_COMPONENT, LABEL_MANAGED_BY)
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_OWNED_WHY = "the operator owns it (docs/operator.md, the unit pod)"


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


def _not_operator_volume(name: str) -> str:
    if name in OPERATOR_VOLUMES:
        raise ValueError(f"volume name {name!r} is one of the operator's {list(OPERATOR_VOLUMES)}: "
                         f"{_OWNED_WHY}; rename yours")
    return name


def _not_operator_path(path: str) -> str:
    for owned in OPERATOR_MOUNT_PATHS:
        if path == owned or path.startswith(owned + "/"):
            raise ValueError(f"mountPath {path} is (or is under) the operator's {owned}: {_OWNED_WHY}; "
                             "mount elsewhere")
    return path


_MOUNT_PATH_RULE = " && ".join(
    f"!(self == '{p}' || self.startsWith('{p}/'))" for p in OPERATOR_MOUNT_PATHS
)


class LocalObjectReference(_Api):
    name: str = Field(min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN)


class Volume(_Api):
    """A core/v1 Volume (any source: persistentVolumeClaim, hostPath, image, configMap, ...):
    its name is checked here, the rest by the apiserver when the pod is created."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})

    name: Annotated[str, AfterValidator(_not_operator_volume)] = Field(
        min_length=1, max_length=63, pattern=_DNS_LABEL,
        description=f"Volume name (not one of the operator's: {', '.join(OPERATOR_VOLUMES)}).",
        json_schema_extra={"x-kubernetes-validations": [{
            "rule": f"!(self in {_cel_list(OPERATOR_VOLUMES)})",
            "messageExpression": f"'volume name ' + self + ' is one of the operator\\'s: {_OWNED_WHY}; rename yours'",
        }]},
    )


class VolumeMount(_Api):
    name: str = Field(min_length=1, max_length=63, pattern=_DNS_LABEL, description="A volume of spec.volumes.")
    mount_path: Annotated[str, AfterValidator(_not_operator_path)] = Field(
        min_length=2, max_length=4096, pattern="^/",
        description=f"Absolute path, not at or under the operator's {', '.join(OPERATOR_MOUNT_PATHS)}.",
        json_schema_extra={"x-kubernetes-validations": [{
            "rule": _MOUNT_PATH_RULE,
            "messageExpression": f"'mountPath ' + self + ' is (or is under) a path of the operator: {_OWNED_WHY}'",
        }]},
    )
    read_only: bool | None = None
    sub_path: str | None = Field(default=None, max_length=4096)


class RoleEnv(_Api):
    """Environment variables of one container role only (decode: every decode engine), after spec.env."""

    lb: list[EnvVar] | None = Field(default=None, max_length=64)
    prefill: list[EnvVar] | None = Field(default=None, max_length=64)
    decode: list[EnvVar] | None = Field(default=None, max_length=64)
    proxy: list[EnvVar] | None = Field(default=None, max_length=64)
    guard: list[EnvVar] | None = Field(default=None, max_length=64)


class RoleVolumeMounts(_Api):
    """Extra volume mounts per container role (decode: every decode engine)."""

    lb: list[VolumeMount] | None = Field(default=None, max_length=32)
    prefill: list[VolumeMount] | None = Field(default=None, max_length=32)
    decode: list[VolumeMount] | None = Field(default=None, max_length=32)
    proxy: list[VolumeMount] | None = Field(default=None, max_length=32)
    guard: list[VolumeMount] | None = Field(default=None, max_length=32)


_LABEL_RULE = (
    f"self.all(k, !k.startsWith('{GROUP}/') && !(k in {_cel_list(OPERATOR_LABEL_KEYS)}))"
)


class PodMetadata(_Api):
    """Labels and annotations added to the unit's pod (never the operator's own keys)."""

    labels: dict[str, str] | None = Field(
        default=None, max_length=64,
        json_schema_extra={"x-kubernetes-validations": [{
            "rule": _LABEL_RULE,
            "message": f"pod labels under {GROUP}/ and {', '.join(OPERATOR_LABEL_KEYS)} are set by the operator",
        }]},
    )
    annotations: dict[str, str] | None = Field(
        default=None, max_length=64,
        json_schema_extra={"x-kubernetes-validations": [{
            "rule": f"self.all(k, !k.startsWith('{GROUP}/'))",
            "message": f"pod annotations under {GROUP}/ are set by the operator",
        }]},
    )

    @field_validator("labels")
    @classmethod
    def _not_operator_labels(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key in value or {}:
            if key.startswith(f"{GROUP}/") or key in OPERATOR_LABEL_KEYS:
                raise ValueError(f"pod label {key} is set by the operator: remove it")
        return value

    @field_validator("annotations")
    @classmethod
    def _not_operator_annotations(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key in value or {}:
            if key.startswith(f"{GROUP}/"):
                raise ValueError(f"pod annotation {key} is set by the operator: remove it")
        return value


_VOICES_READ_ONLY_MESSAGE = ("voices.tokenSecret allows voice writes, voices.readOnly refuses them: "
                             "remove one")
_VOICES_SOURCE_MESSAGE = "voices needs exactly one of volume (a volume of spec.volumes) and claimName"
# The pod volume the operator makes of spec.voices.claimName (reserved: OPERATOR_VOLUMES).
VOICES_CLAIM_VOLUME = "pdunit-voices"


class VoiceStore(_Api):
    """The voice store's volume, mounted into the LB at VOICES_MOUNT_PATH, and the Secret its writes need."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "!has(self.tokenSecret) || !has(self.readOnly) || !self.readOnly",
         "message": _VOICES_READ_ONLY_MESSAGE, "fieldPath": ".tokenSecret"},
        {"rule": "has(self.volume) != has(self.claimName)", "message": _VOICES_SOURCE_MESSAGE},
    ]})

    volume: str | None = Field(
        default=None, min_length=1, max_length=63, pattern=_DNS_LABEL,
        description="A volume of spec.volumes holding the voice store's directory (or claimName).")
    claim_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN,
        description="A PersistentVolumeClaim of the unit's namespace holding the voice store (or volume): the "
        f"operator adds it as the pod volume {VOICES_CLAIM_VOLUME} and mounts it into the LB. Make it "
        "ReadWriteMany: every unit of a set mounts the same claim, so a voice stored through any unit (or the "
        "router) is every unit's at once.")
    sub_path: str | None = Field(default=None, max_length=4096, description="Folder inside that volume.")
    read_only: bool | None = Field(default=None, description="Mount read-only (voices are then never added).")
    token_secret: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN,
        description="A Secret of the unit's namespace whose key voices-token (at least 16 characters) is the "
        "bearer token that creating, replacing and deleting a voice needs (the LB's --voices-token-file, "
        "mounted from it read-only, mode 0440, into the LB only). One Secret for every unit of a set: the same "
        "token uploads a voice to each. Unset: the LB's voice store is read-only (every write 403); listing "
        "and reading voices never need a token.")

    @model_validator(mode="after")
    def _writes_need_a_writable_store(self) -> VoiceStore:
        if self.token_secret and self.read_only:
            raise ValueError(_VOICES_READ_ONLY_MESSAGE)
        if (self.volume is None) == (self.claim_name is None):
            raise ValueError(_VOICES_SOURCE_MESSAGE)
        return self


# spec.tracing.otlpEndpoint: engine/tracing.py's --otlp-endpoint (OTLP/gRPC), host:port or
# http(s)://host:port (a host name, an IPv4 address or an [IPv6] one).
OTLP_ENDPOINT_PATTERN = (r"^(https?://)?([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
                         r":[0-9]{1,5}$")
_OTLP_MESSAGE = "otlpEndpoint must be host:port or http(s)://host:port (an OTLP/gRPC collector)"


def _otlp_endpoint(value: str) -> str:
    if not re.match(OTLP_ENDPOINT_PATTERN, value) or not 0 < int(value.rsplit(":", 1)[1]) <= 65535:
        raise ValueError(f"{_OTLP_MESSAGE}: got {value[:100]!r}")
    return value


class TracingSettings(_Api):
    """OpenTelemetry traces of the unit's processes (docs/tracing.md)."""

    otlp_endpoint: Annotated[str, AfterValidator(_otlp_endpoint)] = Field(
        max_length=512,
        description="The OTLP/gRPC collector every process of the unit (lb, prefill, each decode) sends its "
        "spans to: PDUNIT_OTLP_ENDPOINT in their environment (their --otlp-endpoint). host:port or "
        "http(s)://host:port.",
        json_schema_extra={"x-kubernetes-validations": [{
            "rule": f"self.matches('{OTLP_ENDPOINT_PATTERN.replace(chr(92), chr(92) * 2)}') && "
                    "int(self.substring(self.lastIndexOf(':') + 1)) <= 65535 && "
                    "int(self.substring(self.lastIndexOf(':') + 1)) > 0",
            "message": _OTLP_MESSAGE}]},
    )


Qos = Literal["Burstable", "Guaranteed"]
GpuAllocation = Literal["devicePlugin", "dra"]
ProxyDeviceAccess = Literal["envVar", "volumeMounts"]
_QUALIFIED_NAME = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-_.A-Za-z0-9]*[A-Za-z0-9])?$"


class DraSettings(_Api):
    """gpuAllocation dra: the unit's ResourceClaimTemplate (resource.k8s.io/v1)."""

    device_class_name: str = Field(
        default="gpu.nvidia.com", max_length=253, pattern=_DNS_SUBDOMAIN,
        description="DeviceClass of each GPU request (the NVIDIA DRA driver's: gpu.nvidia.com).")
    nvlink_domain_attribute: str | None = Field(
        default=None, max_length=128, pattern=_QUALIFIED_NAME,
        description="Fully qualified device attribute whose value all the unit's GPUs must share "
        "(a matchAttribute constraint): the NVLink domain as the node's DRA driver publishes it. Unset: "
        "no constraint beyond one node (every GPU of an NVSwitch node shares one NVLink domain).")


_MODEL_RULE = "self.startsWith('/') || self.matches('^random:[A-Za-z0-9_.-]+:[0-9]+$')"

# spec.codec: the --codec of every decode engine and of the LB (engine/audio/codec_spec.py's
# forms). `checkpoint` reads the model's own folder, so it needs a model path.
CODEC_CHECKPOINT = "checkpoint"
CODEC_PATTERN = r"^random:mimi-tiny:[0-9]+$"
_CODEC_RULE = f"self == '' || self == '{CODEC_CHECKPOINT}' || self.matches('{CODEC_PATTERN}') || self.startsWith('/')"
_CODEC_MESSAGE = (f"codec must be empty, '{CODEC_CHECKPOINT}', 'random:mimi-tiny:<seed>' or the absolute path "
                  "of a folder saved by MimiModel.save_pretrained")
_CODEC_CHECKPOINT_MESSAGE = (f"codec {CODEC_CHECKPOINT} reads the model checkpoint's own codec: model must be "
                             "a checkpoint folder (an absolute path)")
AUDIO_MAX_CHUNK_FRAMES = 100  # 8 s of audio at Mimi's 12.5 frames a second


def _codec_form(value: str | None) -> str | None:
    if value and value != CODEC_CHECKPOINT and not re.match(CODEC_PATTERN, value) and not value.startswith("/"):
        raise ValueError(f"{_CODEC_MESSAGE}: got {value[:100]!r}")
    return value


class AudioChunks(_Api):
    """PCM chunking of every decode engine's codec stage (unset: the first chunk after 1 frame, then every 2)."""

    first_chunk_frames: int | None = Field(
        default=None, ge=1, le=AUDIO_MAX_CHUNK_FRAMES,
        description="Frames of a stream's first PCM chunk (--audio-first-chunk-frames; 1 sends the first "
        "frame's audio at once: the lowest time to first audio). Unset: 1.")
    chunk_frames: int | None = Field(
        default=None, ge=1, le=AUDIO_MAX_CHUNK_FRAMES,
        description="Frames of each later PCM chunk (--audio-chunk-frames; fewer, larger codec calls against "
        "the audio's latency). Unset: 2.")


# A ConfigMap key (core/v1's rule: letters, digits, '-', '_', '.'), not only dots.
CONFIG_MAP_KEY_PATTERN = r"^[-._a-zA-Z0-9]*[-_a-zA-Z0-9][-._a-zA-Z0-9]*$"
_CODEC_CONV_TABLE_MESSAGE = "codec conv tiles need a codec: set codec or remove codecConvTable"


class CodecConvTable(_Api):
    """The codec convolutions' launch tiles of every decode engine: one key of a ConfigMap
    holding the JSON table `pdunit bench codec --tune-conv` wrote (docs/audio.md)."""

    config_map_name: str = Field(
        min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN,
        description="A ConfigMap of the unit's namespace holding the table (kubectl create configmap NAME "
        "--from-file=codec-conv.json=codec-conv-<date>-<tag>.json).")
    key: str = Field(
        min_length=1, max_length=253, pattern=CONFIG_MAP_KEY_PATTERN,
        description="The ConfigMap's key whose value is the table; mounted read-only into every decode "
        f"engine as {CODEC_CONV_TABLE_FILE}, which their --codec-conv-table names.")


# The metrics ports run from metricsPort to metricsPort + 2 + decoders (engine/unit_layout.py:
# metrics_block); the apiserver checks what the operator checks. It applies the fields'
# defaults before it checks a rule, so all three are set.
_METRICS_LAST = f"self.metricsPort + {METRICS_OFFSETS['decode'] - 1} + self.decoders"
_METRICS_PORTS_RULE = (
    f"self.metricsPort == 0 || ({_METRICS_LAST} <= 65535 && "
    f"(self.lbPort < self.metricsPort || self.lbPort > {_METRICS_LAST}) && "
    f"(self.adminPort < self.metricsPort || self.adminPort > {_METRICS_LAST}))"
)
_METRICS_PORTS_MESSAGE = (
    "metricsPort takes ports metricsPort .. metricsPort + 2 + decoders: they must end by 65535 "
    "and leave out lbPort and adminPort"
)
_ADMIN_PORT_MESSAGE = "adminPort must differ from lbPort (admin routes never share the stream port)"


class PDUnitSpec(_Api):
    """One unit = one pod: LB + prefill (1 GPU) + decode (1 GPU) + sidecars."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.device == 'cuda' || self.transfer in ['host', 'tcp']",
                    "message": "device cpu needs transfer host or tcp (the other modes move "
                    "GPU memory)",
                    "fieldPath": ".transfer",
                },
                {
                    "rule": "!has(self.gpuAllocation) || self.gpuAllocation != 'dra' || self.device == 'cuda'",
                    "message": "gpuAllocation dra needs device cuda (a cpu unit claims no GPU)",
                    "fieldPath": ".gpuAllocation",
                },
                {
                    "rule": "!has(self.proxyDeviceAccess) || !has(self.gpuAllocation) || "
                    "self.gpuAllocation != 'dra'",
                    "message": "proxyDeviceAccess is for gpuAllocation devicePlugin: with dra the proxy "
                    "holds the unit's claim",
                    "fieldPath": ".proxyDeviceAccess",
                },
                {
                    "rule": "!has(self.dra) || (has(self.gpuAllocation) && self.gpuAllocation == 'dra')",
                    "message": "dra settings need gpuAllocation dra",
                    "fieldPath": ".dra",
                },
                {
                    "rule": "self.adminPort != self.lbPort",
                    "message": _ADMIN_PORT_MESSAGE,
                    "fieldPath": ".adminPort",
                },
                {
                    "rule": _METRICS_PORTS_RULE,
                    "message": _METRICS_PORTS_MESSAGE,
                    "fieldPath": ".metricsPort",
                },
                {
                    "rule": f"!has(self.codec) || self.codec != '{CODEC_CHECKPOINT}' || self.model.startsWith('/')",
                    "message": _CODEC_CHECKPOINT_MESSAGE,
                    "fieldPath": ".codec",
                },
                {
                    "rule": "!has(self.audio) || (has(self.codec) && self.codec != '')",
                    "message": "audio chunking needs a codec: set codec or remove audio",
                    "fieldPath": ".audio",
                },
                {
                    "rule": "!has(self.codecConvTable) || (has(self.codec) && self.codec != '')",
                    "message": _CODEC_CONV_TABLE_MESSAGE,
                    "fieldPath": ".codecConvTable",
                },
            ]
        }
    )

    image: str = Field(min_length=1, max_length=1024, description="Unit image (engine + sidecars).")
    image_pull_policy: PullPolicy = Field(default="IfNotPresent")
    model: str = Field(
        min_length=1,
        max_length=4096,
        description="'random:<config>:<seed>' (deterministic random weights) or the absolute path of a "
        "checkpoint folder (config.json + safetensors) in the image or in a volume of spec.volumes that "
        "volumeMounts mounts into prefill and decode (a PVC, a hostPath, an OCI image volume).",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": _MODEL_RULE,
                    "message": "model must be 'random:<config>:<seed>' or an absolute path",
                }
            ]
        },
    )
    gpu_resource: str = Field(
        default="nvidia.com/gpu",
        max_length=253,
        pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$",
        description="Extended resource name of one GPU; prefill and decode request 1 each.",
    )
    device: Device = Field(
        default="cuda",
        description="cuda: prefill and decode get one GPU each; cpu: no GPU requested "
        "(kind/k3d end-to-end tests, demos).",
    )
    transfer: TransferMode = Field(
        default="auto", description="KV transfer mode; auto probes fabric -> proxy -> tcp."
    )
    # No CRD default: the apiserver would fill it into every stored set it serves, and
    # units an older operator labelled with a hash of the full spec would roll on this
    # upgrade (spec_hash.template_hashes leaves defaults out from now on).
    kv_cache_dtype: KvCacheDtype | None = Field(
        default=None,
        description="KV pool precision of prefill and every decode engine (their --kv-cache-dtype, "
        "always the same: P refuses a D of another pool dtype): unset or auto = the model dtype; "
        "fp8_e4m3 halves the KV bytes per token (docs/performance.md).",
    )
    decode_kernel: DecodeKernelSpec | None = Field(
        default=None,
        description="Decode attention kernel settings of every decode engine (their --decode-kernel), "
        "KEY=VALUE,... over the kernel's defaults, which are the measured best (with fp8_e4m3 pools: "
        "Q K^T on fp8 tensor cores; fp8_dots=0 keeps the query exact; docs/performance.md). Unset: the defaults.",
    )
    # No CRD default either (as kv_cache_dtype): unset and bf16 both mean no flag.
    prefill_gemm: GemmPrecision | None = Field(
        default=None,
        description="GEMM precision of the prefill engine's forwards (its --prefill-gemm): bf16 (the model "
        "dtype) or fp8 (e4m3 weights per channel, activations per row; 1.3-1.4x faster prefill from ~1500 "
        "rows up on H200, docs/performance.md); needs compute capability 8.9+. Unset: bf16.",
    )
    decode_gemm: GemmPrecision | None = Field(
        default=None,
        description="GEMM precision of every decode engine's decode steps (their --decode-gemm): bf16 or "
        "fp8; fp8 made 1P1D's D pass 44 req/s where bf16 failed it in the same run (docs/performance.md); "
        "changes the numerics of every frame. Unset: bf16.",
    )
    depth_kernels: DepthKernels | None = Field(
        default=None,
        description="Kernels of the csm depth decoder's passes in every decode engine's steps and in the "
        "prefill engine's first frames (their --depth-kernels; one in extraArgs comes after it and wins for "
        "its role): torch (its torch modules), fused (the backbone's Triton kernels; CUDA in bf16/fp16 and a "
        "model with a depth decoder, else the engines refuse to start) or auto (fused where it runs, else "
        "torch). Unset: auto.",
    )
    lb_port: int = Field(default=LB_PORT, ge=1, le=65535, description="LB HTTP port (streams, /v1/load, /metrics).")
    admin_port: int = Field(
        default=ADMIN_PORT, ge=1, le=65535, validate_default=True,  # the default must clear lbPort too
        description="LB admin port (POST /v1/admin/drain): a named container port `admin`, served on the pod IP "
        "with the bearer token of the unit's Secret (<unit>-unit-secret, key admin-token); the chart's "
        "NetworkPolicy admits only the operator to it.",
    )

    @field_validator("admin_port")
    @classmethod
    def _admin_port_is_its_own(cls, value: int, info: ValidationInfo) -> int:
        if value == info.data.get("lb_port"):
            raise ValueError(f"{_ADMIN_PORT_MESSAGE}: both are {value}")
        return value

    decoders: int = Field(
        default=1, ge=1, le=7,
        description="Decode engines fed by the unit's one prefill engine (1 = 1P1D, 2 = 1P2D), "
        "one GPU each.",
    )
    metrics_port: int = Field(
        default=9400, ge=0, le=65535, validate_default=True,  # the default must clear lbPort too
        description="First of the unit's Prometheus /metrics ports, one per process: prefill on it, the "
        "nvlink proxy on +1, the quiesce guard on +2 (with its /status), decode engine i on +3+i; each a "
        "named container port (metrics-prefill, metrics-proxy, metrics-guard, metrics-decode<i>) for a "
        "PodMonitor. The LB serves its own /metrics on lbPort. 0 = none of them (the guard then serves "
        "no HTTP).",
    )

    @field_validator("metrics_port")
    @classmethod
    def _metrics_ports_fit(cls, value: int, info: ValidationInfo) -> int:
        block = metrics_block(value, int(info.data.get("decoders") or 1))
        if block and block[-1] > 65535:
            raise ValueError(f"{_METRICS_PORTS_MESSAGE}: {value} + 2 + decoders is {block[-1]}")
        for name in ("lb_port", "admin_port"):
            port = info.data.get(name)
            if port in block:
                raise ValueError(f"{_METRICS_PORTS_MESSAGE}: {to_camel(name)} {port} is one of "
                                 f"{block[0]}..{block[-1]}")
        return value

    resources: RoleResources | None = None
    drain_timeout_seconds: int = Field(
        default=600,
        ge=1,
        le=86400,
        description="Streams still in flight after this long are cut and the pod deleted.",
    )
    draining: bool = Field(
        default=False, description="Stop taking streams, finish those in flight, then stop the pod."
    )
    node_selector: dict[str, str] | None = Field(default=None, max_length=64)
    tolerations: list[Toleration] | None = Field(default=None, max_length=64)
    env: list[EnvVar] | None = Field(default=None, max_length=128)
    extra_args: RoleArgs | None = None
    # Pod adaptation (docs/operator.md, adapting the pod). No CRD defaults (kvCacheDtype's reason).
    pod_metadata: PodMetadata | None = None
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        default=None, max_length=16, description="Pulled with these Secrets, after the operator's own list.")
    service_account_name: str | None = Field(
        default=None, max_length=253, pattern=_DNS_SUBDOMAIN,
        description="The pod's service account (its token stays unmounted: unit pods never call the API).")
    priority_class_name: str | None = Field(default=None, max_length=253, pattern=_DNS_SUBDOMAIN)
    runtime_class_name: str | None = Field(default=None, max_length=253, pattern=_DNS_SUBDOMAIN)
    affinity: KubeObject | None = Field(default=None, description="A core/v1 Affinity.")
    topology_spread_constraints: list[KubeObject] | None = Field(
        default=None, max_length=16, description="core/v1 TopologySpreadConstraints.")
    volumes: list[Volume] | None = Field(
        default=None, max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="core/v1 Volumes added to the pod (weights, voices, caches).")
    volume_mounts: RoleVolumeMounts | None = None
    role_env: RoleEnv | None = None
    qos: Qos | None = Field(
        default=None,
        description="Burstable (unset): every container requests CPU and memory (defaults where "
        "spec.resources gives none). Guaranteed: each container's CPU and memory limits equal its requests.")
    voices: VoiceStore | None = None
    tracing: TracingSettings | None = None
    # No CRD defaults (kvCacheDtype's reason): a unit without them keeps its hash.
    codec: Annotated[str, StringConstraints(max_length=4096), AfterValidator(_codec_form)] | None = Field(
        default=None,
        description="The codec that turns frames into PCM (--codec of every decode engine and of the LB, which "
        "then serves POST /v1/audio/speech and /v1/voices, reading the tokenizer of spec.model): "
        "random:mimi-tiny:<seed> (a tiny random Mimi shaped to the model), checkpoint (the CSM checkpoint "
        "folder's own codec) or the absolute path of a folder saved by MimiModel.save_pretrained, in the image "
        "or on a volume of spec.volumes. Unset or empty: frames only. The LB and the decode engines get the "
        "mounts that hold spec.model and a codec folder (docs/operator.md).",
        json_schema_extra={"x-kubernetes-validations": [{"rule": _CODEC_RULE, "message": _CODEC_MESSAGE}]},
    )
    audio: AudioChunks | None = None
    codec_conv_table: CodecConvTable | None = Field(
        default=None,
        description="The codec convolutions' launch tiles by shape, a table `pdunit bench codec --tune-conv` "
        "wrote on the GPU model the unit runs on, from a ConfigMap key mounted read-only into every decode "
        "engine (their --codec-conv-table). Needs codec. Read once at the engine's start: a table tuned on "
        "another GPU model, or a cpu unit, runs the hand tiles (logged). Unset: the hand tiles.")

    @field_validator("codec")
    @classmethod
    def _codec_fits_the_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        model = info.data.get("model")
        if value == CODEC_CHECKPOINT and model is not None and not model.startswith("/"):
            raise ValueError(f"{_CODEC_CHECKPOINT_MESSAGE}: model is {model!r}")
        return value

    @field_validator("audio")
    @classmethod
    def _audio_needs_a_codec(cls, value: AudioChunks | None, info: ValidationInfo) -> AudioChunks | None:
        # a codec that failed its own check is not in info.data: named once, there
        if value is not None and "codec" in info.data and not info.data["codec"]:
            raise ValueError("audio chunking needs a codec: set codec or remove audio")
        return value

    @field_validator("codec_conv_table")
    @classmethod
    def _conv_table_needs_a_codec(cls, value: CodecConvTable | None, info: ValidationInfo) -> CodecConvTable | None:
        if value is not None and "codec" in info.data and not info.data["codec"]:
            raise ValueError(_CODEC_CONV_TABLE_MESSAGE)
        return value

    gpu_allocation: GpuAllocation | None = Field(
        default=None,
        description="devicePlugin (unset): prefill and each decode request one gpuResource. dra: one "
        "ResourceClaimTemplate <unit>-gpus-<hash> with one request per engine, the proxy holding them all "
        "(Kubernetes >= 1.34, a DRA driver; docs/operator.md).")
    proxy_device_access: ProxyDeviceAccess | None = Field(
        default=None,
        description="devicePlugin only: how the nvlink proxy (no GPU request) sees the node's GPUs: "
        "envVar (unset: NVIDIA_VISIBLE_DEVICES=all) or volumeMounts (a mount at "
        f"{NVIDIA_DEVICES_DIR}/all).")
    dra: DraSettings | None = None

    @model_validator(mode="after")
    def _gpu_allocation_fits(self) -> PDUnitSpec:
        if self.gpu_allocation == "dra":
            if self.device != "cuda":
                raise ValueError("gpuAllocation dra needs device cuda (a cpu unit claims no GPU)")
            if self.proxy_device_access is not None:
                raise ValueError("proxyDeviceAccess is for gpuAllocation devicePlugin: with dra the proxy "
                                 "holds the unit's claim; remove it")
        elif self.dra is not None:
            raise ValueError("dra settings need gpuAllocation dra: set it or remove dra")
        return self


    @model_validator(mode="after")
    def _mounts_name_volumes(self) -> PDUnitSpec:
        names = {v.name for v in self.volumes or []}
        for role in ROLES:
            for i, mount in enumerate(getattr(self.volume_mounts, role, None) or []):
                if mount.name not in names:
                    raise ValueError(f"volumeMounts.{role}[{i}].name {mount.name!r} is not a volume of "
                                     f"spec.volumes {sorted(names)}: add it there")
        if self.voices and self.voices.volume is not None and self.voices.volume not in names:
            raise ValueError(f"voices.volume {self.voices.volume!r} is not a volume of spec.volumes "
                             f"{sorted(names)}: add it there")
        return self


class Condition(_Api):
    type: str = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(default="", max_length=1024)
    message: str = Field(default="", max_length=32768)
    last_transition_time: str | None = None


class DrainStatus(_Api):
    """Progress of a drain, persisted so an operator restart resumes it."""

    started_at: str | None = Field(default=None, description="RFC 3339 time the drain began.")
    requested: bool | None = Field(
        default=None, description="The LB accepted POST /v1/admin/drain."
    )
    empty_checks: int | None = Field(default=None, ge=0, description="Consecutive empty answers.")
    first_empty_at: str | None = None
    completed_at: str | None = Field(default=None, description="When the pod was deleted.")
    forced: bool | None = None
    streams_cut: int | None = Field(default=None, ge=0)


class PDUnitStatus(_Api):
    phase: Phase | None = None
    pod_name: str | None = None
    pod_ip: str | None = Field(default=None, alias="podIP")
    node_name: str | None = Field(
        default=None, description="The node the unit's pod was scheduled to (its spec.nodeName)."
    )
    lb_port: int | None = None
    ready: bool | None = None
    draining: bool | None = None
    transfer_mode: str | None = None
    in_flight: int | None = None
    held_pages: int | None = None
    conditions: list[Condition] | None = Field(
        default=None,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: int | None = None
    message: str | None = None
    drain: DrainStatus | None = None


class TemplateMetadata(_Api):
    labels: dict[str, str] | None = Field(
        default=None,
        max_length=64,
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.all(k, !k.startsWith('pdunit.dev/'))",
                    "message": "labels under pdunit.dev/ are set by the operator",
                }
            ]
        },
    )
    annotations: dict[str, str] | None = Field(default=None, max_length=64)


class UnitTemplate(_Api):
    metadata: TemplateMetadata | None = None
    spec: PDUnitSpec


class RolloutStrategy(_Api):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.maxSurge > 0 || self.maxUnavailable > 0",
                    "message": "maxSurge and maxUnavailable cannot both be 0: "
                    "a rollout could never replace a unit",
                }
            ]
        }
    )

    max_surge: int = Field(default=1, ge=0, le=1000, description="Extra units during a rollout.")
    max_unavailable: int = Field(
        default=0, ge=0, le=1000, description="Ready units a rollout may take below replicas."
    )


class PDUnitSetSpec(_Api):
    replicas: int = Field(default=1, ge=0, le=10000, description="Number of units.")
    template: UnitTemplate
    # The apiserver validates a default as given (CEL included), so it is spelled out.
    strategy: RolloutStrategy = Field(
        default_factory=RolloutStrategy,
        json_schema_extra={"default": {"maxSurge": 1, "maxUnavailable": 0}},
    )


class PDUnitSetStatus(_Api):
    replicas: int | None = None
    ready_replicas: int | None = None
    updated_replicas: int | None = None
    draining_replicas: int | None = None
    selector: str | None = None
    template_hash: str | None = None
    conditions: list[Condition] | None = Field(
        default=None,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: int | None = None


def validation_message(exc: Exception, prefix: str = "spec") -> str:
    """One line per pydantic error, each naming the field as `spec.a.b`."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    parts = []
    for err in errors():
        # pydantic names a field by its alias when the input had it, by its Python name
        # when the error is about its default (metricsPort's check of the default 9400)
        loc = ".".join(_WIRE_NAMES.get(str(p), str(p)) for p in (prefix, *err.get("loc", ())))
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts)


def _wire_names() -> dict[str, str]:
    names: dict[str, str] = {}
    pending: list[type[_Api]] = [_Api]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        names.update({name: f.alias for name, f in cls.model_fields.items() if f.alias and f.alias != name})
    return names


_WIRE_NAMES = _wire_names()


def unit_spec(spec: dict[str, Any]) -> PDUnitSpec:
    """Validate and default a PDUnit spec read from the apiserver (raises ValidationError)."""
    return PDUnitSpec.model_validate(spec)


def set_spec(spec: dict[str, Any]) -> PDUnitSetSpec:
    return PDUnitSetSpec.model_validate(spec)
