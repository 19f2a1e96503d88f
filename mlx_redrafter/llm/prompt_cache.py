"""Caches kept across turns and requests (:class:`PromptCache`), found by the
token ids they hold, in mlx-lm's ``LRUPromptCache``.

The prompt cache's contract: before a generation the stored cache sharing the longest
prefix with the new prompt's ids is copied and trimmed to that prefix, and only the rest is
prefilled; after it, the cache is trimmed to the tokens known to be in it.
Re-tokenizing the whole conversation each time (rather than appending to the
cache) keeps the cache exactly equal to what a fresh prefill would compute,
whatever a chat template does to earlier replies. The chat
(:class:`~mlx_redrafter.chat.conversation.ChatSession`) and the server
(:mod:`mlx_redrafter.serve.engine`) both use it.
"""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache

from ..errors import RedrafterError
from .cache import always_trimmable, drop_sources, feed, prefill_forward, target_size, trim_cache
from .recurrent import cache_length, snapshot

# No bound on the bytes kept (mlx-lm's LRUPromptCache takes a number): what `serve` uses unless told.
NO_BYTE_BOUND = 1 << 63


class PromptCache:
    """KV caches kept across turns and requests, found by the token ids they
    hold: mlx-lm's :class:`~mlx_lm.models.cache.LRUPromptCache` (a prefix
    trie, the least recently stored entries dropped past ``max_size`` entries or
    ``max_bytes`` bytes), with the working cache of the current generation.

    The chat keeps one entry (its one conversation); the server several, so
    that alternating conversations each reuse their own prefix.

    A hybrid model's recurrent states, and a sliding window past its size
    (Gemma 3's), cannot be trimmed back to a prefix, so for such a model
    (``checkpoints``) :meth:`take` prefills all of a prompt but its last token
    itself and stores that state (the turn boundary the next turn's prompt
    extends), and a copy at each mark it is given (the server's: the end of
    the system prompt and tools every request repeats): :meth:`checkpoint`;
    :meth:`store` keeps a cache only when it holds exactly known tokens; such
    a model keeps two entries at least (the boundary and the reply's end).
    ``cache`` and ``ids``: the working cache (mlx-lm's per-layer list, or
    ``None``) and the token ids whose KV it holds once settled.
    """

    KEY = "model"  # one model per PromptCache: the trie's model key is constant

    def __init__(self, model, max_size: int = 1, max_bytes: int = NO_BYTE_BOUND):
        if max_size < 1 or max_bytes < 1:
            raise RedrafterError(
                f"A prompt cache needs room for an entry (got {max_size} entries, {max_bytes} bytes).",
                "Give --prompt-cache-size and --prompt-cache-bytes positive values.",
            )
        self.model = model
        self.checkpoints = model is not None and not always_trimmable(make_prompt_cache(model))
        self.lru = LRUPromptCache(max(max_size, 2) if self.checkpoints else max_size, max_bytes)
        self.cache = None
        self.ids: List[int] = []
        self.hits = 0  # generations that reused a cached prefix
        self.reused_tokens = 0  # prompt tokens those reused, in all
        self.reused = 0  # of the working cache's tokens, those that came from the store (:meth:`reuse`)

    def reuse(self, ids: Sequence[int]) -> int:
        """Take a copy of the stored cache sharing the longest prefix with
        ``ids`` as the working cache, trimmed to that prefix; return the
        length it holds (pass ``ids[length:]`` and ``prompt_cache=self.cache``
        to stream_generate). ``reused``: how many of those came from the
        store; a model with ``checkpoints`` prefilled the rest itself (:meth:`take`)."""
        self.cache, self.reused, held = self.take(ids)
        self.ids = []  # ids unknown until the generation ends
        return held

    def take(self, ids: Sequence[int], marks: Sequence[int] = ()):
        """``(cache, reused, held)``: a copy of the stored cache sharing the
        longest prefix with ``ids`` (its first ``reused`` tokens), or a fresh
        cache, holding ``held`` tokens once a model with ``checkpoints`` has
        prefilled the rest up to the last token (:meth:`checkpoint`, with
        ``marks``). Several generations at once (the server's batch) each
        take their own. ``hits`` and ``reused_tokens`` count what came from
        the store, never what this call prefilled."""
        cache, rest = self.lru.fetch_nearest_cache(self.KEY, list(ids))
        keep = len(ids) - len(rest)
        if cache is not None and not rest:  # an exact hit: stream_generate needs one prompt token
            keep = len(ids) - 1
            if not trim_cache(cache, keep):
                cache = None
        if cache is None or keep <= 0:
            cache, keep = make_prompt_cache(self.model), 0
        held = self.checkpoint(cache, ids, keep, marks) if self.checkpoints and len(ids) - keep > 1 else keep
        self.hits += 1 if keep > 0 else 0
        self.reused_tokens += keep
        return cache, keep, held

    def checkpoint(self, cache, ids: Sequence[int], held: int, marks: Sequence[int] = ()) -> int:
        """For a model whose cache cannot be trimmed back once long (a
        recurrent state, a sliding window past its size), which can only be
        reused up to where it was stored: prefill ``cache`` (which holds
        ``ids[:held]``) up to each of ``marks`` (e.g. the end of a system
        prompt every request shares) and to all of ``ids`` but the last,
        storing a copy at each, so that the next turn (its prompt extends
        this one) or the next request with the same head finds them (as
        mlx-lm's server does: a mark's copy kept longest, as its "system"
        segment, the prompt's as its "user" one). The length ``cache`` holds then."""
        ends = {m: "system" for m in marks if held < m < len(ids) - 1}
        ends[len(ids) - 1] = "user"
        forward = prefill_forward(self.model)
        for mark in sorted(m for m in ends if m > held):
            feed(forward, cache, mx.array(ids[held:mark], mx.int32))
            held = mark
            self.lru.insert_cache(self.KEY, list(ids[:held]), snapshot(cache), cache_type=ends[mark])
        return held

    def settle(self, known: List[int]) -> None:
        """After a generation: the cache holds a prefix of ``known`` (prompt +
        emitted tokens + the EOS that ended them), sometimes missing the last
        token or holding a few accepted drafts past EOS (stream_generate's
        contract); trim it to what we know and store it."""
        if self.store(self.cache, known):
            self.ids = list(known[: cache_length(self.cache)])
        else:
            self.discard()

    def store(self, cache, known: Sequence[int]) -> bool:
        """Store ``cache``, which holds a prefix of ``known`` (see :meth:`settle`),
        trimmed to what is known; False (nothing stored) when it cannot be."""
        size = target_size(self.model) if self.model is not None else len(cache)
        if len(cache) > size and not can_trim_prompt_cache(cache[size:]):  # a hybrid draft model's state
            drop_sources(cache, size)
        length = cache_length(cache)
        held = min(length or 0, len(known))
        if not trim_cache(cache, held) or held <= 0:
            return False
        # A cache taken out of the server's batch is a lazy slice of the whole
        # batch's KV: stored unevaluated, it would keep that buffer alive (ten
        # entries pinned 1.2 GB in a load run, unseen by the bytes bound).
        mx.eval([c.state for c in cache])
        self.lru.insert_cache(self.KEY, list(known[:held]), cache)
        return True

    def discard(self) -> None:
        """Drop the working cache (after an interrupted generation, whose cache
        may hold part of a verification); the stored ones stay valid."""
        self.cache, self.ids = None, []

    def reset(self) -> None:
        """Forget every cache (the next generation prefills its whole prompt)."""
        self.discard()
        self.lru.trim_to(n_sequences=0)

    @property
    def entries(self) -> int:
        return len(self.lru)

    @property
    def nbytes(self) -> int:
        return self.lru.nbytes

    @property
    def byte_bound(self):
        """The most bytes of KV kept, or None when there is no bound."""
        return None if self.lru.max_bytes >= NO_BYTE_BOUND else self.lru.max_bytes
