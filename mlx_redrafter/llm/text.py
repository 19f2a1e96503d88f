"""Prompts into token ids, exactly as mlx-lm encodes them, and the tokenizer wrapper it streams with."""

from __future__ import annotations

from typing import List

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
