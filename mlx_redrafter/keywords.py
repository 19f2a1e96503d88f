"""``stream_generate``'s keywords, resolved once into a
:class:`~mlx_redrafter.config.SamplingConfig` and a
:class:`~mlx_redrafter.config.DraftConfig` (:func:`call_configs`), and the
stateful sources a draft gains (:func:`with_sources`: an MTP head, a draft
model), for the library and the commands alike; the tree a draft runs
(:func:`tree_kw`, :func:`plain_tree`) and the device curve it carries under
``tree="auto"`` (:func:`with_curve`).
"""

from __future__ import annotations

from typing import Optional

from .config import DraftConfig, SamplingConfig, library_draft
from .errors import RedrafterError

AUTO = "auto"  # drafter= and mtp= defaults: the model's own (the store's drafter, the checkpoint's MTP head)


def _refuse_both(given, what: str, **loose) -> None:
    """A resolved config and loose keywords for the same thing contradict each other."""
    named = sorted(k for k, v in loose.items() if v not in (None, False, 0, ()))
    if given is not None and named:
        raise RedrafterError(
            f"Both {what}= and {', '.join(named)}= were given.", f"Put everything in {what}=, or drop it."
        )


def call_configs(
    model,
    sampling,
    draft,
    max_tokens: int,
    loose_sampling: dict,
    loose_draft: dict,
    loose_sources: dict,
    datastore=None,
):
    """``(SamplingConfig, DraftConfig)`` of a :func:`~mlx_redrafter.generate.stream_generate`
    call: the resolved ones given, else the loose keywords' with the store
    that ``datastore=`` names (:func:`~mlx_redrafter.draft.datastore.use.open_datastore`)
    and the stateful sources they name (``mtp=``, ``draft_model=``)."""
    from dataclasses import replace

    from .draft.datastore.use import open_datastore

    _refuse_both(sampling, "sampling", **loose_sampling)
    sampling = sampling or SamplingConfig(**loose_sampling)
    if max_tokens < 1:
        raise RedrafterError(f"max_tokens must be at least 1 (got {max_tokens}).")
    auto = isinstance(loose_draft["drafter"], str) and loose_draft["drafter"] == AUTO
    mtp = loose_sources["mtp"]
    own_mtp = isinstance(mtp, str) and mtp == AUTO
    always = loose_draft.pop("always_draft", None)  # applies to a resolved draft= too
    _refuse_both(
        draft,
        "draft",
        **{**loose_draft, "drafter": None if auto else loose_draft["drafter"]},
        **{**loose_sources, "mtp": None if own_mtp else mtp},
        datastore=datastore is not None and datastore is not False,
    )
    if draft is not None:
        draft = draft if always is None else replace(draft, always_draft=bool(always))
        return sampling, with_curve(model, draft)
    d = dict(loose_draft)
    if auto:
        from .hub.store import drafter_for

        d["drafter"] = drafter_for(model)[0]
    elif isinstance(d["drafter"], str):
        raise RedrafterError(
            f"drafter={d['drafter']!r} is not a drafter.",
            f"Pass load_drafter({d['drafter']!r}), None for plain decoding, or {AUTO!r} for the store's.",
        )
    draft = library_draft(
        model,
        d["drafter"],
        d["beam_width"],
        d["beam_length"],
        d["lookup"],
        warp=d["warp"],
        controller=d["controller"],
        sources=d["sources"],
        **tree_kw(d["tree"], model),
    )
    if always is not None:  # None: DraftConfig's default ($MLX_REDRAFTER_ALWAYS_DRAFT)
        draft = replace(draft, always_draft=bool(always))
    draft = _with_call_sources(model, draft, own_mtp, loose_sources, d["lookup"])
    from .step.plan import asks

    store = open_datastore(datastore, getattr(model, "redrafter_spec", None), drafting=asks(draft))
    draft = draft if store is None else replace(draft, datastore=store)
    return sampling, with_curve(model, draft)


def _with_call_sources(model, draft, own_mtp: bool, src: dict, lookup):
    """``draft`` with the stateful sources of a call's ``mtp=`` and
    ``draft_model=`` keywords. An EAGLE-3 drafter is the draft's layer head:
    the model's own MTP head stays out, one asked for is refused
    (:func:`with_sources`), and so is ``mtp_depth=``."""
    from .draft.mtp_load import resolve_mtp
    from .draft.stateful import SourceFlags

    SourceFlags(mtp_depth=src["mtp_depth"]).check_beside_head(draft.head, "mtp_depth=", "beam_width= and beam_length=")
    if src["num_draft_tokens"] is not None and src["draft_model"] is None:  # as --num-draft-tokens: never ignored
        raise RedrafterError("num_draft_tokens= needs draft_model=.", "Name the draft model with draft_model=.")
    head = None if own_mtp and draft.head is not None else resolve_mtp(model, src["mtp"])
    if src["mtp_depth"] is not None and head is None:  # as --mtp-depth
        if src["mtp"] is None or src["mtp"] is False or str(src["mtp"]).lower() == "none":
            raise RedrafterError("mtp=None and mtp_depth= contradict each other.", "Drop one of them.")
        raise RedrafterError(
            "mtp_depth= was given but the model ships no MTP head.",
            "Pass mtp= (the model's original checkpoint or a split MTP folder), or drop mtp_depth=.",
        )
    return with_sources(model, draft, head, src["mtp_depth"], src["draft_model"], src["num_draft_tokens"], lookup)


def tree_kw(tree: Optional[str], model=None) -> dict:
    """``tree=`` and ``tree_default=`` for :func:`~mlx_redrafter.config.resolve`:
    the tree given (None: a tuned profile's, else the default for ``model``,
    :func:`~mlx_redrafter.step.curve.default_tree`, or DraftConfig's own when
    no model is given)."""
    from .step.curve import default_tree

    return {"tree": tree, **({} if model is None else {"tree_default": default_tree(model)})}


def plain_tree(tree: Optional[str], model) -> str:
    """The tree of a draft without a drafter (no profile): as given, else the model's default."""
    from .step.curve import default_tree

    return tree or default_tree(model)


def with_sources(
    model,
    draft: DraftConfig,
    head=None,
    head_length: Optional[int] = None,
    draft_model=None,
    draft_model_length: Optional[int] = None,
    lookup=None,
    head_width: Optional[int] = None,
) -> DraftConfig:
    """``draft`` with its stateful sources: an MTP (or other layer) head and a
    draft model, each with its length (None: the default). A model that
    drafts with one of them and was not told about lookup drafts with lookup
    too (``lookup``: the flag or keyword as given)."""
    import dataclasses

    from .config import DEFAULT_DRAFT_MODEL_LENGTH, DEFAULT_HEAD_LENGTH, DEFAULT_LOOKUP
    from .draft.stateful import check_one_head

    if head is None and draft_model is None:
        return draft
    if draft_model is not None:
        from .draft.draft_model import check_draft_model

        check_draft_model(model, draft_model)
    extra = {}
    if lookup is None and not draft.lookup:
        extra["lookup"] = DEFAULT_LOOKUP
    check_one_head(draft.head, head)
    if head is None:  # the draft's own head (an EAGLE-3 drafter) stays as it is
        head, head_width, head_length = draft.head, draft.head_width, draft.head_length
    # None is "not given"; 0 stays 0, for DraftConfig.check to refuse (never a default in its place).
    return dataclasses.replace(
        draft,
        head=head,
        head_width=1 if head_width is None else head_width,
        head_length=DEFAULT_HEAD_LENGTH if head_length is None else head_length,
        draft_model=draft_model,
        draft_model_length=DEFAULT_DRAFT_MODEL_LENGTH if draft_model_length is None else draft_model_length,
        **extra,
    )


def with_curve(model, draft: DraftConfig, model_spec: Optional[str] = None) -> DraftConfig:
    """``draft`` with this device's verify-cost curve for ``model`` when its tree is ``auto`` and it has none."""
    import dataclasses

    from .step.curve import curve_for

    if draft.tree != "auto" or draft.curve is not None:
        return draft
    return dataclasses.replace(draft, curve=curve_for(model, model_spec))
