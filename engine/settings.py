"""Process configuration: pydantic models filled from flags, then env, then defaults.

One way for every process: `parse_config(Model, argv)` builds `--field-name` flags from
the model's fields and reads `PDUNIT_FIELD_NAME` from the environment. Flags win over
env, env over defaults. A Literal field's flag takes only its values (argparse lists them
and exits 2); validation errors name the field and the flag. This module
never starts anything; it only turns argv/env into a validated config object.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pdunit.kernels import decode_settings
from pdunit.kernels.kv_dtype_names import KvCacheDtype

M = TypeVar("M", bound=BaseModel)

ENV_PREFIX = "PDUNIT_"


class ConfigError(SystemExit):
    """Bad configuration: the message names the field, the flag and the env variable."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _is_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return bool in args and all(a in (bool, type(None)) for a in args)
    return False


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (list, tuple)


def choices_of(annotation: Any) -> list[str] | None:
    """The values a field of this annotation takes, when it is a Literal of strings (or
    one or None): argparse refuses any other flag value and lists these."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [choices_of(a) for a in typing.get_args(annotation) if a is not type(None)]
        return [v for m in members for v in m or []] if all(members) else None
    if typing.get_origin(annotation) is Literal:
        values = typing.get_args(annotation)
        if all(isinstance(v, str) for v in values):
            return list(values)
    return None


class _Parser(argparse.ArgumentParser):
    """argparse whose errors (an unknown flag, a value outside a field's choices) are a
    ConfigError, as the model's own are: one exception, exit 2, no traceback."""

    def error(self, message: str) -> typing.NoReturn:
        self.print_usage(sys.stderr)
        text = f"{self.prog}: {message}"
        print(text, file=sys.stderr)
        raise ConfigError(text)


def build_parser(model: type[BaseModel], prog: str, description: str | None = None) -> argparse.ArgumentParser:
    # argparse %-formats help texts: a literal % ("1.5-3% faster") crashed `--help`.
    # A short usage line: argparse prints it above every error, and a line naming all of a
    # process's 40 flags buried the one error under it.
    parser = _Parser(prog=prog, usage="%(prog)s [--flag VALUE ...]  (--help lists the flags)",
                     description=(description or model.__doc__ or "").replace("%", "%%"))
    for name, field in model.model_fields.items():
        # A default_factory field has no `default` (pydantic's PydanticUndefined): its
        # factory's value is the default a user gets.
        default = "required" if field.is_required() else f"default {field.get_default(call_default_factory=True)!r}"
        help_text = ((field.description or "") + f" (env {_env(name)}; {default})").replace("%", "%%")
        if _is_bool(field.annotation):
            parser.add_argument(
                _flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                help=help_text,
            )
        else:
            parser.add_argument(_flag(name), dest=name, default=None, choices=choices_of(field.annotation),
                                help=help_text)
    return parser


def _coerce_list(raw: str) -> list[str]:
    return [item for item in (s.strip() for s in raw.split(",")) if item]


def parse_config(
    model: type[M],
    argv: Sequence[str] | None,
    prog: str,
    env: typing.Mapping[str, str] | None = None,
) -> M:
    """Flags, then env, then defaults, validated by the model. Exits 2 with the field named."""
    env = os.environ if env is None else env
    parser = build_parser(model, prog)
    ns = parser.parse_args(list(argv) if argv is not None else sys.argv[1:])
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, field in model.model_fields.items():
        raw = getattr(ns, name)
        source = _flag(name)
        if raw is None and _env(name) in env:
            raw = env[_env(name)]
            source = _env(name)
            if _is_bool(field.annotation):
                raw = raw.strip().lower() in ("1", "true", "yes", "on")
        if raw is None:
            continue
        if isinstance(raw, str) and _is_list(field.annotation):
            raw = _coerce_list(raw)
        values[name] = raw
        sources[name] = source
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            text = err["msg"].removeprefix("Value error, ")
            if not err["loc"]:  # a check across fields: its message names them
                lines.append(f"{prog}: {text}")
                continue
            field_name = str(err["loc"][0])
            where = sources.get(field_name, _flag(field_name))
            lines.append(f"{prog}: invalid {field_name} (from {where}): {text}")
        message = "\n".join(lines)
        print(message, file=sys.stderr)
        raise ConfigError(message) from None


def to_argv(cfg: BaseModel, env: typing.Mapping[str, str] | None = None) -> list[str]:
    """The inverse of `parse_config`: the flags that rebuild `cfg`, one per field whose
    value differs from the field's default, plus one per field that `env` (parse_config's:
    None = os.environ) sets, since that env value would otherwise replace the default."""
    env = os.environ if env is None else env
    argv: list[str] = []
    for name, field in type(cfg).model_fields.items():
        value = getattr(cfg, name)
        if value == field.get_default(call_default_factory=True) and _env(name) not in env:
            continue
        if isinstance(value, bool) and _is_bool(field.annotation):
            argv.append(_flag(name) if value else "--no-" + _flag(name)[2:])
        else:  # one token: a value starting with "-" must not read as a flag
            argv.append(f"{_flag(name)}={_flag_value(name, value, _is_list(field.annotation))}")
    return argv


def _flag_value(name: str, value: Any, is_list: bool) -> str:
    if is_list:
        items = [str(v) for v in value]
        if any("," in item or not item.strip() for item in items):
            raise ValueError(f"{_flag(name)}: items {items!r} cannot be a comma list")
        return ",".join(items)
    if value is None or isinstance(value, (dict, list, tuple, set)):
        raise ValueError(f"{_flag(name)}: {value!r} has no flag form")
    return str(value)


# The one list of KV transfer modes: `--transfer` of P, D and `pdunit local`, the PDUnit
# CRD's spec.transfer (its enum, in this order), the metrics' states; engine/transfer/
# factory.py builds each (tests/test_cli.py checks it builds exactly these). Here, not
# there: this module imports no engine and no torch.
TransferMode = Literal["auto", "fabric", "proxy", "ipc", "posix-fd", "tcp", "host"]
# `--policy` of the monolith: engine/monolith/worker.py POLICIES (kept equal the same way).
MonolithPolicy = Literal["prefill-first", "chunked", "budget"]


def kv_cache_dtype_field() -> Any:
    """`--kv-cache-dtype`, one definition for P, D and the monolith (P and D must agree:
    D's Hello carries its pool dtype and P refuses a different one)."""
    return Field("auto", description="KV pool precision: auto (the model dtype) or fp8_e4m3 (scale 1, "
                 "saturating at +-448, as vLLM's and SGLang's uncalibrated fp8 KV cache): half the KV bytes "
                 "per token, so a decode step reads about half as much KV; P and D must agree")


def canonical_decode_kernel(text: str) -> str:
    """`--decode-kernel` checked, in its canonical form (the settings that differ from
    the default, in the default's order)."""
    return decode_settings.render({**decode_settings.DECODE_DEFAULT, **decode_settings.parse(text)})


# `--decode-kernel` of D and the monolith (the engines that run decode attention).
DecodeKernel = Annotated[str, AfterValidator(canonical_decode_kernel)]


def decode_kernel_field() -> Any:
    return Field("", description="decode attention kernel settings over its defaults, KEY=VALUE,... (e.g. "
                 "kv_as_a=1,fp8_dots=1; kernels/decode_settings.py lists them and their values; `pdunit bench "
                 "step --tune` prints the fastest on its GPU as this flag)")


GemmPrecision = Literal["bf16", "fp8"]  # --prefill-gemm and --decode-gemm


def decode_gemm_field() -> Any:
    """`--decode-gemm`, one definition for D and the monolith."""
    return Field("bf16", description="GEMM precision of decode-only steps: bf16 (the model dtype) or fp8 (e4m3, "
                 "the weights and scales of --prefill-gemm fp8; CUDA needs compute capability 8.9+). On an H200: a "
                 "step 1.5-3% faster at 224-256 streams, slower below (docs/performance.md)")


DepthKernels = Literal["auto", "torch", "fused"]  # --depth-kernels


def depth_kernels_field() -> Any:
    """`--depth-kernels`, one definition for D, the monolith and P (its first frames)."""
    return Field("auto", description="kernels of the csm depth decoder's passes (its frame graphs included): torch "
                 "(its torch modules, ~35 launches a layer), fused (the backbone GPU path's Triton kernels and "
                 "fused q|k|v and gate|up GEMMs; CUDA, bf16/fp16, a model with a depth decoder, else refused) or "
                 "auto (fused where the model has a depth decoder on CUDA in bf16/fp16, else torch; the choice is "
                 "logged at start as `depth kernels`). fused halves csm-1b-shape's step on an H100 "
                 "(docs/performance.md)")


# Row buckets of the prefill CUDA graphs (engine/model/prefill_graphs.py): below ~1000
# rows a forward is bound by its kernel launches from Python, and a graph replays them at
# once (bench/results/prefill-20261130-h200x2-graphs.md); from ~1500 rows up the GPU
# bounds it when the host is free. A bucket pads a forward to its size, and every GEMM
# computes the padding rows.
PREFILL_GRAPH_ROWS = (128, 256, 512, 768, 1024, 1536, 2048)


class PrefillModelFields(BaseModel):
    """The model fields of every engine that runs prefill forwards (P and the monolith):
    engine/prefill/runner.start_prefill_model loads, warms and captures the model they
    describe."""

    model: str = Field("random:tiny:0", description="random:<config>:<seed> or a model directory")
    device: str = Field("cpu", description="torch device")
    dtype: str | None = Field(None, description="compute/KV dtype; default: the model config's")
    kv_cache_dtype: KvCacheDtype = kv_cache_dtype_field()
    prefix_block_tokens: int = Field(16, gt=0, description="rows per prefix-cache block")
    max_batch_rows: int = Field(8192, gt=0, description="prompt rows per prefill forward (the monolith: "
                                "prefill-first's; chunked takes --chunk-tokens)")
    warmup_rows: int | None = Field(None, ge=0, description="before serving, prefill random prompts of this many "
                                    "rows (kernel compilation and GEMM choice happen there, not in the first "
                                    "requests); default --max-batch-rows on CUDA (the largest forward), 0 on CPU")
    prefill_gemm: GemmPrecision = Field("bf16", description="GEMM precision of forwards with prompt rows: "
                                      "bf16 (the model dtype) or fp8 (e4m3, per-channel weight and "
                                      "per-row activation scales; CUDA needs compute capability 8.9+)")
    fp8_min_rows: int | None = Field(None, ge=0, description="prefill_gemm fp8: forwards with fewer rows in all "
                                     "stay in bf16; default 0 with prefill graphs, 1200 without (on an H200 an "
                                     "eager fp8 forward of 800 rows is 0.8x as fast as an eager bf16 one, and an fp8 "
                                     "graph 1.4x a bf16 graph: bench/results/prefill-20261130-h200x2-graphs.md)")
    prefill_graphs: bool | None = Field(None, description="replay CUDA graphs, one per row bucket (--prefill-graph-rows), "
                                        "for prefill forwards that fit one (small forwards are bound by kernel "
                                        "launches); default on where the model takes the GPU path (CUDA, bf16 or "
                                        "fp16), else off; asking for them elsewhere is an error")

    prefill_graph_rows: list[int] = Field(default_factory=list,
                                          description="row buckets of the prefill graphs (comma list; empty, the default: "
                                          "128,256,512,768,1024,1536,2048, up to the first that holds --max-batch-rows): a forward "
                                          "of up to the largest replays the smallest bucket that holds it, its rows "
                                          "padded to the bucket (GEMMs compute the padding); larger forwards run "
                                          "eagerly. Larger buckets take memory and capture time at start")

    @field_validator("prefill_graph_rows")
    @classmethod
    def _buckets_are_row_counts(cls, v: list[int]) -> list[int]:
        if v and min(v) < 1:
            raise ValueError(f"{v}: give positive row counts")
        return sorted(set(v))

    @model_validator(mode="after")
    def _buckets_fit_a_forward(self) -> PrefillModelFields:
        if self.prefill_graph_rows and max(self.prefill_graph_rows) > self.max_batch_rows:
            raise ValueError(f"prefill_graph_rows: a bucket of {max(self.prefill_graph_rows)} rows is larger than "
                             f"--max-batch-rows {self.max_batch_rows}, the largest forward: it would never replay")
        return self

    def graph_buckets(self) -> list[int]:
        """The prefill graphs' row buckets: `--prefill-graph-rows`, else the default ones
        up to the first that holds `--max-batch-rows` (none larger: they would never
        replay)."""
        if self.prefill_graph_rows:
            return list(self.prefill_graph_rows)
        holds = next((b for b in PREFILL_GRAPH_ROWS if b >= self.max_batch_rows), PREFILL_GRAPH_ROWS[-1])
        return [b for b in PREFILL_GRAPH_ROWS if b <= holds]

    def resolved_prefill(self, gpu_path: bool) -> tuple[bool, int]:
        """(prefill_graphs, fp8_min_rows) with their defaults applied for a model that
        does or does not take the GPU path (TTSModel.gpu_path: CUDA in bf16/fp16; the
        graphs capture its kernels)."""
        graphs = self.prefill_graphs if self.prefill_graphs is not None else gpu_path
        min_rows = self.fp8_min_rows if self.fp8_min_rows is not None else (0 if graphs else 1200)
        return graphs, min_rows


class FirstFrameFields(BaseModel):
    """How P makes its first frames (a frame generator after the prefill forward: csm's
    depth decoder), P's and `pdunit bench prefill`'s flags: engine/prefill/runner.py
    start_first_frames sets them (the monolith's come with its decode steps)."""

    depth_kernels: DepthKernels = depth_kernels_field()
    decode_gemm: GemmPrecision = Field("bf16", description="GEMM precision of the frame generator's passes in the "
                                       "first frames (csm's depth decoder): D's --decode-gemm, so P's first frames "
                                       "are D's under fp8 too; bf16 (the model dtype) or fp8 (e4m3). A model "
                                       "without a frame generator has no such passes: fp8 is refused there")
    frame_graphs: bool | None = Field(None, description="replay the first frames from CUDA graphs, one per batch "
                                      "bucket of prompts finished in a forward (1, 2, 4, ... up to the most a "
                                      "forward finishes: P's --max-batch-prompts); more run eagerly. Default on "
                                      "where the model takes the GPU path (CUDA, bf16/fp16) and its frame generator "
                                      "has a capture-safe form (csm's depth decoder), else off; asking for them "
                                      "elsewhere is an error")


def parse_decode_sockets(value: str) -> list[str]:
    """`--decode-socket`: one socket, or a comma list (one P feeding several D's)."""
    sockets = [s.strip() for s in value.split(",") if s.strip()]
    if not sockets:
        raise ValueError("--decode-socket is empty: give D's socket, or a comma list of D sockets")
    if len(set(sockets)) != len(sockets):
        raise ValueError(f"--decode-socket {value!r} names a socket twice: each D once")
    return sockets
