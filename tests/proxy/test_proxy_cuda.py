"""The proxy's CUDA backend on 2 GPUs (run through the device tool): every kernel
placement (pull on D's GPU, push from P's, split over both) and both entry points
(copy lane, Copy RPC) land bit-exact rows and touch no other row."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pdunit.engine.proto import proxy_pb2 as pb
from pdunit.engine.transfer.base import PoolGeometry
from pdunit.engine.transfer.proxy import ProxyReceiver, ProxySender
from tests.proxy.conftest import start_proxy, stop

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

GEO = PoolGeometry(n_layers=4, n_kv_heads=8, head_dim=128, dtype=torch.bfloat16, n_slots=2048, page_size=1)


@pytest.mark.parametrize("placement", [["--copy-device", "dst"], ["--copy-device", "src"],
                                       ["--copy-device", "split", "--copy-split", "0.6",
                                        "--copy-rows", "16", "--copy-threads", "256",
                                        "--copy-blocks-per-sm", "8"]],
                         ids=["pull", "push", "split-persistent"])
def test_every_placement_copies_bit_exact_rows_and_nothing_else(tmp_path, placement):
    proc, sock = start_proxy(tmp_path, "--cuda", "on", *placement)
    rx = tx_lane = tx_rpc = None
    try:
        rx = ProxyReceiver(GEO, "cuda:1", sock)
        desc = rx.descriptors()[0]
        tx_lane = ProxySender(desc, GEO, "cuda:0", sock, pb.SINGLE_KERNEL)
        tx_rpc = ProxySender(desc, GEO, "cuda:0", sock, pb.SINGLE_KERNEL, copy_lane=False)
        info = tx_lane.client.info()
        assert info.copy_device == placement[1]
        src = torch.randn(GEO.shape(), generator=torch.Generator().manual_seed(3)).to(GEO.dtype).to("cuda:0")
        rng = np.random.default_rng(8)
        for k, tx in enumerate((tx_lane, tx_rpc)):
            rx.storage.fill_(-5.0)
            torch.cuda.synchronize(1)
            s, d = rng.permutation(GEO.n_slots)[:700], rng.permutation(GEO.n_slots)[:700]
            deadline = int(time.time() * 1000) + 30_000
            tx.write(10 + k, src, s, d, deadline, capability=rx.grant(10 + k, d, deadline))
            assert tx.last_reply.method == "single_kernel"
            assert torch.equal(rx.storage[:, :, d].cpu(), src[:, :, s].cpu())
            rest = np.setdiff1d(np.arange(GEO.n_slots), d)
            assert bool((rx.storage[:, :, rest] == -5).all())
            assert {"upload", "launch", "sync"} <= set(tx.last_stages)
    finally:
        for part in (tx_lane, tx_rpc, rx):
            if part is not None:
                part.close()
        stop(proc)
