"""A draft source with state, kept in step with the target: a layer head
(draft/head.py: a native MTP head, an EAGLE-3 head) or a small draft model
(draft/draft_model.py).

Such a source has its own cache, which must hold what the target's holds:

* a **draft model** reads the same tokens as the target: its cache holds one
  entry per token in the target's cache;
* a **layer head** pairs each token with the target's features at the
  position before it, ``(t[i+1], h[i])``: its entry ``i`` needs the token
  after position ``i`` (so it lags the target by one) and the target's
  hidden state there (so it can only be computed from a forward of the target
  that kept it: this generation's prefill and verify calls).

The step loop tells the chain which tokens entered the target's cache, with
the target's features at them, once the step's read has brought the
accepted length to the host (:meth:`Chain.extend`), and asks it for the next
step's beams from the LLM's next token ``g0`` (:meth:`Chain.draft`). Both
build lazy graphs and read nothing: the loop's one read per step is
unchanged, except under an adaptive-depth controller (RADAR), whose
decision on each depth is read on the host (draft/controller.py
``DepthGate``), so that no deeper call follows a stop. ``draft`` feeds the
pending tokens and ``g0`` in one call (``g0`` always enters the target's
cache, so its entry is kept), then chains the
head to depth L in copies of the cache, or in the cache itself and trimmed
back (one beam, trimmable caches): a rejected draft never stays in a cache.
:meth:`Chain.close` feeds what is still pending when the generation ends,
so the source's cache ends where the target's does (a head one entry
earlier), and relative trims (llm/cache.py ``trim_cache``) keep them so.

A prompt cache that already holds tokens the source's cache does not (a
request handed over from batched decoding, a fresh source on an old
conversation) leaves the source with a shorter context: it drafts from what
it has seen, the output is the same.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from .beam import Beams
from .controller import DepthGate
from .head import head_beams, takes_last

CHUNK = 512  # positions fed per call (as the target's prefill chunks); longer pending runs are fed early


class Chain:
    """One stateful source of a generation (see the module doc).

    ``head``: a :class:`~mlx_redrafter.draft.head.LayerHead` or a
    :class:`~mlx_redrafter.draft.draft_model.ModelHead`; ``width`` beams of
    ``length`` tokens per step.
    """

    def __init__(self, head, width: int, length: int, controller=None):
        self.head, self.width, self.length = head, width, length
        self.controller = controller  # adaptive depth: decides each draft call (draft/controller.py DepthGate)
        self.reads = 0  # host reads the last draft() made (the controller's decisions)
        self.source = head.source
        self.reads_hidden = getattr(head, "reads_hidden", True)
        self.last = {"last": True} if takes_last(head) else {}
        self.cache: Optional[list] = None
        self._tokens: List[int] = []  # pending: tokens not fed yet
        self._feats: List[mx.array] = []  # a layer head's: the features paired with them, [k, F] each
        self._held: Optional[mx.array] = None  # a layer head's: the last position's features, awaiting its token
        self._fed = False  # draft() fed g0, the first token of the next extend()

    def make_cache(self) -> list:
        return self.head.make_cache()

    def extend(self, tokens: List[int], features: Optional[mx.array] = None) -> None:
        """``tokens`` entered the target's cache, in order; ``features [len, F]``
        (a layer head's) are the target's features at those positions."""
        skip, self._fed = (1 if self._fed else 0), False
        if not tokens:
            return
        if not self.reads_hidden:
            self._tokens += tokens[skip:]
        else:
            if not skip and self._held is not None:
                self._tokens.append(tokens[0])
                self._feats.append(self._held[None])
            if len(tokens) > 1:
                self._tokens += tokens[1:]
                self._feats.append(features[:-1])
            self._held = features[-1]
        while len(self._tokens) > CHUNK:
            self._feed(CHUNK)
            mx.eval([c.state for c in self.cache])

    def draft(self, g0: int) -> Beams:
        """The next step's beams after ``g0`` (lazy): the pending tokens and
        ``g0`` fed, then the head chained to depth ``length``."""
        self._tokens.append(g0)  # a host int: the loop read it
        if self.reads_hidden:
            self._feats.append(self._held[None])
            self._held = None
        while len(self._tokens) > CHUNK:
            self._feed(CHUNK)
            mx.eval([c.state for c in self.cache])
        logits, hidden = self._feed(len(self._tokens))
        gate = None if self.controller is None else DepthGate(self.controller)
        beams, written = head_beams(
            self.head,
            logits[0, -1],
            None if hidden is None else hidden[0, -1],
            self.cache,
            self.width,
            self.length,
            gate,
        )
        self.reads = 0 if gate is None else gate.reads
        for c in self.cache if written else ():
            c.trim(written)
        self._fed = True
        return beams

    def close(self) -> None:
        """Feed what is pending (lazily): the cache then ends where the target's does."""
        if self._tokens:
            self._feed(len(self._tokens))

    def _feed(self, n: int):
        """Feed the first ``n`` pending tokens (and features): ``(logits, hidden)`` of that call."""
        tokens = mx.array(self._tokens[:n], mx.int32)[None]
        self._tokens = self._tokens[n:]
        feats = None
        if self.reads_hidden:
            every = mx.concatenate(self._feats, axis=0) if len(self._feats) > 1 else self._feats[0]
            feats, rest = every[None, :n], every[n:]
            self._feats = [rest] if rest.shape[0] else []
        return self.head(tokens, feats, self.cache, first=True, **self.last)


def chain_for(head, width: int, length: int, controller=None):
    """The step loop's chain of a stateful source: a :class:`Chain`, or the
    source's own when it drafts its own way (``make_chain``: a DFlash block
    drafter, draft/dflash_chain.py, with the same surface)."""
    make = getattr(head, "make_chain", None)
    return make(width, length, controller) if make is not None else Chain(head, width, length, controller)
