"""Validate + pack at the HTTP edge: every bad input gets its status and a precise message."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from pdunit.engine.lb import validate as v
from pdunit.engine.lb.validate import Limits, RequestError, parse_request
from pdunit.engine.proto import pdunit_pb2 as pb

LIMITS = Limits(
    n_codebooks=11, vocab_sizes=(1024,) * 10 + (2048,), max_rows=100, max_body_bytes=200_000
)
JSON = {"content-type": "application/json"}


def ids(rows: int = 20, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate(
        [rng.integers(0, 1024, (rows, 10)), rng.integers(0, 2048, (rows, 1))], axis=1
    )


def bin_headers(dtype: str, width: int | str = 11, **extra: str) -> dict[str, str]:
    h = {
        "content-type": "application/octet-stream",
        "x-pdunit-dtype": dtype,
        "x-pdunit-row-width": str(width),
    }
    h.update(extra)
    return h


def parse_json_body(doc: object, limits: Limits = LIMITS) -> v.PackedRequest:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return parse_request("application/json", JSON, body, limits)


def error_of(fn, *args) -> RequestError:
    with pytest.raises(RequestError) as info:
        fn(*args)
    return info.value


# ------------------------------------------------------------------ accepted input


@pytest.mark.parametrize(
    "dumps",
    [
        lambda d: json.dumps(d),
        lambda d: json.dumps(d, separators=(",", ":")),
        lambda d: json.dumps(d, indent=2),
        lambda d: json.dumps(d).replace(", ", " ,\t").replace("[", "[ \r\n"),
    ],
)
def test_json_prompt_packs_to_int64_rows_in_any_whitespace_layout(dumps):
    a = ids()
    packed = parse_json_body(dumps({"max_frames": 7, "prompt": a.tolist(), "seed": 3}).encode())
    assert packed.prompt.dtype == np.int64 and packed.prompt.tolist() == a.tolist()
    assert np.frombuffer(packed.prompt_bytes, "<i8").reshape(20, 11).tolist() == a.tolist()
    assert (packed.sampling.max_frames, packed.sampling.seed, packed.body_format) == (7, 3, "json")


def test_the_common_json_layout_takes_the_numpy_path():
    body = json.dumps({"prompt": ids().tolist(), "max_frames": 9}).encode()
    assert v._parse_json_fast(body, LIMITS) is not None


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_binary_prompt_packs_to_int64_rows(dtype):
    a = ids()
    packed = parse_request(
        "application/octet-stream",
        bin_headers(
            dtype,
            **{"x-pdunit-max-frames": "50", "x-pdunit-temperature": "0.7", "x-pdunit-top-k": "20"},
        ),
        a.astype("<i4" if dtype == "int32" else "<i8").tobytes(),
        LIMITS,
    )
    assert packed.prompt.dtype == np.int64 and packed.prompt.tolist() == a.tolist()
    assert np.frombuffer(packed.prompt_bytes, "<i8").tolist() == a.ravel().tolist()
    assert packed.sampling == pb.Sampling(
        max_frames=50, min_frames=0, temperature=0.7, top_k=20, seed=0
    )


def test_defaults_fill_the_sampling_fields():
    s = parse_json_body({"prompt": ids(1).tolist()}).sampling
    assert s == pb.Sampling(
        max_frames=LIMITS.default_max_frames, min_frames=0, temperature=0.0, top_k=0, seed=0
    )


def test_ids_at_each_columns_last_valid_value_pass():
    row = [1023] * 10 + [2047]
    assert parse_json_body({"prompt": [row]}).prompt.tolist() == [row]


# ------------------------------------------------------------------ rejected input: JSON


@pytest.mark.parametrize(
    ("doc", "status", "code", "message"),
    [
        (
            {"prompt": [[1] * 11] * 17 + [[1] * 10]},
            422,
            "wrong_row_width",
            "prompt row 17 has 10 columns, expected 11",
        ),
        (
            {"prompt": [[1] * 12]},
            422,
            "wrong_row_width",
            "prompt row 0 has 12 columns, expected 11",
        ),
        (
            {"prompt": [[1] * 11, [5] * 10 + [2048]]},
            422,
            "id_out_of_range",
            "prompt row 1 column 10 has id 2048, outside [0, 2048) of codebook 10",
        ),
        (
            {"prompt": [[1] * 11, [1, 1024] + [1] * 9]},
            422,
            "id_out_of_range",
            "prompt row 1 column 1 has id 1024, outside [0, 1024) of codebook 1",
        ),
        (
            {"prompt": [[1] * 11, [1, -1] + [1] * 9]},
            422,
            "id_out_of_range",
            "prompt row 1 column 1 has id -1",
        ),
        (
            {"prompt": [[1] * 11, [1, 99999999999999999999] + [1] * 9]},
            422,
            "id_out_of_range",
            "row 1 column 1",
        ),
        (
            {"prompt": [[1] * 11] * 101},
            413,
            "too_many_rows",
            "prompt has 101 rows, the limit is 100",
        ),
        ({"prompt": []}, 400, "empty_prompt", "the prompt is empty"),
        (
            {"prompt": [[1] * 11, [1, 2.5] + [1] * 9]},
            400,
            "non_integer_id",
            "prompt row 1 column 1 is 2.5, expected an integer id",
        ),
        (
            {"prompt": [[1] * 11, [1, 2.0] + [1] * 9]},
            400,
            "non_integer_id",
            "prompt row 1 column 1 is 2.0",
        ),
        ({"prompt": [[1] * 10 + ["7"]]}, 400, "non_integer_id", 'prompt row 0 column 10 is "7"'),
        ({"prompt": [[True] + [1] * 10]}, 400, "non_integer_id", "prompt row 0 column 0 is true"),
        ({"prompt": [[None] + [1] * 10]}, 400, "non_integer_id", "prompt row 0 column 0 is null"),
        ({"prompt": [[1] * 11, 5]}, 400, "invalid_type", "prompt row 1 must be a list of 11 ids"),
        ({"prompt": "abc"}, 400, "invalid_type", "prompt must be a list of rows"),
        ({"max_frames": 5}, 400, "missing_field", "field 'prompt' is required"),
        ({"prompt": [[1] * 11], "max_frame": 5}, 400, "unknown_field", "unknown field 'max_frame'"),
        (
            {"prompt": [[1] * 11], "max_frames": 0},
            422,
            "out_of_range",
            "max_frames is 0, expected 1..4096",
        ),
        (
            {"prompt": [[1] * 11], "max_frames": 5000},
            422,
            "out_of_range",
            "max_frames is 5000, expected 1..4096",
        ),
        (
            {"prompt": [[1] * 11], "max_frames": 5, "min_frames": 6},
            422,
            "out_of_range",
            "min_frames is 6, expected 0..max_frames (5)",
        ),
        (
            {"prompt": [[1] * 11], "max_frames": "5"},
            400,
            "invalid_type",
            "max_frames is '5', expected an integer",
        ),
        ({"prompt": [[1] * 11], "temperature": -1}, 422, "out_of_range", "temperature is -1.0"),
        ({"prompt": [[1] * 11], "temperature": "hot"}, 400, "invalid_type", "temperature is 'hot'"),
        (
            {"prompt": [[1] * 11], "top_k": 5000},
            422,
            "out_of_range",
            "top_k is 5000, expected 0..2048",
        ),
        ({"prompt": [[1] * 11], "seed": -3}, 422, "out_of_range", "seed is -3, expected 0..2^64-1"),
        ([[1] * 11], 400, "malformed_json", "request body must be a JSON object, got list"),
    ],
)
def test_bad_json_requests_get_their_status_and_message(doc, status, code, message):
    err = error_of(parse_json_body, doc)
    assert (err.status, err.code) == (status, code)
    assert message in err.message
    assert err.body()["error"]["code"] == code


def test_row_and_column_of_the_first_bad_id_are_named_in_the_error_body():
    a = ids(50)
    a[31, 4] = 1500
    err = error_of(parse_json_body, {"prompt": a.tolist()})
    assert err.body()["error"] == {
        "code": "id_out_of_range",
        "message": "prompt row 31 column 4 has id 1500, outside [0, 1024) of codebook 4",
        "field": "prompt",
        "row": 31,
        "column": 4,
        "limit": 1024,
    }


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b'{"prompt": [[1,2,3]',
        b'{"prompt": [[01,1,1,1,1,1,1,1,1,1,1]]}',
        b"\xff\xfe",
        b'{"prompt": [[1,1,1,1,1,1,1,1,1,1,1]],}',
    ],
)
def test_malformed_json_is_a_400_naming_the_position(body):
    err = error_of(parse_json_body, body)
    assert (err.status, err.code) == (400, "malformed_json")
    assert "not valid JSON" in err.message


def test_body_larger_than_the_limit_is_413_naming_the_limit():
    err = error_of(parse_request, "application/json", JSON, b" " * 200_001, LIMITS)
    assert (err.status, err.code) == (413, "body_too_large")
    assert "200001 bytes, the limit is 200000 (--max-body-bytes)" in err.message


@pytest.mark.parametrize(
    "ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_wrong_content_type_is_400_naming_the_accepted_types(ctype):
    err = error_of(parse_request, ctype, {}, b"{}", LIMITS)
    assert (err.status, err.code, err.field) == (400, "unsupported_content_type", "Content-Type")
    assert "application/json" in err.message and "application/octet-stream" in err.message


def test_content_type_parameters_are_ignored():
    packed = parse_request(
        "application/json; charset=utf-8", {}, json.dumps({"prompt": [[1] * 11]}).encode(), LIMITS
    )
    assert packed.rows == 1


# ------------------------------------------------------------------ rejected input: binary


@pytest.mark.parametrize(
    ("headers", "body", "status", "code", "message"),
    [
        (
            {"content-type": "application/octet-stream", "x-pdunit-row-width": "11"},
            b"\0" * 44,
            400,
            "missing_header",
            "X-Pdunit-Dtype is required",
        ),
        (
            bin_headers("float32"),
            b"\0" * 44,
            400,
            "bad_header",
            "X-Pdunit-Dtype is 'float32', expected int32 or int64",
        ),
        (
            {"content-type": "application/octet-stream", "x-pdunit-dtype": "int32"},
            b"\0" * 44,
            400,
            "missing_header",
            "X-Pdunit-Row-Width is required",
        ),
        (
            bin_headers("int32", "eleven"),
            b"\0" * 44,
            400,
            "bad_header",
            "X-Pdunit-Row-Width is 'eleven'",
        ),
        (
            bin_headers("int32", 10),
            b"\0" * 40,
            422,
            "wrong_row_width",
            "X-Pdunit-Row-Width is 10, expected 11",
        ),
        (bin_headers("int32"), b"", 400, "empty_prompt", "the prompt is empty"),
        (
            bin_headers("int32"),
            b"\0" * 45,
            400,
            "bad_body_length",
            "45 bytes, not a whole number of rows of 11 x int32 (44 bytes)",
        ),
        (bin_headers("int64"), b"\0" * 44, 400, "bad_body_length", "rows of 11 x int64 (88 bytes)"),
        (
            bin_headers("int32"),
            b"\0" * 44 * 101,
            413,
            "too_many_rows",
            "prompt has 101 rows, the limit is 100",
        ),
        (
            bin_headers("int32", **{"x-pdunit-max-frames": "ten"}),
            b"\0" * 44,
            400,
            "bad_header",
            "X-Pdunit-Max-Frames is 'ten', expected an integer",
        ),
        (
            bin_headers("int32", **{"x-pdunit-min-frames": "900"}),
            b"\0" * 44,
            422,
            "out_of_range",
            "X-Pdunit-Min-Frames is 900, expected 0..max_frames (630)",
        ),
    ],
)
def test_bad_binary_requests_get_their_status_and_message(headers, body, status, code, message):
    err = error_of(parse_request, headers["content-type"], headers, body, LIMITS)
    assert (err.status, err.code) == (status, code)
    assert message in err.message


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize(
    ("row", "col", "value"), [(0, 0, -1), (7, 10, 2048), (19, 3, 1024), (3, 3, -(2**31))]
)
def test_binary_ids_out_of_range_name_row_column_and_limit(dtype, row, col, value):
    a = ids().astype("<i4" if dtype == "int32" else "<i8")
    a[row, col] = value
    err = error_of(
        parse_request, "application/octet-stream", bin_headers(dtype), a.tobytes(), LIMITS
    )
    assert (err.status, err.code, err.details["row"], err.details["column"]) == (
        422,
        "id_out_of_range",
        row,
        col,
    )
    limit = 2048 if col == 10 else 1024
    assert f"prompt row {row} column {col} has id {value}, outside [0, {limit})" in err.message


# ------------------------------------------------------------------ fast path == exact path


def _outcome(fn, body: bytes) -> tuple:
    try:
        packed = fn(body, LIMITS)
    except RequestError as err:
        return ("error", err.status, err.code, err.message)
    return ("ok", packed.prompt.tolist(), packed.sampling)


def test_fast_and_exact_json_paths_agree_on_thousands_of_mutated_bodies():
    """Random byte edits of valid bodies: the numpy path must accept exactly what json.loads does."""
    rnd = random.Random(7)
    alphabet = b'0123456789[],. -"e:{}tn\n'
    checked = 0
    for case in range(1500):
        a = ids(rnd.randint(1, 6), seed=case)
        doc = {"prompt": a.tolist()}
        if case % 3 == 0:
            doc["max_frames"] = rnd.randint(1, 100)
        body = bytearray(
            json.dumps(doc, separators=rnd.choice([(",", ":"), (", ", ": ")])).encode()
        )
        for _ in range(rnd.randint(0, 3)):
            pos = rnd.randrange(len(body))
            op = rnd.random()
            if op < 0.4:
                body[pos] = rnd.choice(alphabet)
            elif op < 0.7:
                del body[pos]
            else:
                body.insert(pos, rnd.choice(alphabet))
        raw = bytes(body)
        assert _outcome(v.parse_json, raw) == _outcome(v._parse_json_exact, raw), raw
        checked += 1
    assert checked == 1500


def test_prompt_key_inside_a_string_or_twice_is_not_taken_by_the_fast_path():
    sneaky = b'{"a\\"prompt": [[1,1,1,1,1,1,1,1,1,1,1]], "prompt": [[2,2,2,2,2,2,2,2,2,2,2]]}'
    err = error_of(v.parse_json, sneaky, LIMITS)
    assert err.code == "unknown_field"
    twice = b'{"prompt": [[1,1,1,1,1,1,1,1,1,1,1]], "prompt": [[2,2,2,2,2,2,2,2,2,2,2]]}'
    assert v.parse_json(twice, LIMITS).prompt.tolist() == [
        [2] * 11
    ]  # json.loads semantics: last wins


def test_vocab_sizes_must_match_the_codebooks():
    with pytest.raises(ValueError, match="vocab_sizes has 2 entries, expected n_codebooks=11"):
        Limits(n_codebooks=11, vocab_sizes=(5, 5))
