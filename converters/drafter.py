"""Convert PyTorch-trained ReDrafter drafters into MLX drafter folders.

A source is a drafter folder (``config.json`` plus ``model.safetensors``,
``pytorch_model.bin``, or shards listed in ``model.safetensors.index.json`` /
``pytorch_model.bin.index.json``), one weights file inside such a folder, or a
Hugging Face repo id (read from the cache when offline). The output folder
holds ``config.json`` and ``model.safetensors`` written by
:func:`~mlx_redrafter.draft.redrafter.save_drafter`: the official key names and
shapes, so the official PyTorch code loads it as well.

Pickled checkpoints are never executed (torch_pickle.py reads them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..draft.redrafter import (
    MODEL_TYPE,
    Drafter,
    DrafterConfig,
    check_fits,
    check_weights,
    load_safetensors,
    read_config,
    save_drafter,
)
from ..errors import RedrafterError
from ..files import atomic_folder
from ..llm.load import hub_snapshot, is_path_like, load_model_only, parse_dtype
from ..tuning.cost import StepCost, decode_step_cost, draft_step_cost, model_dtype
from .torch_pickle import SourceTensor, dtype_name, read_torch_bin

# Files looked for in a drafter folder, in this order.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.bin"]
DEFAULT_DTYPE = "float16"


@dataclass
class Checkpoint:
    folder: Path
    config: DrafterConfig
    tensors: Dict[str, SourceTensor]
    files: List[Path]  # the weight files read (shards included)

    @property
    def format(self) -> str:
        kind = "safetensors" if self.files[0].suffix == ".safetensors" else "pytorch pickle"
        return kind if len(self.files) == 1 else f"{kind}, {len(self.files)} shards"

    @property
    def dtypes(self) -> List[str]:
        return sorted({t.dtype for t in self.tensors.values()})

    @property
    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


# --------------------------------------------------------------------------- reading checkpoints


def read_safetensors(path) -> Dict[str, SourceTensor]:
    """Tensors of a safetensors file (bfloat16 widened to float32, exactly)."""
    arrays = load_safetensors(path, "Download or copy the checkpoint again.")
    out = {}
    for k, v in arrays.items():
        out[k] = SourceTensor(np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v), dtype_name(v.dtype))
    return out


def _read_weight_file(path: Path) -> Dict[str, SourceTensor]:
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    if path.suffix in (".bin", ".pt", ".pth"):
        return read_torch_bin(path)
    raise RedrafterError(f"Unknown weights file type: {path}", "Use .safetensors or a torch.save .bin file.")


def _shards(index: Path) -> Tuple[List[Path], set]:
    """Shard files (in order of first use) and keys listed by an ``*.index.json``."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise RedrafterError(
            f"{index} is not a valid shard index ({e}).", "Download or copy the checkpoint again."
        ) from None
    files = [index.parent / f for f in dict.fromkeys(weight_map.values())]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise RedrafterError(
            f"{index} lists shards that are missing: {', '.join(missing)}.", "Download the missing shards."
        )
    return files, set(weight_map)


def read_weights(path: Path) -> Tuple[Dict[str, SourceTensor], List[Path]]:
    """Tensors of one weights file or of every shard of an ``*.index.json``."""
    if not path.name.endswith(".index.json"):
        return _read_weight_file(path), [path]
    files, listed = _shards(path)
    tensors: Dict[str, SourceTensor] = {}
    for f in files:
        tensors.update(_read_weight_file(f))
    absent = sorted(listed - set(tensors))
    if absent:
        raise RedrafterError(
            f"{path} lists tensors that no shard holds: {', '.join(absent)}.", "Download the shards again."
        )
    return tensors, files


def find_weights(folder: Path) -> Path:
    """The weights file (or shard index) of a drafter folder, in the order of ``WEIGHT_FILES``."""
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    indexes = sorted(folder.glob("*.index.json"))
    if indexes:
        return indexes[0]
    raise RedrafterError(
        f"No drafter weights in {folder}.",
        "A drafter folder holds config.json and model.safetensors or pytorch_model.bin "
        "(or shards listed in model.safetensors.index.json / pytorch_model.bin.index.json).",
    )


def resolve_source(src) -> Tuple[Path, Optional[Path]]:
    """``(folder, weights file or None)`` for a folder, a weights file or a Hub repo id."""
    spec = str(src)
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file():
            return path.parent, (None if path.name == "config.json" else path)
        return path, None
    if is_path_like(spec) or spec.count("/") != 1:
        raise RedrafterError(
            f"Drafter path does not exist: {spec}", "Check the path, or give a Hugging Face repo id (owner/name)."
        )
    return hub_snapshot(spec, allow_patterns=HUB_PATTERNS, what="Drafter"), None


def read_checkpoint(src) -> Checkpoint:
    """The config and tensors of a drafter folder, weights file or Hub repo id (nothing is executed)."""
    folder, weights = resolve_source(src)
    config = read_config(folder)
    if config.model_type != MODEL_TYPE:
        raise RedrafterError(
            f"{folder} is not a ReDrafter drafter (config.json has model_type {config.model_type!r}).",
            f"Point at a drafter folder (model_type {MODEL_TYPE!r}); LLMs are loaded with --model.",
        )
    tensors, files = read_weights(weights or find_weights(folder))
    return Checkpoint(folder, config, tensors, files)


# --------------------------------------------------------------------------- checks and casting


def check_finite(tensors: Dict[str, SourceTensor], source: str) -> None:
    """Raise, naming the key, when a weight holds NaN or Inf."""
    for k, t in tensors.items():
        if np.issubdtype(t.array.dtype, np.floating) and not np.isfinite(t.array).all():
            kind = "NaN" if np.isnan(t.array).any() else "Inf"
            raise RedrafterError(
                f"Drafter weight {k} in {source} contains {kind} values.",
                "The checkpoint is damaged or its training diverged; use another checkpoint.",
            )


def cast_weights(tensors: Dict[str, SourceTensor], config: DrafterConfig, dtype: mx.Dtype) -> Dict[str, mx.array]:
    """Floating weights in ``dtype``; other tensors (``draft_vocab``) in the drafter's own dtype.
    Raises when a weight overflows ``dtype``."""
    from mlx.utils import tree_flatten

    expected = dict(tree_flatten(Drafter(config).parameters()))
    out = {}
    for k, t in tensors.items():
        a = mx.array(t.array)
        if mx.issubdtype(a.dtype, mx.floating):
            a = a.astype(dtype)
            if not mx.all(mx.isfinite(a)).item():
                raise RedrafterError(
                    f"Drafter weight {k} overflows {dtype_name(dtype)} (max |w| = {np.abs(t.array).max():.4g}).",
                    "Convert with --dtype float32 or --dtype bfloat16.",
                )
        else:
            a = a.astype(expected[k].dtype)
        out[k] = a
    return out


def rounding_error(tensors: Dict[str, SourceTensor], weights: Dict[str, mx.array]) -> Tuple[float, float]:
    """Max absolute and max relative change of any weight (relative over nonzero weights)."""
    max_abs = max_rel = 0.0
    for k, t in tensors.items():
        if not np.issubdtype(t.array.dtype, np.floating):
            continue
        x = t.array.astype(np.float64)
        err = np.abs(np.array(weights[k].astype(mx.float32)).astype(np.float64) - x)
        nz = x != 0
        max_abs = max(max_abs, float(err.max(initial=0.0)))
        max_rel = max(max_rel, float((err[nz] / np.abs(x[nz])).max(initial=0.0)))
    return max_abs, max_rel


# --------------------------------------------------------------------------- convert


@dataclass
class ConversionReport:
    src: Path
    dst: Path
    format: str
    source_dtypes: List[str]
    dtype: str
    num_params: int
    max_abs_error: float
    max_rel_error: float

    def lines(self) -> List[str]:
        return [
            f"converted {self.src} ({self.format}, {'/'.join(self.source_dtypes)}) -> {self.dst} ({self.dtype})",
            f"parameters: {self.num_params:,}",
            f"rounding error of the dtype change: max abs {self.max_abs_error:.3g}, "
            f"max relative {self.max_rel_error:.3g}",
        ]


def _check_destination(dst: Path, src_folder: Path) -> None:
    if dst.resolve() == src_folder.resolve():
        raise RedrafterError(f"The output folder {dst} is the source folder.", "Write the MLX drafter to a new folder.")
    if dst.exists():
        if not dst.is_dir():
            raise RedrafterError(f"{dst} exists and is a file.", "Choose a new output folder.")
        others = sorted({p.name for p in dst.iterdir()} - {"config.json", "model.safetensors"})
        if others:
            raise RedrafterError(
                f"{dst} exists and holds other files ({', '.join(others[:5])}).",
                "Choose a new or empty output folder (only a previous drafter there is replaced).",
            )


def _write(drafter: Drafter, dst: Path, dtype: mx.Dtype) -> None:
    with atomic_folder(dst) as tmp:
        save_drafter(drafter, tmp, dtype=dtype)


def convert_drafter(src, dst, dtype=DEFAULT_DTYPE, model: Optional[str] = None) -> ConversionReport:
    """Convert the drafter ``src`` into the MLX drafter folder ``dst``.

    Args:
        src: a drafter folder, a weights file in one, or a Hugging Face repo id.
        dst: output folder (``config.json`` + ``model.safetensors``).
        dtype: ``"float16"`` (default), ``"float32"`` or ``"bfloat16"``.
        model: an LLM spec (as for ``load_model``); when given, the drafter
            must fit its hidden size and input embedding.

    Raises :class:`RedrafterError` for unknown or missing keys, shapes that
    contradict ``config.json``, NaN / Inf weights, overflow in ``dtype`` and a
    drafter that does not fit ``model``; nothing is written then.
    """
    target = parse_dtype(dtype) or parse_dtype(DEFAULT_DTYPE)
    dst = Path(dst).expanduser()
    ckpt = read_checkpoint(src)
    _check_destination(dst, ckpt.folder)
    source = f"drafter in {ckpt.folder}"
    check_weights(ckpt.config, ckpt.tensors, source)
    check_finite(ckpt.tensors, source)
    weights = cast_weights(ckpt.tensors, ckpt.config, target)
    drafter = Drafter(ckpt.config)
    drafter.load_weights(list(weights.items()))
    if model is not None:
        check_fits(drafter, load_model_only(model, lazy=True))  # shapes only
    max_abs, max_rel = rounding_error(ckpt.tensors, weights)
    _write(drafter, dst, target)
    return ConversionReport(
        ckpt.folder, dst, ckpt.format, ckpt.dtypes, dtype_name(target), drafter.num_params(), max_abs, max_rel
    )


# --------------------------------------------------------------------------- inspect


@dataclass
class DrafterInfo:
    folder: Path
    config: DrafterConfig
    format: str
    dtypes: List[str]
    num_params: int
    size_bytes: int
    model_dtype: Optional[str] = None
    draft: Optional[StepCost] = None  # one draft step, one beam, at the model's dtype
    decode: Optional[StepCost] = None  # one LLM decode step

    def lines(self) -> List[str]:
        cfg = self.config.to_dict()
        out = [
            f"drafter:      {self.folder} ({self.format})",
            "config:       " + ", ".join(f"{k}={v}" for k, v in cfg.items() if k != "model_type"),
            f"parameters:   {self.num_params:,}",
            f"size on disk: {self.size_bytes:,} bytes ({self.size_bytes / 2**20:.1f} MiB)",
            f"dtype:        {'/'.join(self.dtypes)}",
        ]
        if self.draft is not None:
            d, m = self.draft, self.decode
            out += [
                f"cost per draft step (1 beam) vs one LLM decode step, at {self.model_dtype}:",
                f"  draft step:  {d.flops / 1e6:,.2f} MFLOPs, {d.bytes / 1e6:,.2f} MB read",
                f"  LLM step:    {m.flops / 1e6:,.2f} MFLOPs, {m.bytes / 1e6:,.2f} MB read",
                f"  ratio:       {d.flops / m.flops:.3f}x FLOPs, {d.bytes / m.bytes:.3f}x bytes",
            ]
        return out


def inspect_drafter(src, model: Optional[str] = None, dtype=None) -> DrafterInfo:
    """Config, parameter count, size and dtype of a drafter (MLX or PyTorch
    format, nothing executed); with ``model``, its per-step cost relative to
    that LLM (loaded with ``dtype``, default: the device policy)."""
    ckpt = read_checkpoint(src)
    check_weights(ckpt.config, ckpt.tensors, f"drafter in {ckpt.folder}")
    drafter = Drafter(ckpt.config)  # shapes only: its random weights are never evaluated
    info = DrafterInfo(ckpt.folder, ckpt.config, ckpt.format, ckpt.dtypes, drafter.num_params(), ckpt.size_bytes)
    if model is not None:
        llm = load_model_only(model, dtype=dtype)
        check_fits(drafter, llm)
        info.model_dtype = dtype_name(model_dtype(llm))
        info.draft = draft_step_cost(ckpt.config, model_dtype(llm).size)
        info.decode = decode_step_cost(llm)
    return info
