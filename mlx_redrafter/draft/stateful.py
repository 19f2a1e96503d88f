"""The stateful draft sources a command drafts with: ``--mtp`` (the model's
native MTP head) and ``--draft-model`` (a smaller model with the same
tokenizer), read once for the loaded model (the heads: draft/mtp.py,
draft/draft_model.py; how they draft: draft/chain.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import RedrafterError

NONE = "none"


@dataclass
class SourceFlags:
    """``--mtp PATH|none`` (None: the model's own head, if it ships one),
    ``--mtp-depth``, ``--draft-model SPEC`` and ``--num-draft-tokens``."""

    mtp: Optional[str] = None
    mtp_depth: Optional[int] = None
    draft_model: Optional[str] = None
    num_draft_tokens: Optional[int] = None

    @property
    def no_mtp(self) -> bool:
        return self.mtp is not None and self.mtp.lower() == NONE

    def check(self, no_draft: bool) -> None:
        """Refuse contradicting or out-of-range flags, before the slow load."""
        for name, v in (("--mtp-depth", self.mtp_depth), ("--num-draft-tokens", self.num_draft_tokens)):
            if v is not None and v < 1:
                raise RedrafterError(f"{name} must be at least 1 (got {v}).")
        if no_draft and self.draft_model:
            raise RedrafterError("--no-draft and --draft-model contradict each other.", "Drop one of them.")
        if no_draft and self.mtp and not self.no_mtp:
            raise RedrafterError("--no-draft and --mtp contradict each other.", "Drop one of them.")
        if self.no_mtp and self.mtp_depth is not None:
            raise RedrafterError("--mtp none and --mtp-depth contradict each other.", "Drop one of them.")
        if self.num_draft_tokens is not None and not self.draft_model:
            raise RedrafterError(
                "--num-draft-tokens needs --draft-model.", "Name the draft model with --draft-model M."
            )

    def check_beside_head(self, head, flag: str = "--mtp-depth", fix: str = "--beam-width/--beam-length") -> None:
        """Refuse an MTP head's depth when the drafter is an EAGLE-3 ``head`` (the draft runs one layer head)."""
        if head is not None and self.mtp_depth is not None:
            what = "a DFlash drafter" if getattr(head, "source", None) == "dflash" else "an EAGLE-3 head"
            raise RedrafterError(
                f"{flag} sets an MTP head's depth, but the drafter is {what}.",
                f"Set the EAGLE-3 head's beams with {fix}.",
            )


def check_one_head(drafter_head, head) -> None:
    """Refuse an MTP ``head`` beside a drafter that is a layer head (an EAGLE-3
    head): a draft runs one layer head (``DraftConfig.head``)."""
    if drafter_head is not None and head is not None:
        what = "a DFlash drafter" if getattr(drafter_head, "source", None) == "dflash" else "an EAGLE-3 head"
        raise RedrafterError(
            f"The drafter is {what} and an MTP head was asked for too; a draft runs one layer head.",
            "Drop the MTP head (--mtp none, mtp=None), or draft with another drafter.",
        )


@dataclass
class Loaded:
    """What :func:`load_sources` found: the head and the draft model, and how to name them."""

    head: object = None
    head_label: Optional[str] = None
    draft_model: object = None
    draft_model_label: Optional[str] = None


def load_sources(model, tokenizer, flags: SourceFlags, dtype=None) -> Loaded:
    """The MTP head (``--mtp`` given, else the model's own) and the draft model
    for a loaded ``model``; a head asked for by path but absent, or a draft
    model with another tokenizer, is refused with the reason."""
    from .draft_model import load_draft_model
    from .mtp_load import load_mtp

    out = Loaded()
    if not flags.no_mtp:
        out.head = load_mtp(model, flags.mtp)
        if out.head is None and flags.mtp_depth is not None:
            raise RedrafterError(
                "--mtp-depth was given but the model ships no MTP head.",
                "Point --mtp at the model's original checkpoint or a split MTP folder, or drop --mtp-depth.",
            )
        out.head_label = out.head.found.label if out.head is not None else None
    if flags.draft_model:
        out.draft_model, _ = load_draft_model(flags.draft_model, model, tokenizer, dtype)
        out.draft_model_label = flags.draft_model
    return out
