"""A small model of the same family as a draft source: mlx-lm's
``--draft-model`` / ``draft_model=`` (e.g. Qwen3-0.6B for Qwen3-8B,
Llama-3.2-1B for Llama-3.1-8B).

It drafts by its own greedy beam search (:func:`~mlx_redrafter.draft.head.head_beams`:
one beam is a chain of L tokens, several are a top-k tree), through the
bookkeeping every stateful source shares (:class:`~mlx_redrafter.draft.chain.Chain`):
its cache follows the target's (the same tokens), rejected drafts never stay
in it, and a hybrid draft model (recurrent layers, which cannot be trimmed)
drafts in copies of its state. Its tokenizer must be the target's: a
vocabulary that maps one token to another id is refused, with the token.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..errors import RedrafterError

FIX = "Use a draft model of the same family, with the same tokenizer (e.g. Qwen3-0.6B for Qwen3-8B)."


class ModelHead:
    """An mlx-lm model as a draft source: tokens in, logits out (no features).

    ``vocab``: the target's vocabulary size; logits past it (a draft model
    whose embedding is padded further) are cut, so every draft is a
    target token.
    """

    source = "draft-model"
    taps = None
    draft_to_target = None
    reads_hidden = False

    def __init__(self, model, vocab: Optional[int] = None):
        from ..llm.parts import model_parts

        self.model, self.vocab = model, vocab
        _, self.backbone, self.lm_head = model_parts(model)

    def make_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def __call__(self, tokens: mx.array, features, cache: list, first: bool = True, last: bool = False):
        hidden = self.backbone(tokens, cache=cache)
        logits = self.lm_head(hidden[:, -1:] if last else hidden)
        if self.vocab is not None and logits.shape[-1] > self.vocab:
            logits = logits[..., : self.vocab]
        return logits, None


def vocabulary(tokenizer) -> Optional[dict]:
    """A tokenizer's token -> id map, or None when it cannot say."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    get = getattr(inner, "get_vocab", None)
    return get() if callable(get) else None


def tokenizer_problem(tokenizer, draft_tokenizer) -> Optional[str]:
    """Why ``draft_tokenizer`` cannot draft for a model with ``tokenizer``, or None."""
    ours, theirs = vocabulary(tokenizer), vocabulary(draft_tokenizer)
    if ours is None or theirs is None:
        return None
    if len(ours) != len(theirs):
        return f"The draft model's tokenizer has {len(theirs)} tokens but the model's has {len(ours)}."
    for token, i in ours.items():
        if theirs.get(token) != i:
            return (
                f"The draft model's tokenizer maps {token!r} to {theirs.get(token)} but the model's maps it to {i}: "
                "they are different tokenizers."
            )
    return None


def check_draft_model(model, draft_model, tokenizer=None, draft_tokenizer=None) -> None:
    """Refuse a draft model that cannot draft for ``model``: another
    tokenizer, or an embedding smaller than the token ids the model uses."""
    from ..llm.identity import model_dims

    if draft_model is model:
        return
    problem = None
    if tokenizer is not None and draft_tokenizer is not None:
        problem = tokenizer_problem(tokenizer, draft_tokenizer)
    ours, theirs = model_dims(model), model_dims(draft_model)
    if problem is None and ours is not None and theirs is not None and theirs[1] < ours[1]:
        if tokenizer is None or draft_tokenizer is None:
            problem = f"The draft model's vocabulary has {theirs[1]} tokens but the model's has {ours[1]}."
    if problem:
        raise RedrafterError(problem, FIX)


def load_draft_model(spec: str, model, tokenizer, dtype=None):
    """Load the draft model ``spec`` (a folder, a Hub id, a .gguf: llm/load.py)
    and check it fits ``model``; ``(draft_model, its tokenizer)``."""
    from ..llm.load import load_model

    draft_model, draft_tokenizer = load_model(spec, dtype=dtype)
    check_draft_model(model, draft_model, tokenizer, draft_tokenizer)
    return draft_model, draft_tokenizer
