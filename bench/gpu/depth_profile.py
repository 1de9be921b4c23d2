"""Where a depth decoder's frame time goes on ONE GPU (issue 23): the replay time of the
captured frame graph (fused depth kernels) per top-k cap, then one eager `frames_static`
under torch.profiler, its GPU kernels summed by name (count, total, mean), the top 30.
Diagnostics only, no results file of its own: its output is kept as a .log beside the
step results it explains. Needs CUDA.
  python3 bench/gpu/depth_profile.py [MODEL_SPEC] [BATCH]  (repo root, on the device machine)"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from pdunit.engine.model.family_csm import set_depth_kernels
from pdunit.engine.model.frame_graphs import FrameGraphRunner
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.sampling import ROW_UNIFORMS


def replay_ms(runner: FrameGraphRunner, batch: int, cap: int | None, iters: int = 20) -> float:
    for _ in range(3):
        runner.replay_staged(batch, cap)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        runner.replay_staged(batch, cap)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(spec: str, batch: int) -> None:
    m = load_model(spec, device="cuda", dtype="bfloat16")
    print("depth kernels:", set_depth_kernels(m, "fused"))
    fg = m.frame_generator
    assert fg is not None
    runner = FrameGraphRunner(m, [batch], capture=True)  # zero hidden and rows: greedy, as bench step's
    for cap in (0, 64):
        print(f"replay cap={cap}: {replay_ms(runner, batch, cap):.3f} ms")
    hidden = torch.randn(batch, m.config.hidden, device="cuda", dtype=torch.bfloat16)
    rows = torch.zeros(batch, ROW_UNIFORMS + m.config.n_codebooks, dtype=torch.float64, device="cuda")
    work = fg.static_work(batch, torch.device("cuda"))
    with torch.no_grad():
        for _ in range(2):
            fg.frames_static(m, hidden, rows, work, 0)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fg.frames_static(m, hidden, rows, work, 0)
            torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            totals[ev.name[:90]][0] += 1
            totals[ev.name[:90]][1] += ev.device_time_total
    count = sum(int(v[0]) for v in totals.values())
    print(f"eager frames_static B={batch}: {count} kernels, {sum(v[1] for v in totals.values()) / 1000:.3f} ms device")
    for name, (n, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"{us / 1000:8.3f} ms {int(n):5d}x {us / n:7.1f} us  {name}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "random:csm-1b-shape:0", int(sys.argv[2]) if len(sys.argv) > 2 else 256)
