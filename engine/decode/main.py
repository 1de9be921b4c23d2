"""`pdunit decode`: the decode engine process (D) of a unit."""

from __future__ import annotations

import asyncio
import sys

import torch
from pydantic import Field, ValidationInfo, field_validator

from pdunit.engine.audio.codec_stage import CodecFields, build_codec_stage
from pdunit.engine.decode.admission import AdmissionFields, build_admission, resolve_floor
from pdunit.engine.decode.hub import FrameHub
from pdunit.engine.decode.step_forward import resolve_decode_graphs
from pdunit.engine.decode.worker import DecodeEngine, DecodeService, serve_debug
from pdunit.engine.grpc_server import start_unix_server
from pdunit.engine.kv.pool import PagePool
from pdunit.engine.metrics import register_role
from pdunit.engine.model.config import dtype_name
from pdunit.engine.model.device import bind_thread, device_executor
from pdunit.engine.model.family_csm import set_depth_kernels
from pdunit.engine.model.loader import load_model
from pdunit.engine.observability import (
    log_config,
    serve_metrics,
    setup_logging,
    shutdown_event,
)
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.security import check_unit_secret_file, read_secret_file
from pdunit.engine.settings import (
    DecodeKernel,
    DepthKernels,
    GemmPrecision,
    decode_gemm_field,
    decode_kernel_field,
    depth_kernels_field,
    kv_cache_dtype_field,
    parse_config,
)
from pdunit.engine.stack_sampler import StackSamplingFields, start_sampler, stop_sampler
from pdunit.engine.step_loop import engine_ready, engine_setup
from pdunit.engine.step_pad import SyntheticStepFields
from pdunit.engine.tracing import SpanTable, Tracing, TracingFields
from pdunit.engine.transfer.base import PoolGeometry
from pdunit.engine.transfer.factory import make_receiver
from pdunit.engine.transfer.options import unit_secret_option
from pdunit.engine.unit_layout import pod_socket
from pdunit.kernels.kv_dtype import kv_storage_dtype
from pdunit.kernels.kv_dtype_names import KvCacheDtype
from pdunit.kernels.paged_attention import configure_decode


class DecodeConfig(StackSamplingFields, AdmissionFields, CodecFields, SyntheticStepFields, TracingFields):
    """Decode engine (D): owns the paged KV pool, continuous batching, one message per step."""

    socket: str = Field(pod_socket("decode"), description="unix socket D serves on")
    prefill_socket: str = Field(pod_socket("prefill"), description="P's socket (ABORT, instance probe)")
    model: str = Field("random:tiny:0", description="random:<config>:<seed> or a model directory")
    device: str = Field("cpu", description="torch device of the pool and the model")
    dtype: str | None = Field(None, description="compute/KV dtype; default: the model config's")
    kv_cache_dtype: KvCacheDtype = kv_cache_dtype_field()
    decode_kernel: DecodeKernel = decode_kernel_field()
    decode_gemm: GemmPrecision = decode_gemm_field()
    depth_kernels: DepthKernels = depth_kernels_field()
    transfer: str = Field("host", description="transport D offers: host|proxy|ipc|posix-fd|fabric|tcp|auto")
    pool_tokens: int = Field(65536, ge=0, description="token rows in the KV pool; 0 sizes the pool to the "
                             "device: its free memory once the model is loaded, less --pool-reserve-gib (CUDA only)")
    pool_reserve_gib: float = Field(8.0, ge=0, description="--pool-tokens 0: device memory kept out of the pool, "
                                    "for the decode CUDA graphs, activations and the allocator's scratch")
    page_size: int = Field(1, gt=0, description="tokens per page")
    max_batch: int = Field(512, gt=0, description="streams per decode step (the largest decode graph bucket)")
    cuda_graphs: bool | None = Field(None, description="replay captured CUDA graphs for decode steps (one per "
                                     "batch bucket); default on where the model takes the GPU path (CUDA, bf16 or "
                                     "fp16, any family), else off; asking for them elsewhere (CPU, float32/64) is an "
                                     "error")
    overlap: bool | None = Field(None, description="overlap scheduling: queue decode step n+1 before step n's "
                                 "frames reach the host (same frames); default: on when the model takes the GPU "
                                 "path, off on CPU (--overlap turns it on there too)")
    held_drain_fraction: float = Field(0.25, gt=0, le=1, description="held/pool pages above which D drains")
    abort_resend_ms: int = Field(200, gt=0, description="ABORT re-send period for held requests")
    probe_interval_ms: int = Field(500, gt=0, description="P instance-id probe period")
    tcp_host: str = Field("127.0.0.1", description="tcp transport: listen address; P in the same pod needs "
                          "loopback only, the pod IP only when tcp crosses hosts")
    tcp_port: int = Field(0, ge=0, description="tcp transport: listen port (0 = any free)")
    proxy_socket: str = Field(pod_socket("proxy"), description="nvlink-proxy socket (proxy mode)")
    unit_secret_file: str = Field("", validate_default=True, description="the unit's shared secret (a mode-0600 "
                                  "file): authenticates P to D's tcp KV listener; required with --transfer tcp, "
                                  "and without it --transfer auto offers no tcp")
    metrics_port: int = Field(0, ge=0, description="Prometheus port (0 = off)")
    debug_port: int = Field(0, ge=0, description="fault injection/debug only (never in a pod): serve the pool's "
                            "ownership map on 127.0.0.1:<port>/debug/pool (0 = off)")
    torch_threads: int = Field(1, gt=0, description="torch intra-op threads")
    gil_switch_ms: float = Field(0.5, gt=0, le=100, description="Python's GIL switch interval: the longest a gRPC "
                                 "handler waits for the step-loop thread (Python's default is 5)")
    log_level: str = Field("info", description="log level")

    @field_validator("pool_tokens")
    @classmethod
    def _pool_needs_a_gpu_to_size_itself(cls, v: int, info: ValidationInfo) -> int:
        device = str(info.data.get("device", ""))
        if v == 0 and not device.startswith("cuda"):
            raise ValueError(f"0 sizes the pool to a CUDA device's free memory, and device {device!r} is "
                             "not one: give the pool's token count")
        return v

    @field_validator("unit_secret_file")
    @classmethod
    def _tcp_needs_the_unit_secret(cls, v: str, info: ValidationInfo) -> str:
        return check_unit_secret_file(v, str(info.data.get("transfer", "")), "D's tcp KV listener authenticates P")


def pool_pages(cfg: DecodeConfig, bytes_per_token: int, free_bytes: int) -> int:
    """The pool's pages: `--pool-tokens` of them, or with 0 as many as `free_bytes` of
    device memory hold once `--pool-reserve-gib` is left out. Raises ValueError naming
    the flags when nothing is left for a pool."""
    if cfg.pool_tokens:
        return cfg.pool_tokens // cfg.page_size
    usable = free_bytes - int(cfg.pool_reserve_gib * 2**30)
    pages = usable // (bytes_per_token * cfg.page_size)
    if pages < 1:
        raise ValueError(f"--pool-tokens 0: {free_bytes / 2**30:.1f} GiB free on the device, less "
                         f"--pool-reserve-gib {cfg.pool_reserve_gib}, leaves no room for a page of "
                         f"{bytes_per_token * cfg.page_size} bytes: lower the reserve or give --pool-tokens")
    return int(pages)


async def serve(cfg: DecodeConfig) -> int:
    log = setup_logging("decode", cfg.log_level)
    log_config(log, cfg)
    engine_setup(cfg.torch_threads, cfg.gil_switch_ms)
    log.info("decode kernel settings", extra={"settings": configure_decode(cfg.decode_kernel)})
    register_role("decode")  # this process's series only (engine/metrics.py)
    serve_metrics(cfg.metrics_port)
    bind_thread(cfg.device)  # this thread (gRPC handlers) and every pool thread: the engine's GPU
    asyncio.get_running_loop().set_default_executor(device_executor(cfg.device, "decode-exec"))
    model = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
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
    mc = model.config
    kv_dtype = kv_storage_dtype(cfg.kv_cache_dtype, model.dtype)
    free = torch.cuda.mem_get_info(torch.device(cfg.device))[0] if cfg.pool_tokens == 0 else 0
    n_pages = pool_pages(cfg, mc.kv_bytes_per_token(kv_dtype), free)
    if cfg.pool_tokens == 0:
        log.info("pool sized to the device", extra={"free_gib": round(free / 2**30, 2), "pool_pages": n_pages,
                                                    "pool_tokens": n_pages * cfg.page_size})
    geometry = PoolGeometry(
        n_layers=mc.n_layers, n_kv_heads=mc.n_kv_heads, head_dim=mc.head_dim,
        dtype=kv_dtype, n_slots=n_pages * cfg.page_size, page_size=cfg.page_size,
    )
    receiver = make_receiver(cfg.transfer, geometry, cfg.device, {
        "tcp_host": cfg.tcp_host, "tcp_port": str(cfg.tcp_port), "proxy_socket": cfg.proxy_socket,
        "unit_secret": unit_secret_option(read_secret_file(cfg.unit_secret_file)) if cfg.unit_secret_file else "",
    })
    loop = asyncio.get_running_loop()
    engine = DecodeEngine(
        model, cfg.model, geometry, PagePool(n_pages, cfg.page_size), receiver, FrameHub(loop),
        cfg.prefill_socket, cfg.max_batch, cfg.held_drain_fraction,
        cfg.abort_resend_ms / 1000, cfg.probe_interval_ms / 1000, decode_graphs,
        overlap=model.gpu_path if cfg.overlap is None else cfg.overlap, codec=codec, audio_format=audio_format,
    )
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
    engine.admission = admission
    engine.step_pad = cfg.step_pad()
    engine.traces = SpanTable(Tracing("decode", cfg.otlp_endpoint, engine.instance_id))
    engine.step_pad.export(log)
    log.info("rate-floor admission", extra={**floor.log_fields(), "margin": cfg.floor_margin,
                                            "step_model": cfg.step_model or None, "on": admission is not None})
    sampler = start_sampler(cfg, log)
    stop = shutdown_event(log)
    server = await start_unix_server(
        cfg.socket, lambda s: pbg.add_DecodeServicer_to_server(DecodeService(engine), s), log)
    engine.loop.start()
    if cfg.debug_port:
        serve_debug(engine, cfg.debug_port)
    tasks = [asyncio.create_task(engine.expiry_loop()), asyncio.create_task(engine.abort_loop()),
             asyncio.create_task(engine.probe_loop())]
    engine_ready(log)
    log.info("decode ready", extra={"instance_id": engine.instance_id, "transfer": receiver.mode,
                                    "pool_pages": n_pages, "overlap": engine.overlap is not None,
                                    "decode_graphs": engine.step_forward.graphs is not None,
                                    "kv_dtype": dtype_name(geometry.dtype),
                                    "kv_bytes": geometry.bytes_for(geometry.n_slots)})
    await stop.wait()
    engine.hub.close()
    await server.stop(grace=5)
    for t in tasks:
        t.cancel()
    engine.loop.stop()
    receiver.close()
    engine.traces.tracing.shutdown()
    stop_sampler(sampler, log)
    log.info("decode stopped")
    return 0


def main(argv: list[str]) -> int:
    cfg = parse_config(DecodeConfig, argv, "pdunit decode")
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
