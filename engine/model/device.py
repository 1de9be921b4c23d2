"""Which CUDA device a thread runs on: the binding every engine thread that launches GPU
work needs. CUDA's current device is per thread and a new thread starts on device 0;
Triton launches, graph replay and `torch.cuda.current_stream()` follow it, so an
unbound step thread of an engine on `cuda:1` launches on the wrong GPU.

Owns no state; never changes a thread's device to anything but the engine's own.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


# torch operators follow their tensors' device, but Triton kernel launches, CUDA graph
# replay and `torch.cuda.current_stream()` use the calling thread's current device. In the
# first PD run on two H200s D stalled after one frame this way. In a pod every container
# sees its one GPU as device 0, which is why only a multi-GPU host shows it.
def bind_thread(device: str | torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (no-op off CUDA)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index if dev.index is not None else torch.cuda.current_device())


def device_executor(device: str | torch.device, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads are bound to `device` (asyncio's default executor
    runs D's COMMIT checksum and P's connect: both touch the GPU)."""
    return ThreadPoolExecutor(thread_name_prefix=name, initializer=bind_thread, initargs=(device,))
