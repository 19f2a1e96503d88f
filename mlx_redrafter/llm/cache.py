"""A KV cache kept across turns or requests, with the token ids it holds.

The contract: before a generation the cache is trimmed to the longest common
prefix of the ids it holds and the new prompt's ids, and only the rest is
prefilled; after it, the cache is trimmed to the tokens known to be in it.
Re-tokenizing the whole conversation each time (rather than appending to the
cache) keeps the cache exactly equal to what a fresh prefill would compute,
whatever a chat template does to earlier replies. The chat
(:class:`~mlx_redrafter.chat.ChatSession`) and the server
(:mod:`mlx_redrafter.serve`) both use it.
"""

from __future__ import annotations

from typing import List, Sequence

from mlx_lm.models.cache import make_prompt_cache

from .generate import trim_cache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PromptCache:
    """``cache`` (mlx-lm's per-layer caches, or ``None``) and ``ids``, the
    token ids whose KV it holds."""

    def __init__(self, model):
        self.model = model
        self.cache = None
        self.ids: List[int] = []

    def reuse(self, ids: Sequence[int]) -> int:
        """Trim the cache to its common prefix with ``ids``; return its length
        (pass ``ids[length:]`` and ``prompt_cache=self.cache`` to stream_generate)."""
        # stream_generate needs at least one prompt token to produce logits.
        keep = min(common_prefix(self.ids, ids), len(ids) - 1)
        self.ids = []  # unknown until the generation ends
        if self.cache is None or not trim_cache(self.cache, keep):
            self.cache, keep = make_prompt_cache(self.model), 0
        return keep

    def settle(self, known: List[int]) -> None:
        """After a generation: the cache holds a prefix of ``known`` (prompt +
        emitted tokens + the EOS that ended them), sometimes missing the last
        token or holding a few accepted drafts past EOS (stream_generate's
        contract); trim it to what we know."""
        held = min(self.cache[0].offset, len(known))
        if trim_cache(self.cache, held):
            self.ids = known[:held]
        else:
            self.reset()

    def reset(self) -> None:
        """Forget the cache (the next generation prefills its whole prompt);
        do this after an interrupted generation, whose cache may hold part
        of a verification."""
        self.cache, self.ids = None, []
