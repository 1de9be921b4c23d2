"""The LB against fake P and D gRPC servers: streaming, errors, drain, load, cancel."""

from __future__ import annotations

import json
import os
import re
import struct
import threading
import time

import httpx
import numpy as np
import pytest

from pdunit.engine.proto import pdunit_pb2 as pb
from tests.lb.conftest import wait_until
from tests.lb.fakes import N_CODEBOOKS, FakeProxy, FakeUnit, frame_of, start_proxy


def prompt(rows: int = 12, seed: int = 0) -> list[list[int]]:
    return np.random.default_rng(seed).integers(0, 1024, (rows, N_CODEBOOKS)).tolist()


def ndjson(resp: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in resp.text.splitlines() if line]


def test_frames_stream_in_order_then_a_final_record_with_stage_stamps(start_lb, fake_unit):
    lb = start_lb()
    with lb.client() as c:
        resp = c.post(
            "/v1/tts/stream",
            json={"prompt": prompt(), "max_frames": 25},
            headers={"X-Request-Id": "client-7"},
        )
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/x-ndjson"
    assert resp.headers["x-request-id"] == "client-7"
    lines = ndjson(resp)
    frames, final = lines[:-1], lines[-1]
    assert [f["i"] for f in frames] == list(range(25))
    assert [f["frame"] for f in frames] == [frame_of(j) for j in range(25)]
    assert final["done"] is True and final["reason"] == "length" and final["frames"] == 25
    stages = final["stages"]
    for name in (
        "lb_received",
        "lb_validated",
        "lb_submitted",
        "p_admitted",
        "p_committed",
        "lb_submit_returned",
        "d_first_frame",
        "d_last_frame",
        "lb_first_frame_out",
        "lb_last_frame_out",
    ):
        assert name in stages, name
    assert list(stages.values()) == sorted(stages.values())
    assert (
        stages["lb_received"]
        <= stages["lb_validated"]
        <= stages["lb_submitted"]
        <= stages["p_admitted"]
    )
    assert stages["d_last_frame"] <= stages["lb_last_frame_out"]
    # P got exactly the packed prompt: int64 rows, the sampling fields and the id of the stream.
    (sub,) = fake_unit.prefill.submits
    assert (sub.rows, sub.cols) == (12, N_CODEBOOKS)
    assert np.frombuffer(sub.prompt, "<i8").reshape(12, N_CODEBOOKS).tolist() == prompt()
    assert sub.sampling.max_frames == 25
    assert f"{sub.request_id:016x}" == resp.headers["x-pdunit-request-id"] == final["request_id"]
    wait_until(lambda: len(lb.lb.table) == 0, what="stream left the LB table")


def test_binary_int32_prompt_and_binary_frames(start_lb, fake_unit):
    lb = start_lb()
    ids = np.array(prompt(30), dtype="<i4")
    with lb.client() as c:
        resp = c.post(
            "/v1/tts/stream",
            content=ids.tobytes(),
            headers={
                "Content-Type": "application/octet-stream",
                "X-Pdunit-Dtype": "int32",
                "X-Pdunit-Row-Width": "11",
                "X-Pdunit-Max-Frames": "9",
                "X-Pdunit-Seed": "42",
                "Accept": "application/x-pdunit-frames",
            },
        )
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/x-pdunit-frames"
    body = resp.content
    frame_bytes = 9 * N_CODEBOOKS * 4
    frames = np.frombuffer(body[:frame_bytes], "<i4").reshape(9, N_CODEBOOKS)
    assert frames.tolist() == [frame_of(j) for j in range(9)]
    assert body[frame_bytes : frame_bytes + 4] == b"\xff\xff\xff\xff"
    final = json.loads(body[frame_bytes + 4 :])
    assert final["done"] and final["frames"] == 9
    (sub,) = fake_unit.prefill.submits
    assert np.frombuffer(sub.prompt, "<i8").reshape(30, N_CODEBOOKS).tolist() == ids.tolist()
    assert sub.sampling.seed == 42 and sub.sampling.max_frames == 9


@pytest.mark.parametrize(
    ("status", "http", "retry_after"),
    [
        (pb.NO_CAPACITY, 429, True),
        (pb.DRAINING, 503, True),
        (pb.INVALID, 422, False),
        (pb.DEADLINE_EXCEEDED, 504, False),
        (pb.TRANSFER_FAILED, 502, False),
    ],
)
def test_submit_status_becomes_an_http_error_before_the_first_byte(
    start_lb, fake_unit, status, http, retry_after
):
    lb = start_lb()
    fake_unit.prefill.status = status
    fake_unit.prefill.message = f"fake P says {pb.Status.Name(status)}"
    with lb.client() as c:
        resp = c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 5})
    assert resp.status_code == http
    assert resp.json()["error"] == {
        "code": pb.Status.Name(status).lower(),
        "message": f"fake P says {pb.Status.Name(status)}",
    }
    assert ("retry-after" in resp.headers) == retry_after
    wait_until(lambda: len(lb.lb.table) == 0, what="stream left the LB table")


def test_decode_failure_before_the_first_frame_is_an_http_error(start_lb, fake_unit):
    lb = start_lb()
    fake_unit.prefill.decode_error = pb.CHECKSUM_MISMATCH
    with lb.client() as c:
        resp = c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 5})
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "checksum_mismatch"
    assert "transfer failed" in resp.json()["error"]["message"]


def test_decode_failure_reaches_the_client_at_once_while_prefill_cannot_answer(start_lb, fake_unit):
    lb = start_lb()
    fake_unit.prefill.decode_error = pb.DEADLINE_EXCEEDED
    fake_unit.prefill.hang_s = 20.0  # P is stopped: its Submit answer comes much later
    t0 = time.monotonic()
    with lb.client() as c:
        resp = c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 5})
    assert time.monotonic() - t0 < 5.0
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "deadline_exceeded"


@pytest.mark.parametrize(
    ("body", "headers", "status", "text"),
    [
        (
            json.dumps({"prompt": [[1] * 10]}),
            {"Content-Type": "application/json"},
            422,
            "prompt row 0 has 10 columns, expected 11",
        ),
        (
            json.dumps({"prompt": [[1] * 11, [1] * 10 + [1024]]}),
            {"Content-Type": "application/json"},
            422,
            "prompt row 1 column 10 has id 1024, outside [0, 1024)",
        ),
        (json.dumps({"prompt": []}), {"Content-Type": "application/json"}, 400, "prompt is empty"),
        (
            json.dumps({"prompt": [[1] * 11] * 65}),
            {"Content-Type": "application/json"},
            413,
            "prompt has 65 rows, the limit is 64",
        ),
        (
            "prompt=1",
            {"Content-Type": "text/plain"},
            400,
            "Content-Type 'text/plain' is not accepted",
        ),
        ("x" * 5000, {"Content-Type": "application/json"}, 413, "the limit is 4096"),
    ],
)
def test_bad_input_gets_its_status_and_never_reaches_prefill(
    start_lb, fake_unit, body, headers, status, text
):
    lb = start_lb(max_rows=64, max_body_bytes=4096)
    with lb.client() as c:
        resp = c.post("/v1/tts/stream", content=body, headers=headers)
    assert resp.status_code == status
    assert text in resp.json()["error"]["message"]
    assert fake_unit.prefill.submits == []


def test_draining_refuses_new_streams_with_503_and_lets_streams_in_flight_finish(
    start_lb, fake_unit
):
    lb = start_lb()
    fake_unit.decode.step_s = 0.02
    with (
        lb.client() as c,
        c.stream("POST", "/v1/tts/stream", json={"prompt": prompt(), "max_frames": 40}) as s,
    ):
        assert s.status_code == 200
        lines = s.iter_lines()
        assert json.loads(next(lines))["i"] == 0
        with lb.admin() as admin:
            load = admin.post("/v1/admin/drain").json()
        assert load["draining"] is True and load["ready"] is False
        refused = c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 5})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "draining"
        assert c.get("/readyz").status_code == 503
        rest = [json.loads(line) for line in lines if line]
        assert rest[-1]["done"] is True and rest[-1]["frames"] == 40
    with lb.client() as c:
        with lb.admin() as admin:
            assert admin.post("/v1/admin/drain", json={"draining": False}).json()["draining"] is False
        wait_until(lambda: c.get("/readyz").status_code == 200, what="ready after undrain")


def test_load_document_lists_request_ids_and_is_empty_only_when_nothing_is_held(
    start_lb, fake_unit
):
    lb = start_lb()
    fake_unit.decode.step_s = 0.05
    with lb.client() as c:
        # ready and empty once the LB's probes have answered: read at one instant, a probe
        # slowed past its interval on a busy machine (two CPU burners on 2 cores) had left
        # the document unready right after /readyz said ready
        docs: list[dict] = []

        def idle_and_ready() -> bool:
            docs.append(c.get("/v1/load").json())
            return bool(docs[-1]["ready"]) and docs[-1]["empty"] is True

        try:
            wait_until(idle_and_ready, what="an idle, ready load document")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the last: {docs[-1]}") from None
        idle = docs[-1]
        for key in (
            "unit",
            "ready",
            "draining",
            "transfer_mode",
            "streams_in_flight",
            "prefill_queue",
            "transfers_in_flight",
            "decode_in_flight",
            "held_pages",
            "pool_pages",
            "free_pages",
            "kv_checks_total",
            "kv_mismatch_total",
            "requests",
            "empty",
            "prefill_instance",
            "decode_instance",
        ):
            assert key in idle, key
        assert idle["unit"] == "test-unit" and idle["ready"] and idle["empty"] is True
        assert idle["kv_checks_total"] == 7 and idle["transfer_mode"] == "host"
        assert idle["decode_instance"] == fake_unit.decode.instance_id
        with c.stream("POST", "/v1/tts/stream", json={"prompt": prompt(), "max_frames": 30}) as s:
            lines = s.iter_lines()  # kept: dropping httpx's line iterator closes the connection
            next(lines)
            busy = c.get("/v1/load").json()
            rid = s.headers["x-pdunit-request-id"]
            assert busy["empty"] is False and busy["streams_in_flight"] == 1
            assert busy["requests"]["lb"] == [rid] and busy["requests"]["decode"] == [rid]
            for _ in lines:
                pass
        wait_until(lambda: c.get("/v1/load").json()["empty"], what="empty after the stream")
        fake_unit.decode.held_pages = 3
        held = c.get("/v1/load").json()
        assert held["empty"] is False and held["held_pages"] == 3


def test_client_disconnect_cancels_the_stream_in_prefill_and_decode(start_lb, fake_unit):
    lb = start_lb()
    fake_unit.decode.step_s = 0.05
    with lb.client() as c:
        with c.stream("POST", "/v1/tts/stream", json={"prompt": prompt(), "max_frames": 500}) as s:
            rid = int(s.headers["x-pdunit-request-id"], 16)
            next(s.iter_lines())
        # The response is closed after one frame: the client went away.
        wait_until(
            lambda: rid in fake_unit.decode.cancels and rid in fake_unit.prefill.cancels,
            what="Cancel on P and D",
        )
        assert rid not in fake_unit.decode.active
        wait_until(lambda: c.get("/v1/load").json()["empty"], what="unit empty after cancel")
        metrics = c.get("/metrics").text
    assert 'pdunit_lb_requests_total{code="200",outcome="disconnected"} 1.0' in metrics


def test_client_disconnect_before_the_first_frame_cancels_too(start_lb, fake_unit):
    lb = start_lb()
    fake_unit.prefill.delay_s = 1.0
    with lb.client(timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 5})
    wait_until(
        lambda: len(fake_unit.decode.cancels) == 1 and len(fake_unit.prefill.cancels) == 1,
        what="Cancel on P and D",
    )
    assert fake_unit.decode.cancels[0] == fake_unit.prefill.submits[0].request_id
    wait_until(lambda: len(lb.lb.table) == 0, what="LB table empty")


def test_decode_subscription_break_fails_streams_with_an_error_record_then_reconnects(
    start_lb, fake_unit, loop_thread
):
    lb = start_lb()
    fake_unit.decode.step_s = 0.05
    with lb.client() as c:
        with c.stream("POST", "/v1/tts/stream", json={"prompt": prompt(), "max_frames": 500}) as s:
            lines = s.iter_lines()
            next(lines)
            loop_thread.call(fake_unit.decode.break_subscriptions)
            rest = [json.loads(line) for line in lines if line]
        assert rest[-1]["error"]["code"] == "decode_unavailable"
        assert "fake D went away" in rest[-1]["error"]["message"]
        assert all("frame" in r for r in rest[:-1])
        wait_until(lambda: lb.lb.subscriptions[0].connects == 2, what="resubscribe")
        wait_until(lambda: c.get("/readyz").status_code == 200, what="ready again")
        again = c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 3})
        assert ndjson(again)[-1]["frames"] == 3


def test_a_stream_whose_frames_stop_fails_with_frame_timeout_and_is_cancelled(start_lb, fake_unit):
    lb = start_lb(frame_timeout_ms=300)
    fake_unit.decode.step_s = 0.02
    with (
        lb.client() as c,
        c.stream("POST", "/v1/tts/stream", json={"prompt": prompt(), "max_frames": 500}) as s,
    ):
        rid = int(s.headers["x-pdunit-request-id"], 16)
        lines = s.iter_lines()
        next(lines)
        fake_unit.decode.active[rid].stalled = True
        rest = [json.loads(line) for line in lines if line]
    assert rest[-1]["error"]["code"] == "frame_timeout"
    wait_until(lambda: rid in fake_unit.decode.cancels, what="Cancel on D")


def test_not_ready_without_decode_then_ready_once_it_answers(
    start_lb, fake_unit, loop_thread, short_dir
):
    fake_unit.decode_socket = f"{short_dir}/late-d.sock"
    lb = start_lb(wait_ready=False, decode_socket=fake_unit.decode_socket)
    with lb.client() as c:
        ready = c.get("/readyz")
        assert ready.status_code == 503 and ready.json()["ready"] is False
        refused = c.post("/v1/tts/stream", json={"prompt": prompt()})
        assert refused.status_code == 503 and "retry-after" in refused.headers
        assert c.get("/v1/model").status_code == 503
        assert c.get("/v1/load").json()["empty"] is False  # D never answered: nothing is proven
        loop_thread.run(fake_unit.start_decode())
        wait_until(lambda: c.get("/readyz").status_code == 200, what="ready once D is up")
        assert c.get("/v1/model").json() == {
            "n_codebooks": 11,
            "vocab_sizes": [1024] * 11,
            "eos_id": 1023,
            "max_rows": 4096,
            "max_frames_limit": 4096,
            "default_max_frames": 630,
            "audio": None,  # D has no codec: frames only
            "row_rule": None,  # the pdunit family has none
            "frame_rate_hz": 21.0,  # D's Hello: real time, the pdunit family's
            "rate_floor_fps": 42.0,  # 2x it
        }
    # An empty sender: D must never mistake the LB for its P (a new P id frees held pages).
    assert fake_unit.decode.hellos and set(fake_unit.decode.hellos) == {""}


def test_vocab_sizes_given_by_flag_must_match_the_model_d_serves(start_lb):
    lb = start_lb(wait_ready=False, vocab_sizes="1024,7")
    with lb.client() as c:
        wait_until(lambda: "vocab" in c.get("/readyz").json()["reason"], what="config error")
        reason = c.get("/readyz").json()["reason"]
    assert "--vocab-sizes: vocab_sizes has 2 entries but the model has 11 codebooks" in reason
    lb = start_lb(wait_ready=False, vocab_sizes="512")
    with lb.client() as c:
        wait_until(lambda: "differs" in c.get("/readyz").json()["reason"], what="config error")
    lb = start_lb(vocab_sizes="1024", n_codebooks=11)
    with lb.client() as c:
        assert c.get("/v1/model").json()["vocab_sizes"] == [1024] * 11


def test_a_decode_that_sends_no_metadata_before_its_first_step_still_serves(start_lb, fake_unit):
    fake_unit.decode.send_metadata = False
    lb = start_lb()
    with lb.client() as c:
        resp = c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 6})
    assert ndjson(resp)[-1]["frames"] == 6


def test_decode_draining_turns_readiness_off(start_lb, fake_unit):
    lb = start_lb()
    fake_unit.decode.draining = True
    with lb.client() as c:
        # A 503 alone is not the draining one: before its first probe the LB is not ready
        # either (for another reason); wait for the answer that names the drain.
        wait_until(lambda: "D is draining" in c.get("/readyz").json().get("reason", ""),
                   what="readiness naming the drain")
        assert c.get("/readyz").status_code == 503


def test_metrics_count_requests_frames_validation_and_waterfall_stages(start_lb, fake_unit):
    lb = start_lb()
    with lb.client() as c:
        for _ in range(2):
            assert ndjson(c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 4}))[-1][
                "done"
            ]
        c.post("/v1/tts/stream", json={"prompt": [[1] * 3]})
        text = c.get("/metrics").text
    assert 'pdunit_lb_requests_total{code="200",outcome="length"} 2.0' in text
    assert 'pdunit_lb_requests_total{code="422",outcome="rejected"} 1.0' in text
    assert "pdunit_lb_frames_total 8.0" in text
    assert 'pdunit_lb_validate_seconds_count{format="json"} 2.0' in text
    for stage in (
        "lb_validated",
        "p_admitted",
        "d_first_frame",
        "lb_first_frame_out",
        "lb_last_frame_out",
    ):
        assert f'pdunit_lb_stage_seconds_count{{stage="{stage}"}} 2.0' in text, stage
    assert "pdunit_lb_streams_in_flight 0.0" in text
    assert "pdunit_lb_frames_subscription_up 1.0" in text
    lag = re.search(r"^pdunit_lb_loop_lag_seconds_count (\S+)$", text, re.M)
    assert lag and float(lag.group(1)) >= 1, "the LB watches its own event loop"


def test_many_concurrent_streams_each_get_their_own_frames(start_lb, fake_unit):
    lb = start_lb()
    results: dict[int, list[dict]] = {}

    def one(k: int) -> None:
        with lb.client() as c:
            results[k] = ndjson(
                c.post("/v1/tts/stream", json={"prompt": prompt(seed=k), "max_frames": 10 + k})
            )

    threads = [threading.Thread(target=one, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for k, lines in results.items():
        assert [x["frame"] for x in lines[:-1]] == [frame_of(j) for j in range(10 + k)]
        assert lines[-1]["frames"] == 10 + k
    assert len(results) == 8


def test_binary_frames_header_layout_is_eleven_int32_per_frame(start_lb):
    lb = start_lb()
    with lb.client() as c:
        resp = c.post(
            "/v1/tts/stream",
            json={"prompt": prompt(), "max_frames": 1},
            headers={"Accept": "application/x-pdunit-frames"},
        )
    assert struct.unpack("<11i", resp.content[:44]) == tuple(frame_of(0))


def test_a_new_decode_instance_is_asked_hello_again(start_lb, fake_unit):
    lb = start_lb()
    hellos = len(fake_unit.decode.hellos)
    fake_unit.decode.instance_id = "restarted-d"
    wait_until(
        lambda: lb.lb.hellos[0] is not None and lb.lb.hellos[0].instance_id == "restarted-d",
        what="Hello to the new D",
    )
    assert len(fake_unit.decode.hellos) == hellos + 1
    with lb.client() as c:
        assert c.get("/readyz").status_code == 200


def test_monolith_mode_uses_one_socket_for_both_services(loop_thread, short_dir, start_lb):
    os.makedirs(f"{short_dir}/m")
    mono = FakeUnit(f"{short_dir}/m")
    loop_thread.run(mono.start(monolith=True))
    try:
        lb = start_lb(prefill_socket=mono.prefill_socket, decode_socket=mono.prefill_socket)
        assert lb.lb.unit.prefill_channel is lb.lb.unit.decode_channels[0]
        with lb.client() as c:
            resp = c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 4})
        assert [x["frame"] for x in ndjson(resp)[:-1]] == [frame_of(j) for j in range(4)]
        assert mono.prefill.submits and not mono.decode.cancels
    finally:
        loop_thread.run(mono.stop())


def test_the_proxy_must_answer_and_hold_no_job_for_the_unit_to_be_empty(
    loop_thread, short_dir, start_lb
):
    proxy = FakeProxy(running=[0xABC])
    server = loop_thread.run(start_proxy(proxy, f"{short_dir}/x.sock"))
    try:
        lb = start_lb(proxy_socket=f"{short_dir}/x.sock")
        with lb.client() as c:
            load = c.get("/v1/load").json()
            assert load["requests"]["proxy"] == ["0000000000000abc"] and load["empty"] is False
            proxy.running.clear()
            assert c.get("/v1/load").json()["empty"] is True
            loop_thread.run(server.stop(grace=None))
            wait_until(lambda: c.get("/readyz").status_code == 503, what="not ready without proxy")
            assert "proxy" in c.get("/readyz").json()["reason"]
            gone = c.get("/v1/load").json()
            assert gone["empty"] is False and "proxy" in gone["errors"]
    finally:
        loop_thread.run(server.stop(grace=None))
