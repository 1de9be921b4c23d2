"""The csm family against transformers' CsmForConditionalGeneration (the oracle).

A tiny random CSM is built with transformers' own config classes, saved with
save_pretrained (one file and sharded) and loaded by pdunit; the same inputs go through
both. Nothing is downloaded: configs are built here, HF_HUB_OFFLINE is set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdunit.engine.model.loader import load_model
from pdunit.engine.model.transformer import ForwardBatch, TTSModel

# Before transformers is first imported (inside the functions below): it must never
# reach the Hub. transformers is a pinned dev dependency: a missing one fails here.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

K, V, TEXT_V, AUDIO_TOKEN = 4, 19, 50, 48
CODEC_IDS = 16  # the codec's codebook_size: an audio frame's codes (the row rule) lie below it


def tiny_csm(rope: dict[str, Any] | None = None) -> Any:
    from transformers import (
        CsmConfig,
        CsmDepthDecoderConfig,
        CsmForConditionalGeneration,
        MimiConfig,
    )

    depth = CsmDepthDecoderConfig(
        num_codebooks=K, backbone_hidden_size=32, vocab_size=V, hidden_size=16,
        intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=K + 1,
    )
    codec = MimiConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=16, codebook_dim=8, codebook_size=CODEC_IDS, num_filters=4,
        num_residual_layers=1, upsampling_ratios=[2, 2], num_quantizers=K,
        num_semantic_quantizers=1, head_dim=8, sliding_window=4, upsample_groups=16,
    )
    cfg = CsmConfig(
        num_codebooks=K, vocab_size=V, text_vocab_size=TEXT_V, hidden_size=32,
        intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, rms_norm_eps=1e-6, depth_decoder_config=depth.to_dict(),
        codec_config=codec.to_dict(), pad_token_id=49, audio_token_id=AUDIO_TOKEN,
        audio_eos_token_id=47, bos_token_id=46, codebook_pad_token_id=V - 1,
        **({"rope_parameters": rope} if rope else {}),
    )
    torch.manual_seed(0)
    model = CsmForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():  # weights well away from the init's near-zero values
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.4)
    return model


@pytest.fixture(scope="module")
def oracle() -> Any:
    return tiny_csm()


def saved(model: Any, directory: Path, shard: str | None = None) -> Path:
    model.save_pretrained(str(directory), **({"max_shard_size": shard} if shard else {}))
    return directory


def rows(seed: int, n_text: int, n_audio: int) -> np.ndarray:
    """n_text text rows, then n_audio audio frames: [n, K + 1] in the csm row layout."""
    rng = np.random.default_rng(seed)
    text = np.full((n_text, K + 1), V - 1)
    text[:, K] = rng.integers(0, 46, n_text)
    audio = np.concatenate([rng.integers(0, CODEC_IDS, (n_audio, K)), np.full((n_audio, 1), AUDIO_TOKEN)], 1)
    return np.concatenate([text, audio]).astype(np.int64)


def oracle_embeds(oracle: Any, seqs: list[np.ndarray]) -> torch.Tensor:
    """The same rows embedded by transformers' own modules: [B, T, hidden]."""
    out = []
    with torch.no_grad():
        for r in seqs:
            t = torch.from_numpy(r)
            audio = t[:, K] == AUDIO_TOKEN
            e = oracle.embed_text_tokens(t[:, K])
            e[audio] = oracle.backbone_model.embed_tokens(t[audio][None, :, :K])[0]
            out.append(e)
    return torch.stack(out)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def batch_of(seqs: list[np.ndarray]) -> ForwardBatch:
    n = len(seqs[0])
    return ForwardBatch.from_sequences(seqs, [np.arange(i * n, (i + 1) * n) for i in range(len(seqs))])


def assert_matches_oracle(model: TTSModel, oracle: Any) -> None:
    seqs = [rows(1, 3, 4), rows(2, 2, 5)]
    embeds = oracle_embeds(oracle, seqs)
    with torch.no_grad():
        want_hidden = oracle.backbone_model(inputs_embeds=embeds).last_hidden_state
        want_logits = oracle(inputs_embeds=embeds).logits[:, -1]
    kv = model.new_kv_storage(32)
    hidden = model.hidden_states(batch_of(seqs), kv)
    assert rel(hidden, want_hidden.reshape(hidden.shape)) < 1e-4
    last = model(batch_of(seqs), model.new_kv_storage(32))  # a frame generator's model: the hidden states
    assert torch.equal(last, hidden.view(2, -1, hidden.shape[-1])[:, -1])
    logits = model.logits(last)
    assert logits.shape == (2, 1, V)
    assert rel(logits[:, 0], want_logits) < 1e-4
    # depth decoder: codebooks 1..K-1 from the backbone's last state and codebooks 0..K-2
    h = want_hidden[:, -1]
    codes = torch.from_numpy(np.random.default_rng(3).integers(0, V, (2, K)))
    with torch.no_grad():
        want_depth = oracle.depth_decoder(
            input_ids=torch.nn.functional.pad(codes[:, : K - 1], (1, 0)), backbone_last_hidden_state=h
        ).logits
    assert model.frame_generator is not None
    depth = model.frame_generator.logits(h, codes[:, : K - 1])
    assert depth.shape == (2, K - 1, V)
    assert rel(depth, want_depth) < 1e-4


def test_single_file_checkpoint_matches_transformers_forward(oracle: Any, tmp_path: Path) -> None:
    model = load_model(str(saved(oracle, tmp_path)))
    assert (tmp_path / "model.safetensors").is_file()
    assert model.config.n_codebooks == K + 1 and model.config.head_codebooks == 1
    assert not model.config.qk_norm
    assert_matches_oracle(model, oracle)


def test_sharded_checkpoint_matches_transformers_forward(oracle: Any, tmp_path: Path) -> None:
    saved(oracle, tmp_path, shard="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert_matches_oracle(load_model(str(tmp_path)), oracle)


def test_llama3_rope_scaling_is_honoured(tmp_path: Path) -> None:
    oracle = tiny_csm({
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
    })
    model = load_model(str(saved(oracle, tmp_path)))
    assert model.config.rope_llama3 == (8.0, 1.0, 4.0, 16)
    assert_matches_oracle(model, oracle)


def test_a_text_row_ignores_its_audio_columns(oracle: Any, tmp_path: Path) -> None:
    model = load_model(str(saved(oracle, tmp_path)))
    a = rows(4, 3, 2)
    b = a.copy()
    b[:3, :K] = 0  # other audio ids on the text rows
    b[3, 0] = (b[3, 0] + 1) % V  # one audio id changed on an audio row
    ea, eb = model.embed_rows(torch.from_numpy(a)), model.embed_rows(torch.from_numpy(b))
    assert torch.equal(ea[:3], eb[:3]) and torch.equal(ea[4], eb[4])
    assert not torch.equal(ea[3], eb[3])


# ---------------------------------------------------------------- refused checkpoints


def edit_config(directory: Path, **changes: Any) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))


def test_unknown_model_type_is_refused_naming_it(oracle: Any, tmp_path: Path) -> None:
    edit_config(saved(oracle, tmp_path), model_type="bark")
    with pytest.raises(ValueError, match=r"model_type 'bark' is not a supported model family; supported: csm, pdunit"):
        load_model(str(tmp_path))


def test_unknown_config_field_is_refused_naming_it(oracle: Any, tmp_path: Path) -> None:
    edit_config(saved(oracle, tmp_path), sliding_window=4)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['sliding_window'\]"):
        load_model(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["sliding_window"]
    cfg["depth_decoder_config"]["n_experts"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"depth_decoder_config has unknown field\(s\) \['n_experts'\]"):
        load_model(str(tmp_path))


def test_unsupported_backbone_option_is_refused_naming_it(oracle: Any, tmp_path: Path) -> None:
    edit_config(saved(oracle, tmp_path), attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias is true"):
        load_model(str(tmp_path))


def test_missing_or_misshapen_tensor_is_refused_naming_it(oracle: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = saved(oracle, tmp_path) / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["lm_head.weight"]
    tensors["backbone_model.norm.weight"] = torch.ones(31)
    save_file(tensors, str(weights))
    with pytest.raises(ValueError) as err:
        load_model(str(tmp_path))
    msg = str(err.value)
    assert "missing tensor lm_head.weight (expected shape [19, 32])" in msg
    assert "tensor backbone_model.norm.weight has shape [31], the config expects [32]" in msg


def test_missing_shard_is_refused_naming_it(oracle: Any, tmp_path: Path) -> None:
    saved(oracle, tmp_path, shard="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / gone).unlink()
    with pytest.raises(ValueError, match=rf"shard\(s\) \['{gone}'\] listed in model.safetensors.index.json are missing"):
        load_model(str(tmp_path))


# ---------------------------------------------------------------- greedy frames (offline)


def test_greedy_frames_equal_transformers_generate_frame_for_frame(oracle: Any, tmp_path: Path) -> None:
    from pdunit.engine.model.family_csm import greedy_frames

    model = load_model(str(saved(oracle, tmp_path)))
    texts = [np.array([46, 5, 7, 9, 11]), np.array([46, 30, 2])]  # streams of unequal length
    audio = np.random.default_rng(5).integers(0, V, (1, 3, K))
    prompts = [np.concatenate([np.full((len(t), K), V - 1), t[:, None]], 1) for t in texts]
    prompts.append(np.concatenate([audio[0], np.full((3, 1), AUDIO_TOKEN)], 1))
    mine = greedy_frames(model, prompts, max_frames=8)  # all three streams in one batch
    with torch.no_grad():
        want = [oracle.generate(input_ids=torch.from_numpy(t)[None], max_new_tokens=8, do_sample=False)[0] for t in texts]
        frames = oracle.generate(input_ids=torch.from_numpy(audio), max_new_tokens=8, do_sample=False)[0]
    assert torch.equal(frames[:3], torch.from_numpy(audio[0]))  # a frame prompt comes back first
    want.append(frames[3:])
    for got, ref in zip(mine, want, strict=True):
        assert got.shape == (8, K)
        assert np.array_equal(got, ref.numpy())


def test_bf16_checkpoint_loads_in_its_dtype_or_an_override(tmp_path: Path) -> None:
    oracle = tiny_csm().to(torch.bfloat16)
    saved(oracle, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    model = load_model(str(tmp_path))
    assert model.dtype == torch.bfloat16 and model.frame_generator is not None
    assert model.frame_generator.heads.dtype == torch.bfloat16
    # the same bf16 weights widened: float32 on both sides, float32's tolerance
    assert_matches_oracle(load_model(str(tmp_path), dtype="float32"), oracle.float())


def test_transformers_4_config_spelling_is_read(tmp_path: Path) -> None:
    """sesame/csm-1b's config.json was written by transformers 4.x: rope_theta +
    rope_scaling and torch_dtype instead of rope_parameters and dtype."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    oracle = tiny_csm(rope)
    cfg = json.loads((saved(oracle, tmp_path) / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    cfg["torch_dtype"] = cfg.pop("dtype")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_model(str(tmp_path))
    assert model.config.rope_theta == 10000.0 and model.config.rope_llama3 == (4.0, 1.0, 4.0, 16)
    assert_matches_oracle(model, oracle)


def test_csm_1b_shape_is_the_shape_of_transformers_default_csm() -> None:
    """`random:csm-1b-shape` (the GPU benchmarks' model) has the shape transformers'
    CsmConfig() describes (Sesame's CSM-1B): backbone, depth decoder, codebooks, vocabularies."""
    from transformers import CsmConfig

    from pdunit.engine.model.registry import random_shape

    ref = CsmConfig()
    shape = random_shape("csm-1b-shape")
    assert shape is not None
    m, extras = shape[1].model, shape[1].extras
    assert (m.n_layers, m.hidden, m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_hidden) == (
        ref.num_hidden_layers, ref.hidden_size, ref.num_attention_heads, ref.num_key_value_heads,
        ref.head_dim, ref.intermediate_size)
    assert m.vocab_sizes == (ref.vocab_size,) * ref.num_codebooks + (ref.text_vocab_size,)
    assert not m.qk_norm and m.dtype == "bfloat16"
    assert m.kv_bytes_per_token() == 32 << 10
    d, dref = extras.depth.backbone, ref.depth_decoder_config
    assert (d.n_layers, d.hidden, d.n_heads, d.n_kv_heads, d.head_dim, d.ffn_hidden) == (
        dref.num_hidden_layers, dref.hidden_size, dref.num_attention_heads, dref.num_key_value_heads,
        dref.head_dim, dref.intermediate_size)
    assert (extras.audio_token_id, extras.codebook_pad_token_id) == (ref.audio_token_id, ref.codebook_pad_token_id)
    assert extras.codec_frame_rate_hz == 12.5  # Mimi: the floor is 25 frames/s


def test_dualar_4b_shape_is_the_articles_model_in_csm_form() -> None:
    """The articles' shape: 144 KiB of bf16 KV a token with q/k norm, 10 fast-decoder steps
    a frame (11 audio columns), 21 frames a second."""
    from pdunit.engine.model.registry import random_shape

    shape = random_shape("dualar-4b-shape")
    assert shape is not None
    m, extras = shape[1].model, shape[1].extras
    assert m.qk_norm and m.kv_bytes_per_token() == 144 << 10 and (m.n_layers, m.hidden) == (36, 2560)
    assert extras.n_audio == 11 and m.n_codebooks == 12 and extras.depth.backbone.n_layers == 4
    assert extras.codec_frame_rate_hz == 21.0
