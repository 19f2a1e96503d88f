"""The chat's settings: what ``/set`` and the ``chat`` command's flags can change."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Dict, Optional

from ..config import DEFAULT_LENGTH, DEFAULT_WIDTH, SamplingConfig
from ..errors import RedrafterError


@dataclass
class ChatSettings:
    """What ``/set`` can change during a chat."""

    max_tokens: int = 512
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    beam_width: int = DEFAULT_WIDTH
    beam_length: int = DEFAULT_LENGTH
    lookup: int = 0  # lookup beams (drafts copied from the conversation)
    show_drafts: bool = False

    def as_dict(self) -> dict:
        """The settings as ``/set`` names them (sampling keys flat)."""
        values = {**asdict(self.sampling), **{f.name: getattr(self, f.name) for f in fields(self)}}
        return {k: values[k] for k in SETTABLE}

    def update(self, changes: dict) -> None:
        """Apply checked ``/set`` changes (see :func:`parse_settings`)."""
        sampling_keys = {f.name for f in fields(SamplingConfig)}
        self.sampling = replace(self.sampling, **{k: v for k, v in changes.items() if k in sampling_keys})
        for k, v in changes.items():
            if k not in sampling_keys:
                setattr(self, k, v)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


# key: (parse, is valid, what a valid value is)
SETTABLE: Dict[str, tuple] = {
    "max_tokens": (int, lambda v: v >= 1, "an integer >= 1"),
    "temp": (_parse_float, lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    "top_p": (_parse_float, lambda v: 0 <= v <= 1, "a number from 0 to 1 (0 = off)"),
    "top_k": (int, lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    "min_p": (_parse_float, lambda v: 0 <= v <= 1, "a number from 0 to 1 (0 = off)"),
    "beam_width": (int, lambda v: v >= 1, "an integer >= 1"),
    "beam_length": (int, lambda v: v >= 1, "an integer >= 1"),
    "lookup": (int, lambda v: v >= 0, "an integer >= 0 (lookup beams; 0 = off)"),
    "show_drafts": (_parse_bool, lambda v: True, "on or off"),
}
DRAFT_KEYS = ("beam_width", "beam_length")


def check_setting(key: str, value, name: Optional[str] = None) -> None:
    """Refuse a value outside the range of setting ``key`` (``name``: how
    the message calls it, e.g. the flag)."""
    _, valid, what = SETTABLE[key]
    if not valid(value):
        raise RedrafterError(f"{name or key} must be {what} (got {value}).")


def parse_settings(args: str, has_drafter: bool) -> dict:
    """``"beam_width=3 temp=0.7"`` -> ``{"beam_width": 3, "temp": 0.7}``, all
    validated (nothing is applied when one is wrong)."""
    changes = {}
    for item in args.split():
        key, eq, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not raw:
            raise RedrafterError(f"'{item}' is not key=value.", "Example: /set beam_width=3 temp=0.7")
        if key not in SETTABLE:
            raise RedrafterError(f"'{key}' is not a setting.", f"Settable: {', '.join(SETTABLE)}.")
        parse, _, what = SETTABLE[key]
        try:
            value = parse(raw)
        except ValueError:
            raise RedrafterError(f"{key} must be {what} (got {raw}).") from None
        check_setting(key, value)
        if key in DRAFT_KEYS and not has_drafter:
            raise RedrafterError(
                f"{key} has no effect: this chat decodes without a drafter.",
                "Start the chat without --no-draft, or with --drafter PATH for a model that has no shipped drafter.",
            )
        changes[key] = value
    return changes
