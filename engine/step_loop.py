"""The thread every engine (P's stages, D, the monolith) runs its steps in, the
process-wide knobs of an engine's start and end of start, and the StepFrames message
a decode step publishes (`publish_step`: frames, stamps and the codec stage's PCM).

A loop whose step raises exits the process (EXIT_STEP_LOOP_CRASHED): an engine whose
loop died must never go on answering gRPC while serving nothing. Owns no engine state.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdunit.engine.kernel_compiles import serving_started, watch_kernel_compiles
from pdunit.engine.model.device import bind_thread
from pdunit.engine.observability import now_ns, settle_gc_for_serving
from pdunit.engine.packing import pack
from pdunit.engine.proto import pdunit_pb2 as pb

if TYPE_CHECKING:
    from pdunit.engine.audio.codec_stage import CodecStage, StepCost
    from pdunit.engine.decode.batcher import StepOutput
    from pdunit.engine.decode.hub import FrameHub

log = logging.getLogger("pdunit.step_loop")

EXIT_STEP_LOOP_CRASHED = 70


class StepLoop:
    """Runs `step_once` in a thread until stopped. While there is no work (`step_once`
    returns False) it sleeps on `work` (set it to wake the loop), unless `idle_wait` is
    False: for a `step_once` that blocks on its own queue until work comes (with a
    timeout, so that stopping is seen), where a second sleep would leave work that
    arrives during it waiting up to 50 ms with nobody to wake the loop."""

    def __init__(self, name: str, step_once: Callable[[], bool], device: str | torch.device = "cpu",
                 idle_wait: bool = True) -> None:
        self._step_once = step_once
        self._device = device
        self._idle_wait = idle_wait
        self.work = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.work.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            bind_thread(self._device)  # a new thread is on CUDA device 0 (engine/model/device.py)
            while not self._stop.is_set():
                if not self._step_once() and self._idle_wait:
                    self.work.wait(timeout=0.05)
                    self.work.clear()
        except BaseException as exc:
            # An engine whose loop died serves nothing while its gRPC server still
            # answers: exit, so the LB and the peer see it go (and a new instance id
            # after the restart), instead of streams that silently stop.
            self.error = exc
            log.critical("step loop crashed: exiting", exc_info=True,
                         extra={"loop": self._thread.name, "event": "StepLoopCrashed"})
            logging.shutdown()
            os._exit(EXIT_STEP_LOOP_CRASHED)


def step_message(step: int, out: StepOutput) -> pb.StepFrames:
    """One decode step's frames as D and the monolith publish them; the streams it starts
    and ends carry their stamps, the first and last frame's step time added."""
    msg = pb.StepFrames(
        step=step,
        request_ids=pack(out.request_ids, "u8"),
        frames=pack(out.frames, "i4"),
        finished=pack(out.finished, "u1"),
        step_unix_ns=now_ns(),
    )
    for s in out.started:
        s.stamps["first_frame_step"] = msg.step_unix_ns
        msg.stamps[s.request_id].CopyFrom(pb.Stamps(ns=s.stamps))
    for s in out.ended:
        s.stamps["last_frame_step"] = msg.step_unix_ns
        msg.stamps[s.request_id].CopyFrom(pb.Stamps(ns=s.stamps))
    return msg


def publish_step(hub: FrameHub, step: int, out: StepOutput, codec: CodecStage | None = None) -> StepCost | None:
    """Publish one decode step's frames (`step_message`) with the PCM chunks the codec
    stage has due for its audio streams (and a StreamError for any whose codec failed).
    Every publisher of frames goes through here: D's steps (plain, overlapped), D's first
    frame at COMMIT and the monolith's steps, so no frame's audio is left out. Returns the
    codec's cost of the step (None without a codec): admission's codec term."""
    msg = step_message(step, out)
    cost = None
    if codec is not None:
        chunks, errors, cost = codec.step_costed(out)
        msg.audio.extend(chunks)
        msg.errors.extend(errors)
    hub.publish(msg)
    return cost


def engine_setup(threads: int, gil_switch_ms: float) -> None:
    """Process-wide knobs of an engine (P, D, monolith): torch's intra-op threads, and
    Python's GIL switch interval. The step-loop thread runs Python between kernels; with
    Python's default 5 ms interval a gRPC handler (Reserve, Commit, Submit) waited up to
    that long for the GIL at every hand-over (a scratch test on the 2-core dev box: a
    unary RPC to a process with a Python-busy thread, p99 ~27 ms at 5 ms, ~4 ms at 0.5
    ms; not yet measured in an engine on the GPUs)."""
    torch.set_num_threads(max(1, threads))
    sys.setswitchinterval(gil_switch_ms / 1000)
    watch_kernel_compiles()  # start-up compiles counted as such; serving ones named (engine/kernel_compiles.py)


def engine_ready(log: logging.Logger) -> None:
    """The end of an engine's start (P, D, monolith), right before it says ready: its
    garbage collector settled for serving, and every kernel compiled from here on counted
    as a serving one (it stalls the step that needs it)."""
    settle_gc_for_serving(log)
    serving_started()
