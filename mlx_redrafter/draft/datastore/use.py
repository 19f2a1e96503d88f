"""Which datastores a generation drafts from, and what is kept about them.

A model's stores live in ``cache_root()/datastore/<digest of the model>/``
(:func:`~mlx_redrafter.draft.datastore.index.default_path`):

* ``history.bin``: the replies that ``chat`` and ``serve`` generated, appended
  after each one (``--no-history`` turns it off), and ``history-prompts.bin``
  beside it, the prompt of each (``make-drafter --prompts history`` distils
  from them). It is the user's own text, as token ids, kept on this machine
  only; ``mlx-redrafter datastore clear`` empties both.
* ``built.bin``: replies to training prompts (``mlx-redrafter datastore build``).
* ``corpus.bin``: the user's own documents (``mlx-redrafter datastore add``).
* ``session.json``: the last chat or serve session's datastore counts (``info``).

:func:`open_datastore` turns ``stream_generate``'s ``datastore=`` (a path, a
store, ``None`` for the model's default stores, ``False`` for none) into what
:class:`~mlx_redrafter.config.DraftConfig` holds. The step drafts from it as a
source (step/sources/datastore.py: one row where no source before it copied
from the context).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

from ...errors import RedrafterError
from ...files import write_json_atomic
from .index import NO_MATCH, Datastore, Match, default_path, load_or_empty, model_key

log = logging.getLogger(__name__)

# A store built for a model and shipped with the package (data/datastores/),
# read beside the user's own (see bench/RESULTS.md for whether one ships).
SHIPPED_STORES = {"default": "smollm2-135m-instruct.bin"}
SESSION = "session.json"
LOOKUP, DATASTORE = "lookup", "datastore"  # StepStats.source of their rows


class Stores:
    """Several datastores matched as one: the longest match wins (then the
    more frequent one). ``proposed`` counts the rows drafted from it."""

    def __init__(self, stores: Sequence[Datastore]):
        if not stores:
            raise RedrafterError("Stores needs at least one datastore.")
        self.stores = list(stores)
        self.depth = min(s.depth for s in self.stores)
        self.proposed = 0

    def match(self, history, max_match: int = 16, max_continuations: int = 4, length: int = 4, **kw) -> Match:
        best = NO_MATCH
        for s in self.stores:
            m = s.match(
                history, max_match=min(max_match, s.depth), max_continuations=max_continuations, length=length, **kw
            )
            if (m.length, m.occurrences) > (best.length, best.occurrences):
                best = m
        return best

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.stores)

    def __len__(self) -> int:
        return sum(len(s) for s in self.stores)


def shipped_store_path(model_spec) -> Optional[Path]:
    """The store shipped with the package for ``model_spec``, if any."""
    name = SHIPPED_STORES.get(str(model_spec))
    path = Path(__file__).resolve().parents[1] / "data" / "datastores" / name if name else None
    return path if path is not None and path.is_file() else None


def default_stores(model_spec, history: Optional[Datastore] = None) -> Stores:
    """The model's stores: its history (``history``, if given, is that store
    already opened), built and corpus stores, and the shipped one; each read
    lazily, a missing file is empty and a bad one a warning."""
    key = model_key(model_spec)
    stores = [history or load_or_empty(default_path(model_spec, "history"), key)]
    stores += [load_or_empty(default_path(model_spec, kind), key) for kind in ("built", "corpus")]
    shipped = shipped_store_path(model_spec)
    if shipped is not None:
        stores.append(load_or_empty(shipped, key))
    return Stores(stores)


_DEFAULTS: dict = {}  # (model key, the files' mtimes) -> Stores: a library call reads the files once


def _cached_default_stores(model_spec) -> Stores:
    paths = [default_path(model_spec, kind) for kind in ("history", "built", "corpus")]
    stamp = (model_key(model_spec), tuple(p.stat().st_mtime_ns if p.is_file() else 0 for p in paths))
    if stamp not in _DEFAULTS:
        _DEFAULTS.clear()
        _DEFAULTS[stamp] = default_stores(model_spec)
    return _DEFAULTS[stamp]


def open_datastore(datastore, model_spec=None, drafting: bool = True):
    """What ``DraftConfig.datastore`` holds for a ``datastore=`` argument.

    A path (``str``/``Path``): that file (lazily; a bad file is a warning and
    an empty store). A :class:`Datastore` or :class:`Stores`: as it is.
    ``"default"``: the model's own stores (:func:`default_stores`: history,
    built, corpus) when the draft already drafts (a drafter or lookup) and
    the model was loaded by spec. ``None`` or ``False``: none. Off unless
    asked: in this round's measurements (bench/RESULTS.md section 17) the
    store did not make drafting faster, and a history that grows between
    requests changes the drafts, so seeded sampling would not repeat."""
    if datastore is None or datastore is False:
        return None
    if isinstance(datastore, str) and datastore.lower() == "default":
        return _cached_default_stores(model_spec) if drafting and model_spec is not None else None
    if isinstance(datastore, (str, Path)):
        if str(datastore).lower() == "none":
            return None
        return load_or_empty(Path(datastore).expanduser(), model_key(model_spec) if model_spec else "")
    if hasattr(datastore, "match") and hasattr(datastore, "depth"):
        return datastore
    raise RedrafterError(f"datastore= must be a path, a Datastore, None or False (got {type(datastore).__name__}).")


# -- history and the session's counts --------------------------------------------


@dataclass
class SessionStats:
    """A chat or serve session's datastore counts (``datastore info``)."""

    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))
    replies: int = 0
    tokens: int = 0
    steps: int = 0
    datastore_rows: int = 0  # steps that verified a datastore row
    datastore_steps: int = 0  # steps that accepted tokens from one
    datastore_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.datastore_steps / max(self.datastore_rows, 1)


def session_path(model_spec) -> Path:
    return default_path(model_spec, "history").with_name(SESSION)


def prompts_path(model_spec) -> Path:
    """The history's prompts, beside it: the exact ids each reply answered."""
    return default_path(model_spec, "history").with_name("history-prompts.bin")


def history_prompts(model_spec) -> List[List[int]]:
    """The prompts that ``chat`` and ``serve`` kept for the model, oldest first."""
    return Datastore.open(prompts_path(model_spec), model_key(model_spec)).sequences()


def read_session(model_spec) -> Optional[SessionStats]:
    """The last session's counts, or None (none recorded, or unreadable)."""
    try:
        data = json.loads(session_path(model_spec).read_text())
        return SessionStats(**{k: v for k, v in data.items() if k in SessionStats.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None


class History:
    """Appends replies to a model's history store and keeps the session's counts.

    ``remember(tokens, tally, store, prompt=ids)`` runs after each reply: the
    reply joins the history and its prompt the history's prompts (both saved
    at once, atomically) and the session's counts are written beside them.
    A failure to write is a warning: it never fails a reply."""

    def __init__(self, model_spec, store: Optional[Datastore] = None):
        self.model_spec = model_spec
        self.store = store or load_or_empty(default_path(model_spec, "history"), model_key(model_spec))
        self.prompts = load_or_empty(prompts_path(model_spec), model_key(model_spec))
        self.session = SessionStats()

    def remember(self, tokens: Sequence[int], tally=None, drafts=None, prompt: Optional[Sequence[int]] = None) -> None:
        tokens = [int(t) for t in tokens]
        s = self.session
        s.replies += 1
        if tally is not None:
            s.tokens += tally.tokens
            s.steps += tally.steps
            s.datastore_steps += tally.datastore_steps
            s.datastore_tokens += tally.datastore_tokens
        s.datastore_rows = getattr(drafts, "proposed", s.datastore_rows)
        try:
            if tokens and self.store.refused is None:
                self.store.add(tokens)
                self.store.save()
            if tokens and prompt and self.prompts.refused is None:
                self.prompts.add([int(t) for t in prompt])
                self.prompts.save()
            write_json_atomic(session_path(self.model_spec), asdict(s))
        except (OSError, RedrafterError) as e:
            log.warning("Could not save the datastore history: %s", e)
