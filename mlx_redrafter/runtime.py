"""What the user-facing commands share: model + drafter + (W, L) resolution.

Order of precedence for the beam shape: explicit flags, then the tuned profile
saved by ``mlx-redrafter sweep --save-profile`` for this device + model +
drafter, then the built-in defaults. When the profile's best cell was slower
than plain decoding, the session still drafts (the drafter is used unless
``--no-draft`` is given) and its announcement says that ``--no-draft`` is
faster on this device. Lookup drafts (``--lookup/--no-lookup``) follow the
same order: the flag, the profile's choice, ``DEFAULT_LOOKUP`` with a drafter
(none without); ``--drafter none --lookup`` drafts by lookup alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import RedrafterError
from .generate import DEFAULT_LENGTH, DEFAULT_WIDTH, DraftConfig, draft_shape, lookup_beams

SHIPPED_DRAFTERS = {"default": "smollm2-135m-instruct"}
NO_DRAFTER = "none"  # --drafter none: no drafter (lookup drafts only, with --lookup)


def wants_no_drafter(drafter: Optional[str]) -> bool:
    return drafter is not None and drafter.lower() == NO_DRAFTER


def shipped_drafter_path(model_spec: str) -> Optional[Path]:
    """The drafter installed with the package for ``model_spec``, if any."""
    name = SHIPPED_DRAFTERS.get(model_spec)
    if name is None:
        return None
    path = Path(__file__).parent / "drafters" / name
    return path if (path / "config.json").exists() else None


def resolve_drafter_path(model_spec: str, drafter: Optional[str]) -> Path:
    """``--drafter``, else the drafter shipped for ``model_spec``, else a clear error."""
    if drafter is not None:
        path = Path(drafter).expanduser()
        if not path.exists():
            raise RedrafterError(f"Drafter path does not exist: {drafter}", "Check the --drafter path.")
        return path
    path = shipped_drafter_path(model_spec)
    if path is None:
        hint = "(the default model's drafter is not installed yet)" if model_spec == "default" else f"for {model_spec!r}"
        raise RedrafterError(
            f"No drafter given and none ships {hint}.",
            "Pass --drafter PATH (train one with `mlx-redrafter distill` + `mlx-redrafter train`).",
        )
    return path


@dataclass
class Session:
    model: object
    tokenizer: object
    model_spec: str
    drafter: object = None
    drafter_path: Optional[Path] = None
    beam_width: int = DEFAULT_WIDTH
    beam_length: int = DEFAULT_LENGTH
    shape_source: str = "built-in default"
    controller: object = None
    plain_reason: str = "no drafter"
    note: Optional[str] = None  # a measured fact the user should see, e.g. drafting is slower here
    lookup: int = 0  # lookup beams

    def draft(self, **kw) -> DraftConfig:
        """The session's :class:`DraftConfig`."""
        return DraftConfig(self.drafter, self.beam_width, self.beam_length, controller=self.controller,
                           lookup=self.lookup, **kw)

    def announce(self, console) -> None:
        if self.drafter is None:
            if self.lookup:
                console.print(f"[dim]model {self.model_spec}: lookup drafts only (no drafter)[/dim]")
            else:
                console.print(f"[dim]model {self.model_spec}: plain decoding ({self.plain_reason})[/dim]")
            return
        extra = ", adaptive depth" if self.controller is not None else ""
        lookup = f" + {self.lookup} lookup beam{'s' if self.lookup > 1 else ''}" if self.lookup else ", no lookup"
        console.print(
            f"[dim]model {self.model_spec}, drafter {self.drafter_path}: "
            f"W={self.beam_width} L={self.beam_length} ({self.shape_source}{extra}){lookup}[/dim]"
        )
        if self.note:
            console.print(f"[yellow]Note: {self.note}[/yellow]")


def resolve_session(
    model_spec: str = "default",
    drafter_path: Optional[str] = None,
    no_draft: bool = False,
    beam_width: Optional[int] = None,
    beam_length: Optional[int] = None,
    dtype: Optional[str] = None,
    adaptive: bool = False,
    lookup: Optional[bool] = None,
) -> Session:
    """Load the model and pick its drafter, beam shape and lookup beams
    (``lookup=None``: the tuned profile's choice, else ``DEFAULT_LOOKUP``
    with a drafter and none without). ``drafter_path="none"``: no drafter."""
    from .drafter import check_fits, load_drafter
    from .models import load_model, parse_dtype

    no_drafter = wants_no_drafter(drafter_path)
    if no_draft and drafter_path:
        raise RedrafterError("--no-draft and --drafter contradict each other.", "Drop one of them.")
    if no_draft and lookup:
        raise RedrafterError(
            "--no-draft and --lookup contradict each other.",
            "For lookup drafts without a drafter use --drafter none --lookup.",
        )
    if no_drafter and adaptive:
        raise RedrafterError("--adaptive needs a drafter.", "Pass --drafter PATH.")
    if no_drafter:
        drafter_path = None
    for name, v in (("--beam-width", beam_width), ("--beam-length", beam_length)):
        if v is not None and v < 1:
            raise RedrafterError(f"{name} must be at least 1 (got {v}).")
    parse_dtype(dtype)  # fail on a bad dtype before the slow load
    if drafter_path is not None and not Path(drafter_path).expanduser().exists():
        raise RedrafterError(f"Drafter path does not exist: {drafter_path}", "Check the --drafter path.")
    model, tokenizer = load_model(model_spec, dtype=dtype)
    s = Session(model, tokenizer, model_spec)
    if no_draft:
        s.plain_reason = "--no-draft"
        return s
    if no_drafter:
        path = None
    else:
        path = Path(drafter_path).expanduser() if drafter_path else shipped_drafter_path(model_spec)
    if path is None:
        if adaptive:
            raise RedrafterError("--adaptive needs a drafter.", "Pass --drafter PATH.")
        s.plain_reason = "--drafter none" if no_drafter else "no drafter"
        s.lookup = int(bool(lookup))
        return s
    s.drafter = load_drafter(path, dtype=dtype)
    check_fits(s.drafter, model)
    s.drafter_path = path
    s.beam_width, s.beam_length, s.shape_source, profile = draft_shape(model_spec, path, beam_width, beam_length)
    s.lookup = lookup_beams(lookup, s.drafter, profile)
    if adaptive:
        from .controller import load_controller

        s.controller = load_controller(path)
    if profile is not None and profile.get("speedup", 1.0) < 1.0:
        s.note = (
            f"this device's tuned profile measured ReDrafter at {profile['speedup']:.2f}x of plain decoding; "
            f"--no-draft is faster here (same output)"
        )
    return s
