"""The stream decoder's fused GPU path (kernels/codec_fused.py, `kernels="fused"` of
engine/audio/mimi_stream.py) equals its torch reference: every convolution form with its
ELU, bias, residual and context update, the int16 PCM bit for bit, and whole decoders
(fp32 and fp16) through passes, graphs' static path, streams of every age and a reused
slot, against the torch path and transformers' one-shot decode. The kernels run under
Triton's CPU interpreter (processes of their own, run at once: TRITON_INTERPRET is read at
import), whose bf16 dot is wrong: bf16 is for tests/gpu/test_codec_graphs.py."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from pdunit.engine.audio.mimi_stream import MimiStreamDecoder, _FusedLayer
from pdunit.kernels import codec_fused
from tests.audio.test_mimi_graphs import lively
from tests.audio.tiny import tiny_mimi

REPO = Path(__file__).resolve().parents[2]

# The script's parts, each its own process (run at once: two cores): "kernels" (every
# convolution form, every tile candidate, the int16 PCM) and "decoders" (fp32 with graphs,
# fp16; the costlier, started first: transformers' Mimi is imported there alone).
# `python -c SCRIPT part` prints that part's results as one JSON line.
PARTS = ("decoders", "kernels")

SCRIPT = textwrap.dedent("""
    import json
    import sys
    import numpy as np
    import torch
    from pdunit.engine.audio.mimi_conv import StreamConv
    from pdunit.engine.audio.mimi_stream import MimiStreamDecoder, to_pcm16
    from pdunit.kernels import codec_fused
    from tests.audio.test_mimi_conv import MODULES, stream_conv

    # each form's calls (new rows, ELU, residual): every value of each option meets every
    # value of each other option, in 6 calls rather than the 12 of the whole cross (each
    # an interpreted launch). 1 and 2 rows: fewer than the k7 conv's context of 6
    CALLS = ((1, None, False), (1, 0.8, True), (2, None, True), (2, 0.8, False), (5, None, False), (5, 0.8, True))

    def kernels():  # every convolution form, every tile candidate, the int16 PCM
        out = {}
        torch.manual_seed(0)
        for name, make in sorted(MODULES.items()):
            conv = stream_conv(make().eval())
            worst = [0.0, 0.0, 0.0]  # output, next context, context written by the kernel
            for t, elu, residual in CALLS:
                x = torch.randn(3, t, conv.in_channels)
                state = torch.randn(3, conv.state_values)
                kept = state.clone()
                want_next, got_next = state.clone(), torch.full_like(state, 7.0)
                res = torch.randn(3, t * conv.frames, conv.out_channels) if residual else None
                held = conv.state_values > 0
                want = conv(x, state if held else None, want_next if held else None, elu, res)
                got = conv(x, state if held else None, got_next if held else None, elu, res, fused=True)
                worst[0] = max(worst[0], float((got - want).abs().max()) / max(1.0, float(want.abs().max())))
                if held:
                    worst[1] = max(worst[1], float((got_next - want_next).abs().max()))
                    worst[2] = max(worst[2], float((state - kept).abs().max()))
            out.setdefault("convs", {})[name] = worst

        # every tile candidate, on shapes wide enough that none is cut to another (128 in, 256
        # out) and on one that fits no tile (40 in, 24 out: masked channels and columns). The
        # wide shape's launches are the costly ones under the interpreter: there each candidate
        # runs fp32 with 1 new row (fewer than the context) and fp16 with 5; the narrow one runs
        # every dtype with every call length
        for cin, n, taps, dilation in ((128, 256, 3, 1), (40, 24, 3, 2)):
            # weights fp16 holds exactly: the float32 torch form is the reference of both dtypes
            conv = StreamConv((torch.randn(n, cin, taps) / cin).half().float(), torch.randn(n).half().float(),
                              dilation=dilation)
            for dtype in (torch.float32, torch.float16):
                for t in (1, 5):
                    if cin == 128 and t != (1 if dtype == torch.float32 else 5):
                        continue
                    x, state = torch.randn(3, t, cin).to(dtype), torch.randn(3, conv.state_values).to(dtype)
                    res = torch.randn(3, t, n).to(dtype)
                    want_next = state.clone()
                    want = conv._torch(x.float(), state.float(), want_next, 0.8).view(3, t, n) + res.float()
                    for tiles in codec_fused.conv_candidates(cin, n):
                        got_next = torch.full_like(state, 7.0)
                        got = codec_fused.stream_conv(x, conv.rows.to(dtype), conv.row_bias.to(dtype), taps, dilation,
                                                      state, got_next, 0.8, res, tiles=tiles)
                        key = f"{cin}x{n} {tiles.text()}"
                        err = max(float((got.float() - want).abs().max()) / float(want.abs().max()),
                                  float((got_next - want_next).abs().max()))
                        errs = out.setdefault("tiles", {}).setdefault(key, {})
                        errs[str(dtype)] = max(err, errs.get(str(dtype), 0))

        x = torch.randn(4, 300) * 1.5
        x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        x[1] = (torch.arange(300) - 150.5) / 32767  # near the half-way points
        out["pcm16"] = [torch.equal(to_pcm16(x), codec_fused.pcm16(x)),
                        torch.equal(to_pcm16(x[:, ::3]), codec_fused.pcm16(x[:, ::3])),
                        torch.equal(to_pcm16(x.half()), codec_fused.pcm16(x.half()))]
        return out

    def decoder(dtype, graphs):
        from tests.audio.test_mimi_graphs import lively  # transformers' Mimi: the decoders part only
        from tests.audio.test_mimi_stream import one_shot
        from tests.audio.tiny import tiny_mimi

        codec = lively(tiny_mimi())
        codec.model.to(dtype)
        args = dict(slots=4, graph_frames=2, graphs=graphs, buckets=(2, 4))
        ref = MimiStreamDecoder(codec, kernels="torch", **args)
        ker = MimiStreamDecoder(codec, kernels="fused", **args)
        rng = np.random.default_rng(0)
        streams = {s: rng.integers(0, 32, size=(4, 30)) for s in ("a", "b", "c", "late")}
        done = dict.fromkeys(streams, 0)
        audio = {s: [] for s in streams}
        worst = peak = 0.0
        plan = [{"a": 3}, {"a": 2, "b": 1}, {"a": 1, "b": 2}, {"a": 5, "b": 5}, {"b": 2, "c": 2},
                {"a": 1, "b": 1, "c": 1}, "close a", {"b": 2, "late": 1, "c": 3}, {"late": 2, "b": 1, "c": 2}]
        for d in (ref, ker):
            d.open("a")
        for step in plan:
            if step == "close a":
                for d in (ref, ker):
                    d.close("a")
                continue
            for s in step:
                for d in (ref, ker):
                    if s not in d:
                        d.open(s)
            batch = {s: streams[s][:, done[s] : done[s] + n] for s, n in step.items()}
            got, want = ker.push_many(batch), ref.push_many(batch)
            for s, n in step.items():
                worst = max(worst, float(np.abs(got[s] - want[s]).max()))
                peak = max(peak, float(np.abs(want[s]).max()))
                audio[s].append(got[s])
                done[s] += n
        reference = one_shot(codec, torch.as_tensor(streams["b"][:, : done["b"]]))
        vs_one_shot = float(np.abs(np.concatenate(audio["b"]) - reference.astype(np.float32)).max())
        return {"worst": worst, "peak": peak, "vs_one_shot": vs_one_shot,
                "replays": ker.graphs.replays if graphs else 0}

    def decoders():  # fp32 with graphs, fp16
        torch.manual_seed(0)
        return {"fp32-graphs": decoder(torch.float32, True), "fp16": decoder(torch.float16, False)}

    print(json.dumps({"kernels": kernels, "decoders": decoders}[sys.argv[1]]()))
""")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], dict]]:
    """`interpreted(part)`: that part's results, its process waited for at the first ask
    (every part starts with the first test that needs one)."""
    # one torch thread each: the parts run at once on two cores (beside another test worker
    # in the suite), and their tensors are too small for a second thread to pay
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    logs = tmp_path_factory.mktemp("interpreted")
    runs = {}
    for part in PARTS:
        with open(logs / f"{part}.out", "w") as out, open(logs / f"{part}.err", "w") as err:
            runs[part] = subprocess.Popen([sys.executable, "-c", SCRIPT, part], cwd=REPO, env=env, stdout=out,
                                          stderr=err, text=True)

    @functools.cache
    def results(part: str) -> dict:
        assert runs[part].wait(timeout=600) == 0, (logs / f"{part}.err").read_text()[-3000:]
        return json.loads((logs / f"{part}.out").read_text().strip().splitlines()[-1])

    try:
        yield results
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()


def test_every_convolution_form_fused_equals_its_torch_form_and_writes_the_same_next_context(
        interpreted: Callable[[str], dict]) -> None:
    """k7, narrow (shift-add), dilated, k1, one output, grouped, transposed (with and
    without context, bias, a kernel not a multiple of its stride); 1, 2 and 5 new rows,
    with and without ELU and a residual (each pair of these); the context read is left as
    it was."""
    from tests.audio.test_mimi_conv import MODULES

    convs = interpreted("kernels")["convs"]
    assert set(convs) == set(MODULES)
    for name, (out, context, untouched) in convs.items():
        assert out <= 1e-5 and context <= 1e-6 and untouched == 0.0, name


def test_every_tile_candidate_equals_the_torch_form_in_fp32_and_fp16(interpreted: Callable[[str], dict]) -> None:
    """Each of CONV_CANDIDATES as `--tune-conv` times it: a 3-tap conv with ELU, bias,
    residual and context, fp32 with 1 new row and fp16 (against the float32 torch form)
    with 5; a shape no tile fits, each dtype with 1 and 5."""
    tiles = interpreted("kernels")["tiles"]
    assert len([k for k in tiles if k.startswith("128x256")]) == len(codec_fused.CONV_CANDIDATES)
    assert {k.split()[1] for k in tiles if k.startswith("128x256")} == {c.text() for c in codec_fused.CONV_CANDIDATES}
    for key, errs in tiles.items():
        assert errs["torch.float32"] <= 1e-5 and errs["torch.float16"] <= 3e-3, (key, errs)


def test_int16_pcm_fused_is_bit_for_bit_the_torch_conversion(interpreted: Callable[[str], dict]) -> None:
    assert interpreted("kernels")["pcm16"] == [True, True, True]


@pytest.mark.parametrize("case", ["fp32-graphs", "fp16"])
def test_a_fused_decoder_equals_the_torch_decoder_and_the_one_shot_decode(interpreted: Callable[[str], dict],
                                                                         case: str) -> None:
    """Calls of 1-5 frames (5 and 3 run the transformer in several passes), streams of
    every age past the 6-position window, a closed stream's slot reused. fp32 runs the
    calls of 1 and 2 frames through graphs' static path (padded to a bucket) and the
    others eagerly; fp16 runs every call eagerly."""
    got = interpreted("decoders")[case]
    bound = 1e-5 if case.startswith("fp32") else 3e-3
    assert got["peak"] > 0.1 and got["worst"] <= bound * got["peak"], got
    assert got["vs_one_shot"] <= (1e-3 if case.startswith("fp32") else bound) * max(1.0, got["peak"]), got
    assert (got["replays"] > 0) == (case == "fp32-graphs")


def test_the_kernels_are_chosen_by_device_and_fused_is_refused_where_triton_cannot_run(monkeypatch) -> None:
    codec = tiny_mimi()
    assert MimiStreamDecoder(codec).kernels == "torch"  # auto on a CPU
    monkeypatch.setattr(codec_fused, "INTERPRET", False)
    with pytest.raises(ValueError, match="fused needs CUDA"):
        MimiStreamDecoder(codec, kernels="fused")
    with pytest.raises(ValueError, match="codec kernels 'cuda'"):
        MimiStreamDecoder(codec, kernels="cuda")


def test_the_fused_layer_folds_the_layer_scales_and_refuses_biases(monkeypatch) -> None:
    codec = lively(tiny_mimi())
    layer = codec.model.decoder.decoder_transformer.layers[0]
    fused = _FusedLayer(layer)
    attn, hidden = layer.self_attn, codec.model.config.hidden_size
    y, h = torch.randn(5, hidden), torch.randn(5, hidden)
    with torch.no_grad():
        qkv = torch.cat([attn.q_proj(y), attn.k_proj(y), attn.v_proj(y)], dim=-1)
        assert torch.allclose(y @ fused.qkv, qkv, atol=1e-6)
        assert torch.allclose(h.clone().addmm_(y, fused.o), h + layer.self_attn_layer_scale(attn.o_proj(y)), atol=1e-6)
        g = torch.randn(5, codec.model.config.intermediate_size)
        assert torch.allclose(h.clone().addmm_(g, fused.fc2), h + layer.mlp_layer_scale(layer.mlp.fc2(g)), atol=1e-6)
    attn.q_proj.bias = nn.Parameter(torch.zeros(attn.q_proj.out_features))
    monkeypatch.setattr(codec_fused, "INTERPRET", True)  # construction launches nothing
    with pytest.raises(ValueError, match="attention_bias=True"):
        MimiStreamDecoder(codec, kernels="fused")


def test_a_conv_table_gives_each_shape_the_tiles_of_its_nearest_rows_and_others_the_hand_ones() -> None:
    shape = codec_fused.ConvShape("bf16", 256, 640, 2, 1, 24576)
    small, big = codec_fused.ConvTiles(32, 64, 64, 4, 3), codec_fused.ConvTiles(256, 128, 64, 8, 3)
    table = codec_fused.ConvTable.from_dict(codec_fused.ConvTable(
        [(shape, big), (codec_fused.dataclasses.replace(shape, rows=512), small)], "NVIDIA H100 80GB HBM3").to_dict())
    assert table.tiles(shape) == big
    assert table.tiles(codec_fused.dataclasses.replace(shape, rows=49152)) == big  # 2x the tuned rows
    assert table.tiles(codec_fused.dataclasses.replace(shape, rows=1024)) == small  # nearer 512 than 24576 in ratio
    assert table.tiles(codec_fused.dataclasses.replace(shape, dtype="fp32")) is None  # another dtype: not tuned
    try:
        codec_fused.use_conv_table(table)
        assert codec_fused.conv_tiles(shape) == big
        other = codec_fused.ConvShape("bf16", 64, 1, 3, 1, 491520)
        assert codec_fused.conv_tiles(other) == codec_fused.HAND_TILES.fitted(64, 1) == codec_fused.ConvTiles(
            64, 16, 64, 4, 3)
    finally:
        codec_fused.use_conv_table(None)
    assert codec_fused.conv_tiles(shape) == codec_fused.HAND_TILES


def test_conv_tiles_read_back_and_bad_ones_are_named() -> None:
    tiles = codec_fused.ConvTiles(128, 256, 32, 8, 4)
    assert codec_fused.ConvTiles.parse(tiles.text()) == tiles
    for bad in ("m64-n128-k64-w4", "m48-n128-k64-w4-s3", "m64-n128-k64-w16-s3", "m64-n512-k64-w4-s3"):
        with pytest.raises(ValueError, match="conv tiles"):
            codec_fused.ConvTiles.parse(bad)
    with pytest.raises(ValueError, match="entry 0"):
        codec_fused.ConvTable.from_dict({"device": "x", "entries": [{"dtype": "bf16", "cin": 1}]}, "t.json")


def test_the_engine_takes_a_table_only_from_its_own_gpu_model_and_logs_what_it_runs(tmp_path, monkeypatch,
                                                                                     caplog) -> None:
    import logging

    shape = codec_fused.ConvShape("bf16", 128, 256, 2, 1, 122880)
    path = tmp_path / "codec-conv.json"
    path.write_text(json.dumps(codec_fused.ConvTable([(shape, codec_fused.ConvTiles(256, 128, 64, 8, 3))],
                                                     "NVIDIA H100 80GB HBM3").to_dict()))
    log = logging.getLogger("test.codec")
    cuda = torch.device("cuda")
    try:
        with caplog.at_level(logging.INFO, "test.codec"):
            monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
            assert codec_fused.load_conv_table(str(path), cuda, log) is not None
            assert codec_fused.conv_tiles(shape).block_m == 256
            monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
            assert codec_fused.load_conv_table(str(path), cuda, log) is None
            assert codec_fused.conv_tiles(shape) == codec_fused.HAND_TILES  # the table before is dropped
            assert codec_fused.load_conv_table("", cuda, log) is None
            assert codec_fused.load_conv_table(str(path), torch.device("cpu"), log) is None
        why = [getattr(r, "why", None) for r in caplog.records]
        assert "tuned on 'NVIDIA H100 80GB HBM3', this is 'NVIDIA H200'" in why[1]
        assert why[2] == "no --codec-conv-table" and "no CUDA device" in why[3]
        assert caplog.records[1].levelname == "WARNING"
    finally:
        codec_fused.use_conv_table(None)
