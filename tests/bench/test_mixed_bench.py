"""`pdunit bench mixed`: the monolith's mixed step eager against its captured pair's
replay. Without a GPU it runs the eager rows on the CPU and names why there is no replay
(the runner refuses the CPU path); its argument errors name the flag; on a GPU (gpu
marker) every replayed point equals its eager forward within the GPU test's tolerance
and its staged eager step bit for bit, and the points outside the pairs say why."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pdunit.bench import mixed
from pdunit.bench.step import load_bench_model
from tests.kernels.paging import gpu

CPU = ["--device", "cpu", "--model", "tiny"]


def test_cpu_run_writes_the_eager_rows_and_names_why_there_is_no_replay(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert mixed.main([*CPU, "--batches", "2", "--contexts", "24", "--prompt-rows", "8", "--chunks", "1,2",
                       "--iters", "1", "--warmup", "0", "--out", str(tmp_path), "--machine-tag", "t"]) == 0
    (path,) = tmp_path.glob("mixed-*-t.json")
    doc = json.loads(path.read_text())
    assert doc["bench"] == "mixed" and doc["command"].startswith("pdunit bench mixed --device cpu")
    assert [(r["batch"], r["context"], r["prompt_rows"], r["chunks"]) for r in doc["rows"]] == [(2, 24, 8, 1),
                                                                                             (2, 24, 8, 2)]
    for row in doc["rows"]:
        assert row["eager_ms"] > 0 and row["decode_ms"] > 0 and row["prefill_ms"] > 0
        assert row["decode_path"] == row["prefill_path"] == "eager"
        assert "replay_ms" not in row and "speedup" not in row and "pair" not in row
        assert row["note"].startswith("no replay: refused off the GPU path")
    summary = doc["summary"]
    assert "--mixed-graphs" in summary["replay_refused"] and "GPU path" in summary["replay_refused"]
    assert summary["replayed_points"] == 0 and summary["replays_match_eager"] is None and summary["graphs"] == {}
    md = path.with_suffix(".md").read_text()
    assert "| eager ms | replay ms |" in md and "refused off the GPU path" in md
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "flag"), [
    (["--batches", "0"], "--batches"),
    (["--prompt-rows", "8,x"], "--prompt-rows"),
    (["--kv-cache-dtype", "fp4"], "--kv-cache-dtype"),
    ([*CPU, "--prompt-rows", "2,8", "--chunks", "4"], "--chunks 4 is more than --prompt-rows 2"),
    ([*CPU, "--iters", "0"], "--iters must be >= 1"),
    ([*CPU, "--contexts", "64,9000"], "--contexts [9000] exceed the model's max_positions 8192"),
    (["--dtype", "int8"], "--dtype"),
    (["--device", "cpu", "--model", "random:tiny"], "--model 'random:tiny': expected random:<shape>:<seed>"),
])
def test_argument_errors_name_the_flag(args: list[str], flag: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        mixed.main([*args, "--out", str(tmp_path)])
    text = f"{exc.value.code} {capsys.readouterr().err}"
    assert flag in text, text
    assert not list(tmp_path.iterdir())


def test_chunk_rows_split_the_prompt_rows_evenly() -> None:
    assert mixed.chunk_rows(10, 1) == [10]
    assert mixed.chunk_rows(10, 3) == [4, 3, 3]
    assert sum(mixed.chunk_rows(2048, 4)) == 2048


def test_a_staged_step_has_decode_rows_at_their_context_ends_and_chunks_on_distinct_slots() -> None:
    m = load_bench_model("tiny", 0, "cpu")
    step = mixed.stage_step(m, 3, 40, [9, 7], 16, 1024, np.random.default_rng(0))
    assert step.shape() == (3, [9, 7], 40)
    for e in step.decode:
        assert len(e.context_slots) == 40 and e.positions.tolist() == [39]
        assert e.write_slots.tolist() == [e.context_slots[-1]] and e.tokens.shape == (1, m.config.n_codebooks)
    for e, rows in zip(step.chunks, [9, 7], strict=True):
        assert e.positions.tolist() == list(range(rows)) and np.array_equal(e.write_slots, e.context_slots)
    every = np.concatenate([e.context_slots for e in step.decode + step.chunks])
    assert len(set(every.tolist())) == every.size and every.max() < 1024
    tokens, positions, write_slots, contexts, chunks = step.runner_args()
    assert tokens.shape == (3, m.config.n_codebooks) and positions.tolist() == [39] * 3
    assert [len(c) for c in contexts] == [40] * 3 and chunks is step.chunks


def test_output_diff_compares_finite_entries_and_flags_a_changed_infinity() -> None:
    want = torch.tensor([[1.0, float("-inf")], [2.0, 3.0]])
    got = torch.tensor([[1.5, float("-inf")], [2.0, 3.0]])
    max_abs, rel = mixed.output_diff(got, want)
    assert max_abs == 0.5 and rel == pytest.approx(0.5 / float(torch.tensor([1.0, 2.0, 3.0]).norm()))
    assert mixed.output_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("-inf")])) == (float("inf"),
                                                                                               float("inf"))


@gpu
def test_a_tiny_gpu_grid_replays_what_the_eager_forward_computes() -> None:
    doc = mixed.run_mixed(mixed.MixedConfig(
        model="random:tiny:0", dtype="bfloat16", batches=[3, 8, 9], contexts=[48], prompt_rows=[20, 70],
        chunks=[1, 2], mixed_graph_streams=[4, 8], mixed_graph_rows=[32, 64], iters=3, warmup=1, reserve_gib=0))
    rows = {(r["batch"], r["prompt_rows"], r["chunks"]): r for r in doc["rows"]}
    assert len(rows) == 12
    for (b, p, _), row in rows.items():
        assert row["eager_ms"] > 0 and row["decode_path"] == "graph" and row["prefill_path"] == "graph", row
        if b <= 8 and p <= 64:
            assert row["pair"] == f"{4 if b <= 4 else 8}x32" and row["replay_ms"] > 0, row
            assert row["matches_eager"] and row["rel_diff"] < mixed.TOLERANCE and row["equals_staged"], row
        elif b > 8:
            assert row["note"] == "no pair: 9 streams > the largest stream bucket 8 (--mixed-graph-streams)", row
        else:
            assert row["note"].startswith("no pair: 70 prompt rows > the largest row bucket 64"), row
    summary = doc["summary"]
    assert summary["replay_refused"] is None and summary["replayed_points"] == 4
    assert summary["replays_match_eager"] and summary["replays_equal_staged"]
    assert summary["graphs"]["mixed"]["pairs"] == ["4x32", "8x32"] and summary["graphs"]["mixed"]["capture_s"] > 0
