"""A DFlash drafter as a step's draft source: its context kept in step with
the target, one forward per step, the block's candidates as rows.

The step loop drives it as it drives a layer head (draft/chain.py's
surface: ``extend``, ``draft``, ``close``, ``make_cache``, ``width``,
``source``, ``reads``, ``reads_hidden``):

* :meth:`BlockChain.extend` is told the tokens that entered the target's
  cache and the target's taps at them. A DFlash context entry ``i`` is the
  target's taps at position ``i`` (no pairing with the next token, unlike a
  layer head), so the taps wait, lazily, for the next draft.
* :meth:`BlockChain.draft` appends the waiting context to the drafter's
  cache (keys and values of every layer, :meth:`DFlashDrafter.context`),
  then runs the block ``[g0, mask x L]`` at the positions after it, once.
  The block's own keys are never cached, so nothing is trimmed after a
  draft: the cache holds one entry per token of the target's cache, and a
  rejected draft never enters it.
* :meth:`BlockChain.close` appends what is still waiting, so the cache ends
  where the target's does and relative trims keep them so.

The rows (:func:`block_beams`): one row is the block as a chain (each
position's argmax); ``W`` rows are the top ``W`` paths through the block's
per-position distributions, which under their product are the top ``W``
prefixes at every depth (beam search over independent positions is exact),
so every node of the best-first tree DDTree grows from the per-position
top-K (arXiv 2604.12989) with a budget up to ``W`` is on them. Each node
carries its log-probability (``path_scores``), so ``tree="auto"`` picks the
nodes that pay from them (step/select.py). The rows are deterministic
functions of the drafter's distributions, so the sampling walk over them
(step/accept.py) keeps the target's distribution exactly.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from ..errors import RedrafterError
from .beam import NEG, Beams, top_w

CHUNK = 512  # context positions appended per call (as the target's prefill chunks)


def block_beams(logp: mx.array, width: int, table: Optional[mx.array] = None) -> Beams:
    """The top ``width`` paths through a block's independent per-position
    log-distributions ``logp [L, Vd]`` (best first), lazily; ``table``: the
    draft vocabulary's target ids (None: the target's vocabulary)."""
    length = logp.shape[0]
    if width == 1:
        idx = mx.argmax(logp, axis=-1)
        best = mx.take_along_axis(logp, idx[:, None], axis=-1)[:, 0]
        cum = mx.cumsum(best)[None]
        return Beams(_ids(idx, table)[None], cum[:, -1], path_scores=cum)
    k = min(width, logp.shape[-1])
    top_lp, top_id = _topk(logp, k)  # [L, k] each, best first
    scores = mx.array([0.0] + [NEG] * (width - 1), dtype=mx.float32)
    history = path = None
    for d in range(length):
        total = (scores[:, None] + top_lp[d][None, :]).reshape(-1)
        pick = top_w(total, width)
        parent, scores = pick // k, total[pick]
        tokens = top_id[d][pick % k][:, None]
        history = tokens if history is None else mx.concatenate([history[parent], tokens], axis=1)
        path = scores[:, None] if path is None else mx.concatenate([path[parent], scores[:, None]], axis=1)
    return Beams(_ids(history, table), scores, path_scores=path)


def _topk(logp: mx.array, k: int):
    idx = mx.argsort(-logp, axis=-1)[:, :k]
    return mx.take_along_axis(logp, idx, axis=-1), idx


def _ids(index: mx.array, table: Optional[mx.array]) -> mx.array:
    return index.astype(mx.int32) if table is None else table[index].astype(mx.int32)


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class BlockChain:
    """One generation's DFlash source (see the module doc): ``width`` rows of
    ``length`` drafted tokens per step (``length`` at most the drafter's
    ``block_size - 1``)."""

    reads = 0  # one forward per step, nothing read on the host
    reads_hidden = True

    def __init__(self, drafter, width: int, length: int, controller=None):
        block = drafter.config.block_size
        if controller is not None:
            raise RedrafterError(
                "The adaptive-depth controller decides a chain of draft calls; a DFlash drafter drafts its block "
                "in one call.",
                "Drop --adaptive (controller=) with a DFlash drafter.",
            )
        if length > block - 1:
            raise RedrafterError(
                f"The DFlash drafter drafts blocks of {block} (the last verified token and {block - 1} drafts), "
                f"so it cannot draft {length} tokens per step.",
                f"Use --beam-length {block - 1} or less.",
            )
        self.head, self.width, self.length = drafter, width, length
        self.source = drafter.source
        self.cache: Optional[list] = None
        self._feats: List[mx.array] = []  # context waiting for the next draft: the target's taps, [k, F] each
        self._waiting = 0

    def make_cache(self) -> list:
        return self.head.make_cache()

    def extend(self, tokens: List[int], features: Optional[mx.array] = None) -> None:
        """``tokens`` entered the target's cache; ``features [len, F]`` are its taps there."""
        if not tokens:
            return
        self._feats.append(features)
        self._waiting += features.shape[0]
        while self._waiting > CHUNK:
            self._feed(CHUNK)
            mx.eval([c.state for c in self.cache])

    def draft(self, g0: int) -> Beams:
        """The next step's rows after ``g0`` (lazy): the waiting context
        appended, then the block ``[g0, mask x length]`` drafted in one forward."""
        self._feed(self._waiting)
        mask = self.head.config.mask_token_id
        block = mx.array([[g0] + [mask] * self.length], mx.int32)
        logp = _log_softmax(self.head.block_logits(block, self.cache)[0])
        return block_beams(logp, self.width, self.head.draft_to_target)

    def close(self) -> None:
        """Append what is waiting (lazily): the cache then ends where the target's does."""
        self._feed(self._waiting)

    def _feed(self, n: int) -> None:
        if not n:
            return
        every = mx.concatenate(self._feats, axis=0) if len(self._feats) > 1 else self._feats[0]
        self.head.context(every[None, :n], self.cache)
        rest = every[n:]
        self._feats, self._waiting = ([rest] if rest.shape[0] else []), self._waiting - n
