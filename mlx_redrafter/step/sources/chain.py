"""Sources with a cache of their own, kept in step with the target: a layer
head (a native MTP head, an EAGLE-3 head: draft/head.py) or a small draft
model (draft/draft_model.py), chained to depth L (draft/chain.py).

Such a source must see what each step accepted, with the target's hidden
states there, before it drafts: it proposes after the step's read (the
read-then-build schedule, step/loop.py), catching up first on the accepted
tokens (:meth:`~mlx_redrafter.step.source.Proposer.entered`). Its caches
follow the target's in the prompt cache (mlx-lm's layout for a draft model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ...config import DEFAULT_HEAD_LENGTH, is_layer_head
from ...draft.chain import chain_for
from ...draft.draft_model import ModelHead
from ..source import STATES, Prior, Proposer, Rows, Setting, Source
from .redrafter import PRIOR as DRAFTER_PRIOR
from .redrafter import node_scores

# They score nodes by probability, as the drafter does, and start from its
# priors (unmeasured on real weights): the calibration learns their rates.
# What their rows are called (a layer head's own ``source``; a draft model's).
LABELS = ("mtp", "draft-model", "eagle3", "dflash")
_KINDS = {"eagle3": "An EAGLE-3 head", "dflash": "A DFlash drafter"}  # layer heads that are a drafter of their own


def prior_for(name: str) -> Prior:
    return Prior(name, DRAFTER_PRIOR.edges, DRAFTER_PRIOR.q, DRAFTER_PRIOR.slots)


@dataclass(frozen=True, eq=False)
class ChainSource(Source):
    """``width`` beams of ``length`` tokens from a layer head or a draft model (``head``)."""

    head: object
    width: int = 1
    length: int = DEFAULT_HEAD_LENGTH
    controller: object = None

    needs = STATES
    beams = True

    @property
    def name(self) -> str:
        """The head's own ``source`` (a layer head's: "mtp", "eagle3", "dflash"), else "draft-model"."""
        return getattr(self.head, "source", None) or ("mtp" if is_layer_head(self.head) else "draft-model")

    @property
    def prior(self) -> Prior:
        return prior_for(self.name)

    @property
    def rows(self) -> int:
        return self.width

    @property
    def takes_controller(self) -> bool:
        return is_layer_head(self.head)  # RADAR decides a layer head's calls, never a draft model's

    @property
    def taps(self):
        return tuple(getattr(self.head, "taps", None) or ()) or None

    @property
    def last(self) -> bool:
        return is_layer_head(self.head) and not self.taps

    def check(self, model) -> None:
        """Refuse a shape below one; bind a layer head to ``model`` (its taps follow from it)."""
        from ...errors import RedrafterError

        if is_layer_head(self.head) and hasattr(self.head, "bind"):
            self.head.bind(model)
        if self.width < 1 or self.length < 1:
            what, flag = _words(self.head)
            raise RedrafterError(
                f"{what}'s beams need a width and a length of at least 1 (got width {self.width}, "
                f"length {self.length}).",
                f"Use {flag} with values of at least 1.",
            )

    def open(self, setting: Setting) -> "_Chained":
        return _Chained(self, setting)


def _words(head):
    """The source's kind and the flags that shape its beams, for messages."""
    if not is_layer_head(head):
        return "A draft model", "--num-draft-tokens"
    kind = _KINDS.get(getattr(head, "source", None))
    return (kind, "--beam-width/--beam-length") if kind else ("An MTP head", "--mtp-width/--mtp-depth")


def chain_head(model, head):
    """The chainable head of a source: a layer head as it is (bound to
    ``model`` when it binds: an EAGLE-3 head's taps from the model's layer
    count, its embedding when it has none), an mlx-lm model wrapped."""
    if is_layer_head(head):
        if hasattr(head, "bind"):
            head.bind(model)
        return head
    from ...llm.parts import model_parts

    return ModelHead(head, vocab=model_parts(model)[0].weight.shape[0])


class _Chained(Proposer):
    def __init__(self, source: ChainSource, setting: Setting):
        self.s, self.setting = source, setting
        # A source that drafts its own way (a DFlash block drafter: make_chain) keeps the chain's surface.
        head = chain_head(setting.model, source.head)
        self.chain = chain_for(head, source.width, source.length, source.controller)
        self.make_cache = self.chain.make_cache

    def attach(self, caches: list) -> None:
        self.chain.cache = caches

    def entered(self, tokens: List[int], features) -> None:
        self.chain.extend(tokens, features if self.chain.reads_hidden else None)

    def propose(self, at) -> Optional[Rows]:
        beams = self.chain.draft(at.g0_value)
        self.reads = self.chain.reads
        scores = node_scores(beams) if self.setting.auto else None
        # The controller's depth, else the chain's length.
        return Rows(beams.tokens, (beams.tokens.shape[1],) * self.s.width, self.s.name, self.s.prior, scores=scores)

    def close(self) -> None:
        self.chain.close()


def from_request(draft) -> List[Source]:
    """A request's layer head (``head``, or a drafter that is one: an EAGLE-3
    drafter, shaped by the beam flags) and draft model, in this order (the
    order of their caches after the model's)."""
    out = []
    if draft.head is not None:
        out.append(ChainSource(draft.head, draft.head_width, draft.head_length))
    elif is_layer_head(draft.drafter):
        out.append(ChainSource(draft.drafter, draft.beam_width, draft.beam_length))
    if draft.draft_model is not None:
        out.append(ChainSource(draft.draft_model, draft.draft_model_width, draft.draft_model_length))
    return out
