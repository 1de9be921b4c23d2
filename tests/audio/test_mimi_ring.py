"""The stream decoder's state lives in place in slot-indexed pools (engine/audio/mimi_stream.py,
mimi_mask.py): each slot's KV ring takes only the new positions, streams far past the
window and of every age share a batch, and a reused slot decodes as a fresh one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pdunit.engine.audio.mimi_mask import ring_mask, ring_positions
from pdunit.engine.audio.mimi_stream import MimiCodec, MimiStreamDecoder
from tests.audio.test_mimi_graphs import lively
from tests.audio.tiny import tiny_mimi

BOUND = 1e-3  # of full scale, against transformers' one-shot decode
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def codec() -> MimiCodec:
    return lively(tiny_mimi())


def codes(seed: int, frames: int) -> torch.Tensor:
    return torch.randint(0, 32, (4, frames), generator=torch.Generator().manual_seed(seed))


def one_shot(codec: MimiCodec, c: torch.Tensor) -> np.ndarray:
    with torch.inference_mode():
        return codec.model.decode(c[None]).audio_values[0, 0].numpy()


def test_the_ring_holds_the_window_and_one_pass_and_entries_know_their_positions(codec: MimiCodec) -> None:
    d = MimiStreamDecoder(codec, graph_frames=2)
    assert d.window == 6 and d.pass_positions == 4 and d.ring == 5 + 4  # 2 positions a frame
    last = torch.tensor([-1, 2, 8, 30])
    pos = ring_positions(last, 9)
    assert pos[0].max() < 0  # nothing written
    assert sorted(p for p in pos[1].tolist() if p >= 0) == [0, 1, 2]
    assert sorted(pos[3].tolist()) == list(range(22, 31))  # the last 9 positions
    assert all(p % 9 == e for e, p in enumerate(pos[3].tolist()))
    seen = ring_mask(last[3:], 2, 9, 6)[0, 0]  # queries at 29 and 30
    assert sorted(pos[3][seen[0]].tolist()) == list(range(24, 30))
    assert sorted(pos[3][seen[1]].tolist()) == list(range(25, 31))


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_a_stream_far_past_the_window_equals_the_one_shot_decode(codec: MimiCodec, chunk: int) -> None:
    """40 frames: 80 positions, over 13 times the window and 8 times the ring; a call of 7
    frames (14 positions) runs the transformer in passes of 4."""
    c = codes(11, 40)
    d = MimiStreamDecoder(codec, graph_frames=2)
    d.open("s")
    audio = np.concatenate([d.push("s", c[:, i : i + chunk]) for i in range(0, 40, chunk)])
    reference = one_shot(codec, c)
    assert np.abs(reference).max() > 0.1
    assert np.abs(audio - reference).max() <= BOUND


def test_a_push_writes_only_its_new_ring_entries_and_its_slots(codec: MimiCodec) -> None:
    d = MimiStreamDecoder(codec, slots=4, graph_frames=2)
    for s in "abc":
        d.open(s)
    for _ in range(5):  # every ring full
        d.push_many({s: codes(1, 2) for s in "abc"})
    kv, conv, seen = d._kv.clone(), d._conv.clone(), d._seen.clone()
    d.push("b", codes(2, 1))  # 2 positions: 20, 21 -> entries 2, 3 of the ring of 9
    slot = d._slot["b"]
    changed = (d._kv != kv).flatten(4).any(-1)  # [layers, 2, slots, ring]
    assert changed[:, :, slot, [2, 3]].all()
    changed[:, :, slot, [2, 3]] = False
    assert not changed.any()
    others = [d._slot[s] for s in "ac"]
    assert torch.equal(d._conv[others], conv[others]) and not torch.equal(d._conv[slot], conv[slot])
    assert d._seen[slot] == seen[slot] + 2 and torch.equal(d._seen[others], seen[others])


@pytest.mark.parametrize("graphs", [False, True])
def test_a_reused_slot_decodes_as_a_fresh_decoder(codec: MimiCodec, graphs: bool) -> None:
    """The slot's previous stream ran past the window (its ring and contexts full); the
    next stream there equals the same stream on a decoder that never saw the first."""
    args = dict(slots=2, graphs=graphs, buckets=(1,), graph_frames=2)
    used = MimiStreamDecoder(codec, **args)  # type: ignore[arg-type]
    used.open("old")
    for i in range(0, 30, 2):
        used.push("old", codes(21, 30)[:, i : i + 2])
    slot = used._slot["old"]
    used.close("old")
    used.open("new")
    assert used._slot["new"] == slot
    fresh = MimiStreamDecoder(codec, **args)  # type: ignore[arg-type]
    fresh.open("new")
    c = codes(22, 12)
    got = np.concatenate([used.push("new", c[:, i : i + 2]) for i in range(0, 12, 2)])
    want = np.concatenate([fresh.push("new", c[:, i : i + 2]) for i in range(0, 12, 2)])
    assert np.array_equal(got, want)
    assert np.abs(got - one_shot(codec, c)).max() <= BOUND


@pytest.mark.parametrize("graphs", [False, True])
def test_a_batch_of_streams_of_every_age_and_length_each_equal_their_one_shot(codec: MimiCodec,
                                                                             graphs: bool) -> None:
    """Streams 0, 1, 4 and 20 frames old (before, inside and past the window) in one call
    with calls of 1, 2 and 3 frames (3: over graph_frames, eager); a stream closed and its
    slot reused between calls."""
    d = MimiStreamDecoder(codec, slots=8, graphs=graphs, buckets=(2, 4, 8), graph_frames=2)
    streams = {name: codes(30 + i, 40) for i, name in enumerate(("w", "x", "y", "z", "late"))}
    done = dict.fromkeys(streams, 0)
    out: dict[str, list[np.ndarray]] = {name: [] for name in streams}

    def push(batch: dict[str, int]) -> None:
        got = d.push_many({s: streams[s][:, done[s] : done[s] + n] for s, n in batch.items()})
        for s, n in batch.items():
            out[s].append(got[s])
            done[s] += n

    d.open("z")
    push({"z": 3})
    for _ in range(6):
        push({"z": 3})
    d.open("y")
    push({"y": 2, "z": 2})
    push({"y": 2, "z": 1})
    d.open("x")
    push({"x": 1})
    d.open("w")
    d.open("gone")
    d.push("gone", codes(99, 3))
    d.close("gone")
    d.open("late")  # the slot "gone" held
    for n in (1, 2, 3, 2, 1):
        push({"w": n, "x": (n % 3) + 1, "y": 2, "z": n, "late": 3 - n % 3})
    for s, parts in out.items():
        c = streams[s][:, : done[s]]
        assert np.abs(np.concatenate(parts) - one_shot(codec, c)).max() <= BOUND, s


def test_pools_are_preallocated_per_slot_and_grow_by_doubling(codec: MimiCodec) -> None:
    d = MimiStreamDecoder(codec, slots=2, graph_frames=2)
    cfg = codec.model.config
    assert d._kv.shape == (cfg.num_hidden_layers, 2, 2, d.ring, cfg.num_key_value_heads, cfg.head_dim)
    before = d.pool_bytes
    for s in "abc":
        d.open(s)
    assert d.slots == 4 and d.pool_bytes == 2 * before and d.state_version == 1


def test_the_triton_kernel_interpreted_on_cpu_equals_the_torch_attention() -> None:
    """Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported: its own
    process) runs the ring kernel on CPU tensors: GQA, a head dim under the kernel's 16,
    streams younger than the window, several queries a pass; and a whole decoder on it."""
    script = textwrap.dedent("""
        import json
        import numpy as np
        import torch
        from pdunit.engine.audio.mimi_mask import ring_attention
        from pdunit.engine.audio.mimi_stream import MimiStreamDecoder
        from tests.audio.test_mimi_graphs import lively
        from tests.audio.tiny import tiny_mimi

        torch.manual_seed(0)
        keys, values = torch.randn(5, 13, 2, 8), torch.randn(5, 13, 2, 8)
        slots, last = torch.tensor([3, 0, 4]), torch.tensor([2, 40, 12])
        worst = 0.0
        for q in (1, 3, 4):
            query = torch.randn(3, 4, q, 8)
            a = ring_attention(query, keys, values, slots, last, 9, 0.3, "torch")
            b = ring_attention(query, keys, values, slots, last, 9, 0.3, "triton")
            worst = max(worst, float((a - b).abs().max()))
        codec = lively(tiny_mimi())
        ref, ker = (MimiStreamDecoder(codec, graph_frames=2) for _ in range(2))
        ker.attention = "triton"  # the kernel on CPU tensors: only the interpreter can
        rng = np.random.default_rng(0)
        decoded = 0.0
        for d in (ref, ker):
            d.open("a")
            d.open("b")
        for n in (3, 2, 2, 1, 2):
            batch = {s: rng.integers(0, 32, size=(4, n)) for s in "ab"}
            got, want = ker.push_many(batch), ref.push_many(batch)
            decoded = max(decoded, max(float(np.abs(got[s] - want[s]).max()) for s in "ab"))
        print(json.dumps({"attention": worst, "decoded": decoded}))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["attention"] <= 1e-5 and got["decoded"] <= 1e-5, got
