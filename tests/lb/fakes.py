"""Fake P and D gRPC servers (engine/proto/pdunit.proto) for the LB's tests.

They implement just enough of the proto to drive the LB: P's Submit answers a chosen
status (and on OK makes D emit frames), D's Frames stream sends one StepFrames per
step for every active stream, Cancel and Info record and report. Frame j of a stream
is `[j, j+1, ..., j+10] % 1024` so the client can check order. Everything runs on one
background event loop (`LoopThread`) shared by the servers and the LB under test.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.proto import proxy_pb2 as proxy_pb
from pdunit.engine.proto import proxy_pb2_grpc as proxy_pbg

N_CODEBOOKS = 11


def frame_of(j: int, n_codebooks: int = N_CODEBOOKS) -> list[int]:
    return [(j + c) % 1024 for c in range(n_codebooks)]


class LoopThread:
    """An asyncio loop in a daemon thread; `run(coro)` executes on it and returns the result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name="fake-unit-loop"
        )
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Active:
    request_id: int
    total: int
    emitted: int = 0
    stalled: bool = False
    audio: bool = False
    audio_sent: int = 0  # frames whose PCM went out


def pcm_of(first_frame: int, frames: int, samples_per_frame: int) -> bytes:
    """Fake PCM: sample i of a stream is i mod 32768, so a client can check order."""
    start = first_frame * samples_per_frame
    samples = np.arange(start, start + frames * samples_per_frame, dtype=np.int64) % 32768
    return samples.astype("<i2").tobytes()


@dataclass
class FakeDecode(pbg.DecodeServicer):
    n_codebooks: int = N_CODEBOOKS
    step_s: float = 0.01
    instance_id: str = field(default_factory=lambda: secrets.token_hex(8))
    active: dict[int, Active] = field(default_factory=dict)
    cancels: list[int] = field(default_factory=list)
    hellos: list[str] = field(default_factory=list)
    subscribers: list[asyncio.Queue[Any]] = field(default_factory=list)
    held_pages: int = 0
    draining: bool = False
    unready: str = ""  # InfoReply.unready: why D cannot serve now (e.g. re-registering)
    info_delays: list[float] = field(default_factory=list)  # the next Info calls answer this late
    pending_errors: list[pb.StreamError] = field(default_factory=list)
    audio_streams: list[int] = field(default_factory=list)
    pending_audio: list[Any] = field(default_factory=list)  # Actives whose last chunk is due
    send_metadata: bool = True  # False: like a D that sends nothing before its first step
    model: str = "fake"
    vocab: int = 1024  # ids per column (Hello's vocab_sizes)
    audio_format: pb.AudioFormat | None = None  # a D with a codec: AudioChunks for audio streams
    audio_chunks: tuple[int, int] = (1, 2)  # first chunk after 1 frame, then every 2
    last_chunk_later: bool = False  # the last chunk one step after the finishing frame
    row_rule: pb.RowRule | None = None  # Hello's row rule (a csm-like model's)
    depth_sampling: bool = False  # Hello's depth_decoder_sampling
    frame_rate_hz: float = 21.0  # Hello's real-time frame rate (0: a D from before the field)
    _stepper: asyncio.Task[None] | None = None

    async def Hello(self, request: pb.HelloRequest, context: Any) -> pb.HelloReply:
        self.hellos.append(request.sender_instance)
        return pb.HelloReply(
            instance_id=self.instance_id,
            n_codebooks=self.n_codebooks,
            vocab_sizes=np.full(self.n_codebooks, self.vocab, dtype="<i8").tobytes(),
            eos_id=1023,
            model=self.model,
            audio_format=self.audio_format,
            row_rule=self.row_rule,
            depth_decoder_sampling=self.depth_sampling,
            frame_rate_hz=self.frame_rate_hz,
        )

    async def Frames(self, request: pb.FramesRequest, context: Any) -> Any:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.subscribers.append(queue)
        if self.send_metadata:
            await context.send_initial_metadata(())
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.get_running_loop().create_task(self._step_loop())
        try:
            while True:
                msg = await queue.get()
                if msg is None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake D went away")
                yield msg
        finally:
            self.subscribers.remove(queue)

    async def Cancel(self, request: pb.CancelRequest, context: Any) -> pb.CancelReply:
        self.cancels.append(request.request_id)
        found = self.active.pop(request.request_id, None) is not None
        return pb.CancelReply(found=found)

    async def Info(self, request: pb.Empty, context: Any) -> pb.InfoReply:
        if self.info_delays:
            await asyncio.sleep(self.info_delays.pop(0))
        ids = np.array(list(self.active), dtype="<u8").tobytes()
        return pb.InfoReply(
            role="decode",
            instance_id=self.instance_id,
            in_flight=len(self.active),
            held_pages=self.held_pages,
            pool_pages=4096,
            free_pages=4096 - self.held_pages,
            draining=self.draining,
            unready=self.unready,
            transfer_mode="host",
            request_ids=ids,
            kv_checks_total=7,
        )

    def start_stream(self, request_id: int, frames: int, audio: bool = False) -> None:
        self.active[request_id] = Active(request_id, frames, audio=audio)
        if audio:
            self.audio_streams.append(request_id)

    def break_subscriptions(self) -> None:
        for q in list(self.subscribers):
            q.put_nowait(None)

    async def _step_loop(self) -> None:
        step = 0
        while True:
            await asyncio.sleep(self.step_s)
            step += 1
            ids, frames, finished = [], [], []
            stamps: dict[int, pb.Stamps] = {}
            now = time.time_ns()
            audio, self.pending_audio = [self._chunk(a, last=True) for a in self.pending_audio], []
            for a in list(self.active.values()):
                if a.stalled:
                    continue
                ids.append(a.request_id)
                frames.append(frame_of(a.emitted, self.n_codebooks))
                if a.emitted == 0:
                    stamps[a.request_id] = pb.Stamps(ns={"d_first_frame": now})
                a.emitted += 1
                done = a.emitted >= a.total
                if done:
                    finished.append(2)
                    stamps.setdefault(a.request_id, pb.Stamps()).ns["d_last_frame"] = now
                    del self.active[a.request_id]
                else:
                    finished.append(0)
                if a.audio and self.audio_format is not None:
                    first, every = self.audio_chunks
                    due = a.emitted - a.audio_sent >= (first if a.audio_sent == 0 else every)
                    if done and self.last_chunk_later:
                        self.pending_audio.append(a)
                    elif due or done:
                        audio.append(self._chunk(a, last=done))
            errors, self.pending_errors = self.pending_errors, []
            if not ids and not errors and not audio:
                continue
            msg = pb.StepFrames(
                step=step,
                request_ids=np.array(ids, dtype="<u8").tobytes(),
                frames=np.array(frames, dtype="<i4").reshape(-1, self.n_codebooks).tobytes(),
                finished=bytes(finished),
                errors=errors,
                step_unix_ns=now,
                stamps=stamps,
                audio=audio,
            )
            for q in self.subscribers:
                q.put_nowait(msg)

    def _chunk(self, a: Active, last: bool) -> pb.AudioChunk:
        assert self.audio_format is not None
        n = a.emitted - a.audio_sent
        chunk = pb.AudioChunk(request_id=a.request_id, first_frame=a.audio_sent, frames=n, last=last,
                              pcm=pcm_of(a.audio_sent, n, self.audio_format.samples_per_frame))
        a.audio_sent = a.emitted
        return chunk


@dataclass
class FakePrefill(pbg.PrefillServicer):
    decode: FakeDecode
    instance_id: str = field(default_factory=lambda: secrets.token_hex(8))
    status: int = pb.STATUS_OK
    message: str = ""
    delay_s: float = 0.0
    submits: list[pb.SubmitRequest] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)
    draining: bool = False
    unready: str = ""  # InfoReply.unready: why P cannot serve now
    decode_error: int | None = None  # D reports this Status for the stream instead of frames
    hang_s: float = 0.0  # after D's error, P answers this late (a stopped P)

    async def Submit(self, request: pb.SubmitRequest, context: Any) -> pb.SubmitReply:
        self.submits.append(request)
        admitted = time.time_ns()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.status != pb.STATUS_OK:
            return pb.SubmitReply(status=self.status, message=self.message)
        if self.decode_error is not None:
            self.decode.pending_errors.append(
                pb.StreamError(
                    request_id=request.request_id,
                    status=self.decode_error,
                    message="fake D: transfer failed",
                )
            )
            if self.hang_s:
                await asyncio.sleep(self.hang_s)
        else:
            self.decode.start_stream(request.request_id, request.sampling.max_frames, request.audio)
        return pb.SubmitReply(
            status=pb.STATUS_OK,
            prefill_tokens=request.rows,
            stamps=pb.Stamps(ns={"p_admitted": admitted, "p_committed": time.time_ns()}),
        )

    async def Cancel(self, request: pb.CancelRequest, context: Any) -> pb.CancelReply:
        self.cancels.append(request.request_id)
        return pb.CancelReply(found=False)

    async def Info(self, request: pb.Empty, context: Any) -> pb.InfoReply:
        return pb.InfoReply(
            role="prefill",
            instance_id=self.instance_id,
            draining=self.draining,
            unready=self.unready,
            transfer_mode="host",
        )


class FakeUnit:
    """Fake P and D listening on unix sockets under `directory`."""

    def __init__(self, directory: str) -> None:
        self.prefill_socket = os.path.join(directory, "p.sock")
        self.decode_socket = os.path.join(directory, "d.sock")
        self.decode = FakeDecode()
        self.prefill = FakePrefill(self.decode)
        self._servers: list[grpc.aio.Server] = []

    async def start(self, with_decode: bool = True, monolith: bool = False) -> None:
        p = grpc.aio.server()
        pbg.add_PrefillServicer_to_server(self.prefill, p)
        if monolith:  # one socket serving both services, as `pdunit monolith` does
            pbg.add_DecodeServicer_to_server(self.decode, p)
            self.decode_socket = self.prefill_socket
            with_decode = False
        p.add_insecure_port(f"unix://{self.prefill_socket}")
        await p.start()
        self._servers.append(p)
        if with_decode:
            await self.start_decode()

    async def start_decode(self) -> None:
        d = grpc.aio.server()
        pbg.add_DecodeServicer_to_server(self.decode, d)
        d.add_insecure_port(f"unix://{self.decode_socket}")
        await d.start()
        self._servers.append(d)

    async def stop(self) -> None:
        if self.decode._stepper is not None:
            self.decode._stepper.cancel()
        for server in self._servers:
            await server.stop(grace=None)


@dataclass
class FakeProxy(proxy_pbg.NvlinkProxyServicer):
    """The nvlink-proxy's InFlight: request ids with a copy job running."""

    running: list[int] = field(default_factory=list)

    async def InFlight(self, request: proxy_pb.Empty, context: Any) -> proxy_pb.InFlightReply:
        return proxy_pb.InFlightReply(
            request_ids=np.array(self.running, dtype="<u8").tobytes(),
            jobs_running=len(self.running),
        )


async def start_proxy(proxy: FakeProxy, socket_path: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    proxy_pbg.add_NvlinkProxyServicer_to_server(proxy, server)
    server.add_insecure_port(f"unix://{socket_path}")
    await server.start()
    return server
