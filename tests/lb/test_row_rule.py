"""The model family's row rule and depth-decoder sampling at the LB (issue 23): a D whose
Hello carries csm-tiny's rule (rows of 4 codebooks + a text column) makes the LB refuse,
over raw HTTP, a text row with a stray codebook id, an audio-frame row with a code past
the codec's, a text row holding audio_eos_token_id and a row of the wrong width, each
422 naming row and column and what was expected, P never asked; valid prompts pass, and
`depth_decoder_*` fields pass only where the Hello says the model has a depth decoder.
GET /v1/model shows the rule (null for a model without one)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdunit.engine.model.request_rules import RowRule
from pdunit.engine.proto.row_rule import row_rule_to_pb
from tests.lb import rawhttp

# csm-tiny's rule, its codec a little smaller than its codebook vocabulary (CSM-1B: 2048 of 2051)
RULE = RowRule(marker_column=4, marker_id=62, frame_columns=4, code_limit=30, empty_ids=(0, 31),
               frame_end_id=61, frame_end_code=0)
TEXT = [[31, 31, 31, 31, 7], [0, 0, 0, 0, 9]]  # transformers' pads, Sesame's zeros
AUDIO = [[1, 29, 0, 5, 62], [0, 0, 0, 0, 62]]  # codes, the audio-EOS frame


@pytest.fixture
def csm_lb(start_lb, fake_unit):
    fake_unit.decode.n_codebooks, fake_unit.decode.vocab = 5, 64
    fake_unit.decode.row_rule = row_rule_to_pb(RULE)
    fake_unit.decode.depth_sampling = True
    return start_lb()


CLOSE = "Connection: close\r\n"  # the LB closes after its answer: read_until_closed returns at once


def post(lb, doc: dict) -> rawhttp.Outcome:
    return rawhttp.post_whole(lb.url, "/v1/tts/stream", json.dumps(doc).encode(), CLOSE + "Content-Type: application/json")


def binary(lb, rows: list[list[int]], width: int = 5) -> rawhttp.Outcome:
    headers = f"{CLOSE}Content-Type: application/octet-stream\r\nX-Pdunit-Dtype: int32\r\nX-Pdunit-Row-Width: {width}"
    return rawhttp.post_whole(lb.url, "/v1/tts/stream", np.asarray(rows, "<i4").tobytes(), headers)


def error(out: rawhttp.Outcome) -> dict:
    return json.loads(out.body)["error"]


@pytest.mark.parametrize("bad,row,column,words", [
    ([31, 5, 31, 31, 7], 4, 1, "a text row (column 4 is not 62, audio_token_id) holds 0 or 31 in columns 0..3"),
    ([1, 2, 30, 3, 62], 4, 2, "an audio-frame row (column 4 = 62, audio_token_id) holds codec codes in [0, 30)"),
    ([31, 31, 31, 31, 61], 4, 4, "write the audio's end as an audio-frame row, 0 in columns 0..3"),
])
def test_a_row_breaking_the_families_rule_is_a_422_naming_row_and_column(csm_lb, fake_unit, bad, row, column,
                                                                         words):
    prompt = [*TEXT, *AUDIO, bad]
    for out in (post(csm_lb, {"prompt": prompt}), post(csm_lb, {"prompt": prompt, "seed": 1}),
                binary(csm_lb, prompt)):
        assert out.status == 422, out.data
        err = error(out)
        assert err["code"] == "invalid_row" and (err["row"], err["column"]) == (row, column)
        assert err["message"].startswith(f"prompt row {row} column {column} has id {bad[column]}: ")
        assert words in err["message"] and words in err["expected"]
    assert not fake_unit.prefill.submits


def test_a_row_of_the_wrong_width_is_refused_naming_it(csm_lb, fake_unit):
    out = post(csm_lb, {"prompt": [*TEXT, [31, 31, 31, 7]]})
    assert out.status == 422 and error(out)["code"] == "wrong_row_width" and error(out)["row"] == 2
    out = binary(csm_lb, [[31, 31, 31, 7]], width=4)
    assert out.status == 422 and error(out)["code"] == "wrong_row_width"
    assert not fake_unit.prefill.submits


def test_valid_prompts_and_depth_decoder_fields_pass(csm_lb, fake_unit):
    doc = {"prompt": [*TEXT, *AUDIO], "max_frames": 3, "temperature": 0.9, "seed": 5,
           "depth_decoder_temperature": 0.7, "depth_decoder_top_k": 12}
    out = post(csm_lb, doc)
    assert out.status == 200, out.data
    out = binary(csm_lb, [*TEXT, *AUDIO])
    assert out.status == 200, out.data
    first, second = fake_unit.prefill.submits
    assert first.sampling.HasField("depth_decoder_temperature") and first.sampling.depth_decoder_top_k == 12
    assert first.sampling.depth_decoder_temperature == pytest.approx(0.7)
    assert not second.sampling.HasField("depth_decoder_temperature")
    assert not second.sampling.HasField("depth_decoder_top_k")
    out = post(csm_lb, {"prompt": TEXT, "depth_decoder_top_k": 100})
    assert out.status == 422 and error(out)["field"] == "depth_decoder_top_k"


def test_depth_decoder_fields_are_refused_by_name_without_a_depth_decoder(start_lb, fake_unit):
    lb = start_lb()  # the fake's pdunit-like model: no row rule, no depth decoder
    for f, v in (("depth_decoder_temperature", 0.5), ("depth_decoder_top_k", 3)):
        out = post(lb, {"prompt": [[1] * 11], f: v})
        assert out.status == 422, out.data
        assert error(out)["code"] == "unsupported_field" and error(out)["field"] == f
        assert f in error(out)["message"] and "no" in error(out)["message"]
    headers = (f"{CLOSE}Content-Type: application/octet-stream\r\nX-Pdunit-Dtype: int32\r\nX-Pdunit-Row-Width: 11\r\n"
               "X-Pdunit-Depth-Decoder-Temperature: 0.5")
    out = rawhttp.post_whole(lb.url, "/v1/tts/stream", np.ones((1, 11), "<i4").tobytes(), headers)
    assert out.status == 422 and error(out)["field"] == "X-Pdunit-Depth-Decoder-Temperature"
    assert not fake_unit.prefill.submits


def test_the_model_document_shows_the_row_rule_of_the_model_d_serves(csm_lb):
    with csm_lb.client() as c:
        rule = c.get("/v1/model").json()["row_rule"]
    assert rule == {"width": 5, "marker_column": 4, "marker_id": 62, "frame_columns": 4, "code_limit": 30,
                    "empty_ids": [0, 31], "frame_end_id": 61, "frame_end_code": 0,
                    "description": "column 4 = 62: an audio-frame row, columns 0..3 codes in [0, 30); else a text "
                                   "row, columns 0..3 0 or 31; a text token 61 is written as the audio-frame row "
                                   "of 0s instead"}
    # a client rebuilds the LB's rule from it
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in rule.items() if k not in ("width", "description")}
    assert RowRule(**fields) == RULE


def test_the_model_document_of_a_model_without_a_row_rule_shows_null(start_lb):
    lb = start_lb()  # the fake's pdunit-like model (the pdunit family has no row rule)
    with lb.client() as c:
        doc = c.get("/v1/model").json()
    assert "row_rule" in doc and doc["row_rule"] is None
