"""The sliding-window attention mask of Mimi's streamed decoder transformer, shared by the
eager push (mimi_stream.py) and the captured one (mimi_graphs.py).

Must stay tensor ops only (no host sync, no Python branch on values): a CUDA graph
captures it.
"""

from __future__ import annotations

import torch


def window_mask(seen: torch.Tensor, q: int, past: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [B, q] of `q` new positions after each stream's `seen`, and the additive
    4-D mask [B, 1, q, past + q] over the window's `past` KV rows then the new ones: causal,
    the sliding window (`past + 1` positions), and hiding rows before position 0. Tensor
    ops only (no host sync): the eager and the captured push both build it so."""
    steps = torch.arange(past + q, device=seen.device)
    position_ids = seen[:, None] + steps[None, :q]  # [B, q]
    kv_pos = seen[:, None] - past + steps[None, :]
    q_pos = position_ids[:, :, None]
    allowed = (kv_pos[:, None, :] >= 0) & (kv_pos[:, None, :] <= q_pos)
    allowed &= kv_pos[:, None, :] > q_pos - (past + 1)
    mask = torch.zeros(seen.shape[0], 1, q, past + q, device=seen.device, dtype=dtype)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return position_ids, mask
