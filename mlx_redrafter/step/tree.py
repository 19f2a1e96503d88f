"""Dynamic tree attention: merge the beams' shared prefixes into one packed beam.

Pure array functions over ``beams [W, L]`` (drafted tokens; the LLM's token
``g0`` is the implicit root shared by every beam). The packed sequence that
the LLM verifies is ``[g0] + packed``; index 0 is ``g0`` and index ``n >= 1``
is a unique prefix. Nodes are ordered depth-major (all depth-1 nodes, then
depth-2, ...; beam order within a depth) by default; ``order="beam"`` gives the
official row-major order. Any topological order is valid because the mask is
explicit.

Beams may have different lengths: a negative token (``PAD``) after a beam's
last token is padding. Padding is no node (it is not counted or packed), its
``node_index`` is 0, and acceptance never takes it (no LLM token is negative).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from ..config import PAD  # noqa: F401  (padding after the end of a shorter beam; re-exported)


@dataclass
class Tree:
    tokens: mx.array  # [N+1] g0 followed by the packed unique nodes
    depth: mx.array  # [N+1] 0 for g0, j+1 for a node at beam position j
    parent: mx.array  # [N+1] packed index of each node's parent (g0's is 0)
    node_index: mx.array  # [W, L] packed index of beam w's token at position j
    mask: mx.array  # [N+1, N+1] bool, [q, k] = k is q or an ancestor of q
    levels: int = 0  # depth + 1 if the builder knows it on the host (recurrent layers scan this many steps), else 0
    host: tuple = None  # (depths, parents) of every node when the builder knows them on the host (step/mixers.py)

    @property
    def size(self) -> int:
        """Number of tokens the LLM verifies (g0 included)."""
        return self.tokens.shape[0]


def prefix_tree(beams: mx.array) -> mx.array:
    """``[W, L]``: the smallest beam index sharing ``beams[w, :j+1]`` (official ``_dedup_prefix``)."""
    eq = (beams[:, None, :] == beams[None, :, :]).astype(mx.int32)
    same_prefix = mx.cumprod(eq, axis=-1)  # [W, W, L]
    return mx.argmax(same_prefix, axis=1).astype(mx.int32)


def unique_mask(beams: mx.array) -> mx.array:
    """``[W, L]`` bool: True where ``beams[w, :j+1]`` is seen first in beam ``w``."""
    width = beams.shape[0]
    return prefix_tree(beams) == mx.arange(width, dtype=mx.int32)[:, None]


def count_nodes(beams: mx.array, depth=None) -> mx.array:
    """Number of distinct prefixes (lazy scalar): the packed size without g0.

    With ``depth`` (a lazy scalar), only the first ``depth`` positions count:
    the size of the tree of ``beams[:, :depth]``.
    """
    unique = unique_mask(beams)
    if depth is not None:
        unique = unique & (mx.arange(beams.shape[1])[None, :] < depth)
    return unique.sum()


def count_rows(rows) -> int:
    """Host-side :func:`count_nodes` of a list of beams (lists of ints; PAD ends a beam)."""
    prefixes = set()
    for row in rows:
        for j, t in enumerate(row):
            if t < 0:
                break
            prefixes.add(tuple(row[: j + 1]))
    return len(prefixes)


def _order_keys(width: int, length: int, order: str) -> mx.array:
    w = mx.arange(width, dtype=mx.int32)[:, None]
    j = mx.arange(length, dtype=mx.int32)[None, :]
    if order == "depth":
        return j * width + w
    if order == "beam":
        return w * length + j
    raise ValueError(f"unknown packing order {order!r}")


def pack(beams: mx.array, n_nodes: int, g0: mx.array, order: str = "depth", padded: bool = False) -> Tree:
    """Pack ``beams`` into a tree of ``n_nodes`` unique nodes after ``g0``.

    ``n_nodes`` must equal ``count_nodes(beams)`` (``count_rows`` for padded
    beams); it is a host integer so that the verify call has a static shape
    (the generation loop reads it in the same sync that reads the accepted
    length). ``padded=True`` allows ``PAD`` after a beam's end (a few more
    ops, so equal-length drafter beams skip it).
    """
    width, length = beams.shape
    first = prefix_tree(beams)
    unique = first == mx.arange(width, dtype=mx.int32)[:, None]
    if padded:
        unique = unique & (beams >= 0)
    keys = _order_keys(width, length, order)
    big = width * length
    sort_keys = mx.where(unique, keys, keys + big).reshape(-1)
    perm = mx.argsort(sort_keys)[:n_nodes]  # flat (w*L + j) of the packed nodes
    rank = mx.argsort(mx.argsort(sort_keys))  # flat -> position in sorted order
    canonical = first * length + mx.arange(length, dtype=mx.int32)[None, :]
    node_index = (rank[canonical.reshape(-1)].reshape(width, length) + 1).astype(mx.int32)
    if padded:
        node_index = mx.where(beams >= 0, node_index, 0)

    flat_tokens = beams.reshape(-1)
    tokens = mx.concatenate([g0.reshape(1).astype(beams.dtype), flat_tokens[perm]])
    node_beam = mx.concatenate([mx.zeros((1,), mx.int32), (perm // length).astype(mx.int32)])
    node_pos = (perm % length).astype(mx.int32)
    depth = mx.concatenate([mx.zeros((1,), mx.int32), node_pos + 1])
    parent_pos = mx.maximum(node_pos - 1, 0)
    parent = mx.where(node_pos > 0, node_index[node_beam[1:], parent_pos], 0)
    parent = mx.concatenate([mx.zeros((1,), mx.int32), parent.astype(mx.int32)])
    mask = ancestor_mask(node_index, node_beam, depth)
    return Tree(tokens, depth, parent, node_index, mask, levels=length + 1)


def ancestor_mask(node_index: mx.array, node_beam: mx.array, depth: mx.array) -> mx.array:
    """``[N+1, N+1]`` bool: ``k`` is ``q`` itself or one of its ancestors.

    ``k`` (at depth ``d_k >= 1``) is an ancestor-or-self of ``q`` iff it is the
    node at position ``d_k - 1`` of ``q``'s beam and ``d_k <= d_q``. g0 is the
    ancestor of everything.
    """
    n = depth.shape[0]
    col = mx.maximum(depth - 1, 0)
    along_beam = node_index[node_beam[:, None], col[None, :]]  # [q, k]
    idx = mx.arange(n, dtype=mx.int32)
    mask = (along_beam == idx[None, :]) & (depth[None, :] <= depth[:, None])
    return mask | (idx[None, :] == 0)


# --------------------------------------------------------------------------- unpacked trees


@dataclass
class Layout:
    """A tree whose rows share no nodes: row ``r`` owns ``lengths[r]`` nodes.

    The pipelined loop verifies these: their size (``1 + sum(lengths)``) is
    known before the beams are, so the next verify can be built while the
    current one runs. Shared prefixes are verified twice (each copy gets the
    same logits), which costs compute but no sync. Nodes are row-major:
    row ``r``'s token ``j`` is node ``1 + sum(lengths[:r]) + j``.
    """

    lengths: tuple
    node_row: mx.array  # [N] row of each node after g0
    node_pos: mx.array  # [N] position of each node in its row
    node_index: mx.array  # [R, L] node of row r's token j (0 past the row's end)
    depth: mx.array  # [N+1]
    parent: mx.array  # [N+1]
    mask: mx.array  # [N+1, N+1]
    host: tuple = None  # (depths, parents) on the host: g0's parent is -1

    @property
    def size(self) -> int:
        return self.depth.shape[0]

    def tree(self, beams: mx.array, g0: mx.array) -> Tree:
        """The :class:`Tree` of ``beams [R, L]`` (PAD past each row's end) under ``g0``.

        A PAD inside a row's length (a lookup draft that did not line up) is
        fed to the model as token 0; acceptance never takes it.
        """
        nodes = beams[self.node_row, self.node_pos]
        tokens = mx.concatenate([g0.reshape(1).astype(beams.dtype), mx.maximum(nodes, 0)])
        return Tree(
            tokens, self.depth, self.parent, self.node_index, self.mask, levels=max(self.lengths) + 1, host=self.host
        )


@functools.lru_cache(maxsize=64)
def layout(lengths: tuple) -> Layout:
    """The :class:`Layout` of rows of these lengths (cached: the loop reuses a few)."""
    import numpy as np

    width, length = len(lengths), max(lengths)
    node_index = np.zeros((width, length), np.int32)
    rows, pos = [], []
    for r, n in enumerate(lengths):
        for j in range(n):
            node_index[r, j] = 1 + len(rows)
            rows.append(r)
            pos.append(j)
    depth = np.array([0] + [j + 1 for j in pos], np.int32)
    parent = np.array([0] + [node_index[r, j - 1] if j else 0 for r, j in zip(rows, pos)], np.int32)
    node_beam = mx.array([0] + rows, mx.int32)
    ni, dep = mx.array(node_index), mx.array(depth)
    lay = Layout(
        tuple(lengths),
        mx.array(rows, mx.int32),
        mx.array(pos, mx.int32),
        ni,
        dep,
        mx.array(parent),
        ancestor_mask(ni, node_beam, dep),
        (tuple(depth.tolist()), (-1,) + tuple(parent[1:].tolist())),
    )
    # Evaluated here, once: a lazy array cached by one thread cannot be
    # evaluated by another (MLX's streams are per thread), and the server's
    # worker thread reuses layouts a caller's thread made.
    mx.eval(lay.node_row, lay.node_pos, lay.node_index, lay.depth, lay.parent, lay.mask)
    return lay


def merged_parent(lay: Layout, beams: mx.array) -> mx.array:
    """``[N+1]``: each node's parent in the merged tree of ``beams``.

    In an unpacked tree a row that repeats an earlier row's prefix has its
    own copies of those nodes; the sampling walk visits only the first row
    to reach a prefix (:func:`unique_mask`), so a node's parent is the
    first row's node at the depth above.
    """
    first = prefix_tree(beams)
    canon = lay.node_index[first, mx.arange(beams.shape[1])[None, :]]
    pos = lay.node_pos
    parents = mx.where(pos > 0, canon[lay.node_row, mx.maximum(pos - 1, 0)], 0)
    return mx.concatenate([mx.zeros((1,), mx.int32), parents.astype(mx.int32)])
