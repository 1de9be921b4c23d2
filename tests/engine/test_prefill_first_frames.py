"""P's first frames (issue 23): P takes D's `--depth-kernels` and its own `--frame-graphs`;
at start the depth kernels are set before the warm-up and the frame graphs captured
after it, over buckets of the prompts a forward finishes; `first_frames` replays them
through `TTSModel.frames` where a bucket covers the batch and gives the eager frames;
`--frame-graphs` where they cannot run (the CPU) stops P naming the flag; a unit's P
gets D's `--depth-kernels`. On the CPU (the graphs staged, not captured); the gpu test
compares P's first frames with and without captured graphs on CUDA."""

from __future__ import annotations

import dataclasses
import functools
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from pdunit.engine.model.frame_graphs import FrameGraphRunner
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.prefill import runner
from pdunit.engine.prefill.main import PrefillConfig
from pdunit.engine.prefill.runner import (
    PrefillChunk,
    first_frames,
    frame_graph_buckets,
    random_chunks,
    resolve_frame_graphs,
    run_forward,
    start_first_frames,
    start_prefill_model,
)
from pdunit.engine.settings import ConfigError, parse_config
from pdunit.engine.unit_layout import UnitSpec, unit_commands
from tests.kernels.paging import gpu

LOG = logging.getLogger("test.prefill")
# greedy, EOS suppressed, temperature, top-k under and past 64, the depth decoder's own
PARAMS = [SamplingParams(), SamplingParams(min_frames=5), SamplingParams(temperature=0.9, seed=3),
          SamplingParams(temperature=1.1, top_k=5, seed=4), SamplingParams(temperature=0.8, top_k=100, seed=5),
          SamplingParams(seed=6, depth_decoder_temperature=0.7, depth_decoder_top_k=3)]


def chunks_of(model, lengths: list[int], seed: int = 0) -> list[PrefillChunk]:
    """Whole prompts at slots 0.. with PARAMS' sampling in turn."""
    chunks = random_chunks(model, lengths, np.random.default_rng(seed))
    return [dataclasses.replace(c, params=PARAMS[i % len(PARAMS)]) for i, c in enumerate(chunks)]


def test_p_takes_the_depth_kernels_and_frame_graphs_flags(capsys) -> None:
    cfg = parse_config(PrefillConfig, [], "x", env={})
    assert cfg.depth_kernels == "auto" and cfg.frame_graphs is None
    cfg = parse_config(PrefillConfig, ["--depth-kernels", "torch", "--no-frame-graphs"], "x", env={})
    assert cfg.depth_kernels == "torch" and cfg.frame_graphs is False
    assert parse_config(PrefillConfig, ["--frame-graphs"], "x", env={}).frame_graphs is True
    assert parse_config(PrefillConfig, [], "x", env={"PDUNIT_DEPTH_KERNELS": "fused"}).depth_kernels == "fused"
    with pytest.raises(ConfigError, match=r"argument --depth-kernels: invalid choice: 'triton'"):
        parse_config(PrefillConfig, ["--depth-kernels", "triton"], "x", env={})
    assert "fused" in capsys.readouterr().err


def test_the_buckets_cover_the_prompts_a_forward_finishes() -> None:
    assert frame_graph_buckets(16) == [1, 2, 4, 8, 16]
    assert frame_graph_buckets(12) == [1, 2, 4, 8, 12]
    assert frame_graph_buckets(1) == [1] and frame_graph_buckets(3) == [1, 2, 3]


def test_frame_graphs_default_off_on_the_cpu_and_are_refused_there_naming_the_flag() -> None:
    csm, tiny = load_model("random:csm-tiny:0"), load_model("random:tiny:0")
    assert not resolve_frame_graphs(None, csm) and not resolve_frame_graphs(False, csm)
    with pytest.raises(ValueError, match=r"--frame-graphs: .*need a CUDA device, the model is on cpu.*drop"):
        resolve_frame_graphs(True, csm)
    with pytest.raises(ValueError, match=r"--frame-graphs: .*need a CUDA device"):
        resolve_frame_graphs(True, tiny)


class Recorder:
    """What start_prefill_model did, in order: the depth kernels it set, the warm-up, the
    frame graphs it built (staged, capture=False: the CPU has no graphs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, graphs: bool) -> None:
        self.events: list[str] = []
        real_set, real_warm = runner.set_depth_kernels, runner.warm_up

        def set_depth(model, mode):
            self.events.append(f"depth {mode}")
            return real_set(model, mode)

        def warm(*args, **kwargs):
            self.events.append("warm-up")
            return real_warm(*args, **kwargs)

        def frame_graph_runner(model, buckets):
            self.events.append(f"frame graphs {list(buckets)}")
            return FrameGraphRunner(model, buckets, capture=False)

        monkeypatch.setattr(runner, "set_depth_kernels", set_depth)
        monkeypatch.setattr(runner, "warm_up", warm)
        monkeypatch.setattr(runner, "FrameGraphRunner", frame_graph_runner)
        if graphs:  # as on a GPU, where they default on
            monkeypatch.setattr(runner, "resolve_frame_graphs", lambda requested, model: True)


def p_config(*argv: str) -> PrefillConfig:
    return parse_config(PrefillConfig, ["--model", "random:csm-tiny:0", "--warmup-rows", "24",
                                        "--max-batch-prompts", "4", *argv], "x", env={})


def test_p_sets_its_depth_kernels_before_the_warm_up_and_captures_the_frame_graphs_after(monkeypatch, caplog):
    rec = Recorder(monkeypatch, graphs=True)
    cfg = p_config("--depth-kernels", "torch")
    with caplog.at_level(logging.INFO, logger=LOG.name):
        started = start_prefill_model(cfg, 256, cfg.max_batch_prompts, LOG, first_frames=cfg)
    assert started is not None
    model = started[0]
    assert rec.events == ["depth torch", "warm-up", "frame graphs [1, 2, 4]"]
    assert isinstance(model.frame_graphs, FrameGraphRunner) and model.frame_graphs.sizes == [1, 2, 4]
    logged = {r.getMessage(): r.__dict__ for r in caplog.records}
    assert logged["depth kernels"]["requested"] == "torch" and logged["depth kernels"]["kernels"] == "torch"
    assert logged["frame graphs"]["on"] and logged["frame graphs"]["buckets"] == [1, 2, 4]


def test_p_passes_auto_through_and_the_monoliths_start_sets_neither(monkeypatch, caplog) -> None:
    rec = Recorder(monkeypatch, graphs=False)
    cfg = p_config()
    with caplog.at_level(logging.INFO, logger=LOG.name):
        model = start_prefill_model(cfg, 256, 4, LOG, first_frames=cfg)[0]
    assert rec.events == ["depth auto", "warm-up"] and model.frame_graphs is None
    assert any(r.getMessage() == "frame graphs" and r.__dict__["on"] is False for r in caplog.records)
    rec.events.clear()
    model = start_prefill_model(cfg, 256, 4, LOG)[0]
    assert rec.events == ["warm-up"] and model.frame_graphs is None


@pytest.mark.parametrize(("argv", "says"), [
    (["--frame-graphs"], "--frame-graphs: the first frames' CUDA graphs need a CUDA device"),
    (["--depth-kernels", "fused"], "--depth-kernels fused runs the GPU path's Triton kernels"),
])
def test_p_refuses_what_cannot_run_before_the_warm_up_naming_the_flag(argv, says, monkeypatch, caplog) -> None:
    rec = Recorder(monkeypatch, graphs=False)
    cfg = p_config(*argv)
    with caplog.at_level(logging.ERROR, logger=LOG.name):
        assert start_prefill_model(cfg, 256, 4, LOG, first_frames=cfg) is None
    assert "warm-up" not in rec.events
    assert any(says in r.__dict__.get("error", "") for r in caplog.records), caplog.records


def test_the_prefill_process_asked_for_frame_graphs_on_the_cpu_exits_2_naming_the_flag(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pdunit.engine.cli", "prefill", "--socket", str(tmp_path / "p.sock"),
                           "--decode-socket", str(tmp_path / "d.sock"), "--model", "random:csm-tiny:0",
                           "--frame-graphs"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "--frame-graphs: the first frames' CUDA graphs need a CUDA device" in out and "Traceback" not in out


class FakeRunner:
    """A frame-graph runner that answers batches of up to `largest` rows with frames of
    its own (every id 7), counting them."""

    def __init__(self, largest: int, columns: int) -> None:
        self.sizes, self.columns = [largest], columns
        self.stats, self.seen = {"replays": 0, "eager": 0}, []

    def run(self, hidden, sb):
        if hidden.shape[0] > self.sizes[0]:
            self.stats["eager"] += 1
            return None
        self.stats["replays"] += 1
        self.seen.append((hidden.shape[0], sb.n_rows))
        return torch.full((hidden.shape[0], self.columns), 7, dtype=torch.int32)


def test_first_frames_go_through_an_attached_runner_where_it_covers_the_batch() -> None:
    model = load_model("random:csm-tiny:0")
    storage = model.new_kv_storage(256)
    chunks = chunks_of(model, [9, 12, 7])
    chunks[1] = dataclasses.replace(chunks[1], end=6)  # not its last rows: no first frame yet
    out = run_forward(model, storage, [runner.prefill_entry(c.prompt, c.slots, c.start, c.end) for c in chunks])
    eager = first_frames(model, out, chunks)
    fake = FakeRunner(largest=2, columns=model.config.n_codebooks)
    model.frame_graphs = fake
    frames = first_frames(model, out, chunks)
    assert fake.seen == [(2, 2)] and frames[1] is None  # the two finished prompts, one replay
    assert all((f == 7).all() and f.shape == eager[0].shape for f in (frames[0], frames[2]))
    fake.sizes = [1]  # no bucket covers two: the eager frames
    frames = first_frames(model, out, chunks)
    assert fake.stats == {"replays": 1, "eager": 1}
    assert all(np.array_equal(a, b) for a, b in zip(frames[::2], eager[::2], strict=True))


def test_ps_first_frames_through_its_staged_frame_graphs_equal_the_eager_ones(monkeypatch) -> None:
    """P's frame graphs as start_first_frames builds them (staged on the CPU: what the
    graphs replay), buckets 1, 2, 4: run_prefill's first frames equal those without them,
    byte for byte, for greedy, sampled, top-k and depth-decoder rows at frame 0; a batch
    of 6 runs eagerly."""
    monkeypatch.setattr(runner, "resolve_frame_graphs", lambda requested, model: True)
    monkeypatch.setattr(runner, "FrameGraphRunner", functools.partial(FrameGraphRunner, capture=False))
    model = load_model("random:csm-tiny:0")
    storage = model.new_kv_storage(512)
    first = start_first_frames(model, p_config(), 4, LOG)
    assert first.depth_kernels == "torch" and first.frame_graphs is model.frame_graphs
    assert first.frame_graphs is not None and first.frame_graphs.sizes == [1, 2, 4]
    for n in (1, 3, 4, 6):
        chunks = chunks_of(model, [5 + 3 * i for i in range(n)], seed=n)
        before = dict(first.frame_graphs.stats)
        graphs = runner.run_prefill(model, storage, chunks)
        assert first.frame_graphs.stats["replays"] - before["replays"] == (1 if n <= 4 else 0)
        model.frame_graphs = None
        eager = runner.run_prefill(model, storage, chunks)
        model.frame_graphs = first.frame_graphs
        assert all(a.tobytes() == b.tobytes() for a, b in zip(graphs, eager, strict=True)), n


def test_a_units_p_gets_ds_depth_kernels_from_the_spec_and_its_own_extra_flags_win() -> None:
    def commands(**fields) -> dict[str, list[str]]:
        return unit_commands(UnitSpec(model="random:csm-tiny:0", decoders=2, **fields))

    def kernels(argv: list[str]) -> str:
        i = argv.index("--depth-kernels")
        return parse_config(PrefillConfig, argv[i:i + 2], "x", env={}).depth_kernels

    plain = commands()
    assert all("--depth-kernels" not in argv for argv in plain.values())
    assert commands(depth_kernels="auto") == plain  # the engines' default: no flag
    for mode in ("torch", "fused"):
        cmds = commands(depth_kernels=mode)
        assert [kernels(cmds[name]) for name in ("prefill", "decode-0", "decode-1")] == [mode] * 3
        assert all("--depth-kernels" not in cmds[name] for name in ("lb", "proxy", "guard"))
        mono = unit_commands(UnitSpec(model="random:csm-tiny:0", mode="monolith", depth_kernels=mode))["monolith"]
        assert mono.count("--depth-kernels") == 1 and mono[mono.index("--depth-kernels") + 1] == mode
    # D's extra flags are D's: P takes the field, never D's extra flags
    assert commands(extra_args={"decode": ["--depth-kernels", "torch"]})["prefill"] == plain["prefill"]
    mine = commands(depth_kernels="torch", extra_args={"prefill": ["--depth-kernels", "fused"]})["prefill"]
    assert mine[-2:] == ["--depth-kernels", "fused"]  # P's own, last, wins
    assert parse_config(PrefillConfig, mine[mine.index("--depth-kernels"):], "x", env={}).depth_kernels == "fused"


def test_p_quantises_the_depth_decoder_as_ds_decode_gemm_before_its_depth_kernels(monkeypatch, caplog) -> None:
    """D's --decode-gemm fp8 runs the depth decoder's GEMMs in e4m3; P takes the same flag
    (a unit passes D's), so P's first frames are D's frames: the depth layers' e4m3
    weights exist before the depth kernels are set and the warm-up runs them."""
    rec = Recorder(monkeypatch, graphs=False)
    cfg = p_config("--decode-gemm", "fp8", "--depth-kernels", "torch")
    with caplog.at_level(logging.INFO, logger=LOG.name):
        model = start_prefill_model(cfg, 256, 4, LOG, first_frames=cfg)[0]
    assert rec.events == ["depth torch", "warm-up"]
    assert model.decode_gemm == "fp8" and model.frame_generator.fp8_gemms is not None
    assert any(r.getMessage() == "first-frame gemm" and r.__dict__["decode_gemm"] == "fp8" for r in caplog.records)
    bf16 = start_prefill_model(p_config(), 256, 4, LOG, first_frames=p_config())[0]
    assert bf16.decode_gemm == "bf16" and bf16.frame_generator.fp8_gemms is None


def test_p_refuses_fp8_first_frame_gemms_for_a_model_without_a_frame_generator(monkeypatch, caplog) -> None:
    rec = Recorder(monkeypatch, graphs=False)
    cfg = parse_config(PrefillConfig, ["--model", "random:tiny:0", "--decode-gemm", "fp8"], "x", env={})
    with caplog.at_level(logging.ERROR, logger=LOG.name):
        assert start_prefill_model(cfg, 256, 4, LOG, first_frames=cfg) is None
    assert "warm-up" not in rec.events
    assert any("decode_gemm fp8: the model has no frame generator" in r.__dict__.get("error", "")
               for r in caplog.records), caplog.records


def test_a_units_p_gets_ds_decode_gemm() -> None:
    plain = unit_commands(UnitSpec(model="random:csm-tiny:0"))
    assert "--decode-gemm" not in plain["prefill"]
    cmds = unit_commands(UnitSpec(model="random:csm-tiny:0", decode_gemm="fp8"))
    for role in ("prefill", "decode"):
        i = cmds[role].index("--decode-gemm")
        assert cmds[role][i + 1] == "fp8", role


@gpu
def test_ps_first_frames_with_frame_graphs_equal_them_without_on_cuda() -> None:
    """csm-tiny in bf16 on CUDA as P starts it (auto: fused depth kernels, frame graphs
    over 1, 2, 4 prompts, one graph a bucket): the first frames of batches a bucket holds
    exactly equal the eager ones (the same kernels and shapes); a padded batch's equal
    the capture-safe step run eagerly on the replay's own inputs, and mostly (id by id)
    the eager ones (GEMMs of 3 rows, not 4); 6 prompts run eagerly."""
    cfg = parse_config(PrefillConfig, ["--model", "random:csm-tiny:0", "--device", "cuda", "--dtype", "bfloat16",
                                       "--max-batch-prompts", "4", "--max-batch-rows", "512", "--warmup-rows", "64",
                                       "--no-prefill-graphs"], "x", env={})
    started = start_prefill_model(cfg, 4096, cfg.max_batch_prompts, LOG, first_frames=cfg)
    assert started is not None
    model, storage, _ = started
    fg, graphs = model.frame_generator, model.frame_graphs
    assert isinstance(graphs, FrameGraphRunner) and graphs.sizes == [1, 2, 4] and graphs.caps == (None,)
    assert fg is not None and fg.fused is not None and sorted(graphs._graphs) == [(1, None), (2, None), (4, None)]
    agree = total = 0
    for n in (1, 2, 4, 3, 6):
        chunks = chunks_of(model, [40 + 17 * i for i in range(n)], seed=n)
        out = run_forward(model, storage, [runner.prefill_entry(c.prompt, c.slots, c.start, c.end) for c in chunks])
        before = graphs.stats["replays"]
        replayed = first_frames(model, out, chunks)
        assert graphs.stats["replays"] - before == (1 if n <= 4 else 0), n
        staged = (graphs._hidden[:4].clone(), graphs._rows[:4].clone())
        model.frame_graphs = None
        eager = first_frames(model, out, chunks)
        model.frame_graphs = graphs
        if n in (1, 2, 4, 6):
            assert all(np.array_equal(a, b) for a, b in zip(replayed, eager, strict=True)), (n, replayed, eager)
        else:
            with torch.inference_mode():
                want = fg.frames_static(model, *staged, fg.static_work(4, model.device), None)
            assert np.array_equal(np.stack(replayed), want[:n].cpu().numpy()), n
            agree, total = agree + int((np.stack(replayed) == np.stack(eager)).sum()), total + np.stack(eager).size
    assert agree / total > 0.8, (agree, total)
