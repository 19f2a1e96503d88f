"""What a generation is asked to do: :class:`SamplingConfig`, :class:`DraftConfig`
and the one place where their defaults are resolved.

Order of precedence, for the beam shape and the lookup beams alike: explicit
values (flags, keywords), then the tuned profile saved by ``mlx-redrafter
sweep --save-profile`` for this device + model + drafter, then the built-in
defaults below. :func:`resolve` applies it once; the commands and the public
``stream_generate`` both go through it, and everything after it passes the
resolved :class:`DraftConfig` along as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

from .errors import RedrafterError
from .profiles import lookup_profile

# The draft shape when neither the caller nor a tuned profile gives one: the
# best cell of a sweep of W 1-2 x L 1-2 (with lookup) for the default model
# and its drafter on a 2-core Linux CPU, its weights column-major
# (llm/layout.py): one beam of one token 1.22x of plain decoding over 12
# MT-Bench prompts, two beams 1.19x, a beam of two 1.17x (bench/RESULTS.md §38).
DEFAULT_WIDTH = 1
DEFAULT_LENGTH = 1
# Lookup beams beside the drafter's when the caller does not say (see draft/lookup.py).
DEFAULT_LOOKUP = 1
# Tokens per step a native MTP head drafts (mlx-vlm's default block: two after
# the model's own token) and a draft model (mlx-lm's --num-draft-tokens default).
DEFAULT_HEAD_LENGTH = 2
DEFAULT_DRAFT_MODEL_LENGTH = 3
# Tokens per lookup draft: measured offline on the default model's greedy
# replies (MT-Bench, Spec-Bench summarization; see draft/lookup.py).
LOOKUP_LENGTH = 4
# Token id of padding after the end of a shorter draft row: every draft source
# (draft/) writes it and the step that consumes the rows (step/tree.py) reads it,
# so it lives on the floor both stand on.
PAD = -1
# Which draft nodes a step verifies (see DraftConfig.tree) for a float model;
# a quantized one defaults to "auto" (step/curve.py: default_tree; bench/RESULTS.md section 18).
DEFAULT_TREE = "fixed"
TREES = ("auto", "fixed")
# Layer-head sources that are a drafter of their own (``--drafter``): an EAGLE-3 head, a DFlash block drafter.
DRAFTER_HEADS = ("eagle3", "dflash")


@dataclass
class SamplingConfig:
    """mlx-lm's sampling parameters; ``temp == 0`` is greedy.

    Out-of-range values raise :class:`RedrafterError` (a ``ValueError``).
    """

    temp: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    top_k: int = 0

    def __post_init__(self):
        checks = (
            ("temp", self.temp >= 0, "at least 0", "temp=0 is greedy decoding; sampling needs a positive temperature."),
            ("top_p", 0 <= self.top_p <= 1, "between 0 and 1", "top_p=0 turns nucleus sampling off."),
            ("min_p", 0 <= self.min_p <= 1, "between 0 and 1", "min_p=0 turns min-p sampling off."),
            ("top_k", self.top_k >= 0, "at least 0", "top_k=0 turns top-k sampling off."),
        )
        for name, ok, bound, fix in checks:
            if not ok:
                raise RedrafterError(f"{name} must be {bound} (got {getattr(self, name)}).", fix)

    @property
    def greedy(self) -> bool:
        return self.temp == 0


def always_draft_default() -> bool:
    """``$MLX_REDRAFTER_ALWAYS_DRAFT=1``: every step drafts what was asked (see :class:`DraftConfig`)."""
    return os.environ.get("MLX_REDRAFTER_ALWAYS_DRAFT", "") not in ("", "0")


@dataclass
class DraftConfig:
    """What a generation asks to draft with: the request's drafting fields,
    as the library's keywords, the commands' flags and the server's runtime
    resolve them (flags > tuned profile > built-in, :func:`resolve`). It
    drafts nothing by itself: step/plan.py ``make_plan`` turns it into the
    plan a generation runs (its sources, each read from these fields by its
    own module of step/sources/, the tree policy, the schedule), and checks
    it there. ``drafter=None, lookup=0`` (nothing else) is plain decoding.

    ``beam_length`` counts drafted tokens (not ``g0``). ``controller`` (an
    adaptive-depth :class:`~mlx_redrafter.draft.controller.Controller`) picks
    the depth to verify each step, up to ``beam_length``. ``lookup`` adds
    that many lookup beams (``lookup_length`` tokens copied from the prompt
    and reply, :mod:`~mlx_redrafter.draft.lookup`) to the drafter's beams;
    with no drafter they are the only drafts. ``pipelined=False`` reads each
    step before building the next where the plan would build ahead: for
    comparisons; the tokens are the same. ``datastore`` (a
    :class:`~mlx_redrafter.draft.datastore.index.Datastore` or
    :class:`~mlx_redrafter.draft.datastore.use.Stores`, None for none) adds one row
    of ``lookup_length`` tokens from the model's past outputs on steps where
    context lookup finds nothing (draft/datastore/use.py).

    Sources with state of their own (draft/chain.py) join the same tree (the
    caller's own sources too: ``sources``):
    ``head`` a :class:`~mlx_redrafter.draft.head.LayerHead` (a native MTP
    head, an EAGLE-3 head) drafting ``head_width`` beams of ``head_length``
    tokens; ``draft_model`` an mlx-lm model with the target's tokenizer
    drafting ``draft_model_width`` beams of ``draft_model_length`` tokens.
    """

    drafter: object = None
    beam_width: int = DEFAULT_WIDTH
    beam_length: int = DEFAULT_LENGTH
    warp: bool = False
    controller: object = None
    lookup: int = 0
    lookup_length: int = LOOKUP_LENGTH
    pipelined: bool = True  # False: read, then build, even where the next step could be built ahead
    # "fixed": verify every drafted node. "auto": beam_width x beam_length and
    # the lookup rows are the candidates; each step verifies the subset whose
    # expected tokens per unit of verify cost (``curve``, step/curve.py) is best.
    tree: str = DEFAULT_TREE
    curve: object = None  # a step.curve.CostCurve; None: the built-in one
    datastore: object = None
    head: object = None
    head_width: int = 1
    head_length: int = DEFAULT_HEAD_LENGTH
    draft_model: object = None
    draft_model_width: int = 1
    draft_model_length: int = DEFAULT_DRAFT_MODEL_LENGTH
    # The caller's own sources: objects with a ``name`` and ``propose(tokens)``
    # (step/sources/host.py); their rows join the others' in the one tree.
    sources: tuple = ()
    # False (the default): each step runs the sources that pay, measured live,
    # plain decoding when none does (step/governor.py). True: every step drafts
    # with every source (a sweep's cell, a benchmark of one setting, the tests);
    # $MLX_REDRAFTER_ALWAYS_DRAFT=1 makes it the default.
    always_draft: bool = field(default_factory=always_draft_default)

    @property
    def head_is_drafter(self) -> bool:
        """Whether the layer head is the drafter (an EAGLE-3 head, a DFlash drafter), not a source beside it
        (an MTP head)."""
        return self.drafter is None and getattr(self.head, "source", None) in DRAFTER_HEADS

    @property
    def drafter_shape(self) -> Tuple[int, int]:
        """``(width, length)`` of the drafter's beams (an EAGLE-3 drafter's: its layer head's)."""
        return (self.head_width, self.head_length) if self.head_is_drafter else (self.beam_width, self.beam_length)

    def shaped(self, width: int, length: int, lookup: int) -> "DraftConfig":
        """This draft with the drafter's beams ``width x length`` (see :attr:`drafter_shape`) and ``lookup`` beams."""
        shape = {"head_width": width, "head_length": length} if self.head_is_drafter else {}
        shape = shape or {"beam_width": width, "beam_length": length}
        return replace(self, lookup=lookup, **shape)

    def check(self) -> None:
        """Refuse a tree this package does not know (the sources' own checks: step/plan.py ``make_plan``)."""
        if self.tree not in TREES:
            raise RedrafterError(f"Unknown tree {self.tree!r}.", "Use tree='auto' or tree='fixed' (--tree auto|fixed).")


@dataclass
class Resolved:
    """A :class:`DraftConfig` and where its shape came from (for the commands' announcement)."""

    draft: DraftConfig
    origin: str = "built-in default"  # "flags", "tuned profile FILE", "flags + ...", "built-in default"
    profile: Optional[dict] = None  # the tuned profile's dict, if one was found


def is_layer_head(drafter) -> bool:
    """Whether a drafter is a layer head (an EAGLE-3 head, draft/head.py's
    protocol: decoder layers with a KV cache of their own, fed the target's
    taps) rather than the recurrent ReDrafter head. A layer head drafts as a
    stateful source (``DraftConfig.head``, the sourced loop)."""
    return drafter is not None and hasattr(drafter, "make_cache") and hasattr(drafter, "taps")


def draft_shape(
    model_spec,
    drafter_path,
    beam_width: Optional[int] = None,
    beam_length: Optional[int] = None,
    defaults: Tuple[int, int] = (DEFAULT_WIDTH, DEFAULT_LENGTH),
) -> Tuple[int, int, str, Optional[dict]]:
    """``(width, length, origin, profile)``: the given values, each missing one
    from the tuned profile of this device + model + drafter, else the built-in
    ``defaults``. ``profile`` is the profile's dict, or None."""
    (width, length), origin = defaults, "built-in default"
    profile = lookup_profile(model_spec, drafter_path) if model_spec and drafter_path else None
    if profile is not None:
        width, length = profile["beam_width"], profile["beam_length"]
        origin = f"tuned profile {profile['file']}"
    if beam_width is not None or beam_length is not None:
        # One value alone keeps the other from the profile (or the default): say so.
        both = beam_width is not None and beam_length is not None
        origin = "flags" if both else f"flags + {origin}"
        width = beam_width if beam_width is not None else width
        length = beam_length if beam_length is not None else length
    return width, length, origin, profile


def lookup_beams(lookup, drafter, profile: Optional[dict] = None) -> int:
    """Lookup beams for a ``lookup=`` (True, False, a count, or None: the
    tuned profile's choice, else ``DEFAULT_LOOKUP`` with a drafter and none
    without)."""
    if lookup is not None:
        return int(lookup)
    if drafter is None:
        return 0
    return int(profile.get("lookup", DEFAULT_LOOKUP)) if profile else DEFAULT_LOOKUP


def resolve(
    drafter=None,
    beam_width: Optional[int] = None,
    beam_length: Optional[int] = None,
    lookup=None,
    *,
    model_spec=None,
    drafter_path=None,
    tree: Optional[str] = None,
    tree_default: str = DEFAULT_TREE,
    **kw,
) -> Resolved:
    """The one resolution of a draft: flags > tuned profile > built-in.

    ``model_spec`` and ``drafter_path`` key the tuned profile; without them
    (a drafter built in code) only the built-in defaults fill what is not
    given. A layer-head drafter (an EAGLE-3 head, :func:`is_layer_head`)
    becomes the draft's ``head``, its beams ``head_width x head_length`` (by
    default one beam of ``DEFAULT_HEAD_LENGTH``), a source with a cache of its own.
    ``tree``: as given, else the profile's (a sweep's best cell may be
    an auto one), else ``tree_default`` (the caller's default for the model,
    step/curve.py's ``default_tree``). ``kw``: the other :class:`DraftConfig`
    fields (``controller``, ``warp``...).
    """
    profile, origin = None, "built-in default"
    width, length = beam_width, beam_length
    head = is_layer_head(drafter)
    if drafter is not None:
        defaults = (1, DEFAULT_HEAD_LENGTH) if head else (DEFAULT_WIDTH, DEFAULT_LENGTH)
        defaults = getattr(drafter, "default_shape", None) or defaults  # DFlash (issue 56): its trained block
        width, length, origin, profile = draft_shape(model_spec, drafter_path, beam_width, beam_length, defaults)
    width = DEFAULT_WIDTH if width is None else width
    length = DEFAULT_LENGTH if length is None else length
    # DFlash (issue 56): a drafter may name its own default tree (a long block: "auto").
    tree = tree or (profile or {}).get("tree") or getattr(drafter, "default_tree", None) or tree_default
    lookup = lookup_beams(lookup, drafter, profile)
    if head:  # its beams come from its chain (step/sources/chain.py), beside lookup's rows
        draft = DraftConfig(lookup=lookup, tree=tree, head=drafter, head_width=width, head_length=length, **kw)
    else:
        draft = DraftConfig(drafter, width, length, lookup=lookup, tree=tree, **kw)
    return Resolved(draft, origin, profile)


def library_draft(
    model, drafter, beam_width: Optional[int], beam_length: Optional[int], lookup=None, **kw
) -> DraftConfig:
    """The :class:`DraftConfig` of a public call: :func:`resolve`, with the
    tuned profile keyed by where :func:`~mlx_redrafter.llm.load.load_model` and
    :func:`~mlx_redrafter.hub.load.load_drafter` loaded the model and the
    drafter from (they record it); a drafter built in code has no profile."""
    given = beam_width is not None and beam_length is not None and lookup is not None
    # Everything given: no profile to read (stream_generate runs this on every call).
    spec = None if given else getattr(model, "redrafter_spec", None)
    path = None if given else getattr(drafter, "source_path", None)
    return resolve(drafter, beam_width, beam_length, lookup, model_spec=spec, drafter_path=path, **kw).draft
