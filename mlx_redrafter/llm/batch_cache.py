"""The caches of a batch of rows verified together, each keeping its own accepted tokens.

mlx-lm batches caches for plain decoding: ``BatchKVCache`` keeps rows
left-padded, every one ending at the buffer's end; ``ArraysCache`` holds one
recurrent state per row. A batched tree verification
(step/batch_verify.py) appends every row's tree at the buffer's end and
each row keeps its own number of those tokens, so rows end in different
places (ragged): row ``b`` holds its tokens at ``[left[b], left[b] +
lengths[b])``; what lies after them up to the buffer's end is hidden by
every mask of the batch (the verify calls shadow ``make_mask``). ``offset``
keeps mlx-lm's meaning, each row's token count (RoPE reads it). mlx-lm's
``extend`` (rows joining) and ``filter`` (rows leaving) move a row's tokens
together with its left padding, so they keep this layout;
:func:`extract_row` takes one row out (mlx-lm's ``extract`` would take
everything up to the buffer's end).

:class:`Ragged` mirrors on the host where each row starts and how many
tokens it holds, so that masks and compaction need no read of the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList, KVCache

from ..errors import RedrafterError
from .recurrent import kv_leaves, leaves, recurrent_leaves

# The layer caches a batch of trees runs on (a sliding window's rotating
# cache, a quantized one, cannot: their rows are not moved per row here).
BATCHABLE = (KVCache, ArraysCache)


@dataclass
class Ragged:
    """Host mirror of a ragged batch: each row's left padding and token count."""

    left: List[int] = field(default_factory=list)
    lengths: List[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        """Where the buffer's used part ends: the longest row's end."""
        return max((a + n for a, n in zip(self.left, self.lengths)), default=0)

    @property
    def aligned(self) -> bool:
        """Whether every row ends where the longest does (mlx-lm's own layout: left padding only)."""
        end = self.end
        return all(a + n == end for a, n in zip(self.left, self.lengths))

    def __len__(self) -> int:
        return len(self.lengths)


def can_batch_rows(cache) -> bool:
    """Whether a row's cache can join a batch of trees: every layer a plain
    ``KVCache`` or a recurrent ``ArraysCache`` (``CacheList`` members too)."""
    return all(type(c) in BATCHABLE for c in leaves(cache))


def _merged(caches: Sequence[list]) -> list:
    """mlx-lm's batched caches of single rows (``merge`` layer by layer)."""
    return [caches[0][i].merge([c[i] for c in caches]) for i in range(len(caches[0]))]


def _sync_left(batch, ragged: Ragged) -> None:
    kv = kv_leaves(batch)
    if kv:
        ragged.left = [int(x) for x in kv[0].left_padding.tolist()]
    else:
        ragged.left = [0] * len(ragged.lengths)


def fit_rows(batch, ragged: Ragged) -> None:
    """Every attention layer's offsets and used length from the host mirror
    (after :attr:`Ragged.lengths` changed: a row forgets its last tokens)."""
    offsets, end = mx.array(ragged.lengths, mx.int32), ragged.end
    for c in kv_leaves(batch):
        c.offset = offsets
        c._idx = end  # mlx-lm's private write index: the next tokens go right after the longest row


def join_rows(batch: list, ragged: Ragged, caches: Sequence[list], lengths: Sequence[int]) -> list:
    """Add rows to ``batch`` (``[]``: a new batch): ``caches`` are single
    rows' caches (the model's only) holding ``lengths`` tokens each. Returns
    the batch (a new list when it was empty); ``ragged`` follows."""
    for cache in caches:
        if not can_batch_rows(cache):
            kinds = sorted({type(c).__name__ for c in leaves(cache)})
            raise RedrafterError(
                f"A cache of {', '.join(kinds)} cannot join a batch of draft trees.",
                "Serve this model with plain batched decoding.",
            )
    merged = _merged(caches)
    if not batch:
        batch = merged
    else:
        for c, m in zip(batch, merged):
            c.extend(m)
    ragged.lengths = ragged.lengths + list(lengths)
    _sync_left(batch, ragged)
    fit_rows(batch, ragged)
    return batch


def drop_rows(batch: list, ragged: Ragged, keep: Sequence[int]) -> None:
    """Keep only rows ``keep`` (in that order); mlx-lm's ``filter`` also drops
    the left padding every kept row shares."""
    keep = list(keep)
    if not keep:
        batch.clear()
        ragged.left, ragged.lengths = [], []
        return
    for c in batch:
        c.filter(keep)
    ragged.lengths = [ragged.lengths[i] for i in keep]
    _sync_left(batch, ragged)
    fit_rows(batch, ragged)


def extract_row(batch: list, ragged: Ragged, b: int) -> list:
    """Row ``b``'s own caches (``KVCache`` and ``ArraysCache``), holding its tokens and nothing after them."""
    start, n = ragged.left[b], ragged.lengths[b]

    def one(c):
        if isinstance(c, CacheList):
            return CacheList(*(one(m) for m in c.caches))
        if isinstance(c, BatchKVCache):
            out = KVCache()
            if c.keys is not None and n:
                out.keys = mx.contiguous(c.keys[b : b + 1, :, start : start + n])
                out.values = mx.contiguous(c.values[b : b + 1, :, start : start + n])
                out.offset = n
            return out
        return c.extract(b)

    return [one(c) for c in batch]


def prefix_mask(ragged: Ragged, width: int) -> mx.array:
    """``[B, width]`` bool: the buffer columns that hold each row's tokens."""
    cols = np.arange(width)[None, :]
    left = np.array(ragged.left)[:, None]
    return mx.array((cols >= left) & (cols < left + np.array(ragged.lengths)[:, None]))


def path_columns(batch: list, start: int, paths: mx.array) -> list:
    """After a verify call wrote every row's tree at buffer column ``start``:
    each attention layer's keys and values of every row's accepted path
    (``paths [B, P]``, tree indices: 0 is its root, then the accepted nodes,
    padded with anything), lazily. Evaluate them with the step's read, so
    that :func:`place_paths` then writes into buffers nothing else holds
    (in place; while a gather of a buffer is pending, a write into it copies
    the whole buffer: about a fifth of a 4-row step on this CPU)."""
    src = start + paths.astype(mx.int32)
    rows = mx.arange(paths.shape[0], dtype=mx.int32)[:, None]
    return [(c.keys[rows, :, src], c.values[rows, :, src]) for c in kv_leaves(batch)]


def place_paths(batch: list, ragged: Ragged, columns: list, kept: Sequence[int]) -> None:
    """Row ``b``'s accepted path (:func:`path_columns`) moves right after its
    tokens, and it keeps ``kept[b]`` of them."""
    if columns:
        width = columns[0][0].shape[1]
        ends = mx.array([a + n for a, n in zip(ragged.left, ragged.lengths)], mx.int32)
        dst = ends[:, None] + mx.arange(width, dtype=mx.int32)[None, :]
        rows = mx.arange(dst.shape[0], dtype=mx.int32)[:, None]
        for c, (keys, values) in zip(kv_leaves(batch), columns):
            c.keys[rows, :, dst] = keys
            c.values[rows, :, dst] = values
    ragged.lengths = [n + k for n, k in zip(ragged.lengths, kept)]
    fit_rows(batch, ragged)


def align_rows(batch: list, ragged: Ragged) -> None:
    """Move each row's tokens so that every row ends where the longest does
    (more left padding), lazily: one gather of the buffer, once, after
    drafting steps left the rows' ends ragged. Then a step of one token a row
    writes each row's token in place (:func:`advance_rows`), with no move."""
    end = ragged.end
    shift = [end - (a + n) for a, n in zip(ragged.left, ragged.lengths)]
    if not any(shift):
        return
    left = [a + s for a, s in zip(ragged.left, shift)]
    for c in kv_leaves(batch):
        if c.keys is not None:
            width = c.keys.shape[2]
            src = mx.arange(width, dtype=mx.int32)[None, :] - mx.array(shift, mx.int32)[:, None]
            src = mx.clip(src, 0, width - 1)[:, None, :, None]  # columns before a row's start: anything
            c.keys = mx.take_along_axis(c.keys, src, axis=2)
            c.values = mx.take_along_axis(c.values, src, axis=2)
        c.left_padding = mx.array(left, mx.int32)
    ragged.left = left
    fit_rows(batch, ragged)


def advance_rows(batch: list, ragged: Ragged) -> None:
    """After a verify call of one token a row, written where every row ends
    (:func:`align_rows`): each row keeps it, in place."""
    ragged.lengths = [n + 1 for n in ragged.lengths]
    fit_rows(batch, ragged)


def take_row_states(batch: list, nodes: mx.array) -> None:
    """After a verify call through the recurrent layers: row ``b``'s state
    becomes that of node ``nodes[b]`` (indices into the flattened ``[B * N]``
    nodes of the call, step/batch_verify.py), lazily."""
    index = nodes.reshape(-1).astype(mx.int32)
    for c in recurrent_leaves(batch):
        pending = getattr(c, "pending", None)
        if pending is not None:
            c.cache = pending.take(index)
            c.pending = None
