"""The multi-codebook transformer: weights, shapes, determinism, and paged-attention
equivalences (cached prefix, chunks, batches) that make PD equal monolith."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pdunit.engine.model.config import CONFIGS, ModelConfig, torch_dtype
from pdunit.engine.model.loader import load_model, save_model
from pdunit.engine.model.transformer import ForwardBatch, TTSModel
from pdunit.kernels.kv_dtype import index_copy_kv, to_kv

# float64 equivalence: only BLAS blocking differs between the paths compared below.
TOL = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture(scope="module")
def model() -> TTSModel:
    return load_model("random:tiny:0")


def prompt(rows: int, seed: int, cfg: ModelConfig = CONFIGS["tiny"]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.integers(0, v, rows) for v in cfg.vocab_sizes], axis=1)


def scattered_slots(n: int, n_slots: int, seed: int) -> np.ndarray:
    """n distinct, non-contiguous pool slots: the fragmented case."""
    return np.random.default_rng(seed).permutation(n_slots)[:n].astype(np.int64)


def prefill(m: TTSModel, kv: torch.Tensor, rows: np.ndarray, slots: np.ndarray) -> torch.Tensor:
    return m(ForwardBatch.from_sequences([rows], [slots]), kv)


def test_random_weights_are_identical_for_the_same_seed_and_differ_across_seeds() -> None:
    a, b, c = load_model("random:tiny:0"), load_model("random:tiny:0"), load_model("random:tiny:1")
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    random_tensors = [k for k in sa if not k.endswith("norm.weight")]
    assert all(not torch.equal(sa[k], sc[k]) for k in random_tensors)


def test_random_weights_do_not_depend_on_the_dtype() -> None:
    """Generated once in float32 from integer draws, then cast: the float64 model holds
    exactly the float32 model's values."""
    m32 = load_model("random:tiny:0", dtype="float32")
    m64 = load_model("random:tiny:0")
    assert m32.config.dtype == "float32" and m64.config.dtype == "float64"
    for (k, w32), (_, w64) in zip(m32.state_dict().items(), m64.state_dict().items(), strict=True):
        assert w32.dtype == torch.float32 and w64.dtype == torch.float64, k
        assert torch.equal(w32.double(), w64), k


def test_qwen3_4b_shape_has_144_kib_of_kv_per_token_in_bf16() -> None:
    cfg = CONFIGS["qwen3-4b-shape"]
    assert cfg.kv_bytes_per_token() == 144 * 1024
    assert cfg.kv_bytes_per_token(torch.float32) == 2 * 144 * 1024
    assert torch_dtype(cfg.dtype) == torch.bfloat16


def test_forward_returns_last_token_logits_and_writes_only_its_slots(model: TTSModel) -> None:
    cfg = model.config
    kv = model.new_kv_storage(256)
    assert kv.shape == (cfg.n_layers, 2, 256, cfg.n_kv_heads, cfg.head_dim)
    assert kv.dtype == torch.float64
    s1, s2 = scattered_slots(30, 256, 1), scattered_slots(256, 256, 2)
    s2 = np.setdiff1d(s2, s1)[:7]
    logits = model(ForwardBatch.from_sequences([prompt(30, 0), prompt(7, 1)], [s1, s2]), kv)
    assert logits.shape == (2, cfg.n_codebooks, cfg.vocab_max)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    written = np.zeros(256, dtype=bool)
    written[np.concatenate([s1, s2])] = True
    per_slot = kv.abs().sum(dim=(0, 1, 3, 4))
    assert (per_slot[torch.from_numpy(written)] > 0).all()
    assert (per_slot[torch.from_numpy(~written)] == 0).all()


def test_forward_of_the_same_batch_twice_is_identical(model: TTSModel) -> None:
    slots = scattered_slots(20, 64, 3)
    kv1, kv2 = model.new_kv_storage(64), model.new_kv_storage(64)
    a = prefill(model, kv1, prompt(20, 4), slots)
    b = prefill(model, kv2, prompt(20, 4), slots)
    assert torch.equal(a, b)
    assert torch.equal(kv1, kv2)


def test_prefill_of_a_cached_prefix_plus_new_rows_equals_full_prefill(model: TTSModel) -> None:
    rows = prompt(40, 5)
    slots = scattered_slots(40, 128, 6)
    kv_full, kv_cached = model.new_kv_storage(128), model.new_kv_storage(128)
    full = prefill(model, kv_full, rows, slots)
    # The cached prefix was computed earlier (another request with the same voice).
    prefill(model, kv_cached, rows[:32], slots[:32])
    cached = model(ForwardBatch.from_sequences([rows[32:]], [slots]), kv_cached)
    torch.testing.assert_close(cached, full, **TOL)
    torch.testing.assert_close(kv_cached, kv_full, **TOL)
    assert torch.equal(cached.argmax(-1), full.argmax(-1))


def test_chunked_prefill_equals_full_prefill(model: TTSModel) -> None:
    rows = prompt(45, 7)
    slots = scattered_slots(45, 128, 8)
    kv_full, kv_chunked = model.new_kv_storage(128), model.new_kv_storage(128)
    full = prefill(model, kv_full, rows, slots)
    for end in (16, 32, 45):
        start = end - 16 if end != 45 else 32
        out = model(ForwardBatch.from_sequences([rows[start:end]], [slots[:end]]), kv_chunked)
    torch.testing.assert_close(out, full, **TOL)
    torch.testing.assert_close(kv_chunked, kv_full, **TOL)


def _prefilled(model: TTSModel, lengths: list[int], n_slots: int) -> tuple[torch.Tensor, list]:
    kv = model.new_kv_storage(n_slots)
    perm = scattered_slots(n_slots, n_slots, 9)
    seqs, used = [], 0
    for i, n in enumerate(lengths):
        slots = perm[used : used + n + 4]  # room for decode steps
        used += n + 4
        logits = prefill(model, kv, prompt(n, 10 + i), slots[:n])
        seqs.append((slots, n, logits[0].argmax(-1)))
    return kv, seqs


def test_a_batch_of_decodes_equals_each_decode_alone(model: TTSModel) -> None:
    kv, seqs = _prefilled(model, [5, 23, 60], 128)
    frames = [f[None] for _, _, f in seqs]
    contexts = [slots[: n + 1] for slots, n, _ in seqs]
    kv_batch = kv.clone()
    batched = model(ForwardBatch.from_sequences(frames, contexts), kv_batch)
    for i in range(3):
        kv_alone = kv.clone()
        alone = model(ForwardBatch.from_sequences([frames[i]], [contexts[i]]), kv_alone)
        torch.testing.assert_close(batched[i : i + 1], alone, **TOL)
        assert torch.equal(batched[i].argmax(-1), alone[0].argmax(-1))


def test_a_mixed_batch_of_prefill_chunk_and_decodes_equals_separate_forwards(
    model: TTSModel,
) -> None:
    kv, seqs = _prefilled(model, [12, 30], 160)
    new_slots = np.setdiff1d(np.arange(160), np.concatenate([s for s, _, _ in seqs]))[:25]
    new_rows = prompt(25, 20)
    parts = [
        (seqs[0][2][None], seqs[0][0][:13]),
        (new_rows, new_slots),
        (seqs[1][2][None], seqs[1][0][:31]),
    ]
    kv_mixed = kv.clone()
    mixed = model(
        ForwardBatch.from_sequences([p[0] for p in parts], [p[1] for p in parts]), kv_mixed
    )
    kv_sep = kv.clone()
    for i, (toks, ctx) in enumerate(parts):
        alone = model(ForwardBatch.from_sequences([toks], [ctx]), kv_sep)
        torch.testing.assert_close(mixed[i : i + 1], alone, **TOL)
    torch.testing.assert_close(kv_mixed, kv_sep, **TOL)


def test_greedy_frames_vary_across_decode_steps(model: TTSModel) -> None:
    kv = model.new_kv_storage(128)
    slots = scattered_slots(100, 128, 11)
    frame = prefill(model, kv, prompt(50, 12), slots[:50])[0].argmax(-1)
    frames = []
    for step in range(30):
        frames.append(tuple(frame.tolist()))
        logits = model(ForwardBatch.from_sequences([frame[None]], [slots[: 51 + step]]), kv)
        frame = logits[0].argmax(-1)
    assert len(set(frames)) >= 25, "greedy decoding of the random model is degenerate"
    assert len({f[0] for f in frames}) >= 15


def test_batch_whose_positions_do_not_follow_the_context_is_rejected(model: TTSModel) -> None:
    kv = model.new_kv_storage(32)
    batch = ForwardBatch.from_sequences([prompt(4, 0)], [np.arange(10)])
    batch.positions = batch.positions - 1
    with pytest.raises(ValueError, match="positions"):
        model(batch, kv)
    batch = ForwardBatch.from_sequences([prompt(4, 0)], [np.arange(30, 40)])
    with pytest.raises(ValueError, match="outside the pool"):
        model(batch, kv)
    with pytest.raises(ValueError, match="kv dtype"):
        model(ForwardBatch.from_sequences([prompt(4, 0)], [np.arange(4)]), kv.float())


def test_save_then_load_round_trips_weights_and_logits(model: TTSModel, tmp_path: Path) -> None:
    save_model(model, str(tmp_path))
    loaded = load_model(str(tmp_path))
    assert loaded.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    slots = scattered_slots(10, 32, 13)
    a = prefill(model, model.new_kv_storage(32), prompt(10, 14), slots)
    b = prefill(loaded, loaded.new_kv_storage(32), prompt(10, 14), slots)
    assert torch.equal(a, b)


def test_unknown_config_error_lists_the_known_configs() -> None:
    with pytest.raises(ValueError, match="tiny.*qwen3-4b-shape"):
        load_model("random:huge:0")
    with pytest.raises(ValueError, match=r"random:<config>:<seed>"):
        load_model("random:tiny:abc")
    with pytest.raises(ValueError, match="neither"):
        load_model("/nonexistent/dir")


def test_checkpoint_with_a_missing_or_misshapen_tensor_names_it(
    model: TTSModel, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    save_model(model, str(tmp_path))
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["layers.1.mlp.up_proj.weight"]
    tensors["norm.weight"] = torch.ones(64, dtype=torch.float64)
    save_file(tensors, str(weights))
    with pytest.raises(ValueError) as err:
        load_model(str(tmp_path))
    msg = str(err.value)
    assert "missing tensor layers.1.mlp.up_proj.weight (expected shape [256, 128])" in msg
    assert "tensor norm.weight has shape [64]" in msg and "expects [128]" in msg


def test_config_json_with_an_unknown_field_is_rejected(model: TTSModel, tmp_path: Path) -> None:
    save_model(model, str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["n_experts"] = 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="n_experts"):
        load_model(str(tmp_path))


def test_uneven_vocabularies_pad_logits_with_minus_infinity() -> None:
    import dataclasses

    cfg = dataclasses.replace(
        CONFIGS["tiny"], name="uneven", vocab_sizes=(1200,) + (1024,) * 10, eos_id=1199
    )
    m = TTSModel(cfg)
    from pdunit.engine.model.loader import _fill_random

    _fill_random(m, 0)
    logits = m(
        ForwardBatch.from_sequences([prompt(6, 15, cfg)], [np.arange(6)]), m.new_kv_storage(8)
    )
    assert logits.shape == (1, 11, 1200)
    assert torch.isfinite(logits[0, 0]).all()
    assert torch.isinf(logits[0, 1:, 1024:]).all() and torch.isfinite(logits[0, 1:, :1024]).all()


@pytest.fixture(scope="module")
def fp8_model() -> TTSModel:
    m = load_model("random:tiny:0", dtype="float32")
    m.set_prefill_gemm("fp8")
    return m


def test_fp8_prefill_gemms_stay_close_to_the_model_dtype_but_are_not_it(fp8_model: TTSModel) -> None:
    bf = load_model("random:tiny:0", dtype="float32")
    rows, slots = prompt(40, 31), scattered_slots(40, 128, 32)
    kv8, kv = fp8_model.new_kv_storage(128), bf.new_kv_storage(128)
    got, want = prefill(fp8_model, kv8, rows, slots), prefill(bf, kv, rows, slots)
    assert not torch.equal(got, want)  # the fp8 path really ran
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos > 0.99, float(cos)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.5
    # and so is the K/V it wrote for D
    k_cos = torch.nn.functional.cosine_similarity(kv8[:, :, slots].flatten(), kv[:, :, slots].flatten(), dim=0)
    assert k_cos > 0.99, float(k_cos)


def test_fp8_leaves_decode_only_forwards_in_the_model_dtype(fp8_model: TTSModel) -> None:
    bf = load_model("random:tiny:0", dtype="float32")
    kv = fp8_model.new_kv_storage(64)
    slots = scattered_slots(21, 64, 33)
    frame = prefill(fp8_model, kv, prompt(20, 34), slots[:20])[0].argmax(-1)
    step = ForwardBatch.from_sequences([frame[None]], [slots])
    kv_a, kv_b = kv.clone(), kv.clone()
    assert torch.equal(fp8_model(step, kv_a), bf(step, kv_b))


def test_fp8_decode_gemms_change_decode_only_forwards_and_nothing_else() -> None:
    bf = load_model("random:tiny:0", dtype="float32")
    m = load_model("random:tiny:0", dtype="float32")
    m.set_decode_gemm("fp8")
    assert (m.decode_gemm, m.prefill_gemm) == ("fp8", "bf16")
    kv_m, kv_bf = m.new_kv_storage(64), bf.new_kv_storage(64)
    slots = scattered_slots(21, 64, 39)
    rows = prompt(20, 40)
    first = prefill(m, kv_m, rows, slots[:20])
    assert torch.equal(first, prefill(bf, kv_bf, rows, slots[:20]))  # prompt rows: bf16 GEMMs
    step = ForwardBatch.from_sequences([first[0].argmax(-1)[None]], [slots])
    got, want = m(step, kv_m), bf(step, kv_bf)
    assert not torch.equal(got, want)  # the decode step's GEMMs ran in e4m3
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos > 0.99, float(cos)
    assert m.gemm_weight_bytes(True) < m.gemm_weight_bytes(False) / 3  # 1 byte a weight against 4
    with pytest.raises(ValueError, match="decode_gemm 'int8': expected one of bf16, fp8"):
        m.set_decode_gemm("int8")
    assert m.decode_gemm == "fp8"  # a refused mode changes nothing


def test_fp8_cached_prefix_prefill_equals_full_prefill(fp8_model: TTSModel) -> None:
    """Activations are scaled per row, so a row's GEMMs never see the other rows of its
    forward: a prefix computed by an earlier request is what a full prefill computes."""
    rows, slots = prompt(40, 35), scattered_slots(40, 128, 36)
    kv_full, kv_cached = fp8_model.new_kv_storage(128), fp8_model.new_kv_storage(128)
    full = prefill(fp8_model, kv_full, rows, slots)
    prefill(fp8_model, kv_cached, rows[:32], slots[:32])
    cached = fp8_model(ForwardBatch.from_sequences([rows[32:]], [slots]), kv_cached)
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_cached, kv_full, rtol=1e-5, atol=1e-5)


def test_an_unknown_prefill_gemm_is_refused_naming_the_choices(model: TTSModel) -> None:
    with pytest.raises(ValueError, match="prefill_gemm 'int4': expected one of bf16, fp8"):
        model.set_prefill_gemm("int4")
    assert model.prefill_gemm == "bf16"


def test_fp8_min_rows_keeps_smaller_forwards_in_the_model_dtype() -> None:
    bf = load_model("random:tiny:0", dtype="float32")
    m = load_model("random:tiny:0", dtype="float32")
    m.set_prefill_gemm("fp8", 30)
    for n, fp8 in ((29, False), (30, True)):
        rows, slots = prompt(n, 37), scattered_slots(n, 64, 38)
        got = prefill(m, m.new_kv_storage(64), rows, slots)
        want = prefill(bf, bf.new_kv_storage(64), rows, slots)
        assert torch.equal(got, want) != fp8, n
    with pytest.raises(ValueError, match="min_rows -1 must be >= 0"):
        m.set_prefill_gemm("fp8", -1)


def _bytes(kv: torch.Tensor) -> torch.Tensor:
    return kv.view(torch.uint8)


def test_an_fp8_kv_pool_stores_every_row_as_the_saturating_e4m3_cast(model: TTSModel) -> None:
    """Rows are computed in the model dtype, then stored by kernels/kv_dtype.to_kv: the
    fp8 pool holds exactly the cast of what a full-precision pool holds. Layer 0 only:
    its K/V come from the embeddings alone, later layers' from attention over fp8 rows."""
    rows, slots = prompt(40, 41), scattered_slots(40, 128, 42)
    kv8, kv = model.new_kv_storage(128, kv_cache_dtype="fp8_e4m3"), model.new_kv_storage(128)
    assert kv8.dtype == torch.float8_e4m3fn and kv8.element_size() == 1
    prefill(model, kv8, rows, slots)
    prefill(model, kv, rows, slots)
    assert torch.equal(_bytes(kv8[0]), _bytes(to_kv(kv[0], torch.float8_e4m3fn)))
    assert kv8[0, :, slots].float().any()  # the rows were written


def test_fp8_kv_logits_stay_close_to_the_full_precision_pool_but_are_not_them(model: TTSModel) -> None:
    rows, slots = prompt(40, 43), scattered_slots(41, 128, 44)
    kv8, kv = model.new_kv_storage(128, kv_cache_dtype="fp8_e4m3"), model.new_kv_storage(128)
    got, want = prefill(model, kv8, rows, slots[:40]), prefill(model, kv, rows, slots[:40])
    assert not torch.equal(got, want)  # every row's attention read fp8 K/V
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos > 0.99, float(cos)
    step = ForwardBatch.from_sequences([want[0].argmax(-1)[None]], [slots])
    d_cos = torch.nn.functional.cosine_similarity(model(step, kv8).flatten(), model(step, kv).flatten(), dim=0)
    assert d_cos > 0.99, float(d_cos)


def test_fp8_kv_cached_prefix_and_chunked_prefill_equal_full_prefill(model: TTSModel) -> None:
    """A token's K/V is stored, then read back, in the same forward that computed it: a
    prefix cached by an earlier request, or an earlier chunk, is read exactly as a full
    prefill reads it, so P, D and both monoliths agree on an fp8 pool too."""
    rows, slots = prompt(45, 45), scattered_slots(45, 128, 46)
    pools = [model.new_kv_storage(128, kv_cache_dtype="fp8_e4m3") for _ in range(3)]
    full = prefill(model, pools[0], rows, slots)
    prefill(model, pools[1], rows[:32], slots[:32])
    cached = model(ForwardBatch.from_sequences([rows[32:]], [slots]), pools[1])
    for start, end in ((0, 16), (16, 32), (32, 45)):
        chunked = model(ForwardBatch.from_sequences([rows[start:end]], [slots[:end]]), pools[2])
    for out, kv in ((cached, pools[1]), (chunked, pools[2])):
        torch.testing.assert_close(out, full, **TOL)
        assert torch.equal(_bytes(kv), _bytes(pools[0]))


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_choices(model: TTSModel) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp4'.*auto, fp8_e4m3"):
        model.new_kv_storage(8, kv_cache_dtype="fp4")


def test_kv_index_copy_writes_fp8_rows_on_the_cpu_where_torch_has_no_fp8_index_copy() -> None:
    dst = torch.zeros(2, 6, 3, dtype=torch.float8_e4m3fn)
    src = to_kv(torch.tensor([[[500.0, -1000.0, 0.3]] * 3, [[1.5, 2.0, -3.0]] * 3]), torch.float8_e4m3fn)
    index_copy_kv(dst[0], 0, torch.tensor([4, 1]), src[:, 0])
    assert dst[0, 4].float().tolist() == [448.0, -448.0, 0.3125]  # saturated, and rounded to e4m3
    assert dst[0, 1].float().tolist() == [1.5, 2.0, -3.0]
    assert not dst[1].float().any() and not dst[0, [0, 2, 3, 5]].float().any()
