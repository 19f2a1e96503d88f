"""The drafter store: drafters kept per model under ``cache_root()/drafters``.

A stored drafter is a folder ``<family>/<name>/`` holding the drafter's
files (``config.json``, ``model.safetensors``, the controller's when it has
one) and :data:`META` (``redrafter.json``): the model it was trained for
(its :class:`~mlx_redrafter.llm.identity.ModelIdentity`), where it came
from, its data, recipe, held-out acceptance and verdict. ``make-drafter``
installs into it, drafters fetched from the Hub are kept in it, and the
tools look in it (:func:`find`) for the drafter of the model they loaded.

The drafters shipped in the package (``mlx_redrafter/drafters/``, with their
own META) are part of what :func:`find` and :func:`entries` see; a drafter
in the store made for the same model is preferred to them. A drafter whose
sizes do not fit the model (draft/kinds.py: ``head_fit_problem``) is never
picked; :func:`candidates` says why.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from ..draft.kinds import head_fit_problem as fit_problem
from ..draft.kinds import read_head_config as read_config
from ..draft.redrafter import SHIPPED_DRAFTERS
from ..errors import RedrafterError
from ..files import atomic_folder, cache_root, write_json_atomic
from ..llm.identity import ModelIdentity, model_identity  # noqa: F401 (the store's interface)

META = "redrafter.json"
FORMAT = 1
# The files a drafter folder may hold that the store keeps (nothing else is copied:
# a work folder's distilled data stays where it is).
DRAFTER_FILES = (
    "config.json",
    "model.safetensors",
    "controller.json",
    "controller.safetensors",
    "train_log.jsonl",
    "README.md",
)
# The folder of drafters whose base model is not known (an official drafter from the Hub):
# used when named (--drafter org/name), never found for a model by itself.
UNKNOWN_FAMILY = "any-model"


@dataclass(frozen=True)
class Entry:
    """One drafter the store or the package holds."""

    path: Path
    meta: dict
    shipped: bool = False
    problem: Optional[str] = None  # why it cannot be used (for `drafters list`), None when it can

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def base(self) -> Optional[ModelIdentity]:
        return ModelIdentity.from_dict(self.meta.get("base_model"))

    @property
    def model_id(self) -> str:
        return (self.meta.get("base_model") or {}).get("id") or "?"

    @property
    def source(self) -> str:
        return "shipped with the package" if self.shipped else self.meta.get("source", "?")

    @property
    def speedup(self) -> Optional[float]:
        """The verdict's measured speed-up of the drafter over plain decoding."""
        return ((self.meta.get("verdict") or {}).get("drafter") or {}).get("speedup")


@dataclass(frozen=True)
class Found:
    """The drafter :func:`find` picked for a model: ``exact`` when it was
    trained on this very copy (same fingerprint, or shipped for its name)."""

    path: Path
    meta: dict
    exact: bool
    shipped: bool = False

    @property
    def source(self) -> str:
        return Entry(self.path, self.meta, self.shipped).source

    def note(self, identity: ModelIdentity) -> Optional[str]:
        """The one-line note for a drafter trained on another copy of the model."""
        if self.exact:
            return None
        base = self.meta.get("base_model") or {}
        return (
            f"the drafter was trained for {base.get('id', '?')} (fingerprint {str(base.get('fingerprint', '?'))[:8]}), "
            f"another copy of this model ({identity.id}, {identity.short}): it fits and the output is the same, "
            f"its speed-up may differ"
        )


def store_root() -> Path:
    """``cache_root()/drafters`` (``$MLX_REDRAFTER_CACHE``)."""
    return cache_root() / "drafters"


def shipped_root() -> Path:
    return Path(__file__).resolve().parent.parent / "drafters"


def read_meta(path) -> dict:
    """The metadata of a drafter folder; ``{}`` for a folder without one
    (a drafter trained by hand) or with an unreadable one."""
    try:
        meta = json.loads((Path(path) / META).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def slug(text: str) -> str:
    """A folder name for a model id: ``org/name`` -> ``org--name``."""
    keep = "".join(c if c.isalnum() or c in "._-" else "-" for c in text.replace("/", "--"))
    return keep.strip(".-") or "model"


def default_name(identity: ModelIdentity) -> str:
    """``<model id>-<fingerprint>``: one folder per copy of a model."""
    return f"{slug(identity.id)}-{identity.short}"


def install(folder, identity: Optional[ModelIdentity], meta: dict, name: Optional[str] = None) -> Path:
    """Copy the drafter in ``folder`` into the store for ``identity``'s model
    (atomically: an interrupted install leaves nothing) and write its META:
    ``meta`` with ``format``, ``created`` and ``base_model`` filled in from
    ``identity``. ``identity=None``: the base model is not known (META's own
    ``base_model``, if any, is kept), the drafter goes where only its name finds it.
    A drafter that does not fit ``identity`` is refused. Returns the installed folder."""
    src = Path(folder)
    config = read_config(src)
    if not (src / "model.safetensors").is_file():
        raise RedrafterError(
            f"No model.safetensors in {src}.", "Install a drafter folder (config.json + model.safetensors)."
        )
    if identity is not None:
        problem = fit_problem(config, identity.hidden_size, identity.vocab_size, identity.num_layers or 1 << 30)
        if problem:
            raise RedrafterError(f"Not installed: {problem}", f"Install it for the model it was trained for ({src}).")
    full = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **meta}
    if identity is not None:
        full["base_model"] = identity.to_dict()
    family = identity.family if identity is not None else UNKNOWN_FAMILY
    dst = store_root() / family / (name or (default_name(identity) if identity is not None else slug(src.name)))
    with atomic_folder(dst) as tmp:
        for f in DRAFTER_FILES:
            if (src / f).is_file():
                shutil.copy2(src / f, tmp / f)
        write_json_atomic(tmp / META, full)
    return dst


def _problem(path: Path, meta: dict, identity: Optional[ModelIdentity]) -> Optional[str]:
    """Why the drafter in ``path`` cannot draft for ``identity`` (default: the base model its META names)."""
    try:
        config = read_config(path)
    except RedrafterError as e:
        return e.problem
    if not (path / "model.safetensors").is_file():
        return f"no model.safetensors in {path}"
    target = identity or ModelIdentity.from_dict(meta.get("base_model"))
    if target is None:
        return None
    return fit_problem(config, target.hidden_size, target.vocab_size, target.num_layers or 1 << 30)


def _folders(root: Path) -> List[Path]:
    """The drafter folders one level below ``root`` (not an install's temporary sibling)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def entries(identity: Optional[ModelIdentity] = None) -> List[Entry]:
    """Every drafter of the store and the package (for ``identity``: those
    of its family), each with why it cannot be used, if it cannot."""
    families = [store_root() / identity.family] if identity else _folders(store_root())
    out = []
    for family in families:
        for path in _folders(family):
            meta = read_meta(path)
            out.append(Entry(path, meta, False, _problem(path, meta, identity)))
    for path in _folders(shipped_root()):
        meta = read_meta(path)
        if identity is None or (meta.get("base_model") or {}).get("family") == identity.family:
            out.append(Entry(path, meta, True, _problem(path, meta, identity)))
    return out


def _rank(entry: Entry, identity: ModelIdentity) -> tuple:
    """Best first: a stored drafter of this very copy, of this model's name, the
    package's for this name, then any of the family; the newest first among equals."""
    base = entry.meta.get("base_model") or {}
    shipped_for = entry.shipped and SHIPPED_DRAFTERS.get(identity.id) == entry.name
    if not entry.shipped and base.get("fingerprint") == identity.fingerprint:
        order = 0
    elif not entry.shipped and base.get("id") == identity.id:
        order = 1
    else:
        order = 2 if shipped_for else 3 + entry.shipped
    return order, "~" if entry.shipped else _negated(entry.meta.get("created", ""))


def _negated(created: str) -> str:
    """Sorts later timestamps first."""
    return "".join(chr(255 - ord(c)) for c in created)


def candidates(identity: ModelIdentity) -> List[Entry]:
    """The drafters of ``identity``'s family, best first, each with its problem (None: usable)."""
    return sorted(entries(identity), key=lambda e: _rank(e, identity))


def find(identity: ModelIdentity) -> Optional[Found]:
    """The drafter the tools use for ``identity``'s model, or None (see :func:`candidates`)."""
    for e in candidates(identity):
        if e.problem is None:
            base = e.meta.get("base_model") or {}
            exact = base.get("fingerprint") == identity.fingerprint or (
                e.shipped and SHIPPED_DRAFTERS.get(identity.id) == e.name
            )
            return Found(e.path, e.meta, exact, e.shipped)
    return None


def find_named(spec: str) -> Optional[Entry]:
    """A stored drafter named by its folder name, by the id of the model it was
    trained for (the newest), or by where it came from (``hub:org/name``)."""
    found = [e for e in entries() if not e.shipped and spec in (e.name, e.model_id, e.meta.get("source"))]
    found.sort(key=lambda e: (e.name != spec, _negated(e.meta.get("created", ""))))
    return found[0] if found else None


def remove(spec: str) -> List[Path]:
    """Delete the stored drafters named ``spec`` (a folder name, or every one
    trained for the model id ``spec``); returns their folders."""
    hits = [e for e in entries() if spec in (e.name, e.model_id, str(e.path))]
    shipped = [e for e in hits if e.shipped]
    if shipped and len(shipped) == len(hits):
        raise RedrafterError(
            f"{shipped[0].path} ships with the package and cannot be removed.",
            "Pass --no-draft or --drafter none to run without it.",
        )
    gone = [e.path for e in hits if not e.shipped]
    if not gone:
        raise RedrafterError(
            f"No drafter {spec!r} in the store ({store_root()}).",
            "`mlx-redrafter drafters list` shows the stored drafters.",
        )
    for path in gone:
        shutil.rmtree(path)
    return gone


class _Cached:
    """What :func:`drafter_for` found for a model, kept as a plain attribute
    of it (not a dict or a Module, so never one of the model's parameters)."""

    __slots__ = ("key", "drafter", "found")

    def __init__(self, key, drafter, found):
        self.key, self.drafter, self.found = key, drafter, found


def drafter_for(model, model_spec: Optional[str] = None):
    """``(drafter, found)``: the store's drafter for ``model`` loaded in the
    model's float dtype, or ``(None, None)``. Cached on the model: a later
    call costs one ``stat`` of the model's family folder, and sees a drafter
    installed or removed since."""
    from ..draft.kinds import read_head

    identity = model_identity(model, model_spec)
    family = store_root() / identity.family
    key = (str(family), family.stat().st_mtime_ns if family.is_dir() else None)
    cached = getattr(model, "redrafter_store_drafter", None)
    if isinstance(cached, _Cached) and cached.key == key:
        return cached.drafter, cached.found
    found = find(identity)
    drafter = None if found is None else read_head(found.path, dtype=_float_dtype(model))
    if hasattr(drafter, "bind"):  # a layer head reads the model's layers (and maybe its embedding)
        drafter.bind(model)
    model.redrafter_store_drafter = _Cached(key, drafter, found)
    return drafter, found


def _float_dtype(model):
    """The dtype of the model's floating weights (None: the device policy)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return next((v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)), None)
