"""Where a named drafter is: a folder, a drafter the store or the package
knows, or a Hugging Face Hub repo.

:func:`locate` is what ``--drafter SPEC`` and ``load_drafter(SPEC)`` go
through. A Hub repo (``org/name``) is fetched with ``huggingface_hub`` as
mlx-lm fetches models (llm/load.py: ``hub_snapshot``: cached, and the cache
alone under ``HF_HUB_OFFLINE``), then kept in the store (hub/store.py),
one folder per repo, refreshed when the repo's revision changes. Both
layouts load: this project's (``config.json`` + ``model.safetensors``, with
the official key names, so an official safetensors checkpoint is one too) and
the official PyTorch code's (``pytorch_model.bin`` or shards), which is
converted once, through converters/drafter.py's safe reader (no pickle code
runs), into the store. EAGLE-3 heads load too (draft/eagle3_io.py): one in
vLLM's speculators layout is kept as it is, one in the EAGLE repository's
layout is converted once into the speculators layout.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..draft.eagle3_io import layout_of
from ..draft.redrafter import MODEL_TYPE, shipped_drafter_path
from ..errors import RedrafterError
from ..llm.identity import ModelIdentity, model_name
from ..llm.load import hub_snapshot, is_path_like
from . import store

# The files of a drafter repo (README.md: its model card).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.bin", "README.md"]


@dataclass(frozen=True)
class Located:
    """A drafter folder and where it came from (for the announcement)."""

    path: Path
    source: str
    note: Optional[str] = None


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` names a Hub repo (``org/name``) rather than a local path."""
    return spec.count("/") == 1 and not is_path_like(spec) and not Path(spec).expanduser().exists()


def locate(spec, say: Optional[Callable[[str], None]] = None) -> Located:
    """The drafter folder ``spec`` names: an existing folder (or a file in one);
    a stored drafter's name, or the id of a model the store holds a drafter
    for (preferred to the package's own); ``"default"`` or another name a
    drafter ships for; else a Hub repo id, fetched. ``say`` gets one-line
    messages (default: standard error)."""
    spec = str(spec)
    path = Path(spec).expanduser()
    if path.exists():
        return Located(path if path.is_dir() else path.parent, "given")
    stored = store.find_named(spec) or store.find_named(model_name(spec) or spec)
    if stored is not None:
        return Located(stored.path, f"from the store: {stored.source}")
    shipped = shipped_drafter_path(spec)
    if shipped is not None:
        return Located(shipped, "shipped with the package")
    if is_hub_id(spec):
        return fetch(spec, say)
    raise RedrafterError(
        f"Drafter path does not exist: {spec}",
        "Give a drafter folder, a Hub repo id (org/name), a name from `mlx-redrafter drafters list`, or 'default' "
        "for the drafter shipped with the default model.",
    )


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def _stored(repo: str) -> Optional[store.Entry]:
    return next((e for e in store.entries() if (e.meta.get("hub") or {}).get("repo") == repo), None)


def fetch(repo: str, say: Optional[Callable[[str], None]] = None) -> Located:
    """The drafter of the Hub repo ``repo``, in the store (fetched, and
    converted from the PyTorch layout, on its first use or a new revision)."""
    say = say or _say
    kept = _stored(repo)
    try:
        head = hub_snapshot(repo, allow_patterns=["config.json", store.META], what="Drafter")
    except RedrafterError:
        if kept is None:
            raise
        say(f"The Hub cannot be reached: using the copy of {repo} in the store ({kept.path}).")
        return Located(kept.path, kept.source)
    revision = head.name
    if kept is not None and (kept.meta.get("hub") or {}).get("revision") == revision:
        return Located(kept.path, kept.source)
    _check_is_drafter(repo, head)
    snapshot = hub_snapshot(repo, allow_patterns=HUB_PATTERNS, what="Drafter")
    meta = store.read_meta(snapshot)
    identity = ModelIdentity.from_dict(meta.get("base_model"))
    hub = {"repo": repo, "revision": revision}
    config = json.loads((snapshot / "config.json").read_text()) if (snapshot / "config.json").is_file() else {}
    eagle3 = layout_of(config)
    if ((snapshot / "model.safetensors").is_file() and eagle3 != "eagle") or _is_dflash(config):
        path = store.install(snapshot, identity, {**meta, "source": f"hub:{repo}", "hub": hub}, name=store.slug(repo))
        return Located(path, f"hub:{repo}")
    convert = _convert_eagle3 if eagle3 else _convert
    return Located(convert(repo, snapshot, identity, {**meta, "hub": hub}, say), f"converted from hub:{repo}")


def _check_is_drafter(repo: str, folder: Path) -> None:
    """Refuse a repo that is not a drafter (a model repo's weights are never fetched as one)."""
    try:
        kind = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        kind = None
    if kind != MODEL_TYPE and not _is_eagle3(folder):
        raise RedrafterError(
            f"{repo} on the Hugging Face Hub is not a ReDrafter drafter, an EAGLE-3 head or a DFlash drafter "
            f"(config.json model_type {kind!r}), "
            "and the drafter store holds no drafter for a model of that name.",
            f"Make one for it: mlx-redrafter make-drafter --model {repo}",
        )


def _is_dflash(config: dict) -> bool:
    """A DFlash drafter (either layout, safetensors only): kept as it is, shards and all."""
    from ..draft.dflash_io import layout_of as dflash_layout

    return dflash_layout(config) is not None


def _is_eagle3(folder: Path) -> bool:
    """Whether ``folder`` holds a layer-head drafter: an EAGLE-3 head or a DFlash drafter (kept as they are)."""
    try:
        d = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return layout_of(d) is not None or _is_dflash(d)


def eagle3_tensors(folder: Path) -> dict:
    """An EAGLE-3 head's weights as numpy arrays, from whichever file the folder
    holds (a PyTorch pickle is read without running it, converters/torch_pickle.py)."""
    from ..converters.drafter import find_weights, read_weights

    tensors, _ = read_weights(find_weights(folder))
    return {k: t.array for k, t in tensors.items()}


def _convert_eagle3(repo: str, snapshot: Path, identity, meta: dict, say) -> Path:
    """An EAGLE-3 head in the EAGLE repository's layout (or sharded), once into the store in the speculators
    layout, in the dtype its config names (float16 when it names none)."""
    from ..draft.eagle3_io import read_eagle3, save_eagle3

    say(f"Converting the EAGLE-3 head {repo} into the drafter store (once; pickles are read, never run)...")
    dtype = json.loads((snapshot / "config.json").read_text()).get("torch_dtype") or "float16"
    store.store_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=store.store_root(), prefix=".convert-") as tmp:
        head = read_eagle3(snapshot, dtype="float32", tensors=eagle3_tensors(snapshot))  # widened exactly
        out = save_eagle3(head, Path(tmp) / "head", dtype=dtype if dtype in ("float16", "bfloat16") else "float32")
        path = store.install(out, identity, {**meta, "source": f"converted from hub:{repo}"}, name=store.slug(repo))
    say(f"Converted {repo} (EAGLE-3, the EAGLE repository's layout) -> {path}")
    return path


def _convert(repo: str, snapshot: Path, identity, meta: dict, say) -> Path:
    """Convert the PyTorch-layout drafter in ``snapshot`` into the store, once."""
    from ..converters.drafter import convert_drafter

    say(f"Converting the PyTorch drafter {repo} into the drafter store (once; pickles are read, never run)...")
    store.store_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=store.store_root(), prefix=".convert-") as tmp:
        # float32: every source dtype widens to it exactly; the drafter loads at the device's dtype.
        report = convert_drafter(snapshot, Path(tmp) / "drafter", dtype="float32")
        path = store.install(
            report.dst,
            identity,
            {
                **meta,
                "source": f"converted from hub:{repo}",
                "conversion": {"format": report.format, "source_dtypes": report.source_dtypes},
            },
            name=store.slug(repo),
        )
    say(f"Converted {repo} ({report.format}) -> {path}")
    return path
