"""Acceptance over the verified tree: which drafted tokens the LLM keeps.

Everything is lazy; the generation loop reads the result in its one sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .tree import unique_mask


@dataclass
class Accepted:
    n: mx.array  # scalar int32: accepted drafts (0..L)
    beam: mx.array  # scalar int32: the beam they come from
    path: mx.array  # [L+1] packed indices: g0, then the accepted nodes (valid padding after)
    last: mx.array  # scalar int32: packed index of the last accepted node
    next_token: mx.array  # scalar int32: the LLM's own token after the last accepted node


def _path(node_index: mx.array, beam: mx.array, n: mx.array) -> mx.array:
    """g0 then beam's nodes; positions past ``n`` repeat the last accepted node."""
    length = node_index.shape[1]
    nodes = mx.concatenate([mx.zeros((1,), mx.int32), node_index[beam]])
    pos = mx.minimum(mx.arange(length + 1), n)
    return nodes[pos]


def accept_greedy(beams: mx.array, node_index: mx.array, logits: mx.array) -> Accepted:
    """Greedy acceptance: a node is kept if its token is the argmax of its
    parent's logits and its parent is kept; the deepest kept node wins
    (lowest beam index on ties, like the official code). Padding (a negative
    token) never equals an argmax, so it ends a run."""
    pred = mx.argmax(logits, axis=-1).astype(mx.int32)  # [N+1]
    parents = mx.concatenate([mx.zeros((beams.shape[0], 1), mx.int32), node_index[:, :-1]], axis=1)
    correct = (beams == pred[parents]).astype(mx.int32)
    run = mx.cumprod(correct, axis=1).sum(axis=1)  # [W]
    beam = mx.argmax(run).astype(mx.int32)
    n = run[beam].astype(mx.int32)
    path = _path(node_index, beam, n)
    last = path[-1]
    return Accepted(n, beam, path, last, pred[last])


# --------------------------------------------------------------------------- sampling


def target_probs(logits: mx.array, sampling) -> mx.array:
    """The distribution mlx-lm's sampler draws from, as probabilities.

    Same transform as ``mlx_lm.sample_utils.make_sampler``: normalize to
    log-probabilities, apply top-p, min-p and top-k (in that order) with
    mlx-lm's own functions, then divide by the temperature.
    """
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    return mx.softmax(filtered_logprobs(logprobs, sampling) * (1.0 / sampling.temp), axis=-1)


def filtered_logprobs(logprobs: mx.array, sampling) -> mx.array:
    """``logprobs`` through mlx-lm's sampler filters, as ``make_sampler``
    chains them: top-p, min-p, then top-k (mlx-lm's own functions)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    if 0 < sampling.top_p < 1.0:
        logprobs = apply_top_p(logprobs, sampling.top_p)
    if sampling.min_p != 0.0:
        logprobs = apply_min_p(logprobs, sampling.min_p)
    if sampling.top_k > 0:
        logprobs = apply_top_k(logprobs, sampling.top_k)
    return logprobs


def sample_first(logits: mx.array, sampling) -> mx.array:
    """The token after the prompt: argmax, or a draw from the target distribution."""
    if sampling.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    return mx.random.categorical(mx.log(target_probs(logits, sampling))).astype(mx.int32)


def accept_sampling(beams: mx.array, tree, logits: mx.array, sampling, key=None) -> Accepted:
    """Distribution-exact acceptance over a deterministic draft tree.

    Walk from g0. At a node with target ``p``, test its children in beam
    order: accept child ``d`` with probability ``p(d)``; on rejection remove
    ``d`` from ``p`` and renormalize. Descend into an accepted child (its own
    target becomes ``p``); when every child is rejected, stop. The emitted
    token is drawn from the final ``p``. Beam drafts are point masses, so this
    is speculative sampling applied to siblings in turn, and the output has
    exactly the target distribution. Shapes are fixed (a ``W x L`` unrolled
    walk) and nothing syncs. ``key``: the walk's own random key (a row of a
    batch, step/batch_verify.py), else the global random state.
    """
    width, length = beams.shape
    target = target_probs(logits, sampling)  # [N+1, V]
    k_u, k_g = mx.random.split(key) if key is not None else (None, None)  # issue 57: a batch row's own key
    u = mx.random.uniform(shape=(length, width), key=k_u)
    gumbel = mx.random.gumbel(shape=(target.shape[-1],), key=k_g)
    n, beam, last, token = walk_tree(beams, tree.node_index, tree.parent, target, u, gumbel)
    return Accepted(n, beam, _path(tree.node_index, beam, n), last, token)


def walk_tree(beams, node_index, parent, target, u, gumbel):
    """The sampling walk as a pure function of its random inputs.

    ``target [N+1, V]``: target distribution after each node; ``u [..., L, W]``
    uniforms for the tests; ``gumbel [..., V]`` noise for the final draw
    (Gumbel-max). Leading ``...`` axes run independent walks over the same
    tree (the generation loop uses none; tests use many). Padding (``PAD``)
    is never a child, not even at depth 0 (a lookup row of the pipelined
    loop that did not line up is all padding). Returns
    ``(n, beam, last, token)``: accepted drafts, the beam they lie on, the
    last accepted node and the emitted token.
    """
    width, length = beams.shape
    batch = u.shape[:-2]
    unique = unique_mask(beams) & (beams >= 0)  # beam w is the first to reach its node at depth j
    vocab = mx.arange(target.shape[-1])
    cur = mx.zeros(batch, mx.int32)
    beam = mx.zeros(batch, mx.int32)
    n = mx.zeros(batch, mx.int32)
    done = mx.zeros(batch, mx.bool_)
    p = mx.broadcast_to(target[0], (*batch, target.shape[-1]))
    for d in range(length):
        moved = mx.zeros(batch, mx.bool_)
        for w in range(width):
            node = node_index[w, d]
            tok = beams[w, d]
            is_child = ~done & ~moved & unique[w, d] & (parent[node] == cur)
            p_tok = mx.take(p, tok, axis=-1)
            ok = is_child & (u[..., d, w] < p_tok)
            rejected = is_child & ~ok
            residual = mx.where(vocab == tok, 0.0, p) / mx.maximum(1.0 - p_tok, 1e-12)[..., None]
            p = mx.where(ok[..., None], target[node], mx.where(rejected[..., None], residual, p))
            cur = mx.where(ok, node, cur)
            beam = mx.where(ok, w, beam)
            n = mx.where(ok, d + 1, n)
            moved = moved | ok
        done = done | ~moved
    token = mx.argmax(mx.log(p) + gumbel, axis=-1).astype(mx.int32)
    return n, beam, cur, token
