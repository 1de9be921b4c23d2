"""The router in front of fake units on loopback: what clients and units observe."""

from __future__ import annotations

import asyncio
import collections
import json
import math
import struct

import httpx
import pytest

from tests.router.routerkit import FakeUnit, key_owned_by, read_stream, run_router, run_units

pytestmark = pytest.mark.anyio


async def wait_for(predicate, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    assert predicate(), "condition not reached in time"


async def test_stream_is_relayed_line_by_line_with_the_units_trailer() -> None:
    unit = FakeUnit("a", frames=4)
    async with run_units(unit) as served, run_router({"a": served["a"].url}) as router:
        async with httpx.AsyncClient() as client:
            status, lines, headers = await read_stream(
                client, router.url, session="v1", **{"X-Request-Id": "req-1"}
            )
    assert status == 200
    assert [line["i"] for line in lines[:-1]] == [0, 1, 2, 3]
    assert lines[-1] == {"done": True, "reason": "length", "frames": 4}
    assert headers["content-type"].startswith("application/x-ndjson")
    assert headers["x-request-id"] == "req-1" and headers["x-pdunit-unit"] == "a"
    assert unit.request_ids == ["req-1"] and unit.sessions == ["v1"]


async def test_chunks_reach_the_client_before_the_stream_ends() -> None:
    unit = FakeUnit("a", frames=3)
    unit.hold = asyncio.Event()  # the unit sends its frames, then waits before the trailer
    async with run_units(unit) as served, run_router({"a": served["a"].url}) as router:
        async with httpx.AsyncClient() as client:
            async with client.stream(
                "POST", router.url + "/v1/tts/stream", json={"prompt": [[1] * 11]}
            ) as resp:
                lines = resp.aiter_lines()
                first = json.loads(await asyncio.wait_for(lines.__anext__(), timeout=5))
                assert first["i"] == 0 and unit.completed == 0  # not buffered until the end
                unit.hold.set()
                rest = [json.loads(line) async for line in lines if line]
    assert rest[-1]["done"] is True


async def test_same_session_goes_to_the_same_unit_while_units_are_stable() -> None:
    units = [FakeUnit(n, frames=1, frame_delay_s=0) for n in ("a", "b", "c")]
    async with run_units(*units) as served:
        async with run_router({n: s.url for n, s in served.items()}) as router:
            async with httpx.AsyncClient() as client:
                for _round in range(5):
                    for s in range(30):
                        status, _, _ = await read_stream(client, router.url, session=f"voice-{s}")
                        assert status == 200
            moves = router.app.state.router.forwarder.metrics.session_moves._value.get()
    seen = collections.defaultdict(set)
    for unit in units:
        for session in unit.sessions:
            seen[session].add(unit.name)
    assert len(seen) == 30 and all(len(names) == 1 for names in seen.values())
    assert all(unit.starts > 0 for unit in units)  # the keys spread over all three
    assert moves == 0


async def test_requests_without_session_go_to_the_least_loaded_unit() -> None:
    units = [FakeUnit(n, frames=2) for n in ("a", "b", "c")]
    for unit in units:
        unit.hold = asyncio.Event()
    async with run_units(*units) as served:
        async with run_router({n: s.url for n, s in served.items()}) as router:
            async with httpx.AsyncClient() as client:
                tasks = [asyncio.create_task(read_stream(client, router.url)) for _ in range(9)]
                await wait_for(lambda: sum(u.starts for u in units) == 9)
                assert [u.starts for u in units] == [3, 3, 3]
                for unit in units:
                    unit.hold.set()
                results = await asyncio.gather(*tasks)
    assert all(status == 200 for status, _, _ in results)


async def test_draining_unit_gets_no_new_sessions_and_its_streams_finish() -> None:
    a, b = FakeUnit("a", frames=3), FakeUnit("b", frames=3)
    a.hold = asyncio.Event()
    async with run_units(a, b) as served:
        async with run_router({n: s.url for n, s in served.items()}) as router:
            key_a = key_owned_by(router.table, "a")
            async with httpx.AsyncClient() as client:
                # Two streams open on a, then a drains (as the operator would ask).
                open_streams = [
                    asyncio.create_task(read_stream(client, router.url, session=key_a))
                    for _ in range(2)
                ]
                await wait_for(lambda: a.in_flight == 2)
                r = await client.post(served["a"].url + "/v1/admin/drain", json={"draining": True})
                assert r.json()["draining"] is True
                await wait_for(lambda: router.table.units["a"].state == "draining")
                # New sessions, including a's own key, all go elsewhere.
                for s in [key_a] + [f"new-{i}" for i in range(20)]:
                    status, lines, headers = await read_stream(client, router.url, session=s)
                    assert status == 200 and headers["x-pdunit-unit"] == "b"
                assert a.starts == 2
                # The streams that were open on a run to their end.
                a.hold.set()
                finished = await asyncio.gather(*open_streams)
    assert all(status == 200 and lines[-1].get("done") for status, lines, _ in finished)
    assert a.completed == 2 and a.cancelled == 0


async def test_load_bound_spreads_a_hot_session_key_over_units() -> None:
    units = [FakeUnit(n, frames=2) for n in ("a", "b", "c", "d")]
    for unit in units:
        unit.hold = asyncio.Event()
    async with run_units(*units) as served:
        async with run_router({n: s.url for n, s in served.items()}) as router:
            owner = router.table.ring.owner("hot-voice")
            async with httpx.AsyncClient() as client:
                tasks = []
                for _ in range(12):
                    tasks.append(
                        asyncio.create_task(read_stream(client, router.url, session="hot-voice"))
                    )
                    # One at a time, as a real burst is seen by the router: each decision
                    # counts the streams already opened.
                    opened = len(tasks)
                    await wait_for(lambda: sum(u.starts for u in units) == opened)  # noqa: B023
                starts = {u.name: u.starts for u in units}
                for unit in units:
                    unit.hold.set()
                results = await asyncio.gather(*tasks)
    assert all(status == 200 for status, _, _ in results)
    bound = math.ceil(1.25 * 12 / 4)
    assert starts[owner] == bound  # the owner took its share first...
    assert max(starts.values()) <= bound  # ...nobody more than the bound...
    assert sum(1 for v in starts.values() if v) >= 3  # ...and the rest spilled over


async def test_stream_that_fails_after_its_first_byte_is_never_retried() -> None:
    a, b = FakeUnit("a", frames=5), FakeUnit("b", frames=5)
    a.fail_after_frames = 2
    async with run_units(a, b) as served:
        async with run_router({n: s.url for n, s in served.items()}) as router:
            key_a = key_owned_by(router.table, "a")
            async with httpx.AsyncClient() as client:
                status, lines, _ = await read_stream(client, router.url, session=key_a)
            metrics = router.app.state.router.forwarder.metrics
            failed = metrics.requests.labels(unit="a", outcome="failed_mid_stream")._value.get()
    assert status == 200
    assert [line.get("i") for line in lines[:2]] == [0, 1]
    assert lines[-1]["error"]["code"] == "failed_mid_stream"
    assert "not retried" in lines[-1]["error"]["message"]
    assert len(lines) == 3  # two frames and the error trailer: nothing from another unit
    assert (a.starts, b.starts) == (1, 0)
    assert failed == 1


async def test_binary_stream_that_breaks_is_cut_off_not_retried() -> None:
    a, b = FakeUnit("a", frames=5), FakeUnit("b", frames=5)
    a.binary = b.binary = True
    a.fail_after_frames = 2
    async with run_units(a, b) as served:
        async with run_router({n: s.url for n, s in served.items()}) as router:
            key_a = key_owned_by(router.table, "a")
            received = b""
            async with httpx.AsyncClient() as client:
                with pytest.raises(httpx.RemoteProtocolError):
                    async with client.stream(
                        "POST",
                        router.url + "/v1/tts/stream",
                        json={"prompt": [[1] * 11]},
                        headers={"X-Session-Id": key_a, "Accept": "application/x-pdunit-frames"},
                    ) as resp:
                        assert resp.status_code == 200
                        async for chunk in resp.aiter_raw():
                            received += chunk
    # Two whole frames arrived, then the connection broke: no trailer that could pass
    # for a clean end, and no second start anywhere.
    assert received == struct.pack("<11i", *[0] * 11) + struct.pack("<11i", *[1] * 11)
    assert (a.starts, b.starts) == (1, 0)


async def test_503_from_a_draining_unit_is_retried_on_another_unit() -> None:
    a, b = FakeUnit("a", frames=2), FakeUnit("b", frames=2)
    async with run_units(a, b) as served:
        # Polls far apart: the router has not yet seen that a drains.
        async with run_router({n: s.url for n, s in served.items()}, poll_interval_s=60) as router:
            key_a = key_owned_by(router.table, "a")
            a.draining = True
            async with httpx.AsyncClient() as client:
                status, lines, headers = await read_stream(client, router.url, session=key_a)
                assert router.table.units["a"].state == "unready"  # learned from the 503
                # The next request for the same key goes straight to b: no new refusal.
                await read_stream(client, router.url, session=key_a)
            retries = router.app.state.router.forwarder.metrics.retries
            refused = retries.labels(unit="a", reason="unit_503")._value.get()
    assert status == 200 and headers["x-pdunit-unit"] == "b" and lines[-1]["done"]
    assert (a.starts, b.starts) == (0, 2)
    assert refused == 1


async def test_429_from_a_full_unit_is_retried_on_another_unit() -> None:
    a, b = FakeUnit("a", frames=2), FakeUnit("b", frames=2)
    async with run_units(a, b) as served:
        async with run_router({n: s.url for n, s in served.items()}, poll_interval_s=60) as router:
            key_a = key_owned_by(router.table, "a")
            a.refuse_with = 429
            async with httpx.AsyncClient() as client:
                status, _, headers = await read_stream(client, router.url, session=key_a)
            assert router.table.units["a"].state == "full"
    assert status == 200 and headers["x-pdunit-unit"] == "b"
    assert (a.starts, b.starts) == (0, 1)


async def test_refused_connection_is_retried_on_another_unit() -> None:
    a, b = FakeUnit("a", frames=2), FakeUnit("b", frames=2)
    async with run_units(a, b) as served:
        async with run_router({n: s.url for n, s in served.items()}, poll_interval_s=60) as router:
            key_a = key_owned_by(router.table, "a")
            await served["a"].stop()  # a's port now refuses connections
            async with httpx.AsyncClient() as client:
                status, lines, headers = await read_stream(client, router.url, session=key_a)
            state = router.table.units["a"]
    assert status == 200 and headers["x-pdunit-unit"] == "b" and lines[-1]["done"]
    assert state.state == "unreachable" and "connect to" in state.last_error
    assert b.starts == 1


async def test_no_routable_unit_gives_503_with_a_json_error() -> None:
    a = FakeUnit("a")
    async with run_units(a) as served:
        async with run_router({"a": served["a"].url}) as router:
            a.draining = True
            await wait_for(lambda: router.table.routable_count() == 0)
            async with httpx.AsyncClient() as client:
                resp = await client.post(router.url + "/v1/tts/stream", json={"prompt": [[1] * 11]})
                ready = await client.get(router.url + "/readyz")
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "1"
    error = resp.json()["error"]
    assert error["code"] == "no_routable_unit" and "a: draining" in error["message"]
    assert ready.status_code == 503 and "no routable unit" in ready.json()["reason"]
    assert a.starts == 0


async def test_every_unit_refusing_gives_503_listing_the_attempts() -> None:
    a, b = FakeUnit("a"), FakeUnit("b")
    async with run_units(a, b) as served:
        async with run_router({n: s.url for n, s in served.items()}, poll_interval_s=60) as router:
            a.draining = b.draining = True
            async with httpx.AsyncClient() as client:
                resp = await client.post(router.url + "/v1/tts/stream", json={"prompt": [[1] * 11]})
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["code"] == "no_unit_available"
    assert {attempt["unit"] for attempt in error["attempts"]} == {"a", "b"}
    assert "HTTP 503" in error["message"]


async def test_units_errors_before_streaming_pass_through_unretried() -> None:
    a, b = FakeUnit("a"), FakeUnit("b")
    async with run_units(a, b) as served:
        async with run_router({n: s.url for n, s in served.items()}) as router:
            async with httpx.AsyncClient() as client:
                resp = await client.post(router.url + "/v1/tts/stream", json={"prompt": []})
    assert resp.status_code == 400
    assert resp.json()["error"]["field"] == "prompt"
    assert a.starts == b.starts == 0


async def test_client_disconnect_closes_the_upstream_stream() -> None:
    a = FakeUnit("a", frames=1000, frame_delay_s=0.01)
    async with run_units(a) as served, run_router({"a": served["a"].url}) as router:
        async with httpx.AsyncClient() as client:
            async with client.stream(
                "POST", router.url + "/v1/tts/stream", json={"prompt": [[1] * 11]}
            ) as resp:
                async for line in resp.aiter_lines():
                    if line:
                        break  # the listener hangs up after the first frame
        await wait_for(lambda: a.cancelled == 1)
        await wait_for(lambda: router.table.units["a"].router_in_flight == 0)
        metrics = router.app.state.router.forwarder.metrics
        gone = metrics.requests.labels(unit="a", outcome="client_disconnected")._value.get()
    assert a.completed == 0 and gone == 1


async def test_unreachable_unit_is_marked_unroutable_in_the_table() -> None:
    a = FakeUnit("a")
    async with run_units(a) as served:
        # b's port has nothing listening.
        dead = "http://127.0.0.1:9"
        async with run_router({"a": served["a"].url, "b": dead}, wait_routable=1) as router:
            await wait_for(lambda: router.table.units["b"].state == "unreachable")
            async with httpx.AsyncClient() as client:
                table = (await client.get(router.url + "/v1/units")).json()
                for i in range(10):
                    status, _, headers = await read_stream(client, router.url, session=f"s{i}")
                    assert status == 200 and headers["x-pdunit-unit"] == "a"
    b = next(u for u in table["units"] if u["name"] == "b")
    assert b["state"] == "unreachable" and not b["routable"]
    assert "/v1/load" in b["last_error"]


async def test_units_endpoint_and_metrics_describe_the_routing() -> None:
    a, b = FakeUnit("a", frames=1, frame_delay_s=0), FakeUnit("b", frames=1, frame_delay_s=0)
    async with run_units(a, b) as served:
        async with run_router({n: s.url for n, s in served.items()}) as router:
            async with httpx.AsyncClient() as client:
                for i in range(6):
                    await read_stream(client, router.url, session=f"s{i}")
                doc = (await client.get(router.url + "/v1/units")).json()
                text = (await client.get(router.url + "/metrics")).text
                health = await client.get(router.url + "/healthz")
                ready = await client.get(router.url + "/readyz")
    assert health.status_code == 200 and ready.json() == {"ready": True, "routable_units": 2}
    assert doc["load_bound_factor"] == 1.25 and doc["routable_units"] == 2
    by_name = {u["name"]: u for u in doc["units"]}
    assert by_name["a"]["url"] == served["a"].url
    assert by_name["a"]["sessions"] + by_name["b"]["sessions"] == 6
    assert by_name["a"]["sessions"] == a.starts and by_name["b"]["sessions"] == b.starts
    assert {"ready", "draining", "in_flight", "load_bound"} <= set(by_name["a"])
    ok = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdunit_router_requests_total{") and 'outcome="ok"' in line
    )
    assert ok == 6
    assert 'pdunit_router_units{state="routable"} 2.0' in text
    assert "pdunit_router_decision_latency_seconds_count 6.0" in text
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert line.startswith("pdunit_router_"), line


async def test_body_over_the_limit_is_refused_before_any_unit() -> None:
    a = FakeUnit("a")
    async with run_units(a) as served:
        async with run_router({"a": served["a"].url}, max_body_bytes=100) as router:
            async with httpx.AsyncClient() as client:
                resp = await client.post(
                    router.url + "/v1/tts/stream", json={"prompt": [[1] * 11] * 20}
                )
    assert resp.status_code == 413 and "--max-body-bytes" in resp.json()["error"]["message"]
    assert a.starts == 0
