"""The draft plan: one frozen, validated answer to "how does this generation draft?".

:func:`make_plan` turns a request (the model and a
:class:`~mlx_redrafter.config.DraftConfig`, which the library's keywords,
the commands' flags and the server's API fields all resolve into) into a
:class:`DraftPlan`: the sources that draft (step/sources/, asked in their
registry's order), the tree policy (:class:`TreePolicy`: every node, packed
or laid out, or the nodes that pay on a cost) and the schedule (step/loop.py:
build ahead, or read then build). Where nothing drafts, the plan says why
(``reason``) and the schedule is plain decoding. Every rule that once
rewrote a draft downstream is here, once: a model whose layers no tree
covers, a tree auto on a curve where no draft pays, stateful sources under a
grammar. A combination refused is refused here, for every caller, with one
message.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

from ..config import DraftConfig
from ..errors import RedrafterError
from .source import STATES

PLAIN, AHEAD, AFTER_READ = "plain", "build ahead", "read then build"
# Wide and deep trees of one beam search share prefixes and verify fewer
# nodes packed: past this many nodes (W x L) of such a source the
# read-then-build schedule, which packs them, measured faster
# (bench/RESULTS.md section 11: W=2 L=3 is faster built ahead, W=4 L=5 packed).
MAX_SHARED_NODES = 8


@dataclass(frozen=True)
class TreePolicy:
    """Which drafted nodes a step verifies.

    ``kind="fixed"``: every node, ``packed`` (rows that share a prefix share
    its nodes; the read-then-build schedule with every row on the host) or
    laid out. ``kind="auto"``: the nodes expected to pay on ``cost``
    (step/auto.py; anything with :class:`~mlx_redrafter.step.curve.CostCurve`'s
    interface, the built-in curve when None): a step may verify ``g0``
    alone, a plain decoding step."""

    kind: str = "fixed"
    cost: object = None
    packed: bool = False

    @property
    def auto(self) -> bool:
        return self.kind == "auto"

    def open(self, sources, live: bool = True):
        """One generation's :class:`~mlx_redrafter.step.auto.AutoTree` (None for a
        fixed tree); ``live``: its cost learned from the steps (else the stored curve's)."""
        if not self.auto:
            return None
        from .auto import AutoTree

        return AutoTree(self.cost, [s.prior for s in sources], live=live)


@dataclass(frozen=True)
class DraftPlan:
    """How a generation drafts (see the module doc)."""

    sources: Tuple[object, ...] = ()
    tree: TreePolicy = TreePolicy()
    schedule: str = PLAIN
    reason: str = "nothing drafts"
    structured: bool = False  # made for a grammar: the schedule reads, then builds, and prunes by it
    # Each step runs the sources that pay, measured live, plain decoding when
    # none does (step/governor.py); False: every step drafts with every source.
    governed: bool = True
    starts_plain: bool = False  # governed: the stored curve says no draft pays, so the first steps run plain

    @property
    def drafting(self) -> bool:
        return self.schedule != PLAIN

    @property
    def margin(self) -> int:
        """Context a verification needs past the last token: ``g0`` and the
        deepest draft (positions run to offset + depth)."""
        return 1 + max(s.length for s in self.sources) if self.drafting else 0

    @property
    def labels(self) -> Tuple[str, ...]:
        return tuple(s.name for s in self.sources)


def request_sources(draft: DraftConfig) -> list:
    from .sources import request_sources as asked

    return asked(draft)


def asks(draft: Optional[DraftConfig]) -> bool:
    """Whether a request asks for any source (whether they pay is :func:`make_plan`'s to say)."""
    return draft is not None and len(request_sources(draft)) > 0


def make_plan(
    model,
    draft: Optional[DraftConfig],
    *,
    grammar: bool = False,
    timings: bool = False,
    cache=None,
    batched: bool = False,
) -> DraftPlan:
    """The :class:`DraftPlan` of ``draft`` on ``model`` (None: plain decoding).

    ``grammar``: the generation is constrained (structured output);
    ``timings``: its phases are timed (a sync each); ``cache``: the prompt
    cache it runs on (None: the model's own kind); ``batched``: the rows of a
    batch (step/batched.py: every row's rows on the host, the batch's width
    its own policy; the controller does not decide depths there). Raises :class:`~mlx_redrafter.errors.RedrafterError`
    for a request no step can run.
    """
    if draft is None:
        return DraftPlan()
    sources = _checked(model, draft)
    if not sources:
        return DraftPlan(reason="nothing drafts")
    from .verify import tree_support

    why_not = tree_support(model)
    if why_not:  # e.g. a recurrent layer no hook covers: plain decoding, said once
        _say_plain_once(model, why_not)
        return DraftPlan(reason=f"{why_not.rstrip('.')}; no drafting for it yet")
    dropped = ""
    if grammar and not batched and any(s.needs == STATES for s in sources):  # their rows come after the read
        names = " and ".join(sorted({s.name for s in sources if s.needs == STATES}))
        dropped = f"under a grammar, {names} do not draft (their rows come after the step's read)"
        sources = [s for s in sources if s.needs != STATES]
        if not sources:
            return DraftPlan(reason=dropped, structured=grammar)
    tree = TreePolicy(draft.tree, draft.curve)
    if batched:  # every row's rows on the host; the batch's width is its own policy
        sources = [replace(s, controller=None) if s.controller is not None else s for s in sources]
        return DraftPlan(
            tuple(sources),
            TreePolicy("fixed", draft.curve, packed=True),
            AFTER_READ,
            dropped,
            False,
            not draft.always_draft,  # the batch's own governors (step/batched.py)
        )
    # Timed phases are a measurement of one setting: they draft every step.
    governed, starts_plain = not (draft.always_draft or timings), False
    if grammar:  # the masks follow every row's tokens on the host: a packed tree
        tree = TreePolicy("fixed", packed=True)
    elif tree.auto and not any(s.controller is not None for s in sources):
        from .auto import can_pay

        if not can_pay(sources, draft.curve):
            if not governed:
                return DraftPlan(reason="no draft can pay on this device's verify-cost curve")
            # The stored curve says no draft pays: start plain, and let the steps' own times say otherwise.
            starts_plain = True
    schedule = _schedule(model, draft, sources, tree, grammar, timings, cache)
    if schedule == AFTER_READ and not tree.auto and not any(s.needs == STATES for s in sources):
        tree = replace(tree, packed=True)  # every row reaches the host before the tree is built
    return DraftPlan(tuple(sources), tree, schedule, dropped, grammar, governed, starts_plain)


def _checked(model, draft: DraftConfig) -> list:
    """The request's sources, each checked, the controller given to the one drafter it decides for."""
    draft.check()  # the request's own fields (the tree)
    sources = request_sources(draft)
    for s in sources:
        s.check(model)
    if draft.controller is None:
        return sources
    drafters = [i for i, s in enumerate(sources) if s.beams]
    if not drafters:
        raise RedrafterError(
            "The adaptive-depth controller (--adaptive, controller=) needs a drafter whose depth it decides, "
            "and this draft has none (rows copied from the context have no depth to decide).",
            "Pass a drafter (--drafter PATH, drafter=), or drop --adaptive (controller=).",
        )
    if len(drafters) != 1 or not sources[drafters[0]].takes_controller:
        what = f"{len(drafters)}: " + ", ".join(sources[i].name for i in drafters)
        raise RedrafterError(
            "The adaptive-depth controller decides the draft depth of one drafter (the ReDrafter drafter or a "
            f"layer head), and this draft has {what}.",
            "Drop --adaptive (controller=), or draft with one drafter (--mtp none, no --draft-model).",
        )
    i = drafters[0]
    sources[i] = replace(sources[i], controller=draft.controller)
    return sources


def _schedule(model, draft, sources, tree, grammar: bool, timings: bool, cache) -> str:
    """Build ahead where every source can and the cache can keep holes; else read, then build."""
    if grammar or timings or not draft.pipelined or not all(s.ahead for s in sources):
        return AFTER_READ
    if not holes_fit(model, cache):
        return AFTER_READ
    if not tree.auto:  # a chosen tree has a bucket's size whatever the rows are
        shared = sum(s.rows * s.length for s in sources if s.beams and s.rows > 1 and s.length > 1)
        if shared > MAX_SHARED_NODES:
            return AFTER_READ
    return AHEAD


def _say_plain_once(model, why: str) -> None:
    """One warning per model that it decodes without drafting, and why."""
    import warnings

    if not getattr(model, "_redrafter_said_plain", False):
        object.__setattr__(model, "_redrafter_said_plain", True)
        warnings.warn(f"{why} Decoding without drafting (same output).", stacklevel=4)


def holes_fit(model, cache=None) -> bool:
    """Whether the cache can keep rejected rows as masked holes: recurrent
    layers keep only the accepted node's state (taken on the device),
    attention layers keep holes, which sliding windows cannot."""
    from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, make_prompt_cache

    from ..llm.cache import target_size
    from ..llm.recurrent import leaves

    cache = cache[: target_size(model)] if cache is not None else make_prompt_cache(model)
    return all(type(c) in (KVCache, QuantizedKVCache, ArraysCache) for c in leaves(cache))
