"""Prompts into token ids, exactly as mlx-lm encodes them, and the tokenizer wrapper it streams with."""

from __future__ import annotations

import functools
import json
from typing import Dict, List, Optional, Tuple

import mlx.core as mx


def encode_prompt(tokenizer, text: str) -> List[int]:
    """Token ids of a prompt string, exactly as :func:`~mlx_redrafter.generate.stream_generate` encodes it.

    As mlx-lm: special tokens are added unless the text already starts with
    BOS (a chat template usually writes it).
    """
    add_special = tokenizer.bos_token is None or not text.startswith(tokenizer.bos_token)
    return tokenizer.encode(text, add_special_tokens=add_special)


def prompt_array(tokenizer, prompt) -> mx.array:
    """A prompt given as text, token ids or an array, as an int32 array."""
    if isinstance(prompt, mx.array):
        return prompt.astype(mx.int32)
    if isinstance(prompt, str):
        prompt = encode_prompt(tokenizer, prompt)
    return mx.array(list(prompt), dtype=mx.int32)


def wrap_tokenizer(tokenizer):
    """mlx-lm's ``TokenizerWrapper`` around a Hugging Face tokenizer (a wrapped one as it is)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


# How much shorter a normalizer can make a text, at most (None: no bound): NFC composes a
# character's full canonical decomposition, at most 4 characters (U+1F82), back into one.
SHRINK = {None: 1, "NFC": 4}
# Pre-tokenizers that keep every character of the text (Whitespace, Bert... drop some).
KEEPING = {"ByteLevel", "Split", "Digits", "Punctuation"}


def token_floor(tokenizer, text: str) -> int:
    """A number of tokens that ``text`` provably encodes to at least, found
    without tokenizing it (0: nothing can be proven for this tokenizer).

    A byte-level BPE tokenizer (GPT-2's, Llama 3's, Qwen's, SmolLM's) stands
    for every byte of the normalized text, but the bytes its vocabulary lacks,
    with tokens of at most :func:`byte_cover`'s ``longest`` bytes, so a text
    of C characters (those made of a lacking byte left out) takes at least
    C / (shrink x longest) tokens. This lets a server refuse a prompt far over
    the model's context before spending seconds (and gigabytes) tokenizing it."""
    cover = byte_cover(tokenizer)
    if cover is None:
        return 0
    longest, dropped = cover
    chars = len(text) - sum(text.count(c) for c in dropped)
    return -(-chars // longest)


@functools.lru_cache(maxsize=8)
def byte_cover(tokenizer) -> Optional[Tuple[int, str]]:
    """``(longest, dropped)``: the most characters of a text one token can
    stand for (at most its bytes) times what the normalizer can shrink a text
    by, and the ASCII characters the vocabulary lacks (BPE without an unknown
    token drops them). None when no bound can be proven for this tokenizer:
    not byte-level BPE, a pre-tokenizer that drops text, an added token that
    swallows the whitespace around it, a UTF-8 continuation byte it lacks."""
    spec = _pipeline(tokenizer)
    if spec is None:
        return None
    normalizer, model = spec.get("normalizer"), spec.get("model") or {}
    kind = normalizer["type"] if normalizer else None
    steps = _steps(spec.get("pre_tokenizer"))
    kinds = {s["type"] for s in steps}
    if kind not in SHRINK or model.get("type") != "BPE" or "ByteLevel" not in kinds or kinds - KEEPING:
        return None
    added = spec.get("added_tokens") or []
    if any(s.get("behavior") == "Removed" for s in steps) or any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    vocab = model.get("vocab") or {}
    lacking = [b for b, c in _byte_chars().items() if c not in vocab]
    if any(0x80 <= b < 0xC0 for b in lacking):  # then a character may be dropped whole: no bound
        return None
    longest = max([len(t) for t in vocab] + [len(a["content"].encode()) for a in added])
    return longest * SHRINK[kind], "".join(chr(b) for b in lacking if b < 0x80)


def _byte_chars() -> Dict[int, str]:
    """Each byte's character in the byte-level alphabet (GPT-2's ``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _pipeline(tokenizer) -> Optional[dict]:
    """The Hugging Face ``tokenizers`` pipeline behind ``tokenizer`` (mlx-lm's
    wrapper or a fast tokenizer) as its JSON, or None without one."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(inner, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        return json.loads(backend.to_str())
    except (AttributeError, ValueError):
        return None


def _steps(pre: Optional[dict]) -> List[dict]:
    """A pre-tokenizer's steps, sequences flattened."""
    if not pre:
        return []
    if pre["type"] == "Sequence":
        return [s for p in pre.get("pretokenizers", []) for s in _steps(p)]
    return [pre]
