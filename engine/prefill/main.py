"""`pdunit prefill`: the prefill engine process (P) of a unit: its config, start and stop.

It never carries fault-injection switches: a `--fault-*` switch is refused, naming
where it exists (the fault suite's own entry point, started with
PDUNIT_FAULT_INJECTION=1), so a pod can never turn one on.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import numpy as np
from pydantic import Field, ValidationInfo, field_validator

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
from pdunit.engine.prefill.worker import PrefillEngine, PrefillService
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.security import check_unit_secret_file, read_secret_file
from pdunit.engine.settings import (
    ConfigError,
    FirstFrameFields,
    PrefillModelFields,
    parse_config,
    parse_decode_sockets,
)
from pdunit.engine.stack_sampler import StackSamplingFields, start_sampler, stop_sampler
from pdunit.engine.step_loop import engine_ready, engine_setup
from pdunit.engine.step_pad import SyntheticForwardFields
from pdunit.engine.tracing import Tracing, TracingFields
from pdunit.engine.transfer.options import unit_secret_option
from pdunit.engine.unit_layout import pod_socket


class PrefillConfig(PrefillModelFields, FirstFrameFields, StackSamplingFields, TracingFields, SyntheticForwardFields):
    """Prefill engine (P): admission queue, prefix cache, KV + first frame handed to D."""

    socket: str = Field(pod_socket("prefill"), description="unix socket P serves on")
    decode_socket: str = Field(pod_socket("decode"), description="D's socket, or a comma list of D "
                               "sockets (one P feeding several D's: 1P2D)")
    decode_probe_interval_ms: int = Field(500, gt=0, description="with several D's: how often P asks each D "
                                          "for Info (free pages, streams) to choose the D of a request")
    transfer: str = Field("auto", description="transport to use among those D offers (auto = D's best)")
    cache_tokens: int = Field(65536, gt=0, description="token rows of P's own KV storage (prefix cache)")
    max_batch_prompts: int = Field(16, gt=0, description="prompts per prefill forward")
    reserve_concurrency: int = Field(1, gt=0, description="queued requests whose RESERVEs P sends at once, added "
                                     "to the next forward together (a clump's first forward holds the "
                                     "clump, not the one request reserved before it started); 1, one at a "
                                     "time, until a GPU A/B measures more (docs/performance.md)")
    kv_check_sample: int = Field(1, gt=0, description="checksum every k-th token (1 = every row)")
    max_held_aborts: int = Field(3, gt=0, description="held aborts at which P exits on purpose")
    held_abort_grace_ms: int = Field(1000, ge=0, description="an abort counts as held after this long")
    transfer_deadline_ms: int = Field(0, ge=0, description="cap on one request's RESERVE-to-COMMIT time, its "
                                      "forward included; D enforces it too (0 = the request deadline)")
    transfer_workers: int = Field(4, gt=0, description="threads writing KV to D, one request each: a stalled "
                                  "write holds up only its own request")
    proxy_socket: str = Field(pod_socket("proxy"), description="nvlink-proxy socket (proxy mode)")
    tcp_connections: int = Field(4, gt=0, description="tcp transport: parallel connections")
    unit_secret_file: str = Field("", validate_default=True, description="the unit's shared secret (a mode-0600 "
                                  "file): authenticates P to D's tcp KV listener; required with --transfer tcp, "
                                  "and without it --transfer auto cannot use tcp")
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

    @field_validator("unit_secret_file")
    @classmethod
    def _tcp_needs_the_unit_secret(cls, v: str, info: ValidationInfo) -> str:
        return check_unit_secret_file(v, str(info.data.get("transfer", "")), "P authenticates to D's tcp KV listener")


FAULT_ENV = "PDUNIT_FAULT_INJECTION"  # "1": the fault suite's P may start (never in a pod)
FAULT_ENTRY = "python -m pdunit.bench.fault_injection"  # the fault suite's P
FAULT_FLAG = "--fault-"


def refuse_fault_switches(argv: list[str], prog: str) -> None:
    """Exit 2 naming the first `--fault-*` switch in `argv`: a production process has none."""
    for arg in argv:
        if arg.startswith(FAULT_FLAG):
            message = (f"{prog}: {arg.partition('=')[0]} is a fault-injection switch: it exists only in "
                       f"`{FAULT_ENTRY}`, started with {FAULT_ENV}=1 (the fault-injection suite), never in a pod")
            print(message, file=sys.stderr)
            raise ConfigError(message)


async def serve(cfg: PrefillConfig, engine_factory: Callable[..., PrefillEngine] = PrefillEngine) -> int:
    """`engine_factory`: PrefillEngine, or a subclass wrapping its senders (the fault suite's)."""
    log = setup_logging("prefill", cfg.log_level)
    log_config(log, cfg)
    engine_setup(cfg.torch_threads, cfg.gil_switch_ms)
    register_role("prefill")  # this process's series only (engine/metrics.py)
    serve_metrics(cfg.metrics_port)
    bind_thread(cfg.device)  # this thread (gRPC handlers) and every pool thread: the engine's GPU
    asyncio.get_running_loop().set_default_executor(device_executor(cfg.device, "prefill-exec"))
    started = start_prefill_model(cfg, cfg.cache_tokens, cfg.max_batch_prompts, log, first_frames=cfg)
    if started is None:
        return 2
    model, storage, graphs = started
    if storage.is_cuda:
        # The KV checksum kernel compiles at its first use; the transfer workers' first
        # requests arrive together and each compiled it (four serving compiles in the
        # H200 runs, bench/results/capacity-20261130-h200x2-60s-q8.md).
        kv_checksum(storage, np.arange(min(16, storage.shape[2])))
    secret = unit_secret_option(read_secret_file(cfg.unit_secret_file)) if cfg.unit_secret_file else ""
    engine = engine_factory(
        model, cfg.model, cfg.device, storage, PrefixCache(cfg.cache_tokens, cfg.prefix_block_tokens),
        PrefillScheduler(cfg.max_batch_prompts, cfg.max_batch_rows), cfg.decode_socket, cfg.transfer,
        {"proxy_socket": cfg.proxy_socket, "tcp_connections": str(cfg.tcp_connections), "unit_secret": secret},
        cfg.kv_check_sample, cfg.max_held_aborts, cfg.held_abort_grace_ms / 1000, cfg.transfer_deadline_ms,
        decode_probe_interval_s=cfg.decode_probe_interval_ms / 1000,
        transfer_workers=cfg.transfer_workers,
        graphs=graphs,
        reserve_concurrency=cfg.reserve_concurrency,
    )
    engine.pipeline.forward_pad = cfg.forward_pad()
    engine.pipeline.forward_pad.export(log)
    sampler = start_sampler(cfg, log)
    stop = shutdown_event(log)
    loop = asyncio.get_running_loop()
    # Serve only once D answered: the LB's readiness follows from P answering Info.
    await loop.run_in_executor(None, engine.connect)
    engine.links.start_probe()

    tracing = Tracing("prefill", cfg.otlp_endpoint, engine.instance_id)
    server = await start_unix_server(
        cfg.socket, lambda s: pbg.add_PrefillServicer_to_server(PrefillService(engine, tracing), s), log)
    engine.start()
    engine_ready(log)
    log.info("prefill ready", extra={"instance_id": engine.instance_id, "d_instance": engine.links.instances(),
                                     "decoders": len(engine.links), "transfer": engine.links.transfer_modes()})
    await stop.wait()
    await server.stop(grace=5)
    tracing.shutdown()
    engine.stop()
    engine.links.stop_probe()
    engine.links.close()
    stop_sampler(sampler, log)
    log.info("prefill stopped")
    return 0


def main(argv: list[str]) -> int:
    refuse_fault_switches(argv, "pdunit prefill")
    cfg = parse_config(PrefillConfig, argv, "pdunit prefill")
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
