"""`pdunit monolith`: prefill and decode in one process (the baseline). Serves both the
Prefill and the Decode gRPC services on one socket, so an LB points both at it."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import torch
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
from pdunit.engine.model.family_csm import set_depth_kernels
from pdunit.engine.model.mixed_graphs import (
    DEFAULT_STREAM_BUCKETS,
    MixedGraphRunner,
    mixed_graphs_refusal,
)
from pdunit.engine.model.transformer import TTSModel
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
    DepthKernels,
    GemmPrecision,
    MonolithPolicy,
    PrefillModelFields,
    decode_gemm_field,
    decode_kernel_field,
    depth_kernels_field,
    parse_config,
)
from pdunit.engine.stack_sampler import StackSamplingFields, start_sampler, stop_sampler
from pdunit.engine.step_loop import engine_ready, engine_setup
from pdunit.engine.step_pad import SyntheticStepFields
from pdunit.engine.tracing import Tracing, TracingFields
from pdunit.engine.unit_layout import pod_socket
from pdunit.kernels.paged_attention import configure_decode

# Prompts per captured prefill graph: P's default --max-batch-prompts, so both baselines
# replay the same shapes.
PREFILL_GRAPH_SEQS = 16


class MonolithConfig(PrefillModelFields, StackSamplingFields, AdmissionFields, CodecFields, SyntheticStepFields,
                     TracingFields):
    """Monolith: P and D in one process on one device (prefill-first, chunked or budget)."""

    socket: str = Field(pod_socket("monolith"), description="unix socket (both services)")
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
    mixed_graphs: bool = Field(False, description="replay a captured CUDA graph for mixed steps (decode rows and "
                               "prompt rows in one forward: chunked and budget), one per (--mixed-graph-streams, "
                               "--mixed-graph-rows) bucket pair, its rows padded to the pair; steps outside the pairs "
                               "run eagerly (pdunit_monolith_mixed_steps_total{path}). Needs the GPU path (CUDA, "
                               "bf16/fp16): asking for them elsewhere is an error")
    mixed_graph_streams: list[int] = Field(default_factory=list, description="decode-row buckets of the mixed-step "
                                           "graphs (comma list; empty, the default: 8,16,32,64,128,256,512 below "
                                           "--max-batch, and --max-batch)")
    mixed_graph_rows: list[int] = Field(default_factory=list, description="prompt-row buckets of the mixed-step "
                                        "graphs (comma list; empty, the default: 1, 2, 4 ... 32 blocks of "
                                        "--prefix-block-tokens rows, the budget policy's chunks, below "
                                        "--max-batch-rows)")
    mixed_graph_chunks: int = Field(4, gt=0, description="prompt chunks a mixed-step graph holds (more: eager)")
    decode_kernel: DecodeKernel = decode_kernel_field()
    decode_gemm: GemmPrecision = decode_gemm_field()
    depth_kernels: DepthKernels = depth_kernels_field()
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


def mixed_graph_buckets(cfg: MonolithConfig) -> tuple[list[int], list[int]]:
    """(decode-row buckets, prompt-row buckets) of `--mixed-graphs`, defaults applied."""
    streams = cfg.mixed_graph_streams or sorted({b for b in DEFAULT_STREAM_BUCKETS if b < cfg.max_batch}
                                                | {cfg.max_batch})
    blocks = [cfg.prefix_block_tokens << i for i in range(6)]
    rows = cfg.mixed_graph_rows or ([b for b in blocks if b <= cfg.max_batch_rows] or [cfg.max_batch_rows])
    return sorted(set(streams)), sorted(set(rows))


def capture_mixed_graphs(cfg: MonolithConfig, model: TTSModel, storage: torch.Tensor,
                         log: logging.Logger) -> MixedGraphRunner | None:
    """The runner of `--mixed-graphs` (None: off); ValueError naming the flag where the
    model cannot take them."""
    if not cfg.mixed_graphs:
        return None
    refusal = mixed_graphs_refusal(model)
    if refusal is not None:
        raise ValueError(refusal)
    t0, reserved = time.perf_counter(), torch.cuda.memory_reserved(storage.device)
    streams, rows = mixed_graph_buckets(cfg)
    runner = MixedGraphRunner(model, storage, streams, rows, cfg.mixed_graph_chunks)
    log.info("mixed graphs captured", extra={
        "stream_buckets": streams, "row_buckets": rows, "max_chunks": cfg.mixed_graph_chunks,
        "pairs": len(runner.pairs), "seconds": round(time.perf_counter() - t0, 2),
        "reserved_mib": round((torch.cuda.memory_reserved(storage.device) - reserved) / 2**20)})
    return runner


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
        depth = set_depth_kernels(model, cfg.depth_kernels)  # and before the frame graphs record these
        log.info("depth kernels", extra={"requested": cfg.depth_kernels, "kernels": depth})
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
    try:
        mixed = capture_mixed_graphs(cfg, model, storage, log)
    except ValueError as exc:
        log.error("cannot start the model", extra={"error": str(exc)})
        return 2
    cache = PrefixCache(cfg.cache_tokens, cfg.prefix_block_tokens) if cfg.cache_tokens else None
    overlap = model.gpu_path if cfg.overlap is None else cfg.overlap
    try:
        engine = MonolithEngine(
            model, cfg.model, pool, storage, FrameHub(asyncio.get_running_loop()),
            cfg.policy, cfg.chunk_tokens, cfg.max_batch, cfg.max_batch_rows, decode_graphs, graphs, cache,
            admission, overlap=overlap, min_chunk_rows=cfg.prefix_block_tokens, codec=codec,
            audio_format=audio_format, mixed_graphs=mixed,
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
                                      "decode_graphs": engine.step_forward.graphs is not None,
                                      "mixed_graphs": mixed is not None})
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
