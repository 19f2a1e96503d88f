"""Every KV-cache operation of the package, beside mlx-lm's own (``models/cache.py``).

* **Across turns and requests** (:func:`trim_cache`, :func:`trim_to_known`;
  the caches kept by the token ids they hold: llm/prompt_cache.py).
* **Inside a step** (:func:`check_cache`, :func:`verify_starts`,
  :func:`compact_cache`, :func:`set_cache_length`): the synchronous loop
  verifies a tree behind the cached prefix, then moves the accepted path's
  rows into place. Keys are cached after RoPE, so compaction only moves rows.
* **A cache with holes** (:class:`HoleyCache`): the pipelined loop keeps
  every verified row and masks the rejected ones out.
* **Timing** (:func:`warm_cache`): a cache rewound after each timed call.

"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
)

from ..errors import RedrafterError
from .parts import model_parts
from .recurrent import cache_length, kv_leaves, leaves

SUPPORTED_CACHES = (KVCache, QuantizedKVCache, RotatingKVCache)
# Tokens per forward when a prompt is fed into a cache (bounded memory per call).
PREFILL_STEP = 512
# Squeeze holes out of a HoleyCache once this many are known. Attention over a
# hole costs a little every step; a compaction moves every cached row once.
COMPACT_HOLES = 48


# --------------------------------------------------------------------------- across turns


def feed(forward, cache, tokens: mx.array, sink=None) -> None:
    """Run ``tokens [T]`` through ``forward`` (a model or its backbone) into
    ``cache``, ``PREFILL_STEP`` at a time, each chunk evaluated. ``sink(start,
    out)``: each chunk's output ``[T, F]`` from position ``start``, evaluated
    with it (a stateful draft source reads the backbone's hidden states)."""
    for start in range(0, tokens.size, PREFILL_STEP):
        out = forward(tokens[start : start + PREFILL_STEP][None], cache=cache)
        if sink is not None:
            sink(start, out[0])
        mx.eval([c.state for c in cache] + ([out] if sink is not None else []))


def trim_cache(cache, length: int) -> bool:
    """Trim every layer so that it holds exactly ``length`` tokens (the
    model's; a draft source's caches after them lose as many).

    Returns False (and changes nothing) when a layer cannot be trimmed
    (a rotating window that has wrapped) or holds fewer tokens: rebuild the
    cache from the tokens then.
    """
    current = cache_length(cache)
    if current is None or current < length or not can_trim_prompt_cache(cache):
        return current == length
    # By the same count everywhere, as mlx-lm's trim_prompt_cache: a draft
    # source's caches after the model's (a head's ends one entry earlier)
    # keep ending where the model's does.
    for c in kv_leaves(cache):
        c.trim(current - length)
    return True


def always_trimmable(cache) -> bool:
    """Whether every layer of ``cache`` can be trimmed however long it grows
    (a sliding window that has wrapped, or a recurrent state, cannot)."""
    return all(isinstance(c, (KVCache, QuantizedKVCache)) for c in leaves(cache))


def prefill_forward(model):
    """What feeds a prompt into a cache: the backbone (no logits over the
    vocabulary for every token), or the model where it has none."""
    try:
        return model_parts(model)[1]
    except RedrafterError:
        return model


def trim_to_known(cache, known: Sequence[int]):
    """``(cache, held)``: ``cache`` (which holds a prefix of ``known``) trimmed
    to its first ``held`` tokens, at most all of ``known`` but the last (the
    next step's input); ``(None, 0)`` without a cache or when it cannot be
    trimmed. For a generation that moves to another loop mid-reply."""
    if cache is None:
        return None, 0
    held = min(cache_length(cache) or 0, len(known) - 1)
    return (cache, held) if trim_cache(cache, held) else (None, 0)


# --------------------------------------------------------------------------- draft sources' caches


def target_size(model) -> int:
    """How many caches are the model's own (``make_prompt_cache(model)``): a
    prompt cache may hold a draft source's caches after them, mlx-lm's layout
    for a draft model (``make_prompt_cache(model) + make_prompt_cache(draft_model)``)."""
    return len(make_prompt_cache(model))


def attach_sources(cache: list, size: int, makers) -> List[list]:
    """Each stateful draft source's caches, after the model's ``size``: the
    ones ``cache`` holds (a prompt cache kept across turns), else new ones
    appended to it in place. ``makers``: one function per source making its
    empty caches. Caches left by other sources are refused."""
    fresh = [make() for make in makers]
    extra = cache[size:]
    if not extra:
        cache.extend(c for caches in fresh for c in caches)
        return fresh
    out = split_sources(extra, fresh)
    if out is None:
        raise RedrafterError(
            f"The prompt cache holds {len(extra)} caches after the model's {size}, "
            "not the ones these draft sources keep (it was used with other draft sources).",
            "Make a new prompt cache (make_prompt_cache(model)) or keep the same MTP head and draft model.",
        )
    return out


def split_sources(extra: list, fresh: List[list]) -> Optional[List[list]]:
    """``extra`` (the caches after the model's) split per source as ``fresh``
    (each source's new caches) is; None when they are not the same sources' caches."""
    if not extra or [type(c) for c in extra] != [type(c) for caches in fresh for c in caches]:
        return None
    out, start = [], 0
    for caches in fresh:
        out.append(extra[start : start + len(caches)])
        start += len(caches)
    return out


def drop_sources(cache: list, size: int) -> None:
    """Drop draft sources' caches after the model's ``size`` (in place): a
    generation without them would leave them behind the model's."""
    del cache[size:]


# --------------------------------------------------------------------------- inside a step


def check_cache(cache) -> None:
    for c in leaves(cache):
        if not isinstance(c, SUPPORTED_CACHES + (ArraysCache,)):
            raise RedrafterError(
                f"Cache type {type(c).__name__} is not supported by tree verification "
                "(supported: KVCache, QuantizedKVCache, RotatingKVCache, and ArraysCache of covered recurrent layers).",
                "Decode this model without drafting (plain decoding: no drafter and no lookup).",
            )


def kv_offsets(cache) -> List[int]:
    """Each attention layer's offset (the recurrent layers count no tokens)."""
    return [c.offset for c in kv_leaves(cache)]


def cached_length(c) -> int:
    """Number of cached keys the next multi-token update attends to."""
    if isinstance(c, RotatingKVCache):
        # A multi-token update keeps at most max_size - 1 old tokens.
        return min(c.offset, c.max_size - 1)
    return c.offset


def verify_starts(cache) -> List[int]:
    """Row index of g0 in each attention layer's buffer after the verify update."""
    return [cached_length(c) for c in kv_leaves(cache)]


def map_rows(c, fn) -> None:
    """Apply ``fn`` to each of a layer cache's key and value arrays (a
    quantized cache's are tuples of data, scales and biases, row-aligned)."""
    if isinstance(c, QuantizedKVCache):
        c.keys = tuple(fn(a) for a in c.keys)
        c.values = tuple(fn(a) for a in c.values)
    else:
        c.keys, c.values = fn(c.keys), fn(c.values)


def _move_rows(arr: mx.array, start: int, rows: mx.array) -> mx.array:
    """``arr[..., start:start+len(rows), :] = arr[..., start+rows, :]`` (fixed size)."""
    picked = mx.take(arr, start + rows, axis=2)
    arr[..., start : start + rows.shape[0], :] = picked
    return arr


def compact_cache(cache, start_offsets: List[int], path: mx.array) -> None:
    """Move the accepted path's rows into place, lazily.

    ``path [L+1]`` holds packed indices (0 = g0, then the accepted nodes,
    padded with anything): rows ``start + path`` move to ``start + arange``.
    Offsets are fixed later by :func:`set_cache_length` once the accepted
    length is known on the host, so no sync happens here.
    """
    # A RotatingKVCache holds [old | new] in time order after a multi-token
    # update (start = len(old)), like a plain KVCache.
    for c, start in zip(kv_leaves(cache), start_offsets):
        map_rows(c, lambda a, start=start: _move_rows(a, start, path))


def set_cache_length(cache, starts: List[int], offsets: List[int], kept: int) -> None:
    """After compaction: keep ``kept`` tree rows (g0 + accepted drafts) in the attention layers."""
    for c, start, offset in zip(kv_leaves(cache), starts, offsets):
        c.offset = offset + kept
        if isinstance(c, RotatingKVCache):
            # The buffer must end exactly at the last kept row: mlx-lm reads
            # rows past `_idx` as the oldest ones once the window has wrapped.
            c.keys = c.keys[..., : start + kept, :]
            c.values = c.values[..., : start + kept, :]
            c._idx = start + kept


# --------------------------------------------------------------------------- with holes


class HoleyCache:
    """Host bookkeeping of a cache that keeps every verified row (the pipelined loop).

    Rows ``[0, solid)`` are real tokens. ``flags`` say which rows after them
    (of steps already read) are real; ``tail`` (device, bool) covers every
    row after ``solid``, read or not.
    """

    def __init__(self, cache):
        self.cache = cache
        self.solid = cache_length(cache) or 0
        self.flags: List[bool] = []
        self.unread: List[int] = []  # sizes of the steps queued but not read
        self.tail = mx.zeros((0,), mx.bool_)

    @property
    def dirty(self) -> bool:
        """Whether the cache may hold holes (then masks and positions need the device's view)."""
        return not all(self.flags) or any(size > 1 for size in self.unread)

    def valid(self) -> mx.array:
        return mx.concatenate([mx.ones((self.solid,), mx.bool_), self.tail])

    def append(self, size: int, kept: mx.array) -> None:
        self.tail = mx.concatenate([self.tail, kept])
        self.unread.append(size)

    def settle(self, flags: List[bool]) -> None:
        """The oldest unread step was read: ``flags`` say which of its rows are real."""
        self.unread.pop(0)
        self.flags += flags
        if all(self.flags):  # nothing to squeeze: the read rows join the solid part
            self.solid += len(self.flags)
            self.tail = self.tail[len(self.flags) :]
            self.flags = []
        elif len(self.flags) - sum(self.flags) >= COMPACT_HOLES:
            self.compact()

    def compact(self, drop_unread: bool = False) -> None:
        """Move the real rows of the read steps together (lazily); ``drop_unread``
        also cuts off the rows of steps queued but not read (the loop ends)."""
        unread = 0 if drop_unread else sum(self.unread)
        real = [self.solid + i for i, f in enumerate(self.flags) if f]
        solid = self.solid + len(real)
        if all(self.flags):  # no holes: keeping a prefix is a trim
            length = solid + unread
            for c in kv_leaves(self.cache):
                c.offset = length
        else:
            end = self.solid + len(self.flags)
            idx = mx.array(list(range(self.solid)) + real + list(range(end, end + unread)), mx.int32)
            for c in kv_leaves(self.cache):
                map_rows(c, lambda a: mx.take(a, idx, axis=2))
                c.offset = idx.size
        self.tail = mx.zeros((0,), mx.bool_) if drop_unread else self.tail[len(self.flags) :]
        self.solid, self.flags = solid, []
        if drop_unread:
            self.unread = []


# --------------------------------------------------------------------------- timing


def rewinder(cache):
    """A function that puts ``cache`` back as it is now, for timing the same
    call again and again. A layer's offset alone would do for a plain
    KVCache; a RotatingKVCache (Gemma 3's sliding layers) also has its
    buffer, which a multi-token call replaces by a longer one, and its write
    index: every one is put back (the rows a call wrote in place are only
    ever attended to by the timed calls, whose timing does not depend on them)."""
    kv = kv_leaves(cache)
    saved = [(c.offset, getattr(c, "_idx", None), c.keys, c.values) for c in kv]
    states = [(c, list(c.cache)) for c in leaves(cache) if isinstance(c, ArraysCache)]

    def rewind():
        for c, (offset, idx, keys, values) in zip(kv, saved):
            c.offset, c.keys, c.values = offset, keys, values
            if idx is not None:
                c._idx = idx
        for c, entries in states:  # a recurrent state is replaced by each call, never written in place
            c.cache, c.pending = list(entries), None

    return rewind


def warm_cache(model, backbone, tokens: int = 64):
    """A prompt cache holding ``tokens`` positions, and a function that rewinds
    it there, so that every timed LLM call sees the same context."""
    cache = make_prompt_cache(model)
    mx.eval(backbone(mx.arange(tokens)[None], cache=cache))
    return cache, rewinder(cache)
