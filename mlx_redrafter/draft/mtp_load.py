"""Where a model's MTP head is, and reading it (the head itself: draft/mtp.py).

mlx-lm's loaders throw a model's MTP weights away (its ``sanitize`` drops
``mtp.*`` and the next-n layer), so this module reads them again from the
files:

* **The original checkpoint**: the model's own folder (a Hub snapshot of
  e.g. ``Qwen/Qwen3.5-0.8B`` keeps every tensor), or any folder given with
  ``--mtp``. The shards that hold the family's MTP keys (from
  ``model.safetensors.index.json``, else every ``*.safetensors``) are read;
  MLX loads lazily, so the rest of a shard is never read. Quantized MTP
  weights load quantized (then the dtype policy applies, as to the model).
  Qwen's norms are zero-centred in a Hugging Face checkpoint: ``+1`` is
  added, unless the files are already in MLX's layout (mlx-lm's own test:
  a ``conv1d`` weight stored ``(C, K, 1)``).
* **A split MTP folder** as mlx-vlm writes it (``split_qwen3_5_mtp``):
  ``config.json`` with ``model_type: qwen3_5_mtp`` and the target's
  ``text_config``, ``model.safetensors`` with the MTP keys without their
  ``mtp.`` prefix and the norms already shifted. Converted mlx-community
  models have dropped the tensors; a split folder brings them back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

from ..errors import RedrafterError
from .mtp import MIMO, NEXT_N, QWEN, checkpoint_keys, family_of, load_head, text_args

SPLIT_TYPES = {"qwen3_5_mtp": ("qwen3_5", "qwen3_5_moe")}
FAMILIES = QWEN + NEXT_N + MIMO


@dataclass(frozen=True)
class Found:
    """Where a model's MTP weights are: ``files`` hold ``keys`` (checkpoint names)."""

    path: Path
    family: str
    layout: str  # "checkpoint" or "split"
    files: tuple
    layers: int  # MTP decoder layers the head stacks (next-n: the first module only)
    modules: int = 1  # next-n modules in the checkpoint (only the first drafts)

    @property
    def label(self) -> str:
        """How listings and announcements name it."""
        where = "split MTP folder" if self.layout == "split" else "checkpoint"
        return f"{self.family} MTP head, {self.layers} layer{'s' if self.layers > 1 else ''} ({where} {self.path})"


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RedrafterError(f"Cannot read {path}: {e}", "Restore the file or give another folder.") from None


def _shards(folder: Path, pattern) -> List[Path]:
    """The safetensors files of ``folder`` that hold keys matching ``pattern``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = {f for k, f in _json(index).get("weight_map", {}).items() if pattern.match(k)}
        return [folder / n for n in sorted(names)]
    return [f for f in sorted(folder.glob("*.safetensors")) if any(pattern.match(k) for k in _keys(f))]


def _header(file: Path) -> dict:
    """The JSON header of a safetensors file (names, shapes, metadata), nothing else read."""
    import struct

    try:
        with open(file, "rb") as fh:
            size = struct.unpack("<Q", fh.read(8))[0]
            return json.loads(fh.read(size))
    except (OSError, ValueError, struct.error):
        return {}


def _keys(file: Path) -> List[str]:
    """The tensor names of a safetensors file."""
    return [k for k in _header(file) if k != "__metadata__"]


def find_mtp(folder, model_type: Optional[str] = None, num_hidden_layers: Optional[int] = None) -> Optional[Found]:
    """The MTP weights in ``folder`` (a checkpoint or a split folder), or None.

    ``model_type``/``num_hidden_layers``: the target's, when known (a split
    folder says its own; a checkpoint's config.json says them otherwise).
    """
    folder = Path(folder).expanduser()
    if not (folder / "config.json").is_file():
        return None
    config = _json(folder / "config.json")
    kind = config.get("model_type", "")
    if kind in SPLIT_TYPES:
        text = config.get("text_config") or {}
        layers = int(text.get("mtp_num_hidden_layers", 1))
        files = (folder / "model.safetensors",)
        return Found(folder, model_type or SPLIT_TYPES[kind][0], "split", files, layers)
    text = config.get("text_config") or config
    family = model_type or kind
    if family not in FAMILIES:
        return None
    n = num_hidden_layers if num_hidden_layers is not None else int(text.get("num_hidden_layers", 0))
    pattern = checkpoint_keys(family, n)
    files = tuple(_shards(folder, pattern))
    if not files:
        return None
    keys = [pattern.match(k).group(1) for f in files for k in _keys(f) if pattern.match(k)]
    modules = int(text.get("num_nextn_predict_layers", 1) or 1) if family in NEXT_N else 1
    return Found(folder, family, "checkpoint", files, _layer_count(keys), modules)


def _layer_count(keys) -> int:
    """Decoder layers in a Qwen MTP stack (``layers.{i}.*``); one elsewhere."""
    found = {k.split(".")[1] for k in keys if k.startswith("layers.")}
    return max(len(found), 1)


def read_found(found: Found, num_hidden_layers: int) -> Dict[str, mx.array]:
    """The MTP tensors of ``found``, keyed without their checkpoint prefix (lazily read)."""
    if found.layout == "split":
        return dict(mx.load(str(found.files[0])))
    pattern = checkpoint_keys(found.family, num_hidden_layers)
    out = {}
    for f in found.files:
        try:
            arrays = mx.load(str(f))
        except Exception as e:
            raise RedrafterError(f"{f} cannot be read (truncated or corrupt): {e}", "Restore the file.") from None
        out.update({pattern.match(k).group(1): v for k, v in arrays.items() if pattern.match(k)})
    return out


def hf_layout(found: Found) -> bool:
    """Whether a Qwen checkpoint is in Hugging Face's layout (zero-centred
    norms). A split folder never is; nor are files MLX wrote (metadata
    ``format: mlx``, mlx-vlm's test); otherwise mlx-lm's test decides (a
    ``conv1d`` weight stored ``(C, 1, K)``), and without one it is taken as HF."""
    if found.layout == "split":
        return False
    for f in found.files:
        header = _header(f)
        if (header.get("__metadata__") or {}).get("format") == "mlx":
            return False
        for k, v in header.items():
            if "conv1d.weight" in k and isinstance(v, dict):
                return v.get("shape", [1])[-1] != 1
    return True


def model_folder(model) -> Optional[Path]:
    """The folder :func:`~mlx_redrafter.llm.load.load_model` loaded ``model`` from, if it recorded one."""
    path = getattr(model, "redrafter_path", None)
    return Path(path) if path is not None else None


def locate_mtp(model, where=None) -> Optional[Found]:
    """The MTP weights for a loaded ``model``: in ``where`` (a checkpoint or a
    split folder) when given, else in the model's own folder; None if none."""
    family = family_of(model)
    args = text_args(model) if family in FAMILIES else None
    n = getattr(args, "num_hidden_layers", None)
    if where is not None:
        folder = Path(where).expanduser()
        if not folder.is_dir():
            raise RedrafterError(
                f"MTP path does not exist: {folder}",
                "Give the model's original checkpoint folder or a split MTP folder (config.json + *.safetensors).",
            )
        found = find_mtp(folder, family or None, n)
        if found is None:
            raise RedrafterError(
                f"No MTP weights for a {family or 'model of this kind'} in {folder}.",
                f"Give a checkpoint that ships MTP weights ({', '.join(FAMILIES)}) or a split folder "
                f"({', '.join(SPLIT_TYPES)}).",
            )
        return found
    folder = model_folder(model)
    if folder is None or family not in FAMILIES:
        return None
    return find_mtp(folder, family, n)


def load_mtp(model, where=None):
    """The :class:`~mlx_redrafter.draft.mtp.MTPHead` of a loaded ``model``
    (see :func:`locate_mtp`), or None when it ships none. A split folder or
    checkpoint made for another model is refused, with the reason."""
    found = locate_mtp(model, where)
    if found is None:
        return None
    family = family_of(model)
    if family not in FAMILIES:
        raise RedrafterError(
            f"MTP heads draft for {', '.join(FAMILIES)} models; this model is {family or 'of an unknown type'}.",
            "Load the model the MTP head belongs to, or drop --mtp.",
        )
    if found.layout == "split" and family not in SPLIT_TYPES.get(_split_type(found), ()):
        raise RedrafterError(
            f"The split MTP folder {found.path} is for {', '.join(SPLIT_TYPES[_split_type(found)])}, "
            f"not for this {family} model.",
            "Give the split folder made from this model's checkpoint.",
        )
    _check_split_config(found, model)
    n = text_args(model).num_hidden_layers
    head = load_head(
        model, family, read_found(found, n), zero_centred=family in QWEN and hf_layout(found), num_layers=found.layers
    )
    head.found = found
    return head


def _split_type(found: Found) -> str:
    return _json(found.path / "config.json").get("model_type", "")


def _check_split_config(found: Found, model) -> None:
    """A split folder's ``text_config`` must describe this model (hidden size and vocabulary)."""
    if found.layout != "split":
        return
    text = _json(found.path / "config.json").get("text_config") or {}
    args = text_args(model)
    for name in ("hidden_size", "vocab_size"):
        theirs, ours = text.get(name), getattr(args, name, None)
        if theirs is not None and theirs != ours:
            raise RedrafterError(
                f"The split MTP folder {found.path} has {name} {theirs} but the model has {ours}.",
                "Give the split folder made from this model's checkpoint.",
            )


class _Held:
    """A plain holder: a head kept on the model must not become one of its modules."""

    def __init__(self, head):
        self.head = head


def mtp_for(model):
    """The MTP head the model ships (:func:`load_mtp` from its own folder),
    read once and kept on the model; None when it ships none."""
    held = getattr(model, "redrafter_mtp", None)
    if isinstance(held, _Held):
        return held.head
    head = load_mtp(model)
    model.redrafter_mtp = _Held(head)
    return head


def resolve_mtp(model, mtp):
    """``mtp=`` of a call as a head or None: ``"auto"`` the model's own
    (:func:`mtp_for`), None/False none, a path a checkpoint or split folder,
    a head as it is."""
    if mtp is None or mtp is False:
        return None
    if isinstance(mtp, str) and mtp == "auto":
        return mtp_for(model)
    if isinstance(mtp, str) and mtp.lower() == "none":
        return None
    if isinstance(mtp, (str, Path)):
        return load_mtp(model, mtp)
    if not (hasattr(mtp, "make_cache") and callable(mtp)):
        raise RedrafterError(
            f"mtp= must be 'auto', None, a folder or a layer head (got {type(mtp).__name__}).",
            "Pass mtp='auto' (the model's own head), None, or the path of a checkpoint or split MTP folder.",
        )
    return mtp
