"""`--codec SPEC` (engine/audio/codec_spec.py): the forms, the match with the model, the AudioFormat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdunit.engine.audio.codec_spec import audio_format, load_codec, tiny_mimi_model
from pdunit.engine.model.loader import load_model


def test_random_tiny_is_shaped_to_the_model_and_repeats_per_seed() -> None:
    a = load_codec("random:mimi-tiny:3", n_codebooks=4, codebook_size=32)
    b = load_codec("random:mimi-tiny:3", n_codebooks=4, codebook_size=32)
    assert (a.num_codebooks, a.codebook_size) == (4, 32)
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    other = load_codec("random:mimi-tiny:0", n_codebooks=11, codebook_size=1024)
    assert (other.num_codebooks, other.codebook_size) == (11, 1024)


def test_the_random_csm_tiny_model_names_the_codec_it_needs() -> None:
    model = load_model("random:csm-tiny:0")
    k, size = model.codec_books
    assert (k, size) == (4, 32)
    load_codec("random:mimi-tiny:0", n_codebooks=k, codebook_size=size)


def test_a_saved_directory_loads_and_a_mismatch_is_refused_naming_the_flag_and_both_values(tmp_path: Path) -> None:
    codec = load_codec("random:mimi-tiny:1", n_codebooks=4, codebook_size=32)
    codec.model.save_pretrained(str(tmp_path))
    again = load_codec(str(tmp_path), n_codebooks=4, codebook_size=32)
    codes = torch.randint(0, 32, (1, 4, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(codec.model.decode(codes).audio_values, again.model.decode(codes).audio_values)
    with pytest.raises(ValueError, match=r"--codec .* 4 codebooks of 32 ids.* 8 codebooks of 32 ids"):
        load_codec(str(tmp_path), n_codebooks=8, codebook_size=32)
    with pytest.raises(ValueError, match=r"--codec .* 4 codebooks of 32 ids.* 4 codebooks of 2048 ids"):
        load_codec(str(tmp_path), n_codebooks=4, codebook_size=2048)


@pytest.mark.parametrize("spec", ["random:mimi:0", "random:mimi-tiny:x", "/nonexistent/codec", "checkpoint"])
def test_unknown_forms_are_refused_naming_the_flag(spec: str) -> None:
    with pytest.raises(ValueError, match="--codec"):
        load_codec(spec, n_codebooks=4, codebook_size=32, model_dir=None)


def csm_with_codec(codebook_size: int) -> tuple[Any, int]:
    """A tiny transformers CSM (codebook vocabulary 19) carrying a decodable tiny Mimi."""
    from transformers import CsmConfig, CsmDepthDecoderConfig, CsmForConditionalGeneration

    k, v = 4, 19
    depth = CsmDepthDecoderConfig(
        num_codebooks=k, backbone_hidden_size=32, vocab_size=v, hidden_size=16, intermediate_size=24,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=k + 1,
    )
    codec = tiny_mimi_model(k, codebook_size, seed=5).config
    cfg = CsmConfig(
        num_codebooks=k, vocab_size=v, text_vocab_size=50, hidden_size=32, intermediate_size=48,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        depth_decoder_config=depth.to_dict(), codec_config=codec.to_dict(), pad_token_id=49, audio_token_id=48,
        audio_eos_token_id=47, bos_token_id=46, codebook_pad_token_id=v - 1,
    )
    torch.manual_seed(0)
    return CsmForConditionalGeneration(cfg).float().eval(), k


def test_checkpoint_form_reads_the_csm_checkpoints_own_codec(tmp_path: Path) -> None:
    oracle, k = csm_with_codec(16)
    oracle.save_pretrained(str(tmp_path))
    model = load_model(str(tmp_path))
    assert model.codec_books == (k, 16)  # the codec's 16 ids, not the codebook vocabulary of 19
    codec = load_codec("checkpoint", n_codebooks=k, codebook_size=16, model_dir=str(tmp_path))
    codes = torch.randint(0, 16, (1, k, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = oracle.codec_model.decode(codes).audio_values
        got = codec.model.decode(codes).audio_values
    assert want.abs().max() > 0.01
    assert np.abs((want - got).numpy()).max() < 1e-6
    with pytest.raises(ValueError, match="--codec 'checkpoint' .* 4 codebooks of 16 ids.* 4 codebooks of 19 ids"):
        load_codec("checkpoint", n_codebooks=k, codebook_size=19, model_dir=str(tmp_path))


def test_audio_format_is_the_codecs() -> None:
    codec = load_codec("random:mimi-tiny:0", n_codebooks=4, codebook_size=32)
    fmt = audio_format(codec, "random:mimi-tiny:0")
    assert (fmt.sample_rate, fmt.samples_per_frame, fmt.codec) == (800, 32, "random:mimi-tiny:0")
    assert fmt.frame_rate_hz == pytest.approx(800 / 32)
