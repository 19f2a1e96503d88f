"""Layer heads: draft heads made of decoder layers, fed by the target's hidden states.

A *layer head* is a small draft model of one (or a few) decoder layers with
its own KV cache. It reads hidden states of the target model and a token,
and predicts the token after that one. Native multi-token-prediction heads
(:mod:`~mlx_redrafter.draft.mtp`: Qwen3.5/3.6/3.8, Qwen3-Next, DeepSeek-V3,
GLM-4.5+, MiMo) and EAGLE-3 heads (``draft/eagle3.py``) are layer heads.
They share this protocol, the chained beam search (:func:`head_beams`) and
the bookkeeping that keeps a head in step with the target
(:class:`~mlx_redrafter.draft.chain.Chain`).

**The protocol** (:class:`LayerHead`). One call covers ``T`` positions::

    logits, hidden = head(tokens, features, cache, first)

* ``tokens [B, T]`` int32, target-vocabulary ids. At position ``i`` the
  token is the one that *follows* the position whose features come with
  it: the head pairs ``(t[i+1], h[i])`` and predicts ``t[i+2]``.
* ``features [B, T, F]``. ``first=True``: the target's own features at
  those positions: its final hidden state after the final norm when
  ``taps`` is None (every MTP family), else the outputs of the target layers
  ``taps`` (as :func:`~mlx_redrafter.llm.parts.capture_layers` records
  them: layer ``i``'s output is the residual stream entering layer
  ``i + 1``), concatenated in ``taps`` order, ``F = len(taps) * h``.
  ``first=False``: the head's own ``hidden`` from its previous call
  (chained drafting past the first token), ``F = h``.
* ``cache``: the list :meth:`LayerHead.make_cache` made (mlx-lm caches, one
  per head layer), advanced by ``T`` positions. The head's positions are its
  cache's offsets: entry ``i`` sits at position ``i``, the position of the
  hidden state it read, as vLLM and mlx-vlm number them.
* ``logits [B, T, Vd]`` over the head's vocabulary (``Vd`` = the target's,
  or a reduced draft vocabulary mapped back by ``draft_to_target``). A head
  whose ``__call__`` takes ``last=True`` returns the last position's alone,
  ``[B, 1, Vd]``: a step's catch-up call feeds several positions and needs
  one distribution, and the vocabulary projection is most of a head's cost.
* ``hidden [B, T, h]``: what the next chained call reads as its features.
  Each family says which state that is: after the head's final norm for
  Qwen3.5/Qwen3-Next and MiMo, before the shared head's norm for
  DeepSeek-V3/GLM (vLLM's ``deepseek_mtp.py``), the layer's output for
  EAGLE-3.

A head is built for one target: it holds references to what it shares with
the target (embedding, LM head) without owning them as parameters. It drafts
when it is a draft's ``head`` (``DraftConfig(head=..., head_width=...,
head_length=...)``), as a source of the step (step/sources/chain.py): the
step loop asks the target's backbone for the ``taps`` it names, keeps the head in step with the
accepted tokens (:class:`~mlx_redrafter.draft.chain.Chain`) and joins its
beams to the tree; its ``source`` names its tokens in the step stats.
"""

from __future__ import annotations

import copy
from typing import List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import mlx.core as mx

from .beam import NEG, Beams, top_w


@runtime_checkable
class LayerHead(Protocol):
    """A draft head of decoder layers with its own KV cache (see the module doc).

    Attributes:
        source: the name its drafts carry in step stats (``"mtp"``, ``"eagle3"``).
        taps: target layers whose outputs the head reads, or None for the
            target's final post-norm hidden state (every MTP family).
        draft_to_target: ``[Vd]`` int32, the target id of each draft-vocabulary
            id, or None when the head predicts over the target's vocabulary.
    """

    source: str
    taps: Optional[Tuple[int, ...]]
    draft_to_target: Optional[mx.array]

    def make_cache(self) -> list:
        """The head's own mlx-lm caches (one per head layer), empty."""
        ...

    def __call__(self, tokens: mx.array, features: mx.array, cache: list, first: bool) -> Tuple[mx.array, mx.array]:
        """``(logits [B, T, Vd], hidden [B, T, h])`` for ``tokens [B, T]`` and
        ``features [B, T, F]`` (see the module doc), advancing ``cache`` by ``T``
        (an optional ``last=True``: the last position's logits only)."""
        ...


def takes_last(head) -> bool:
    """Whether ``head(...)`` accepts ``last=True`` (the last position's logits only)."""
    import inspect

    try:
        return "last" in inspect.signature(head.__call__).parameters
    except (TypeError, ValueError):
        return False


def target_ids(head, index: mx.array) -> mx.array:
    """Target token ids of draft-vocabulary indices."""
    table = getattr(head, "draft_to_target", None)
    return index.astype(mx.int32) if table is None else table[index].astype(mx.int32)


def beam_caches(cache: Sequence, width: int) -> list:
    """Copies of a head's caches for ``width`` beams: every batch-1 array of
    each cache repeated ``width`` times. The originals are left as they are
    (chained drafts must not enter the committed cache)."""
    return [_map_arrays(copy.copy(c), lambda a: mx.repeat(a, width, axis=0)) for c in cache]


def reorder_caches(cache: Sequence, parent: mx.array) -> None:
    """Rows of each beam cache taken from their parent beams (in place)."""
    for c in cache:
        _map_arrays(c, lambda a: a[parent])


def _map_arrays(c, fn):
    """``fn`` applied to every array a cache object holds (keys, values, a
    quantized cache's triples, an ArraysCache's states), each replaced by a
    new array object: writes into ``c`` never reach the arrays it came from.
    A ``CacheList``'s members (Falcon-H1's layers) are copied and mapped too:
    sharing them, a beam would write into the cache it was copied from."""
    members = getattr(c, "caches", None)
    if isinstance(members, (list, tuple)):
        c.caches = type(members)(_map_arrays(copy.copy(m), fn) for m in members)
        return c
    for name, value in list(vars(c).items()):
        if isinstance(value, mx.array) and value.ndim > 0:
            setattr(c, name, fn(value))
        elif isinstance(value, (list, tuple)) and any(isinstance(v, mx.array) for v in value):
            mapped = [fn(v) if isinstance(v, mx.array) and v.ndim > 0 else v for v in value]
            setattr(c, name, type(value)(mapped) if isinstance(value, tuple) else mapped)
    return c


def head_beams(
    head, logits: mx.array, hidden: Optional[mx.array], cache: list, width: int, length: int, gate=None
) -> Tuple[Beams, int]:
    """Beam search over a head chained to depth ``length``, lazily.

    ``logits [Vd]`` and ``hidden [h]`` are the head's outputs at the last
    committed position (depth 1's distribution). Each later depth feeds every
    beam's token and its own hidden state back (``first=False``); the top
    ``width`` of ``width x Vd`` continuations survive, as the recurrent
    drafter's beams do (:func:`~mlx_redrafter.draft.beam.beam_search`). With
    one beam and trimmable caches the chain runs in ``cache`` itself; the
    caller trims the returned number of positions off it. Otherwise it runs
    in copies (:func:`beam_caches`) and 0 is returned.

    ``gate`` (a :class:`~mlx_redrafter.draft.controller.DepthGate`), when
    given, is asked before each call past the first whether to make it
    (``deeper``), and told after each depth the top-k probabilities of the
    distribution that gave the best beam its token there (``drafted``: keep
    the depth?); the chain stops at the first no (the beams are shorter than
    ``length``).
    """
    logp = _log_softmax(logits)[None]  # [1, Vd]
    scores = mx.array([0.0] + [NEG] * (width - 1), dtype=mx.float32)
    tokens = history = path_scores = parent = None
    in_place = width == 1 and all(c.is_trimmable() for c in cache)
    chain = cache if in_place else None
    calls = 0  # chained calls made (in place: positions to trim)
    for depth in range(length):
        if depth:
            if gate is not None and not gate.deeper(depth):
                break
            if chain is None:  # copies of the committed cache: every row alike, no reorder yet
                chain = beam_caches(cache, width)
            elif not in_place:  # each row follows the beam it continues
                reorder_caches(chain, parent)
            feats = None if hidden is None else hidden[:, None, :]
            out, hid = head(tokens[:, None], feats, chain, first=False)
            logp = _log_softmax(out[:, -1])
            hidden = None if hid is None else hid[:, -1]
            calls += 1
        vocab = logp.shape[-1]
        total = (scores[:, None] + logp).reshape(-1)
        if gate is not None and not gate.drafted(depth, _confidences(logp, total, vocab, gate.controller.top_k)):
            break
        idx = top_w(total, width)
        parent = idx // vocab
        scores = total[idx]
        tokens = target_ids(head, idx % vocab)
        if hidden is not None:
            hidden = mx.broadcast_to(hidden, (width, hidden.shape[-1])) if hidden.ndim == 1 else hidden[parent]
        history = tokens[:, None] if history is None else mx.concatenate([history[parent], tokens[:, None]], axis=1)
        path_scores = (
            scores[:, None] if path_scores is None else mx.concatenate([path_scores[parent], scores[:, None]], axis=1)
        )
    return Beams(history, scores, path_scores=path_scores), (calls if in_place else 0)


def _confidences(logp: mx.array, total: mx.array, vocab: int, k: int) -> mx.array:
    """``[k]`` confidences of the row whose continuation is the best beam."""
    return top_confidences(logp[0] if logp.shape[0] == 1 else logp[mx.argmax(total) // vocab], k)


def top_confidences(logp: mx.array, k: int) -> mx.array:
    """``[k]`` descending top-k probabilities of one log-distribution ``[V]``: what a
    depth controller reads of a depth (at run time, and in its recorded episodes)."""
    return mx.exp(mx.sort(mx.topk(logp, k))[::-1])


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def check_vocabulary(head_vocab: int, target_vocab: int, what: str) -> Optional[str]:
    """Why a head predicting over ``head_vocab`` ids cannot draft for a
    target with ``target_vocab`` embedding rows, or None."""
    if head_vocab != target_vocab:
        return f"The {what} predicts over {head_vocab} tokens but the model's vocabulary has {target_vocab}."
    return None


__all__: List[str] = ["LayerHead", "beam_caches", "head_beams", "reorder_caches", "target_ids", "top_confidences"]
