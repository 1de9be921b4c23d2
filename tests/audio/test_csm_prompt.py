"""Text -> CSM rows equals transformers' CsmProcessor (and CSM's own input embedding).

The checkpoint is built here: a tiny byte-level BPE tokenizer trained in-process with
`tokenizers`, a tiny random CsmConfig (Mimi codec at its real conv stack, toy width),
saved as transformers saves them. CsmProcessor is constructed offline from those files
with CSM's chat-template layout (`<bos>[speaker]text<eos>`, then `<|AUDIO|><|audio_eos|>`
for a turn with audio) written out below.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdunit.engine.audio.csm_prompt import CsmPrompter, PromptLimits, Turn
from pdunit.engine.audio.errors import FieldError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

K, V = 4, 35  # codebooks; audio vocab (Mimi's 32 codes + pad, eos, spare)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|AUDIO|>", "<|audio_eos|>", "<|pad|>"]
TEMPLATE = (
    "{%- for message in messages %}{{- bos_token }}{{- '[' + message['role'] + ']' }}"
    "{{- message['content'][0]['text'] }}{{- eos_token }}"
    "{%- if message['content']|length > 1 %}{{- '<|AUDIO|><|audio_eos|>' }}{%- endif %}"
    "{%- endfor %}"
)
TEXTS = ["Hello from Sesame.", "This is a test sentence, with [1] in it!", "ok"]


def tiny_checkpoint(directory: Path) -> tuple[Any, Any]:
    """-> (CsmForConditionalGeneration, CsmProcessor), both saved into `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        CsmConfig,
        CsmDepthDecoderConfig,
        CsmForConditionalGeneration,
        CsmProcessor,
        EncodecFeatureExtractor,
        MimiConfig,
        PreTrainedTokenizerFast,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(TEXTS * 3, trainer)
    tok.add_special_tokens(SPECIALS)
    bos, eos, audio, audio_eos, pad = (tok.token_to_id(s) for s in SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"),
        bos_token=SPECIALS[0], eos_token=SPECIALS[1], pad_token=SPECIALS[4],
    )
    processor = CsmProcessor(
        EncodecFeatureExtractor(feature_size=1, sampling_rate=24000), hf_tok, chat_template=TEMPLATE
    )
    processor.save_pretrained(str(directory))

    codec = MimiConfig(
        hidden_size=16, num_filters=4, num_hidden_layers=1, intermediate_size=16,
        num_attention_heads=2, num_key_value_heads=2, codebook_size=32, codebook_dim=8,
        num_quantizers=K, num_semantic_quantizers=1, vector_quantization_hidden_dimension=8,
        upsample_groups=16, sliding_window=8,
    )
    depth = CsmDepthDecoderConfig(
        num_codebooks=K, backbone_hidden_size=32, vocab_size=V, hidden_size=16,
        intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=K + 1,
    )
    cfg = CsmConfig(
        num_codebooks=K, vocab_size=V, text_vocab_size=320, hidden_size=32, intermediate_size=48,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, depth_decoder_config=depth.to_dict(),
        codec_config=codec.to_dict(), bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        audio_token_id=audio, audio_eos_token_id=audio_eos, codebook_pad_token_id=V - 1,
        codebook_eos_token_id=0,
    )
    torch.manual_seed(0)
    model = CsmForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.4)
    model.save_pretrained(str(directory))
    return model, processor


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    directory = tmp_path_factory.mktemp("csm")
    model, processor = tiny_checkpoint(directory)
    return directory, model, processor


@pytest.fixture(scope="module")
def prompter(checkpoint: tuple[Path, Any, Any]) -> CsmPrompter:
    return CsmPrompter.from_checkpoint(checkpoint[0])


def clip(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.3 * rng.standard_normal(int(24000 * seconds))).astype(np.float32)


def voice_turn(model: Any, speaker: int, text: str, audio: np.ndarray) -> Turn:
    """A voice turn as the store keeps it: the clip's codes from the CSM's own codec."""
    with torch.no_grad():
        codes = model.codec_model.encode(torch.from_numpy(audio)[None, None]).audio_codes[0]
    return Turn(speaker, text, codes.numpy())


def conversation(voice: list[tuple[Turn, np.ndarray]], speaker: int, text: str) -> list[dict]:
    turns = [
        {"role": str(t.speaker), "content": [{"type": "text", "text": t.text}, {"type": "audio", "audio": a}]}
        for t, a in voice
    ]
    return [*turns, {"role": str(speaker), "content": [{"type": "text", "text": text}]}]


def processor_ids(processor: Any, conv: list[dict]) -> np.ndarray:
    out = processor.apply_chat_template(conv, tokenize=True, return_dict=True)
    return out["input_ids"][0].numpy()


@pytest.mark.parametrize("text", TEXTS)
def test_text_rows_equal_the_processors_input_ids(checkpoint: Any, prompter: CsmPrompter, text: str) -> None:
    _, _, processor = checkpoint
    rows = prompter.rows(text, speaker=1)
    assert rows.dtype == np.int64 and rows.shape[1] == K + 1
    assert rows[:, K].tolist() == processor_ids(processor, conversation([], 1, text)).tolist()
    assert (rows[:, :K] == V - 1).all()  # text rows: codebook pads


def test_voice_rows_equal_the_processors_ids_and_the_codecs_frames(
    checkpoint: Any, prompter: CsmPrompter
) -> None:
    _, model, processor = checkpoint
    audios = [clip(1.0, 1), clip(0.6, 2)]
    voice = [voice_turn(model, 0, "This is a test sentence.", audios[0]),
             voice_turn(model, 1, "Hello!", audios[1])]
    rows = prompter.rows("Hello from Sesame.", speaker=0, voice=voice)
    AUDIO, AUDIO_EOS = prompter.layout.audio_token_id, prompter.layout.audio_eos_token_id
    ids = processor_ids(processor, conversation(list(zip(voice, audios, strict=True)), 0, "Hello from Sesame."))
    n_frames = voice[0].codes.shape[1] + voice[1].codes.shape[1]
    assert (ids == AUDIO).sum() == n_frames == 13 + 8  # the processor's frame count: the codec's
    # the audio-eos row is an all-eos audio frame (transformers embeds it so)
    assert rows[:, K].tolist() == np.where(ids == AUDIO_EOS, AUDIO, ids).tolist()
    frames = rows[ids == AUDIO, :K]
    assert frames.tolist() == np.concatenate([t.codes for t in voice], axis=1).T.tolist()
    assert (rows[ids == AUDIO_EOS, :K] == 0).all()


def test_rows_embed_as_csm_embeds_the_processors_output(checkpoint: Any, prompter: CsmPrompter) -> None:
    """pdunit's csm row embedding of the rows == transformers' merge of the processor's
    input_ids and input_values (the codec encoding the clip inside the model)."""
    from pdunit.engine.model.loader import load_model

    directory, model, processor = checkpoint
    audio = clip(1.0, 3)
    voice = [voice_turn(model, 1, "This is a test.", audio)]
    out = processor.apply_chat_template(
        conversation(list(zip(voice, [audio], strict=True)), 1, "ok"), tokenize=True, return_dict=True
    )
    with torch.no_grad():
        want = model._merge_input_ids_with_input_values(
            input_ids=out["input_ids"], input_values=out["input_values"],
            input_values_cutoffs=out["input_values_cutoffs"],
        )["inputs_embeds"][0]
        got = load_model(str(directory)).embed_rows(
            torch.from_numpy(prompter.rows("ok", speaker=1, voice=voice))
        )
    assert got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_naming_the_field(checkpoint: Any, prompter: CsmPrompter) -> None:
    _, model, _ = checkpoint
    cases = [
        (dict(text=""), "input", "empty"),
        (dict(text="a <|AUDIO|> b"), "input", "special token '<|AUDIO|>'"),
        (dict(text="x" * 4097), "input", "4097 characters, over the limit of 4096"),
        (dict(text="hi", speaker=-1), "speaker", "integer >= 0"),
        (dict(text="hi", voice=[Turn(0, "a<|begin_of_text|>", np.zeros((K, 2), np.int64))]),
         "voice", "turn 0 transcript holds the special token"),
        (dict(text="hi", voice=[Turn(0, "a", np.zeros((K + 1, 2), np.int64))]),
         "voice", r"turn 0 codes have shape \(5, 2\), expected \(4, frames >= 1\)"),
        (dict(text="hi", voice=[Turn(0, "a", np.full((K, 2), V, np.int64))]),
         "voice", r"codes must be integers in \[0, 35\)"),
        (dict(text="hi", voice=[Turn(0, "a", None)]), "voice", "no audio codes"),
    ]
    for kwargs, field, message in cases:
        with pytest.raises(FieldError, match=message) as err:
            prompter.rows(**kwargs)
        assert err.value.field == field


def test_limits_on_tokens_voice_frames_and_rows_name_the_field(checkpoint: Any) -> None:
    directory = checkpoint[0]
    small = CsmPrompter.from_checkpoint(
        directory, PromptLimits(max_input_tokens=3, max_voice_frames=5, max_rows=12)
    )
    with pytest.raises(FieldError, match="input: is .* tokens, over the limit of 3"):
        small.rows("This is a test sentence")
    with pytest.raises(FieldError, match="voice: has 6 frames of audio, over the limit of 5"):
        small.rows("ok", voice=[Turn(0, "a", np.zeros((K, 6), np.int64))])
    with pytest.raises(FieldError, match="input: with its voice makes .* over the limit of 12"):
        small.rows("ok", voice=[Turn(0, "This is a test.", np.zeros((K, 5), np.int64))])


def test_a_tokenizer_from_another_checkpoint_is_refused_at_load(checkpoint: Any, tmp_path: Path) -> None:
    import json
    import shutil

    directory = checkpoint[0]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(directory / name, tmp_path / name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["audio_token_id"] = 7
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="audio_token_id 7 is not a special token of tokenizer.json"):
        CsmPrompter.from_checkpoint(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json"):
        CsmPrompter.from_checkpoint(tmp_path)
