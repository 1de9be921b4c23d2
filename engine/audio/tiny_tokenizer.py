"""A tiny deterministic text tokenizer for `random:csm-tiny:<seed>` (no checkpoint files).

Owns the character vocabulary of the tiny CSM (lower-cased letters, digits, space and
common punctuation, an `<unk>` for anything else) and its special tokens at the ids the
tiny config fixes (`audio_token_id`, `audio_eos_token_id`), every id below its
`text_vocab_size`. Built in code with the `tokenizers` library (imported when used), so
a unit with random weights takes text like a real checkpoint. Never for real models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdunit.engine.audio.csm_prompt import CsmLayout, CsmPrompter, PromptLimits

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TINY_SHAPE = "csm-tiny"
BOS, EOS, PAD, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<unk>"
AUDIO, AUDIO_EOS = "<|AUDIO|>", "<|audio_eos|>"
# Every character the tiny model reads (upper case is folded to lower case first).
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?'\"-:;()[]"


def tiny_layout() -> tuple[CsmLayout, int]:
    """The tiny CSM's row ids (from its random config) and its text_vocab_size."""
    from pdunit.engine.model.family_csm import CsmExtras
    from pdunit.engine.model.registry import random_shape

    shape = random_shape(TINY_SHAPE)
    if shape is None:
        raise ValueError(f"the {TINY_SHAPE} random shape is not registered")
    parsed = shape[1]
    extras: CsmExtras = parsed.extras
    if extras.audio_eos_token_id is None:
        raise ValueError(f"{TINY_SHAPE} has no audio_eos_token_id")
    layout = CsmLayout(
        num_codebooks=extras.n_audio, audio_vocab_size=parsed.model.vocab_sizes[0],
        audio_token_id=extras.audio_token_id, audio_eos_token_id=extras.audio_eos_token_id,
        codebook_pad_token_id=extras.codebook_pad_token_id, codebook_eos_token_id=parsed.model.eos_id,
    )
    return layout, parsed.model.vocab_sizes[-1]


def tiny_tokenizer(layout: CsmLayout, text_vocab_size: int) -> Tokenizer:
    """Characters at ids 0.., the special tokens on the ids left at the top of the text
    vocabulary (audio and audio-eos exactly where the layout puts them)."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

    fixed = {layout.audio_token_id: AUDIO, layout.audio_eos_token_id: AUDIO_EOS}
    free = [i for i in range(text_vocab_size) if i not in fixed]
    plain = [UNK, *CHARS]
    others = [BOS, EOS, PAD]
    if len(plain) + len(others) > len(free):
        raise ValueError(
            f"text_vocab_size {text_vocab_size} cannot hold {len(plain)} characters and "
            f"{len(others) + len(fixed)} special tokens"
        )
    vocab: dict[str, int] = {tok: free[i] for i, tok in enumerate(plain)}
    for name, i in zip(others, free[-len(others):], strict=True):
        vocab[name] = i
    for i, name in fixed.items():
        vocab[name] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKD(), normalizers.StripAccents(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*others, *fixed.values())])
    for t in (*others, *fixed.values()):
        if tok.token_to_id(t) != vocab[t]:
            raise AssertionError(f"{t} landed on {tok.token_to_id(t)}, expected {vocab[t]}")
    return tok


def tiny_prompter(limits: PromptLimits | None = None) -> CsmPrompter:
    """The CsmPrompter of `random:csm-tiny:<seed>` (every seed: the text ids do not depend on it)."""
    layout, text_vocab = tiny_layout()
    return CsmPrompter(tiny_tokenizer(layout, text_vocab), layout, BOS, EOS, limits)
