"""The operator's reads of a unit LB's /v1/load: a LoadDocument, or why not, as a value."""

from __future__ import annotations

import asyncio

import httpx

from pdunit.bench.scaler_bench import fake_load_document
from pdunit.engine.lb.load import LoadDocument, read_load_document
from pdunit.operator.lbapi import LbApi


def load_answering(response: httpx.Response) -> tuple[LoadDocument | None, str | None]:
    async def read() -> tuple[LoadDocument | None, str | None]:
        api = LbApi(1.0)
        await api.close()
        api.client = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: response))
        try:
            return await api.load("10.0.0.7", 8000)
        finally:
            await api.close()

    return asyncio.run(read())


def test_a_load_document_is_read_whole() -> None:
    doc, error = load_answering(httpx.Response(200, json=fake_load_document("u0", held_pages=4)))
    assert error is None and doc is not None
    assert doc == read_load_document(fake_load_document("u0", held_pages=4))
    assert doc.model_dump() == fake_load_document("u0", held_pages=4)


def test_a_document_missing_a_field_is_an_error_naming_it() -> None:
    doc, error = load_answering(httpx.Response(200, json=fake_load_document("u0", empty=None)))
    assert doc is None
    assert error == (
        "GET http://10.0.0.7:8000/v1/load: not a load document: field empty is missing "
        "(not a pdunit LB, or another version?)"
    )


def test_a_wrong_type_is_an_error_naming_the_field() -> None:
    doc, error = load_answering(
        httpx.Response(200, json=fake_load_document("u0", streams_in_flight="3"))
    )
    assert doc is None and error is not None and "field streams_in_flight is '3'" in error


def test_an_http_error_status_is_an_error_value() -> None:
    assert load_answering(httpx.Response(503)) == (
        None, "GET http://10.0.0.7:8000/v1/load: HTTP 503"
    )
