"""What the user-facing commands run on: a :class:`Runtime` (the loaded model,
its tokenizer, and the :class:`~mlx_redrafter.config.DraftConfig` resolved
once from flags, the tuned profile and the built-in defaults, config.py).

A :class:`Runtime` is the model side of a command; a chat's conversation
is :class:`~mlx_redrafter.chat.ChatSession`. When the profile's best cell
was slower than plain decoding, the runtime still drafts (the drafter is used unless
``--no-draft`` is given) and its announcement says that ``--no-draft`` is
faster on this device. Lookup drafts (``--lookup/--no-lookup``) follow the
same order: the flag, the profile's choice, ``DEFAULT_LOOKUP`` with a drafter
(none without); ``--drafter none --lookup`` drafts by lookup alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rich.markup import escape

from .config import DraftConfig, resolve
from .draft.redrafter import SHIPPED_DRAFTERS, shipped_drafter_path  # noqa: F401 (re-exported)
from .draft.stateful import SourceFlags
from .errors import RedrafterError
from .keywords import plain_tree, tree_kw, with_curve, with_sources
from .step.plan import asks

_HEAD_WORDS = {"eagle3": "EAGLE-3", "dflash": "DFlash"}  # a layer head's name in the announcement (else MTP)
NO_DRAFTER = "none"  # --drafter none: no drafter (lookup drafts only, with --lookup)


def wants_no_drafter(drafter: Optional[str]) -> bool:
    return drafter is not None and drafter.lower() == NO_DRAFTER


def resolve_drafter_path(model_spec: str, drafter: Optional[str]) -> Path:
    """``--drafter`` (a folder, a stored drafter, a Hub repo: hub/locate.py
    ``locate``), else the store's or the package's drafter for
    ``model_spec`` (found from its files, before any load), else a clear error."""
    from .hub.locate import locate
    from .hub.store import find
    from .llm.load import identity_for_spec

    if drafter is not None:
        return locate(drafter).path
    found = find(identity_for_spec(model_spec))
    if found is None:
        raise RedrafterError(
            f"No drafter given and the drafter store holds none for {model_spec!r}.",
            f"Make one with `mlx-redrafter make-drafter --model {model_spec}`, or pass --drafter PATH|org/name.",
        )
    return found.path


@dataclass
class Runtime:
    """A loaded model and how it drafts: what ``generate``, ``chat``, ``serve``
    and the tools hand to the engine (``draft`` as it is, no keyword spreading)."""

    model: object
    tokenizer: object
    model_spec: str
    draft: DraftConfig = field(default_factory=DraftConfig)
    drafter_path: Optional[Path] = None
    shape_origin: str = "built-in default"
    plain_reason: str = "no drafter"
    note: Optional[str] = None  # a measured fact the user should see, e.g. drafting is slower here
    history: object = None  # a draft.stores.History: chat and serve append each reply to it
    drafter_origin: Optional[str] = None  # where the drafter came from: the store, the package, the Hub
    drafter_note: Optional[str] = None  # e.g. the drafter was trained on another copy of the model
    hint: Optional[str] = None  # no drafter: how to make one
    source_labels: tuple = ()  # the stateful sources, named: ("MTP head: ...", "draft model: ...")

    _plans: dict = field(default_factory=dict, repr=False)

    def plan(self, structured: bool = False, batched: bool = False):
        """The :class:`~mlx_redrafter.step.plan.DraftPlan` of the runtime's draft
        (``structured``: for a generation under a grammar; ``batched``: for the
        rows of a batch), made once per draft."""
        from .step.plan import make_plan

        key = (id(self.draft), structured, batched)
        if key not in self._plans:
            self._plans = {k: v for k, v in self._plans.items() if k[0] == id(self.draft)}
            plan = make_plan(self.model, self.draft, grammar=structured, batched=batched)
            self._plans[key] = (self.draft, plan)
        return self._plans[key][1]

    # Read-only views of the resolved draft, for the announcement and reports.
    drafter = property(lambda self: self.draft.drafter)
    beam_width = property(lambda self: self.draft.beam_width)
    beam_length = property(lambda self: self.draft.beam_length)
    controller = property(lambda self: self.draft.controller)
    lookup = property(lambda self: self.draft.lookup)

    def announce(self, console) -> None:
        """One line that says, without the paper's terms, how each step drafts."""
        copies = f"{self.lookup} cop{'ies' if self.lookup > 1 else 'y'} from the context"
        if self.draft.datastore is not None:  # its one row stands in when lookup finds nothing
            copies = f"{copies} (else 1 from the datastore)" if self.lookup else "1 copy from the datastore"
        guesses = self._guesses()
        copied = self.draft.lookup or self.draft.datastore is not None  # a row copied from the context each step
        if self.drafter is None:
            if asks(self.draft):
                what = " + ".join(guesses + ([copies] if copied else []))
                line = f"model {self.model_spec}, drafting: {what} per step{'' if guesses else ' (no drafter)'}"
                if self.drafter_path is not None:  # an EAGLE-3 drafter: a layer head, not draft.drafter
                    adaptive = ", adaptive depth" if self.controller is not None else ""
                    line += f" [{self.shape_origin}{adaptive}, drafter {self.drafter_path}]"
                console.print(f"[dim]{escape(line)}[/dim]")
                self._announce_sources(console)
                self._announce_datastore(console)
                self._announce_unpaid(console)
            else:
                console.print(f"[dim]model {self.model_spec}: plain decoding ({self.plain_reason})[/dim]")
            if self.hint:
                console.print(f"[yellow]{escape(self.hint)}[/yellow]", soft_wrap=True)
            return
        w, length = self.beam_width, self.beam_length
        extra = ", adaptive depth" if self.controller is not None else ""
        if self.draft.tree == "auto":
            curve = "built-in curve" if self.draft.curve is None or self.draft.curve.builtin else "measured curve"
            extra += f", tree auto on the {curve}"
        line = (
            f"model {self.model_spec}, drafting: {' + '.join(guesses)}"
            f"{' + ' + copies + ' per step' if copied else ' per step (no copies from the context)'} "
            f"[W={w} L={length} ({self.shape_origin}{extra}), drafter {self.drafter_path}"
            f"{f' ({self.drafter_origin})' if self.drafter_origin else ''}]"
        )
        console.print(f"[dim]{escape(line)}[/dim]")
        self._announce_sources(console)
        for note in (self.drafter_note, self.note):
            if note:
                console.print(f"[yellow]Note: {escape(note)}[/yellow]")
        self._announce_datastore(console)
        self._announce_unpaid(console)

    def _guesses(self) -> list:
        """What each drafting source proposes per step, in words."""
        d, out = self.draft, []
        for who, source, width, length in (
            ("drafter", d.drafter, d.beam_width, d.beam_length),
            (_HEAD_WORDS.get(getattr(d.head, "source", None), "MTP"), d.head, d.head_width, d.head_length),
            ("draft-model", d.draft_model, d.draft_model_width, d.draft_model_length),
        ):
            if source is not None:
                out.append(
                    f"{width} {who} guess{'es' if width > 1 else ''} of {length} token{'s' if length > 1 else ''}"
                )
        return out

    def _announce_sources(self, console) -> None:
        for label in self.source_labels:
            console.print(f"[dim]{escape(label)}[/dim]", soft_wrap=True)

    def _announce_unpaid(self, console) -> None:
        if self.draft.tree == "auto" and asks(self.draft) and not self.plan().drafting:
            c2 = self.draft.curve(2) if self.draft.curve is not None else None
            cost = f" (2 tokens cost {c2:.2f} plain steps)" if c2 is not None else ""
            console.print(
                f"[yellow]Note: tree auto: on this device's verify-cost curve{cost} no draft can pay, "
                "so generation runs plain decoding (same output).[/yellow]"
            )

    def _announce_datastore(self, console) -> None:
        store = self.draft.datastore
        if store is not None:
            console.print(f"[dim]datastore: {len(store)} sequences, {store.tokens} tokens[/dim]")


@dataclass
class LoadOptions:
    """What a command loads and how it drafts, as its flags say: built once at
    the edge (each command, :func:`load_runtime`'s keywords) and passed whole
    to :func:`open_runtime`. ``drafter``: a folder, a stored drafter, a Hub
    repo, ``"none"`` or None (the store's); ``tree``: ``auto``/``fixed`` (None:
    the default); ``datastore``: a store file, ``"none"``, or None for the
    model's own stores when it drafts (draft/datastore/use.py); ``history``:
    append replies to the model's history; ``sources``: a
    :class:`~mlx_redrafter.draft.stateful.SourceFlags` (by default the model's own
    MTP head, if its checkpoint ships one, and no draft model)."""

    model: str = "default"
    drafter: Optional[str] = None
    no_draft: bool = False
    beam_width: Optional[int] = None
    beam_length: Optional[int] = None
    dtype: Optional[str] = None
    adaptive: bool = False
    lookup: Optional[bool] = None
    tree: Optional[str] = None
    datastore: Optional[str] = None
    history: bool = False
    sources: SourceFlags = field(default_factory=SourceFlags)

    def check(self) -> None:
        """Refuse contradicting or out-of-range flags, before the slow load."""
        from .llm.load import parse_dtype

        if self.no_draft and self.drafter:
            raise RedrafterError("--no-draft and --drafter contradict each other.", "Drop one of them.")
        if self.no_draft and self.lookup:
            raise RedrafterError(
                "--no-draft and --lookup contradict each other.",
                "For lookup drafts without a drafter use --drafter none --lookup.",
            )
        if wants_no_drafter(self.drafter) and self.adaptive:
            raise RedrafterError("--adaptive needs a drafter.", "Pass --drafter PATH.")
        for name, v in (("--beam-width", self.beam_width), ("--beam-length", self.beam_length)):
            if v is not None and v < 1:
                raise RedrafterError(f"{name} must be at least 1 (got {v}).")
        parse_dtype(self.dtype)  # a bad dtype fails now, not after the load
        DraftConfig(**({} if self.tree is None else {"tree": self.tree})).check()
        self.sources.check(self.no_draft)


def load_runtime(model_spec: str = "default", drafter_path: Optional[str] = None, **flags) -> Runtime:
    """Load the model and pick its drafter, beam shape and lookup beams
    (:func:`~mlx_redrafter.config.resolve`: flags > tuned profile > built-in):
    the library's shorthand for :func:`open_runtime` with
    ``LoadOptions(model_spec, drafter_path, **flags)`` (flags: the other
    fields of :class:`LoadOptions`)."""
    return open_runtime(LoadOptions(model_spec, drafter_path, **flags))


def open_runtime(options: LoadOptions) -> Runtime:
    """The :class:`Runtime` that ``options`` describe: flags checked before
    the slow load, the model loaded, its draft resolved (the drafter, the
    stateful sources, the datastore) and planned as the library plans it
    (:func:`~mlx_redrafter.step.plan.make_plan`: ``generate``, ``chat``
    and ``serve`` refuse what ``stream_generate`` refuses, with its words);
    under ``tree="auto"`` the draft carries this device's verify-cost curve
    (:func:`~mlx_redrafter.step.curve.curve_for`)."""
    options.check()  # contradicting flags fail before the slow load
    rt = _load_drafting(options)
    if not options.no_draft:
        _add_sources(rt, options.sources, options.lookup, options.dtype)
    _add_datastore(rt, options.datastore, options.history)
    rt.plan()  # the one check of a draft, the library's (make_plan): a draft stream_generate refuses, no command runs
    return rt


def _add_sources(rt: Runtime, flags, lookup, dtype) -> None:
    """The MTP head and the draft model join the runtime's draft; a model
    that ships an MTP head drafts with it (and lookup) by default."""
    import dataclasses

    from .draft.stateful import load_sources

    flags.check_beside_head(rt.draft.head)  # the drafter may be an EAGLE-3 head
    own_out = "--adaptive drafts with the drafter alone" if rt.draft.controller is not None else None  # own MTP out
    own_out = "the drafter (EAGLE-3 or DFlash) is the draft's layer head" if rt.draft.head is not None else own_out
    if own_out and flags.mtp is None:  # the model's own head stays out, said so
        from .draft.mtp_load import locate_mtp

        if locate_mtp(rt.model) is not None:
            rt.source_labels = (f"MTP head: left out ({own_out})",)
        flags = dataclasses.replace(flags, mtp="none")
    found = load_sources(rt.model, rt.tokenizer, flags, dtype)
    if found.head is None and found.draft_model is None:
        return
    head_shape = (None, flags.mtp_depth)
    if found.head is not None and flags.mtp_depth is None:  # `sweep --grid mtp --save-profile`
        profile = tuned_source(rt.model_spec, found.head.found.path, "mtp")
        if profile is not None:
            head_shape = (profile["beam_width"], profile["beam_length"])
            lookup = profile.get("lookup", lookup) if lookup is None else lookup
    draft = with_sources(
        rt.model, rt.draft, found.head, head_shape[1], found.draft_model, flags.num_draft_tokens, lookup, head_shape[0]
    )
    rt.draft = with_curve(rt.model, draft, rt.model_spec)
    rt.source_labels = tuple(
        f"{what}: {label}"
        for what, label in (("MTP head", found.head_label), ("draft model", found.draft_model_label))
        if label
    )
    if found.head is not None:
        rt.hint = None  # the model ships its own drafter


def _add_datastore(rt: Runtime, datastore: Optional[str], history: bool) -> None:
    """Set the runtime's datastore and history (they share the history store)."""
    from dataclasses import replace

    from .draft.datastore.index import default_path, load_or_empty, model_key
    from .draft.datastore.use import History, default_stores, open_datastore

    spec = rt.model_spec
    own_stores = isinstance(datastore, str) and datastore.lower() == "default"
    own = load_or_empty(default_path(spec, "history"), model_key(spec)) if history or own_stores else None
    if history:
        rt.history = History(spec, own)
    if own_stores:
        store = default_stores(spec, own) if asks(rt.draft) else None
    else:
        store = open_datastore(datastore, spec)
    if store is not None:
        rt.draft = replace(rt.draft, datastore=store)


def _load_drafting(options: LoadOptions) -> Runtime:
    """The model and its drafter (the flag's, the store's or the package's), its shape resolved."""
    from .draft.redrafter import check_fits
    from .hub.load import load_drafter
    from .llm.load import load_model

    model_spec, drafter_path, no_draft, lookup, tree = (
        options.model,
        options.drafter,
        options.no_draft,
        options.lookup,
        options.tree,
    )
    no_drafter = wants_no_drafter(drafter_path)
    located = None
    if drafter_path and not no_drafter:  # a missing folder or an uncached Hub repo fails before the slow load
        from .hub.locate import locate

        located = locate(drafter_path)
    model, tokenizer = load_model(model_spec, dtype=options.dtype)
    rt = Runtime(model, tokenizer, model_spec)
    if no_draft:
        rt.plain_reason = "--no-draft"
        return rt
    from .step.verify import tree_support

    why_not = tree_support(model)
    if why_not:  # said before anything announces drafting
        rt.plain_reason = f"{why_not.rstrip('.')}; no drafting for it yet"
        return rt
    located = located or (None if no_drafter else _store_drafter(model, model_spec))
    if located is None:
        if options.adaptive:
            raise RedrafterError("--adaptive needs a drafter.", "Pass --drafter PATH.")
        _without_drafter(rt, no_drafter, lookup, tree)
        return rt
    path = located.path
    rt.drafter_origin, rt.drafter_note = (None if located.source == "given" else located.source), located.note
    drafter = load_drafter(path, dtype=options.dtype)
    check_fits(drafter, model)
    controller = None
    if options.adaptive:
        from .draft.controller import load_controller

        controller = load_controller(path)
    resolved = resolve(
        drafter,
        options.beam_width,
        options.beam_length,
        lookup,
        model_spec=model_spec,
        drafter_path=path,
        controller=controller,
        **tree_kw(tree, model),
    )
    resolved.draft = with_curve(model, resolved.draft, model_spec)
    rt.draft, rt.drafter_path, rt.shape_origin = resolved.draft, path, resolved.origin
    profile = resolved.profile
    if profile is not None and profile.get("speedup", 1.0) < 1.0:
        rt.note = (
            f"this device's tuned profile measured ReDrafter at {profile['speedup']:.2f}x of plain decoding; "
            f"--no-draft is faster here (same output)"
        )
    return rt


def tuned_source(model_spec: str, path, grid: str) -> Optional[dict]:
    """The tuned profile of a stateful source's grid (``sweep --grid mtp
    --save-profile``) for this device + model, keyed by the source's folder."""
    from .profiles import lookup_profile

    try:
        profile = lookup_profile(model_spec, path)
    except OSError:  # a folder without weights files to key it by
        return None
    return profile if profile is not None and profile.get("grid") == grid else None


def _store_drafter(model, model_spec: str):
    """The drafter the store (or the package) holds for the loaded model, as a located folder, or None."""
    from .hub.locate import Located
    from .hub.store import find, model_identity

    identity = model_identity(model, model_spec)
    found = find(identity)
    if found is None:
        return None
    return Located(
        found.path, found.source if found.shipped else f"from the store: {found.source}", found.note(identity)
    )


def _without_drafter(rt: Runtime, no_drafter: bool, lookup, tree: Optional[str]) -> None:
    """The draft of a model without a drafter: lookup drafts as asked; not
    asked (and no ``--drafter none``), where this device's verify-cost curve
    says they pay, with the one line that says how to make a drafter."""
    import dataclasses

    from .step.auto import can_pay
    from .step.curve import curve_for
    from .step.sources import request_sources

    model, spec = rt.model, rt.model_spec
    rt.plain_reason = "--drafter none" if no_drafter else "no drafter"
    draft = with_curve(model, DraftConfig(lookup=int(bool(lookup)), tree=plain_tree(tree, model)), spec)
    if not no_drafter:
        pays = can_pay(request_sources(dataclasses.replace(draft, lookup=1)), curve_for(model, spec))
        if lookup is None:
            draft = dataclasses.replace(draft, lookup=int(pays))
            if not pays:
                rt.plain_reason = "no drafter; lookup drafts do not pay on this device's verify-cost curve"
        rt.hint = f"No drafter for this model yet: `mlx-redrafter make-drafter --model {spec}` makes one."
    rt.draft = draft
