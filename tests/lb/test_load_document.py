"""The /v1/load document as one type: what the LB serves is exactly a LoadDocument, and a
reader given anything else gets an error naming the field."""

from __future__ import annotations

import json

import pytest

from pdunit.bench.scaler_bench import fake_load_document
from pdunit.engine.lb.load import LoadDocumentError, read_load_document


def test_the_lb_serves_exactly_a_load_document(start_lb) -> None:
    lb = start_lb()
    with lb.client() as c:
        resp = c.get("/v1/load")
    doc = read_load_document(resp.content)
    assert doc.model_dump() == resp.json()  # no field served that the type lacks, none lost
    assert [d.name for d in doc.decoders] == ["decode"] and doc.ready


def test_the_fakes_serve_a_load_document() -> None:
    doc = read_load_document(fake_load_document("u0", streams_in_flight=3))
    assert (doc.unit, doc.streams_in_flight, doc.empty) == ("u0", 3, True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ready": None}, "field ready is missing"),
        ({"decoders": [{"name": "D"}]}, "field decoders[0].instance is missing"),
        ({"requests": {"lb": [], "prefill": [], "decode": []}}, "field requests.proxy is missing"),
        ({"held_pages": "7"}, "field held_pages is '7'"),
        ({"streams_in_flight": True}, "field streams_in_flight is True"),  # no bool for a count
        ({"decode_in_flight": -1}, "field decode_in_flight is -1: Input should be greater than"),
        ({"headroom_streams": -2}, "field headroom_streams is -2"),
    ],
)
def test_a_missing_field_or_a_wrong_type_is_an_error_naming_the_field(change, message) -> None:
    raw = fake_load_document("u0", **change)
    with pytest.raises(LoadDocumentError, match="^not a load document: ") as err:
        read_load_document(json.dumps(raw).encode())
    assert message in str(err.value)
    with pytest.raises(LoadDocumentError) as err:  # the decoded object reads the same
        read_load_document(raw)
    assert message in str(err.value)


def test_a_body_that_is_not_json_is_an_error() -> None:
    with pytest.raises(LoadDocumentError, match="the body is not JSON"):
        read_load_document(b"<html>502 Bad Gateway</html>")


def test_many_problems_are_cut_to_three_and_counted() -> None:
    with pytest.raises(LoadDocumentError) as err:
        read_load_document({"unit": "u0"})
    assert str(err.value).count("is missing") == 3 and "more)" in str(err.value)


def test_an_unknown_field_is_ignored_and_an_absent_headroom_means_no_admission() -> None:
    doc = read_load_document(fake_load_document("u0", headroom_streams=None, added_later=1))
    assert doc.headroom_streams == -1
