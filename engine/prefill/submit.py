"""The Submit RPC as P and the monolith serve it: unpack the packed prompt, check it
against the model (the LB validated it already; this guards the socket): width, id
ranges, the family's row rule and sampling fields; queue the job, and answer when the
prompt's KV is committed to decode (or failed)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from pdunit.engine.model.config import ModelConfig
from pdunit.engine.model.request_rules import RowRule
from pdunit.engine.observability import now_ns
from pdunit.engine.packing import unpack
from pdunit.engine.prefill.scheduler import PrefillJob
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto.sampling import sampling_from_pb
from pdunit.engine.tracing import PREFILL_STAGES, Span

NO_DEPTH_DECODER = ("depth_decoder_temperature / depth_decoder_top_k: this model has no depth decoder "
                    "(its family samples every codebook with temperature and top_k)")


def check_prompt(
    req: pb.SubmitRequest, config: ModelConfig, row_rule: RowRule | None = None
) -> tuple[np.ndarray | None, str]:
    if req.cols != config.n_codebooks:
        return None, f"prompt has {req.cols} columns, the model has {config.n_codebooks} codebooks"
    if req.rows <= 0:
        return None, "empty prompt"
    if len(req.prompt) != req.rows * req.cols * 8:
        return None, f"prompt bytes {len(req.prompt)} != rows*cols*8 = {req.rows * req.cols * 8}"
    prompt = unpack(req.prompt, "i8", req.cols)
    limits = np.asarray(config.vocab_sizes, dtype=np.int64)
    bad = (prompt < 0) | (prompt >= limits)
    if bad.any():
        row, col = (int(x) for x in np.argwhere(bad)[0])
        return None, f"prompt row {row} column {col} id {int(prompt[row, col])} outside [0, {limits[col]})"
    if row_rule is not None:
        error = row_rule.check(prompt)
        if error is not None:
            return None, error.message()
    if req.rows + max(1, req.sampling.max_frames) > config.max_positions:
        return None, f"prompt rows + max_frames exceed the model's {config.max_positions} positions"
    return prompt, ""


async def serve_submit(
    req: pb.SubmitRequest,
    config: ModelConfig,
    submit: Callable[[PrefillJob], None],
    cancel: Callable[[int], bool],
    span: Span | None = None,
    row_rule: RowRule | None = None,
    depth_sampling: bool = False,
) -> pb.SubmitReply:
    """Check, queue and answer one Submit. `span`: the request's trace span in this
    process (engine/tracing.py), closed with its stages when the answer is known.
    `row_rule`, `depth_sampling`: the model's (`TTSModel.row_rule`, `.depth_sampling`)."""
    try:
        reply = await _serve(req, config, submit, cancel, span, row_rule, depth_sampling)
    except BaseException as exc:
        if span is not None:
            span.end({}, (), now_ns(), f"Submit did not complete: {exc!r}")
        raise
    if span is not None:
        failed = "" if reply.status == pb.STATUS_OK else pb.Status.Name(reply.status).lower()
        span.end(dict(reply.stamps.ns), PREFILL_STAGES, now_ns(), failed, status=pb.Status.Name(reply.status),
                 prefill_tokens=reply.prefill_tokens, cached_tokens=reply.cached_tokens)
    return reply


async def _serve(
    req: pb.SubmitRequest,
    config: ModelConfig,
    submit: Callable[[PrefillJob], None],
    cancel: Callable[[int], bool],
    span: Span | None,
    row_rule: RowRule | None,
    depth_sampling: bool,
) -> pb.SubmitReply:
    prompt, error = check_prompt(req, config, row_rule)
    if prompt is None:
        return pb.SubmitReply(status=pb.INVALID, message=error)
    loop = asyncio.get_running_loop()
    future: asyncio.Future[pb.SubmitReply] = loop.create_future()

    def resolve(reply: pb.SubmitReply) -> None:
        if not future.done():  # a cancelled Submit leaves its future done
            future.set_result(reply)

    def done(reply: pb.SubmitReply) -> None:
        loop.call_soon_threadsafe(resolve, reply)

    try:
        params = sampling_from_pb(req.sampling)
    except ValueError as exc:
        return pb.SubmitReply(status=pb.INVALID, message=str(exc))
    if params.has_depth and not depth_sampling:
        return pb.SubmitReply(status=pb.INVALID, message=NO_DEPTH_DECODER)
    job = PrefillJob(
        request_id=req.request_id, prompt=prompt, params=params,
        deadline_unix_ms=req.deadline_unix_ms, stamps=dict(req.stamps.ns), done=done, audio=req.audio,
        span=span,
    )
    submit(job)
    try:
        return await future
    except asyncio.CancelledError:  # the LB gave up on this request (client gone)
        cancel(req.request_id)
        raise
