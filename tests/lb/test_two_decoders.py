"""The LB of a 1P2D unit (`--decode-socket a,b`) against a fake P and two fake D's:
frames from both D's, /v1/load sums them, readiness needs every D, cancels go to the D
that holds the stream, and a broken subscription fails only that D's streams."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from tests.lb.conftest import wait_until
from tests.lb.fakes import N_CODEBOOKS, FakeDecode, FakeUnit, LoopThread, frame_of


class SecondDecode:
    def __init__(self, decode: FakeDecode, socket: str, server: grpc.aio.Server) -> None:
        self.decode, self.socket, self.server = decode, socket, server


@pytest.fixture
def second(loop_thread: LoopThread, fake_unit: FakeUnit, short_dir: str) -> Iterator[SecondDecode]:
    decode = FakeDecode()
    socket = os.path.join(short_dir, "d1.sock")

    async def serve() -> grpc.aio.Server:
        server = grpc.aio.server()
        pbg.add_DecodeServicer_to_server(decode, server)
        server.add_insecure_port(f"unix://{socket}")
        await server.start()
        return server

    d1 = SecondDecode(decode, socket, loop_thread.run(serve()))
    yield d1

    async def stop() -> None:
        if decode._stepper is not None:
            decode._stepper.cancel()
        await d1.server.stop(grace=None)

    loop_thread.run(stop())


def prompt(rows: int = 12, seed: int = 0) -> list[list[int]]:
    return np.random.default_rng(seed).integers(0, 1024, (rows, N_CODEBOOKS)).tolist()


@pytest.fixture
def lb2(start_lb, fake_unit: FakeUnit, second: SecondDecode):
    return start_lb(decode_socket=f"{fake_unit.decode_socket},{second.socket}")


def route_to(fake_unit: FakeUnit, decode: FakeDecode) -> None:
    fake_unit.prefill.decode = decode  # the fake P "chooses" this D for the next Submit


def test_streams_from_both_decoders_reach_their_clients(lb2, fake_unit, second):
    with lb2.client() as c:
        for decode in (fake_unit.decode, second.decode):
            route_to(fake_unit, decode)
            resp = c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 12})
            lines = [json.loads(x) for x in resp.text.splitlines() if x]
            assert resp.status_code == 200
            assert [x["frame"] for x in lines[:-1]] == [frame_of(j) for j in range(12)]
            assert lines[-1]["done"] is True


def test_load_sums_the_decoders_and_is_empty_only_when_every_decoder_is(lb2, fake_unit, second):
    fake_unit.decode.step_s = second.decode.step_s = 0.05
    with lb2.client() as c:
        idle = c.get("/v1/load").json()
        assert idle["empty"] is True and idle["ready"] is True
        assert idle["pool_pages"] == 2 * 4096 and idle["kv_checks_total"] == 2 * 7
        assert idle["decode_instance"] == f"{fake_unit.decode.instance_id},{second.decode.instance_id}"
        assert [d["name"] for d in idle["decoders"]] == ["decode-0", "decode-1"]
        route_to(fake_unit, second.decode)
        with c.stream("POST", "/v1/tts/stream", json={"prompt": prompt(), "max_frames": 40}) as s:
            lines = s.iter_lines()
            next(lines)
            rid = s.headers["x-pdunit-request-id"]
            busy = c.get("/v1/load").json()
            assert busy["empty"] is False and busy["decode_in_flight"] == 1
            assert busy["requests"]["decode"] == [rid]
            d0, d1 = busy["decoders"]
            assert d0["requests"] == [] and d1["requests"] == [rid]
            assert d1["streams_in_flight"] == 1 and d0["streams_in_flight"] == 0
            for _ in lines:
                pass
        wait_until(lambda: c.get("/v1/load").json()["empty"], what="empty after the stream")
        second.decode.held_pages = 4  # only the second D holds pages: the unit is not empty
        fake_unit.decode.held_pages = 3
        held = c.get("/v1/load").json()
        assert held["empty"] is False and held["held_pages"] == 7
        assert held["free_pages"] == 2 * 4096 - 7
        fake_unit.decode.held_pages = 0
        assert c.get("/v1/load").json()["empty"] is False
        second.decode.held_pages = 0
        assert c.get("/v1/load").json()["empty"] is True


def test_the_unit_is_ready_only_while_every_decoder_is(lb2, second):
    with lb2.client() as c:
        second.decode.draining = True
        wait_until(lambda: c.get("/readyz").status_code == 503, what="not ready")
        body = c.get("/readyz").json()
        assert "decode-1 is draining" in body["reason"]
        second.decode.draining = False
        wait_until(lambda: c.get("/readyz").status_code == 200, what="ready again")


def test_a_stopped_second_decoder_makes_the_unit_unready(loop_thread, lb2, second):
    loop_thread.run(second.server.stop(grace=None))
    with lb2.client() as c:
        wait_until(lambda: c.get("/readyz").status_code == 503, what="not ready")
        assert "decode-1" in c.get("/readyz").json()["reason"]
        doc = c.get("/v1/load").json()
        assert doc["empty"] is False and "decode-1" in doc["errors"]


def test_a_cancel_goes_only_to_the_decoder_that_holds_the_stream(lb2, fake_unit, second):
    second.decode.step_s = 0.05
    route_to(fake_unit, second.decode)
    with lb2.client() as c:
        with c.stream("POST", "/v1/tts/stream", json={"prompt": prompt(), "max_frames": 200}) as s:
            lines = s.iter_lines()
            next(lines)
            next(lines)
            rid = int(s.headers["x-pdunit-request-id"], 16)
    wait_until(lambda: rid in second.decode.cancels and rid in fake_unit.prefill.cancels, what="cancel on D1 and P")
    assert rid not in fake_unit.decode.cancels
    assert rid not in second.decode.active


def test_a_broken_subscription_fails_only_the_streams_of_that_decoder(loop_thread, lb2, fake_unit, second):
    fake_unit.decode.step_s = second.decode.step_s = 0.05
    with lb2.client() as c0, lb2.client() as c1:
        route_to(fake_unit, fake_unit.decode)
        with c0.stream("POST", "/v1/tts/stream", json={"prompt": prompt(), "max_frames": 40}) as s0:
            lines0 = s0.iter_lines()
            next(lines0)
            route_to(fake_unit, second.decode)
            with c1.stream("POST", "/v1/tts/stream", json={"prompt": prompt(), "max_frames": 400}) as s1:
                lines1 = s1.iter_lines()
                next(lines1)
                loop_thread.call(second.decode.break_subscriptions)
                last1 = json.loads(list(lines1)[-1])
            last0 = json.loads(list(lines0)[-1])
    assert last1["error"]["code"] == "decode_unavailable" and "decode-1" in last1["error"]["message"]
    assert last0["done"] is True and last0["frames"] == 40
    wait_until(lambda: lb2.lb.subscriptions[1].connects == 2, what="decode-1 resubscribed")


def test_decoders_serving_different_models_make_the_unit_unready(start_lb, fake_unit, second):
    second.decode.n_codebooks = N_CODEBOOKS + 1
    lb = start_lb(wait_ready=False, decode_socket=f"{fake_unit.decode_socket},{second.socket}")
    with lb.client() as c:
        wait_until(lambda: "same model" in c.get("/readyz").json()["reason"], what="a config error")
        assert c.get("/readyz").status_code == 503
        assert c.post("/v1/tts/stream", json={"prompt": prompt()}).status_code == 503


def test_decoders_playing_at_different_frame_rates_make_the_unit_unready(start_lb, fake_unit, second):
    second.decode.frame_rate_hz = 12.5  # the first's is 21: streams could not be judged alike
    lb = start_lb(wait_ready=False, decode_socket=f"{fake_unit.decode_socket},{second.socket}")
    with lb.client() as c:
        wait_until(lambda: "same model" in c.get("/readyz").json()["reason"], what="a config error")
        assert "12.5 frames/s" in c.get("/readyz").json()["reason"]


def test_decode_socket_lists_each_decoder_once():
    from pdunit.engine.lb.config import LBConfig

    assert LBConfig(decode_socket=" a.sock , b.sock ").decode_sockets() == ["a.sock", "b.sock"]
    with pytest.raises(ValueError, match="names a socket twice"):
        LBConfig(decode_socket="a.sock,a.sock")
