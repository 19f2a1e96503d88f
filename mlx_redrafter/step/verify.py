"""Run a packed draft tree through an unmodified mlx-lm model, and compact its cache.

mlx-lm models take no mask argument and apply RoPE with ``cache.offset``. Two
small hooks make them verify a tree:

* **Mask.** Every backbone asks ``cache.make_mask(N, ...)`` for its mask. For
  the verify call only, each layer cache's ``make_mask`` is shadowed by one
  that returns the boolean tree mask ``[N, K + N]`` (the cached prefix, then
  ancestors-or-self; windowed for sliding-window layers).
* **Positions.** Each attention's ``rope`` module is wrapped once. With no
  positions set it passes straight through; during a verify call it moves the
  token axis into the batch axis and passes one offset per token, which
  ``mx.fast.rope`` supports for every RoPE variant.

Keys are cached after RoPE, so compaction only moves rows: the accepted path
is gathered into place and the offset set.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from .errors import RedrafterError

SUPPORTED_ROPES = ("RoPE", "Llama3RoPE", "YarnRoPE", "SuScaledRoPE", "ProportionalRoPE")
SUPPORTED_CACHES = (KVCache, QuantizedKVCache, RotatingKVCache)


class TreeRoPE(nn.Module):
    """Wraps a model's RoPE module; applies per-token positions while a tree is verified.

    ``_depth`` (set): token ``i`` sits at ``offset + depth[i]``, ``offset``
    being the cache's. ``_base`` (set): positions count from this device
    scalar instead of the cache's offset (the pipelined loop's cache holds
    holes, so its offset is not the position).
    """

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.inner = rope
        self._depth: Optional[mx.array] = None
        self._base: Optional[mx.array] = None

    def __call__(self, x, offset=0, **kwargs):
        depth, base = self._depth, self._base
        if base is not None:
            offset = base
        if depth is None:
            return self.inner(x, offset=offset, **kwargs)
        B, H, L, D = x.shape
        y = x.transpose(2, 0, 1, 3).reshape(L, B * H, 1, D)
        y = self.inner(y, offset=offset + depth, **kwargs)
        return y.reshape(L, B, H, D).transpose(1, 2, 0, 3)


def install_tree_hooks(model: nn.Module) -> List[TreeRoPE]:
    """Wrap every attention's ``rope`` (idempotent) and return the wrappers.

    Raises a clear error for position schemes a tree cannot use.
    """
    hooks = getattr(model, "_redrafter_ropes", None)
    if hooks is not None:
        return hooks
    hooks = []
    for _, module in model.named_modules():
        rope = module.get("rope") if isinstance(module, nn.Module) else None
        if rope is None or isinstance(rope, TreeRoPE):
            continue
        name = type(rope).__name__
        if name not in SUPPORTED_ROPES:
            raise RedrafterError(
                f"This model uses {name} positions, which tree verification does not support "
                f"(supported: {', '.join(SUPPORTED_ROPES)}).",
                "Use --no-draft for plain decoding with this model.",
            )
        wrapper = TreeRoPE(rope)
        module.rope = wrapper
        hooks.append(wrapper)
    if not hooks:
        raise RedrafterError(
            f"No RoPE modules found in {type(model).__module__}; ReDrafter needs rotary positions.",
            "Use --no-draft for plain decoding with this model.",
        )
    object.__setattr__(model, "_redrafter_ropes", hooks)
    return hooks


def check_cache(cache) -> None:
    for c in cache:
        if not isinstance(c, SUPPORTED_CACHES):
            raise RedrafterError(
                f"Cache type {type(c).__name__} is not supported by tree verification "
                "(supported: KVCache, QuantizedKVCache, RotatingKVCache).",
                "Use --no-draft for plain decoding with this model.",
            )


def cached_length(c) -> int:
    """Number of cached keys the next multi-token update attends to."""
    if isinstance(c, RotatingKVCache):
        # A multi-token update keeps at most max_size - 1 old tokens.
        return min(c.offset, c.max_size - 1)
    return c.offset


def tree_attention_mask(
    tree_mask: mx.array, depth: mx.array, cached: int, window: Optional[int], valid: Optional[mx.array] = None
) -> mx.array:
    """``[N, cached + N]`` bool mask: every cached key, then the tree's ancestors-or-self.

    With a sliding ``window``, a key is visible only if its position is within
    ``window`` of the query's (as in mlx-lm's ``create_causal_mask``).
    ``valid [cached]`` (the pipelined loop's cache, which holds holes): only
    the cached keys marked valid are visible; windows are not supported then.
    """
    n = tree_mask.shape[0]
    if valid is not None:
        if window is not None:
            raise RedrafterError("A cache with holes cannot serve a sliding-window layer.")
        return mx.concatenate([mx.broadcast_to(valid[None], (n, cached)), tree_mask], axis=1)
    prefix = mx.ones((n, cached), dtype=mx.bool_)
    tree = tree_mask
    if window is not None:
        # cached key i sits at relative position i - cached; node q at depth[q].
        rel = mx.arange(cached, dtype=mx.int32)[None, :] - cached
        prefix = rel > (depth[:, None] - window)
        tree = tree & (depth[None, :] > depth[:, None] - window)
    return mx.concatenate([prefix, tree], axis=1)


@contextmanager
def tree_hooks(model, cache, tree, base: Optional[mx.array] = None, valid: Optional[mx.array] = None,
               chain: bool = False):
    """Inside the block, a model call on ``tree.tokens`` runs as a tree.

    ``base`` and ``valid`` (the pipelined loop): the position of ``g0`` as a
    device scalar, and which cached rows are real tokens. ``chain=True`` (a
    single path) gives consecutive positions from ``base`` without moving
    the token axis.
    """
    ropes = install_tree_hooks(model)
    patched = []
    try:
        for r in ropes:
            r._depth, r._base = (None if chain else tree.depth), base
        for c in cache:
            cached = c.offset if valid is not None else cached_length(c)

            def make_mask(N, return_array=False, window_size=None, _cached=cached):
                return tree_attention_mask(tree.mask, tree.depth, _cached, window_size, valid)

            c.make_mask = make_mask  # shadows the class method for this call only
            patched.append(c)
        yield
    finally:
        for r in ropes:
            r._depth = r._base = None
        for c in patched:
            del c.make_mask


def verify(model, backbone, head, cache, tree, chain: bool = False):
    """One forward over ``tree.tokens``: ``(logits [N, V], hidden [N, h])``.

    ``chain=True`` says the tree is a single path (every beam the same, or
    W=1): its positions and mask are the model's own causal ones, so the
    call runs unhooked, like a prefill chunk.
    """
    if chain:
        hidden = backbone(tree.tokens[None], cache=cache)[0]
        return head(hidden), hidden
    with tree_hooks(model, cache, tree):
        hidden = backbone(tree.tokens[None], cache=cache)[0]
    return head(hidden), hidden


# --------------------------------------------------------------------------- compaction


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
    for c, start in zip(cache, start_offsets):
        map_rows(c, lambda a, start=start: _move_rows(a, start, path))


def map_rows(c, fn) -> None:
    """Apply ``fn`` to each of a layer cache's key and value arrays (a
    quantized cache's are tuples of data, scales and biases, row-aligned)."""
    if isinstance(c, QuantizedKVCache):
        c.keys = tuple(fn(a) for a in c.keys)
        c.values = tuple(fn(a) for a in c.values)
    else:
        c.keys, c.values = fn(c.keys), fn(c.values)


def verify_starts(cache) -> List[int]:
    """Row index of g0 in each layer's buffer after the verify update."""
    return [cached_length(c) for c in cache]


def set_cache_length(cache, starts: List[int], offsets: List[int], kept: int) -> None:
    """After compaction: keep ``kept`` tree rows (g0 + accepted drafts)."""
    for c, start, offset in zip(cache, starts, offsets):
        c.offset = offset + kept
        if isinstance(c, RotatingKVCache):
            # The buffer must end exactly at the last kept row: mlx-lm reads
            # rows past `_idx` as the oldest ones once the window has wrapped.
            c.keys = c.keys[..., : start + kept, :]
            c.values = c.values[..., : start + kept, :]
            c._idx = start + kept
