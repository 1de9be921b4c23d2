"""Parse, validate and pack one `POST /v1/tts/stream` body at the HTTP edge.

Owns turning raw request bytes (JSON rows, or a binary int32/int64 body with a row-width
header) plus headers into a `PackedRequest` (an int64 [rows, cols] array, its
little-endian bytes for `SubmitRequest.prompt`, and the `pb.Sampling` it carries), or a
`RequestError` whose HTTP status and message name the row, column or field and the limit
(the model family's row rule, from D's Hello, included: engine/model/request_rules.py).
Every `json.loads` first bounds the nesting (`MAX_JSON_DEPTH`): CPython's parser recurses
once per level, and a RecursionError would be a 500. A bad prompt never reaches P.
Never: talk to P or D, keep state between requests, log request bodies.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdunit.engine.model.request_rules import RowRule
from pdunit.engine.packing import pack, view
from pdunit.engine.proto import pdunit_pb2 as pb

JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/octet-stream"
DEPTH_FIELDS = ("depth_decoder_temperature", "depth_decoder_top_k")
SAMPLING_FIELDS = ("max_frames", "min_frames", "temperature", "top_k", "seed", *DEPTH_FIELDS)
JSON_FIELDS = ("prompt", *SAMPLING_FIELDS)
SAMPLING_HEADERS = {
    "max_frames": "x-pdunit-max-frames",
    "min_frames": "x-pdunit-min-frames",
    "temperature": "x-pdunit-temperature",
    "top_k": "x-pdunit-top-k",
    "seed": "x-pdunit-seed",
    "depth_decoder_temperature": "x-pdunit-depth-decoder-temperature",
    "depth_decoder_top_k": "x-pdunit-depth-decoder-top-k",
}
MAX_TEMPERATURE = 100.0
MAX_JSON_DEPTH = 32  # a request nests 3 levels ({"prompt": [[...]]}); more is an attack
UINT64_MAX = (1 << 64) - 1

_WHITESPACE = b" \t\n\r"
_IDENTITY = bytes(range(256))
_QUOTE, _LBRACE, _RBRACE = ord('"'), ord("["), ord("]")
_COMMA, _ZERO = ord(","), ord("0")
_LCURLY, _RCURLY, _BACKSLASH = ord("{"), ord("}"), ord("\\")
_PAD = b"]" * 16


class RequestError(Exception):
    """A client error: HTTP status, a stable code, a message naming field and limit."""

    def __init__(
        self, status: int, code: str, message: str, field: str | None = None, **details: Any
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.details = details

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field is not None:
            err["field"] = self.field
        err.update(self.details)
        return {"error": err}


@dataclass(frozen=True)
class Limits:
    """What the unit accepts; `vocab_sizes[c]` bounds the ids of column c: [0, vocab)."""

    n_codebooks: int
    vocab_sizes: tuple[int, ...]
    max_rows: int = 4096
    max_body_bytes: int = 4 << 20
    max_frames_limit: int = 4096
    default_max_frames: int = 630
    row_rule: RowRule | None = None  # the family's (D's Hello): what each row must hold
    depth_sampling: bool = False  # the model has a depth decoder: depth_decoder_* accepted
    _vocab32: np.ndarray = field(init=False, repr=False, compare=False)
    _vocab64: np.ndarray = field(init=False, repr=False, compare=False)
    _max_digits: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.vocab_sizes) != self.n_codebooks:
            raise ValueError(
                f"vocab_sizes has {len(self.vocab_sizes)} entries, expected n_codebooks="
                f"{self.n_codebooks} (give one size for all columns or one per column)"
            )
        if min(self.vocab_sizes) < 1 or max(self.vocab_sizes) > 2**31 - 1:
            raise ValueError(f"vocab_sizes must lie in [1, 2^31), got {self.vocab_sizes}")
        # Unsigned views make `id < 0 or id >= vocab` one comparison: negatives wrap high.
        object.__setattr__(self, "_vocab32", np.asarray(self.vocab_sizes, dtype=np.uint32))
        object.__setattr__(self, "_vocab64", np.asarray(self.vocab_sizes, dtype=np.uint64))
        # Longest decimal id the fast JSON path must read; one more digit is out of range.
        object.__setattr__(self, "_max_digits", len(str(max(self.vocab_sizes) - 1)))


@dataclass(frozen=True)
class PackedRequest:
    """A validated request: `prompt` int64 [rows, cols], `prompt_bytes` its LE bytes."""

    prompt: np.ndarray
    prompt_bytes: bytes
    sampling: pb.Sampling
    body_format: str  # "json" | "binary"

    @property
    def rows(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def cols(self) -> int:
        return int(self.prompt.shape[1])


# ------------------------------------------------------------------ entry point


def parse_request(
    content_type: str | None, headers: Mapping[str, str], body: bytes, limits: Limits
) -> PackedRequest:
    """Dispatch on the content type; `headers` keys are lower-case (Starlette's are)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if len(body) > limits.max_body_bytes:
        raise body_too_large(len(body), limits)
    if media == JSON_CONTENT_TYPE:
        return parse_json(body, limits)
    if media == BINARY_CONTENT_TYPE:
        return parse_binary(body, headers, limits)
    raise RequestError(
        400,
        "unsupported_content_type",
        f"Content-Type {content_type or '(none)'!r} is not accepted; send "
        f"{JSON_CONTENT_TYPE} or {BINARY_CONTENT_TYPE} (with X-Pdunit-Dtype and "
        f"X-Pdunit-Row-Width)",
        field="Content-Type",
    )


def body_too_large(size: int, limits: Limits) -> RequestError:
    return RequestError(
        413,
        "body_too_large",
        f"request body has {size} bytes, the limit is {limits.max_body_bytes} (--max-body-bytes)",
        field="body",
        limit=limits.max_body_bytes,
    )


# ------------------------------------------------------------------ binary


def parse_binary(body: bytes, headers: Mapping[str, str], limits: Limits) -> PackedRequest:
    dtype_name = headers.get("x-pdunit-dtype")
    if dtype_name is None:
        raise RequestError(
            400,
            "missing_header",
            "header X-Pdunit-Dtype is required: int32 or int64",
            field="X-Pdunit-Dtype",
        )
    dtype_name = dtype_name.strip().lower()
    if dtype_name not in ("int32", "int64"):
        raise RequestError(
            400,
            "bad_header",
            f"X-Pdunit-Dtype is {dtype_name!r}, expected int32 or int64",
            field="X-Pdunit-Dtype",
        )
    width_raw = headers.get("x-pdunit-row-width")
    if width_raw is None:
        raise RequestError(
            400,
            "missing_header",
            f"header X-Pdunit-Row-Width is required (this unit: {limits.n_codebooks})",
            field="X-Pdunit-Row-Width",
        )
    width = _header_int(width_raw, "X-Pdunit-Row-Width")
    if width != limits.n_codebooks:
        raise RequestError(
            422,
            "wrong_row_width",
            f"X-Pdunit-Row-Width is {width}, expected {limits.n_codebooks}",
            field="X-Pdunit-Row-Width",
            expected=limits.n_codebooks,
        )
    itemsize = 4 if dtype_name == "int32" else 8
    row_bytes = itemsize * width
    if not body:
        raise RequestError(
            400, "empty_prompt", "the prompt is empty: send at least one row", field="prompt"
        )
    if len(body) % row_bytes:
        raise RequestError(
            400,
            "bad_body_length",
            f"body has {len(body)} bytes, not a whole number of rows of {width} x {dtype_name} "
            f"({row_bytes} bytes)",
            field="body",
        )
    rows = len(body) // row_bytes
    if rows > limits.max_rows:
        raise too_many_rows(rows, limits)
    sampling = _sampling_from_headers(headers, limits)
    if itemsize == 4:
        ids = view(body, "i4", width)
        bad = ids.view("<u4") >= limits._vocab32
    else:
        ids = view(body, "i8", width)
        bad = ids.view("<u8") >= limits._vocab64
    if bad.any():
        raise _out_of_range(ids, bad, limits)
    _check_row_rule(ids, limits)
    if itemsize == 8:
        # The body already is the packed little-endian int64 prompt: no copy.
        return PackedRequest(ids, body, sampling, "binary")
    packed = ids.astype("<i8")
    return PackedRequest(packed, pack(packed, "i8"), sampling, "binary")


def _header_int(raw: str, name: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise RequestError(
            400, "bad_header", f"{name} is {raw!r}, expected an integer", field=name
        ) from None


def _header_float(raw: str, name: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise RequestError(
            400, "bad_header", f"{name} is {raw!r}, expected a number", field=name
        ) from None


def _sampling_from_headers(headers: Mapping[str, str], limits: Limits) -> pb.Sampling:
    values: dict[str, Any] = {}
    for name, header in SAMPLING_HEADERS.items():
        raw = headers.get(header)
        if raw is None:
            continue
        pretty = "-".join(part.capitalize() for part in header.split("-"))
        values[name] = (
            _header_float(raw, pretty) if name.endswith("temperature") else _header_int(raw, pretty)
        )
    return make_sampling(values, limits, header_names=True)


# ------------------------------------------------------------------ sampling


def make_sampling(
    values: Mapping[str, Any], limits: Limits, header_names: bool = False
) -> pb.Sampling:
    """Types and ranges of the sampling fields; the error names the field and the limit."""

    def name(f: str) -> str:
        if not header_names:
            return f
        return "-".join(part.capitalize() for part in SAMPLING_HEADERS[f].split("-"))

    def get_int(f: str, default: int) -> int:
        v = values.get(f, default)
        if type(v) is not int:
            raise RequestError(
                400, "invalid_type", f"{name(f)} is {v!r}, expected an integer", field=name(f)
            )
        return v

    max_frames = get_int("max_frames", limits.default_max_frames)
    if not 1 <= max_frames <= limits.max_frames_limit:
        raise RequestError(
            422,
            "out_of_range",
            f"{name('max_frames')} is {max_frames}, expected 1..{limits.max_frames_limit}",
            field=name("max_frames"),
            limit=limits.max_frames_limit,
        )
    min_frames = get_int("min_frames", 0)
    if not 0 <= min_frames <= max_frames:
        raise RequestError(
            422,
            "out_of_range",
            f"{name('min_frames')} is {min_frames}, expected 0..max_frames ({max_frames})",
            field=name("min_frames"),
        )
    def get_temperature(f: str) -> float:
        temperature = values.get(f, 0.0)
        if type(temperature) not in (int, float):
            raise RequestError(
                400, "invalid_type", f"{name(f)} is {temperature!r}, expected a number", field=name(f)
            )
        temperature = float(temperature)
        if not (math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
            raise RequestError(
                422,
                "out_of_range",
                f"{name(f)} is {temperature}, expected 0..{MAX_TEMPERATURE} (0 = greedy)",
                field=name(f),
            )
        return temperature

    max_vocab = max(limits.vocab_sizes)

    def get_top_k(f: str) -> int:
        top_k = get_int(f, 0)
        if not 0 <= top_k <= max_vocab:
            raise RequestError(
                422,
                "out_of_range",
                f"{name(f)} is {top_k}, expected 0..{max_vocab} (0 = full vocabulary)",
                field=name(f),
            )
        return top_k

    temperature = get_temperature("temperature")
    top_k = get_top_k("top_k")
    seed = get_int("seed", 0)
    if not 0 <= seed <= UINT64_MAX:
        raise RequestError(
            422, "out_of_range", f"{name('seed')} is {seed}, expected 0..2^64-1", field=name("seed")
        )
    out = pb.Sampling(
        max_frames=max_frames, min_frames=min_frames, temperature=temperature, top_k=top_k, seed=seed
    )
    for f in DEPTH_FIELDS:
        if f not in values:
            continue
        if not limits.depth_sampling:
            raise RequestError(
                422,
                "unsupported_field",
                f"{name(f)} is for a model whose depth decoder samples codebooks 1.. (csm); this "
                f"unit's model has none: it samples every codebook with temperature and top_k",
                field=name(f),
            )
        if f == "depth_decoder_temperature":
            out.depth_decoder_temperature = get_temperature(f)
        else:
            out.depth_decoder_top_k = get_top_k(f)
    return out


# ------------------------------------------------------------------ JSON


def too_many_rows(rows: int, limits: Limits) -> RequestError:
    return RequestError(
        413,
        "too_many_rows",
        f"prompt has {rows} rows, the limit is {limits.max_rows} (--max-rows)",
        field="prompt",
        limit=limits.max_rows,
    )


def parse_json(body: bytes, limits: Limits) -> PackedRequest:
    fast = _parse_json_fast(body, limits)
    if fast is not None:
        return fast
    return _parse_json_exact(body, limits)


def _parse_json_fast(body: bytes, limits: Limits) -> PackedRequest | None:
    """The common case in numpy; None means "not recognised": the exact path decides.

    Why (the targets: a 2000 x 11 prompt in <= 2 ms JSON, <= 0.1 ms binary, on 2 cores):
    `json.loads` + `np.array` of nested lists alone take about that, so this finds the
    prompt's bytes, parses the numbers with numpy (no per-element Python) and checks the
    bracket/comma structure with integer gathers. Anything it does not recognise (other
    number forms, escapes, duplicate keys, any error) goes the exact path, whose message
    is precise: errors are rare, their path may be slow, never imprecise.
    """
    key = body.find(b'"prompt"')
    if key < 0 or body.find(b'"prompt"', key + 8) >= 0:
        return None
    colon = key + 8
    while colon < len(body) and body[colon] in _WHITESPACE:
        colon += 1
    if colon >= len(body) or body[colon] != ord(":"):
        return None
    start = colon + 1
    while start < len(body) and body[start] in _WHITESPACE:
        start += 1
    if start >= len(body) or body[start] != _LBRACE:
        return None
    # A valid prompt holds only digits, brackets, commas and whitespace, so it ends at
    # the last ']' before the next '"' or '}'; the structure check below proves it.
    stop = len(body)
    for ch in (b'"', b"}"):
        pos = body.find(ch, start)
        if 0 <= pos < stop:
            stop = pos
    end = body.rfind(b"]", start, stop) + 1
    if end <= start:
        return None
    compact = body[start:end].translate(_IDENTITY, _WHITESPACE)
    ids = _numbers_in_rows(compact, limits)
    if ids is None:
        return None
    if len(compact) != end - start and _digit_runs(body[start:end]) != ids.size:
        return None  # whitespace inside a number ("36 6"): the compact form would misread it
    rest_bytes = body[:start] + b"null" + body[end:]
    check_json_depth(rest_bytes)
    try:
        rest = json.loads(rest_bytes)
    except ValueError:
        return None
    if type(rest) is not dict or "prompt" not in rest or rest["prompt"] is not None:
        return None
    unknown = set(rest) - set(JSON_FIELDS)
    if unknown:
        raise _unknown_fields(unknown)
    rows = ids.shape[0]
    if rows > limits.max_rows:
        raise too_many_rows(rows, limits)
    sampling = make_sampling(rest, limits)
    bad = ids.view(np.uint64) >= limits._vocab64
    if bad.any():
        raise _out_of_range(ids, bad, limits)
    _check_row_rule(ids, limits)
    return PackedRequest(ids, pack(ids, "i8"), sampling, "json")


def _digit_runs(raw: bytes) -> int:
    isdig = (np.frombuffer(raw, dtype=np.uint8) - np.uint8(_ZERO)) < 10
    return int(isdig[0]) + int(np.count_nonzero(isdig[1:] & ~isdig[:-1]))


def _numbers_in_rows(compact: bytes, limits: Limits) -> np.ndarray | None:
    """`[[d,d,...],[...]]` without whitespace -> int64 [rows, width]; None if not exactly that.

    Every byte is accounted for: number runs are digits, and the bytes between two
    numbers are ',' inside a row or '],[' across rows, with '[[' and ']]' at the ends.
    """
    width = limits.n_codebooks
    n = len(compact)
    # Padding lets the digit gathers below read past the last number without a bound check.
    c = np.frombuffer(compact + _PAD, dtype=np.uint8)
    if n < 5 or c[0] != _LBRACE or c[1] != _LBRACE or c[n - 1] != _RBRACE:
        return None
    isdig = (c[:n] - np.uint8(_ZERO)) < 10
    starts = np.flatnonzero(isdig[1:] & ~isdig[:-1]) + 1
    ends = np.flatnonzero(isdig[:-1] & ~isdig[1:]) + 1  # one past each number
    count = starts.size
    if count == 0 or count % width or ends.size != count:
        return None
    rows = count // width
    lengths = ends - starts
    longest = int(lengths.max())
    if longest > limits._max_digits + 1:
        return None  # wider than any valid id: the exact path names it
    if ((c[starts] == _ZERO) & (lengths > 1)).any():
        return None  # leading zeros are not JSON
    # Structure, per row: numbers separated by exactly one ',' and the row closed by
    # ']'; rows separated by exactly '],['; the prompt opens with '[[' and ends ']]'.
    s2 = starts.reshape(rows, width)
    e2 = ends.reshape(rows, width)
    delim = c[e2]
    if (delim[:, :-1] != _COMMA).any() or (delim[:, -1] != _RBRACE).any():
        return None
    if ((s2[:, 1:] - e2[:, :-1]) != 1).any():
        return None
    if rows > 1:
        row_ends = e2[:-1, -1]
        if ((s2[1:, 0] - row_ends) != 3).any():
            return None
        if (c[row_ends + 1] != _COMMA).any() or (c[row_ends + 2] != _LBRACE).any():
            return None
    if starts[0] != 2 or ends[-1] + 2 != n:
        return None
    # Horner over digit positions, vectorised across numbers.
    value = c[starts].astype(np.int64) - _ZERO
    for k in range(1, longest):
        digit = c[starts + k].astype(np.int64) - _ZERO
        value = np.where(lengths > k, value * 10 + digit, value)
    return value.reshape(rows, width)


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in `raw`, brackets inside strings not
    counted. Up to the first syntax error it follows what `json.loads` would descend
    into, and the parser stops at that error: its depth never exceeds this one."""
    c = np.frombuffer(raw, dtype=np.uint8)
    brackets = (c == _LBRACE) | (c == _LCURLY) | (c == _RBRACE) | (c == _RCURLY)
    if not brackets.any():
        return 0
    quote = c == _QUOTE
    if quote.any():
        backslash = c == _BACKSLASH
        if backslash.any():
            # a quote right after an odd run of backslashes is escaped
            before = np.concatenate(([False], backslash[:-1]))
            after = np.concatenate((backslash[1:], [False]))
            starts = np.flatnonzero(backslash & ~before)
            ends = np.flatnonzero(backslash & ~after)
            escaped = ends[(ends - starts) % 2 == 0] + 1
            escaped = escaped[escaped < c.size]
            quote[escaped[quote[escaped]]] = False
        inside = np.bitwise_xor.accumulate(quote.view(np.uint8)).view(bool)
        brackets &= ~inside
    at = np.flatnonzero(brackets)
    step = np.where((c[at] == _LBRACE) | (c[at] == _LCURLY), 1, -1)
    return int(np.cumsum(step).max(initial=0))


def check_json_depth(raw: bytes) -> None:
    """A 400 naming the limit when `raw` nests deeper than MAX_JSON_DEPTH."""
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise RequestError(
            400,
            "json_too_deep",
            f"the JSON body nests {depth} levels deep, the limit is {MAX_JSON_DEPTH} "
            f"(a request needs 3)",
            field="body",
            limit=MAX_JSON_DEPTH,
        )


def _parse_json_exact(body: bytes, limits: Limits) -> PackedRequest:
    check_json_depth(body)
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise RequestError(
            400, "malformed_json", f"request body is not valid JSON: {exc}", field="body"
        ) from None
    if type(obj) is not dict:
        raise RequestError(
            400,
            "malformed_json",
            f"request body must be a JSON object, got {type(obj).__name__}",
            field="body",
        )
    unknown = set(obj) - set(JSON_FIELDS)
    if unknown:
        raise _unknown_fields(unknown)
    if "prompt" not in obj:
        raise RequestError(
            400,
            "missing_field",
            "field 'prompt' is required: a list of rows of ids",
            field="prompt",
        )
    prompt = obj["prompt"]
    width = limits.n_codebooks
    if type(prompt) is not list:
        raise RequestError(
            400,
            "invalid_type",
            f"prompt must be a list of rows, got {type(prompt).__name__}",
            field="prompt",
        )
    if not prompt:
        raise RequestError(
            400, "empty_prompt", "the prompt is empty: send at least one row", field="prompt"
        )
    if len(prompt) > limits.max_rows:
        raise too_many_rows(len(prompt), limits)
    for r, row in enumerate(prompt):
        if type(row) is not list:
            raise RequestError(
                400,
                "invalid_type",
                f"prompt row {r} must be a list of {width} ids, got {type(row).__name__}",
                field="prompt",
                row=r,
            )
        if len(row) != width:
            raise RequestError(
                422,
                "wrong_row_width",
                f"prompt row {r} has {len(row)} columns, expected {width}",
                field="prompt",
                row=r,
                expected=width,
            )
        for c, v in enumerate(row):
            if type(v) is not int:
                raise RequestError(
                    400,
                    "non_integer_id",
                    f"prompt row {r} column {c} is {json.dumps(v)}, expected an integer id",
                    field="prompt",
                    row=r,
                    column=c,
                )
            if not 0 <= v < limits.vocab_sizes[c]:
                raise _id_out_of_range(r, c, v, limits)
    sampling = make_sampling(obj, limits)
    ids = np.array(prompt, dtype=np.int64)
    _check_row_rule(ids, limits)
    return PackedRequest(ids, pack(ids, "i8"), sampling, "json")


def _unknown_fields(unknown: set[str]) -> RequestError:
    names = ", ".join(repr(u) for u in sorted(unknown))
    return RequestError(
        400,
        "unknown_field",
        f"unknown field {names}; accepted fields: {', '.join(JSON_FIELDS)}",
        field=sorted(unknown)[0],
    )


def _id_out_of_range(r: int, c: int, v: int, limits: Limits) -> RequestError:
    """The one 422 for an id outside its column's vocabulary (fast and exact paths)."""
    return RequestError(
        422,
        "id_out_of_range",
        f"prompt row {r} column {c} has id {v}, outside [0, {limits.vocab_sizes[c]}) "
        f"of codebook {c}",
        field="prompt",
        row=r,
        column=c,
        limit=limits.vocab_sizes[c],
    )


def _out_of_range(ids: np.ndarray, bad: np.ndarray, limits: Limits) -> RequestError:
    flat = int(np.argmax(bad.reshape(-1)))
    r, c = divmod(flat, ids.shape[1])
    return _id_out_of_range(r, c, int(ids[r, c]), limits)


def _check_row_rule(ids: np.ndarray, limits: Limits) -> None:
    """The family's row rule (csm: text rows and audio-frame rows): a 422 naming the
    first bad row and column and what the rule expects there."""
    if limits.row_rule is None:
        return
    error = limits.row_rule.check(ids)
    if error is not None:
        raise RequestError(
            422,
            "invalid_row",
            error.message(),
            field="prompt",
            row=error.row,
            column=error.column,
            expected=error.expected,
        )
