"""`pdunit prefill`: the prefill engine process (P) of a unit."""

from __future__ import annotations

import asyncio
import sys

import numpy as np
from pydantic import Field, field_validator

from pdunit.engine.decode.worker import engine_ready, engine_setup
from pdunit.engine.grpc_server import start_unix_server
from pdunit.engine.kv.checksum import kv_checksum
from pdunit.engine.kv.prefix_cache import PrefixCache
from pdunit.engine.metrics import register_role
from pdunit.engine.model.device import bind_thread, device_executor
from pdunit.engine.observability import (
    log_config,
    serve_metrics,
    setup_logging,
    shutdown_event,
)
from pdunit.engine.prefill.runner import start_prefill_model
from pdunit.engine.prefill.scheduler import PrefillScheduler
from pdunit.engine.prefill.worker import (
    FaultInjection,
    PrefillEngine,
    PrefillService,
)
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.settings import PrefillModelFields, parse_config, parse_decode_sockets
from pdunit.engine.stack_sampler import StackSamplingFields, start_sampler, stop_sampler


class PrefillConfig(PrefillModelFields, StackSamplingFields):
    """Prefill engine (P): admission queue, prefix cache, KV + first frame handed to D."""

    socket: str = Field("/run/pdunit/prefill.sock", description="unix socket P serves on")
    decode_socket: str = Field("/run/pdunit/decode.sock", description="D's socket, or a comma list of D "
                               "sockets (one P feeding several D's: 1P2D)")
    decode_probe_interval_ms: int = Field(500, gt=0, description="with several D's: how often P asks each D "
                                          "for Info (free pages, streams) to choose the D of a request")
    transfer: str = Field("auto", description="transport to use among those D offers (auto = D's best)")
    cache_tokens: int = Field(65536, gt=0, description="token rows of P's own KV storage (prefix cache)")
    max_batch_prompts: int = Field(16, gt=0, description="prompts per prefill forward")
    kv_check_sample: int = Field(1, gt=0, description="checksum every k-th token (1 = every row)")
    max_held_aborts: int = Field(3, gt=0, description="held aborts at which P exits on purpose")
    held_abort_grace_ms: int = Field(1000, ge=0, description="an abort counts as held after this long")
    transfer_deadline_ms: int = Field(0, ge=0, description="cap on one request's RESERVE-to-COMMIT time, its "
                                      "forward included; D enforces it too (0 = the request deadline)")
    transfer_workers: int = Field(4, gt=0, description="threads writing KV to D, one request each: a stalled "
                                  "write holds up only its own request")
    transfer_chunk_tokens: int = Field(0, ge=0, description="fault injection: write in chunks of this many tokens")
    transfer_chunk_delay_ms: float = Field(0.0, ge=0, description="fault injection: pause between chunks")
    proxy_socket: str = Field("/run/pdunit/proxy.sock", description="nvlink-proxy socket (proxy mode)")
    tcp_connections: int = Field(4, gt=0, description="tcp transport: parallel connections")
    fault_corrupt_id: int = Field(-1, ge=-1, description="fault injection (never in a pod): flip a bit in the KV "
                                  "rows sent for prompts whose row 0 column 0 is this id (-1 = off)")
    fault_slow_id: int = Field(-1, ge=-1, description="fault injection: such prompts' writes pause mid-transfer "
                               "for --fault-slow-ms (-1 = off)")
    fault_slow_ms: int = Field(0, ge=0, description="fault injection: the pause of --fault-slow-id writes")
    fault_wedge_id: int = Field(-1, ge=-1, description="fault injection: such prompts' writes never complete and "
                                "cannot be cancelled, so their aborts stay held (-1 = off)")
    fault_tcp_relay: str = Field("", description="fault injection: host:port the tcp transport connects to "
                                 "instead of D's address (a relay that can stall)")
    metrics_port: int = Field(0, ge=0, description="Prometheus port (0 = off)")
    torch_threads: int = Field(1, gt=0, description="torch intra-op threads")
    gil_switch_ms: float = Field(0.5, gt=0, le=100, description="Python's GIL switch interval: the longest a gRPC "
                                 "handler waits for the step-loop thread (Python's default is 5)")
    log_level: str = Field("info", description="log level")

    @field_validator("decode_socket")
    @classmethod
    def _decode_sockets(cls, v: str) -> str:
        parse_decode_sockets(v)
        return v


async def serve(cfg: PrefillConfig) -> int:
    log = setup_logging("prefill", cfg.log_level)
    log_config(log, cfg)
    engine_setup(cfg.torch_threads, cfg.gil_switch_ms)
    register_role("prefill")  # this process's series only (engine/metrics.py)
    serve_metrics(cfg.metrics_port)
    bind_thread(cfg.device)  # this thread (gRPC handlers) and every pool thread: the engine's GPU
    asyncio.get_running_loop().set_default_executor(device_executor(cfg.device, "prefill-exec"))
    started = start_prefill_model(cfg, cfg.cache_tokens, cfg.max_batch_prompts, log)
    if started is None:
        return 2
    model, storage, graphs = started
    if storage.is_cuda:
        # The KV checksum kernel compiles at its first use; the transfer workers' first
        # requests arrive together and each compiled it (four serving compiles in the
        # H200 runs, bench/results/capacity-20261130-h200x2-60s-q8.md).
        kv_checksum(storage, np.arange(min(16, storage.shape[2])))
    engine = PrefillEngine(
        model, cfg.model, cfg.device, storage, PrefixCache(cfg.cache_tokens, cfg.prefix_block_tokens),
        PrefillScheduler(cfg.max_batch_prompts, cfg.max_batch_rows), cfg.decode_socket, cfg.transfer,
        {"proxy_socket": cfg.proxy_socket, "tcp_connections": str(cfg.tcp_connections),
         "chunk_tokens": str(cfg.transfer_chunk_tokens), "chunk_delay_s": str(cfg.transfer_chunk_delay_ms / 1000),
         "tcp_chunk_tokens": str(cfg.transfer_chunk_tokens)},
        cfg.kv_check_sample, cfg.max_held_aborts, cfg.held_abort_grace_ms / 1000, cfg.transfer_deadline_ms,
        FaultInjection(cfg.fault_corrupt_id, cfg.fault_slow_id, cfg.fault_slow_ms, cfg.fault_wedge_id,
                       cfg.fault_tcp_relay),
        decode_probe_interval_s=cfg.decode_probe_interval_ms / 1000,
        transfer_workers=cfg.transfer_workers,
        graphs=graphs,
    )
    sampler = start_sampler(cfg, log)
    stop = shutdown_event(log)
    loop = asyncio.get_running_loop()
    # Serve only once D answered: the LB's readiness follows from P answering Info.
    await loop.run_in_executor(None, engine.connect)
    engine.start_probe()

    server = await start_unix_server(
        cfg.socket, lambda s: pbg.add_PrefillServicer_to_server(PrefillService(engine), s), log)
    engine.start()
    engine_ready(log)
    log.info("prefill ready", extra={"instance_id": engine.instance_id, "d_instance": engine.d_instance,
                                     "decoders": len(engine.links), "transfer": engine.transfer_mode})
    await stop.wait()
    await server.stop(grace=5)
    engine.stop()
    engine.stop_probe()
    for link in engine.links:
        if link.sender is not None:
            link.sender.close()
    stop_sampler(sampler, log)
    log.info("prefill stopped")
    return 0


def main(argv: list[str]) -> int:
    cfg = parse_config(PrefillConfig, argv, "pdunit prefill")
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
