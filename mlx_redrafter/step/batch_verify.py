"""Verify the draft trees of a batch of rows in one forward pass.

Each row of a batch (a request of ``serve``) brings its own tree: the packed
tree of its drafts (:func:`~mlx_redrafter.step.tree.pack`, as a row alone
builds it) or its next token alone. :func:`stack_trees` pads them to the
widest: a padding slot is a node of its own under the root (its token 0),
which no beam holds, so acceptance never takes it. One call of the
unmodified mlx-lm model verifies them all, through the hooks a single tree
uses (step/verify.py), batched:

* **Mask** ``[B, 1, N, K + N]``: row ``b`` sees the buffer columns holding
  its own tokens (its left padding and whatever lies after its end are
  hidden: the batch is ragged, llm/batch_cache.py), then its tree's
  ancestors-or-self.
* **Positions**: row ``b``'s node ``i`` sits at ``offset[b] + depth[b, i]``
  (``offset``: the row's token count, which ``BatchKVCache`` keeps per row).
* **Recurrent layers** (hybrids): :class:`BatchTreeMixer` runs every node of
  every row from its own row's state, along its path, and keeps every node's
  state until acceptance takes each row's own.

Acceptance runs per row with the single row's functions (step/accept.py,
step/grammar.py), so each row accepts its own prefix and the accepted
lengths are ragged; llm/batch_cache.py then moves each row's accepted path
into place.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..errors import RedrafterError
from ..llm.batch_cache import Ragged, prefix_mask
from ..llm.recurrent import kv_leaves
from .accept import Accepted, accept_greedy, accept_sampling, target_probs
from .grammar import apply_mask
from .mixers import NodeStates, TreeMixer, TreePaths, _bind
from .tree import Tree
from .verify import install_tree_hooks


@dataclass
class RowTree:
    """One row's part of a batched verification: its packed ``tree`` and
    ``beams`` (None: its next token ``g0`` alone) and the tree's size."""

    g0: mx.array
    tree: Optional[Tree] = None
    beams: Optional[mx.array] = None

    @property
    def size(self) -> int:
        return self.tree.size if self.tree is not None else 1

    @property
    def depth(self) -> int:
        """The deepest draft (the accepted path holds ``depth + 1`` nodes at most)."""
        return self.beams.shape[1] if self.tree is not None else 0


@dataclass
class BatchTree:
    """The rows' trees padded to the widest: ``tokens``, ``depth`` ``[B, N]``,
    ``mask [B, N, N]`` (``[b, q, k]``: ``k`` is ``q`` or an ancestor of it)."""

    tokens: mx.array
    depth: mx.array
    mask: mx.array
    rows: List[RowTree]
    levels: int  # the deepest row's depth + 1

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


def stack_trees(rows: Sequence[RowTree]) -> BatchTree:
    """The rows' trees in one ``[B, N]`` batch (see the module doc for the padding)."""
    width = max(r.size for r in rows)
    idx = mx.arange(width)
    pad_mask = (idx[:, None] == idx[None, :]) | (idx[None, :] == 0)  # a padding slot: the root and itself
    tokens, depths, masks = [], [], []
    for r in rows:
        n = r.size
        if r.tree is None:
            tok, dep, mask = r.g0.reshape(1).astype(mx.int32), mx.zeros((1,), mx.int32), mx.ones((1, 1), mx.bool_)
        else:
            tok, dep, mask = r.tree.tokens.astype(mx.int32), r.tree.depth.astype(mx.int32), r.tree.mask
        if n < width:
            tok = mx.concatenate([tok, mx.zeros((width - n,), mx.int32)])
            dep = mx.concatenate([dep, mx.ones((width - n,), mx.int32)])
            full = mx.array(pad_mask)
            full[:n, :n] = mask
            mask = full
        tokens.append(tok)
        depths.append(dep)
        masks.append(mask)
    levels = 1 + max(r.depth for r in rows)
    return BatchTree(mx.stack(tokens), mx.stack(depths), mx.stack(masks), list(rows), levels)


def batch_attention_mask(bt: BatchTree, ragged: Ragged, cached: int) -> mx.array:
    """``[B, 1, N, cached + N]`` bool: each row's own cached tokens, then its tree."""
    b, n = bt.tokens.shape
    prefix = mx.broadcast_to(prefix_mask(ragged, cached)[:, None, :], (b, n, cached))
    return mx.concatenate([prefix, bt.mask], axis=2)[:, None]


class BatchTreeMixer(TreeMixer):
    """A recurrent mixer during a batched verify call: the ``B x N`` nodes run
    as one flat tree (``paths`` over the flattened nodes), each from its own
    row's state (``rows [B * N]``); every node's state waits in ``pending``
    (llm/batch_cache.py ``take_row_states`` keeps each row's accepted one)."""

    def __init__(self, inner, paths: TreePaths, rows: mx.array):
        super().__init__(inner, paths)
        self._rows = rows

    def __call__(self, *args, **kwargs):
        x, cache = _bind(self.inner, args, kwargs)
        b, n = x.shape[:2]
        proxy = ArraysCache(len(cache.cache))
        proxy.cache = [None if e is None else e[self._rows] for e in cache.cache]
        run = self._steps if self._stepwise else self._padded
        out = run(x.reshape(b * n, *x.shape[2:]), proxy)
        cache.pending = NodeStates(proxy.cache)
        return out.reshape(b, n, *out.shape[1:])


def flat_paths(bt: BatchTree) -> TreePaths:
    """Every row's node paths (step/mixers.py ``TreePaths``) over the flattened ``[B * N]`` nodes."""
    b, n = bt.tokens.shape
    per_row = [TreePaths.of(bt.mask[i], bt.depth[i], bt.levels) for i in range(b)]
    path = mx.concatenate([p.path + i * n for i, p in enumerate(per_row)])
    return TreePaths(path, mx.concatenate([p.real for p in per_row]), mx.concatenate([p.depth for p in per_row]))


@contextmanager
def batch_tree_hooks(model, cache, bt: BatchTree, ragged: Ragged):
    """Inside the block, a model call on ``bt.tokens`` verifies every row's tree (see the module doc)."""
    hooks = install_tree_hooks(model)
    patched, swapped = [], []
    try:
        for r in hooks.ropes:
            r._depth = bt.depth  # two-dimensional: per row and token (step/verify.py TreeRoPE)
        mask = None
        for c in kv_leaves(cache):
            if mask is None:
                mask = batch_attention_mask(bt, ragged, c._idx)

            def make_mask(N, return_array=False, window_size=None, _mask=mask, **kwargs):
                if window_size is not None:
                    raise RedrafterError("A sliding-window layer cannot verify a batch of trees.")
                return _mask

            c.make_mask = make_mask  # shadows the class method for this call only
            patched.append(c)
        if hooks.mixers and bt.width > 1:  # one token a row: the mixers' own batched step is exact
            paths, b, n = flat_paths(bt), *bt.tokens.shape
            rows = mx.repeat(mx.arange(b, dtype=mx.int32), n)
            for parent, name, mixer in hooks.mixers:
                setattr(parent, name, BatchTreeMixer(mixer, paths, rows))
                swapped.append((parent, name, mixer))
        yield
    finally:
        for r in hooks.ropes:
            r._depth = None
        for c in patched:
            del c.make_mask
        for parent, name, mixer in swapped:
            setattr(parent, name, mixer)


def verify_batch(model, backbone, head, cache, bt: BatchTree, ragged: Ragged):
    """One forward over every row's tree: ``(logits [B, N, V], hidden [B, N, h])``, lazily.

    One token a row, every row ending at the buffer's end (a plain step,
    llm/batch_cache.py ``align_rows``), is mlx-lm's own batched decoding
    step: its masks and positions are the cache's, so no hook is installed
    (the hooks' per-row positions and mask cost a 4-row plain step 1-2%
    on a CPU, bench/batch_plain.py)."""
    if bt.width == 1 and ragged.aligned:
        hidden = backbone(bt.tokens, cache=cache)
    else:
        with batch_tree_hooks(model, cache, bt, ragged):
            hidden = backbone(bt.tokens, cache=cache)
    return head(hidden), hidden


# --------------------------------------------------------------------------- acceptance, per row


def draw(logits: mx.array, sampling, key: Optional[mx.array]) -> mx.array:
    """The next token from one position's logits: the argmax, or a draw from
    the target distribution (step/accept.py ``target_probs``) with ``key``."""
    if sampling.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    return mx.random.categorical(mx.log(target_probs(logits, sampling)), key=key).astype(mx.int32)


def accept_row(row: RowTree, logits: mx.array, sampling, key=None, masks: Optional[mx.array] = None) -> Accepted:
    """Row ``row``'s acceptance over its own logits ``[N, V]`` (its padding
    slots cut off), exactly as a row alone accepts: greedy, or the sampling
    walk with the row's own ``key``; ``masks`` (its grammar's, one per node)
    mask the logits first (step/grammar.py ``accept_constrained``)."""
    logits = logits[: row.size]
    if masks is not None:
        logits = apply_mask(logits, masks)
    if row.tree is None:
        zero = mx.array(0, mx.int32)
        return Accepted(zero, zero, mx.zeros((1,), mx.int32), zero, draw(logits[0], sampling, key))
    if sampling.greedy:
        return accept_greedy(row.beams, row.tree.node_index, logits)
    return accept_sampling(row.beams, row.tree, logits, sampling, key=key)


def padded_paths(accs: Sequence[Accepted], length: int) -> mx.array:
    """``[B, length]`` accepted paths (each padded with its last node: moving it twice is harmless)."""
    out = []
    for a in accs:
        p = a.path.astype(mx.int32)
        if p.shape[0] < length:
            p = mx.concatenate([p, mx.broadcast_to(p[-1:], (length - p.shape[0],))])
        out.append(p)
    return mx.stack(out)
