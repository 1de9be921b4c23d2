"""`pdunit monolith`: prefill and decode in one process (the baseline). Serves both the
Prefill and the Decode gRPC services on one socket, so an LB points both at it."""

from __future__ import annotations

import asyncio
import sys

from pydantic import Field

from pdunit.engine.audio.codec_stage import CodecFields, build_codec_stage
from pdunit.engine.decode.admission import AdmissionFields, build_admission, resolve_floor
from pdunit.engine.decode.hub import FrameHub
from pdunit.engine.decode.step_forward import resolve_decode_graphs
from pdunit.engine.grpc_server import start_unix_server
from pdunit.engine.kv.pool import PagePool
from pdunit.engine.kv.prefix_cache import PrefixCache
from pdunit.engine.metrics import register_role
from pdunit.engine.model.device import bind_thread, device_executor
from pdunit.engine.monolith.worker import MonolithEngine
from pdunit.engine.observability import (
    log_config,
    now_ns,
    serve_metrics,
    setup_logging,
    shutdown_event,
)
from pdunit.engine.prefill.runner import start_prefill_model
from pdunit.engine.prefill.submit import serve_submit
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.settings import (
    DecodeKernel,
    GemmPrecision,
    MonolithPolicy,
    PrefillModelFields,
    decode_gemm_field,
    decode_kernel_field,
    parse_config,
)
from pdunit.engine.stack_sampler import StackSamplingFields, start_sampler, stop_sampler
from pdunit.engine.step_loop import engine_ready, engine_setup
from pdunit.engine.step_pad import SyntheticStepFields
from pdunit.engine.tracing import Tracing, TracingFields
from pdunit.kernels.paged_attention import configure_decode

# Prompts per captured prefill graph: P's default --max-batch-prompts, so both baselines
# replay the same shapes.
PREFILL_GRAPH_SEQS = 16


class MonolithConfig(PrefillModelFields, StackSamplingFields, AdmissionFields, CodecFields, SyntheticStepFields,
                     TracingFields):
    """Monolith: P and D in one process on one device (prefill-first, chunked or budget)."""

    socket: str = Field("/run/pdunit/monolith.sock", description="unix socket (both services)")
    policy: MonolithPolicy = Field("prefill-first", description="scheduling policy: prefill-first (prompts "
                                   "before decode steps) | chunked (--chunk-tokens rows per step) | budget (a "
                                   "step's prompt rows are what fits in the rate floor's step budget beside the "
                                   "decoding streams; needs --rate-floor > 0)")
    chunk_tokens: int = Field(8192, gt=0, description="chunked policy: rows per iteration (decode included)")
    pool_tokens: int = Field(65536, gt=0, description="token rows in the KV pool")
    cache_tokens: int = Field(65536, ge=0, description="token rows of a prefix cache beside the pool, as P keeps "
                              "one: a reused voice skips its cached leading blocks (0 = none)")
    page_size: int = Field(1, gt=0, description="tokens per page")
    max_batch: int = Field(512, gt=0, description="streams per decode step (the largest decode graph bucket)")
    cuda_graphs: bool | None = Field(None, description="replay captured CUDA graphs for decode-only steps, as D's "
                                     "--cuda-graphs: default on where the model takes the GPU path, else off; asking "
                                     "for them elsewhere (CPU, float32/64) is an error")
    overlap: bool | None = Field(None, description="overlap scheduling, as D's: queue step n+1 (decode-only, mixed "
                                 "or prefill-only) before step n's frames reach the host (same frames); default: "
                                 "on when the model takes the GPU path, off on CPU (--overlap turns it on there too)")
    decode_kernel: DecodeKernel = decode_kernel_field()
    decode_gemm: GemmPrecision = decode_gemm_field()
    metrics_port: int = Field(0, ge=0, description="Prometheus port (0 = off)")
    torch_threads: int = Field(1, gt=0, description="torch intra-op threads")
    gil_switch_ms: float = Field(0.5, gt=0, le=100, description="Python's GIL switch interval: the longest a gRPC "
                                 "handler waits for the step-loop thread (Python's default is 5)")
    log_level: str = Field("info", description="log level")


class MonolithPrefill(pbg.PrefillServicer):
    def __init__(self, engine: MonolithEngine, tracing: Tracing | None = None) -> None:
        self.tracing = tracing or Tracing("monolith", "")
        self.engine = engine

    async def Submit(self, request, context):  # noqa: N802 - gRPC names
        # the monolith traces its prefill (queue, forward); its frames are in the LB's span
        span = self.tracing.start("prefill.request", now_ns(), context.invocation_metadata(),
                                  request_id=f"{request.request_id:016x}") if self.tracing.enabled else None
        return await serve_submit(request, self.engine.model.config, self.engine.submit, self.engine.cancel,
                                  span, self.engine.model.row_rule, self.engine.model.depth_sampling)

    async def Cancel(self, request, context):  # noqa: N802
        return pb.CancelReply(found=self.engine.cancel(request.request_id))

    async def Abort(self, request, context):  # noqa: N802
        return pb.AbortReply(ack=True, instance_id=self.engine.instance_id)  # nothing is ever in transfer

    async def Info(self, request, context):  # noqa: N802
        return self.engine.info()


class MonolithDecode(pbg.DecodeServicer):
    def __init__(self, engine: MonolithEngine) -> None:
        self.engine = engine

    async def Hello(self, request, context):  # noqa: N802
        return self.engine.hello()

    async def Reserve(self, request, context):  # noqa: N802
        return pb.ReserveReply(status=pb.INVALID, message="the monolith takes no KV transfers")

    async def Commit(self, request, context):  # noqa: N802
        return pb.CommitReply(status=pb.INVALID, message="the monolith takes no KV transfers")

    async def Frames(self, request, context):  # noqa: N802
        subscription = self.engine.hub.subscribe()
        await context.send_initial_metadata(())  # the LB knows it is subscribed from here on
        async for message in subscription:
            yield message

    async def Cancel(self, request, context):  # noqa: N802
        return pb.CancelReply(found=self.engine.cancel(request.request_id))

    async def Info(self, request, context):  # noqa: N802
        return self.engine.info()


async def serve(cfg: MonolithConfig) -> int:
    log = setup_logging("monolith", cfg.log_level)
    log_config(log, cfg)
    engine_setup(cfg.torch_threads, cfg.gil_switch_ms)
    log.info("decode kernel settings", extra={"settings": configure_decode(cfg.decode_kernel)})
    register_role("monolith")  # this process's series only (engine/metrics.py)
    serve_metrics(cfg.metrics_port)
    bind_thread(cfg.device)  # this thread (gRPC handlers) and every pool thread: the engine's GPU
    asyncio.get_running_loop().set_default_executor(device_executor(cfg.device, "monolith-exec"))
    pool = PagePool(cfg.pool_tokens // cfg.page_size, cfg.page_size)
    # one storage: the pool's slots, then the prefix cache's
    started = start_prefill_model(cfg, pool.n_slots + cfg.cache_tokens, PREFILL_GRAPH_SEQS, log)
    if started is None:
        return 2
    model, storage, graphs = started
    try:
        model.set_decode_gemm(cfg.decode_gemm)  # before the decode graphs record the GEMMs
        decode_graphs = resolve_decode_graphs(cfg.cuda_graphs, model)
    except ValueError as exc:
        log.error("cannot start the model", extra={"error": str(exc)})
        return 2
    try:
        codec, audio_format = build_codec_stage(cfg, model, cfg.model, cfg.device, log)
    except ValueError as exc:
        log.error("cannot start the codec", extra={"error": str(exc)})
        return 2
    # the floor follows the model: --rate-floor, else (on a CUDA device) 2 x the codec's or
    # the model config's frame rate, else 42; off on CPU (engine/decode/admission.py)
    on_gpu = model.device.type == "cuda"
    floor = resolve_floor(cfg.rate_floor, on_gpu, audio_format.frame_rate_hz if audio_format is not None else None,
                          model.frame_rate_hz)
    try:
        admission = build_admission(cfg, on_gpu, floor)
    except ValueError as exc:
        log.error("cannot start rate-floor admission", extra={"error": str(exc)})
        return 2
    log.info("rate-floor admission", extra={**floor.log_fields(), "margin": cfg.floor_margin,
                                            "step_model": cfg.step_model or None, "on": admission is not None})
    cache = PrefixCache(cfg.cache_tokens, cfg.prefix_block_tokens) if cfg.cache_tokens else None
    overlap = model.gpu_path if cfg.overlap is None else cfg.overlap
    try:
        engine = MonolithEngine(
            model, cfg.model, pool, storage, FrameHub(asyncio.get_running_loop()),
            cfg.policy, cfg.chunk_tokens, cfg.max_batch, cfg.max_batch_rows, decode_graphs, graphs, cache,
            admission, overlap=overlap, min_chunk_rows=cfg.prefix_block_tokens, codec=codec,
            audio_format=audio_format,
        )
    except ValueError as exc:
        log.error("cannot start the monolith", extra={"error": str(exc)})
        return 2
    engine.step_pad = cfg.step_pad()
    engine.step_pad.export(log)
    sampler = start_sampler(cfg, log)
    stop = shutdown_event(log)

    tracing = Tracing("monolith", cfg.otlp_endpoint, engine.instance_id)

    def register(server) -> None:
        pbg.add_PrefillServicer_to_server(MonolithPrefill(engine, tracing), server)
        pbg.add_DecodeServicer_to_server(MonolithDecode(engine), server)

    server = await start_unix_server(cfg.socket, register, log)
    engine.loop.start()
    engine_ready(log)
    log.info("monolith ready", extra={"instance_id": engine.instance_id, "policy": cfg.policy,
                                      "overlap": engine.overlap is not None,
                                      "decode_graphs": engine.step_forward.graphs is not None})
    await stop.wait()
    engine.hub.close()
    await server.stop(grace=5)
    tracing.shutdown()
    engine.loop.stop()
    stop_sampler(sampler, log)
    log.info("monolith stopped")
    return 0


def main(argv: list[str]) -> int:
    cfg = parse_config(MonolithConfig, argv, "pdunit monolith")
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
