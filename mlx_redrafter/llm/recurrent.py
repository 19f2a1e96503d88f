"""The caches of hybrid models: which layers keep keys and values, which a recurrent state.

A hybrid model's cache mixes mlx-lm's ``KVCache`` (attention layers) with
``ArraysCache`` (gated delta nets, Mamba2, short convolutions: a
convolution window and a recurrent state per layer); Falcon-H1 holds both in
one ``CacheList`` per layer. Keys and values are moved, trimmed and masked
(llm/cache.py); a recurrent state cannot be trimmed back, so a verify call
keeps every node's state (``pending``, step/mixers.py) and acceptance takes the
accepted node's (:func:`take_tree_states`).
"""

from __future__ import annotations

from typing import Iterator, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList


def leaves(cache) -> Iterator[object]:
    """Every layer cache, ``CacheList`` members one by one."""
    for c in cache:
        if isinstance(c, CacheList):
            yield from leaves(c.caches)
        else:
            yield c


def kv_leaves(cache) -> List[object]:
    """The layer caches that hold keys and values (every one but the recurrent ones)."""
    return [c for c in leaves(cache) if not isinstance(c, ArraysCache)]


def recurrent_leaves(cache) -> List[ArraysCache]:
    return [c for c in leaves(cache) if isinstance(c, ArraysCache)]


def is_hybrid(cache) -> bool:
    """Whether any layer keeps a recurrent state (a cache that cannot be trimmed back)."""
    return len(recurrent_leaves(cache)) > 0


def cache_length(cache) -> Optional[int]:
    """Tokens the cache holds (an attention layer's offset); None when no layer counts them."""
    for c in kv_leaves(cache):
        return c.offset
    return None


def take_tree_states(cache, node: mx.array) -> None:
    """After a verify call through the recurrent layers: each one's state
    becomes that of tree node ``node`` (a device scalar: no sync), and the
    other nodes' states are dropped."""
    index = node.reshape(1).astype(mx.int32)
    for c in recurrent_leaves(cache):
        pending = getattr(c, "pending", None)
        if pending is None:
            continue
        c.cache = pending.take(index)  # step/mixers.py's NodeStates or LevelStates
        c.pending = None


def recurrent_states(cache) -> list:
    """The recurrent layers' states as they are now (arrays are replaced, never
    written in place, so keeping the lists keeps the states)."""
    return [list(c.cache) for c in recurrent_leaves(cache)]


def restore_states(cache, states: list) -> None:
    """Put back what :func:`recurrent_states` kept (a step queued but never read is undone)."""
    for c, entries in zip(recurrent_leaves(cache), states):
        c.cache, c.pending = list(entries), None


def snapshot(cache) -> list:
    """A copy of ``cache`` that later updates of it do not change: recurrent
    states are replaced, never written in place, so their arrays are shared;
    key and value buffers are written in place, so they are copied."""
    import copy

    return copy.deepcopy(cache)
