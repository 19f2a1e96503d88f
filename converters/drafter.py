"""Convert PyTorch-trained ReDrafter drafters into MLX drafter folders.

A source is a drafter folder (``config.json`` plus ``model.safetensors``,
``pytorch_model.bin``, or shards listed in ``model.safetensors.index.json`` /
``pytorch_model.bin.index.json``), one weights file inside such a folder, or a
Hugging Face repo id (read from the cache when offline). The output folder
holds ``config.json`` and ``model.safetensors`` written by
:func:`~mlx_redrafter.drafter.save_drafter`: the official key names and
shapes, so the official PyTorch code loads it as well.

Pickled checkpoints are never executed. ``.bin`` files (torch's zip format,
and the legacy pre-1.6 format) are read by an unpickler that resolves only
the globals in :data:`ALLOWED_GLOBALS` (tensor rebuilders, storage types,
``OrderedDict`` and plain builtins) and builds arrays with numpy; torch is not
needed. Any other global (``os.system``, ``builtins.eval``, a class of the
training code) stops the read when the unpickler meets it, before anything
could be called.
"""

from __future__ import annotations

import _compat_pickle
import builtins
import collections
import io
import json
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..draft.drafter import MODEL_TYPE, Drafter, DrafterConfig, read_config, check_fits, check_weights, load_safetensors, save_drafter
from ..errors import RedrafterError
from ..files import atomic_folder
from ..llm.load import hub_snapshot, is_path_like, load_model_only, parse_dtype
from ..tuning.cost import StepCost, decode_step_cost, draft_step_cost, model_dtype

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
class SourceTensor:
    """One checkpoint tensor as numpy (bfloat16 widened to float32, exactly)
    and the dtype it had in the file."""

    array: np.ndarray
    dtype: str

    @property
    def shape(self) -> Tuple[int, ...]:
        return self.array.shape


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


# --------------------------------------------------------------------------- safe unpickling


@dataclass(frozen=True, slots=True)
class _StorageType:
    name: str  # dtype name, as torch calls it
    raw: str  # numpy dtype of the stored elements (bfloat16 is read as uint16)


_STORAGE_TYPES = {
    "DoubleStorage": _StorageType("float64", "f8"),
    "FloatStorage": _StorageType("float32", "f4"),
    "HalfStorage": _StorageType("float16", "f2"),
    "BFloat16Storage": _StorageType("bfloat16", "u2"),
    "LongStorage": _StorageType("int64", "i8"),
    "IntStorage": _StorageType("int32", "i4"),
    "ShortStorage": _StorageType("int16", "i2"),
    "CharStorage": _StorageType("int8", "i1"),
    "ByteStorage": _StorageType("uint8", "u1"),
    "BoolStorage": _StorageType("bool", "?"),
}


@dataclass(eq=False, slots=True)
class _Storage:
    """A flat storage; ``data`` is filled from the file (or a slice of ``base``
    for legacy storage views). Slots: a pickle's BUILD cannot add attributes."""

    type: _StorageType
    numel: int
    data: Optional[np.ndarray] = None
    base: Optional["_Storage"] = None
    offset: int = 0

    def array(self) -> np.ndarray:
        if self.base is not None:
            return self.base.array()[self.offset : self.offset + self.numel]
        return self.data


@dataclass(frozen=True, eq=False, slots=True)
class _LazyTensor:
    """What ``torch._utils._rebuild_tensor_v2`` would build, as a description:
    legacy files store the storage bytes after the pickle. Frozen, so that a
    pickle's BUILD cannot change it after the checks."""

    storage: _Storage
    offset: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]

    def materialize(self, source: str, key: str) -> SourceTensor:
        data, kind = self.storage.array(), self.storage.type
        if not (isinstance(data, np.ndarray) and data.ndim == 1 and isinstance(kind, _StorageType)):
            raise _corrupt(source, f"the storage of tensor {key} was not read")
        size, stride, offset = self.size, self.stride, self.offset
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if 0 not in size and last >= len(data):
            # as_strided would read outside the storage: never build such a view.
            raise _corrupt(source, f"tensor {key} does not fit in its storage")
        view = np.lib.stride_tricks.as_strided(data[offset:], shape=size, strides=[s * data.itemsize for s in stride])
        arr = np.array(view)  # an owned, contiguous copy
        if kind.name == "bfloat16":
            arr = bfloat16_to_float32(arr)
        return SourceTensor(arr, kind.name)


def dtype_name(dtype: mx.Dtype) -> str:
    """``mx.float16`` -> ``"float16"``."""
    return str(dtype).split(".")[-1]


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly (bfloat16 is the top half of float32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _is_index(n) -> bool:
    return type(n) is int and n >= 0


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    """Stands in for ``torch._utils._rebuild_tensor_v2``: checks the arguments, copies nothing yet."""
    size, stride = tuple(size), tuple(stride)
    if not (
        isinstance(storage, _Storage)
        and _is_index(storage_offset)
        and len(size) == len(stride)
        and all(_is_index(n) for n in size + stride)
    ):
        raise pickle.UnpicklingError("_rebuild_tensor_v2 with invalid arguments")
    return _LazyTensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    return data  # nn.Parameter is a tensor with requires_grad; keep the tensor


_SAFE_BUILTINS = ("dict", "list", "tuple", "set", "frozenset", "int", "float", "bool", "str", "complex")

ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    **{("builtins", name): getattr(builtins, name) for name in _SAFE_BUILTINS},
    **{(module, name): t for module in ("torch", "torch.cuda") for name, t in _STORAGE_TYPES.items()},
}


class _SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`ALLOWED_GLOBALS`.

    Every callable a pickle can call (REDUCE, NEWOBJ, INST, OBJ, EXT) comes
    from ``find_class``, so refusing there refuses everything else; BUILD only
    reaches objects made by allowed globals (whose own objects are frozen or
    slotted). Storages come through ``persistent_load``.
    """

    def __init__(self, file, source: str, load_storage):
        super().__init__(file)
        self.source = source
        self.load_storage = load_storage

    def find_class(self, module, name):
        # Protocol-2 pickles (torch's default) name Python 2 modules (`__builtin__`):
        # map them as pickle's own find_class does, then look them up.
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        obj = ALLOWED_GLOBALS.get((module, name))
        if obj is None:
            raise RedrafterError(
                f"{self.source} refers to the global `{module}.{name}`, which is not a tensor, "
                "storage or plain container: the file was refused and nothing in it was run.",
                "A drafter checkpoint holds only a state dict of tensors. If you trust where the file "
                "comes from, re-save its state dict as safetensors and convert that.",
            )
        return obj

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        if not isinstance(pid[1], _StorageType):
            raise pickle.UnpicklingError("storage without a storage type")
        return self.load_storage(pid)


def _corrupt(source, detail) -> RedrafterError:
    return RedrafterError(
        f"{source} cannot be read (truncated or corrupt: {detail}).", "Download or copy the checkpoint again."
    )


def _unpickle(file, source: str, load_storage):
    try:
        return _SafeUnpickler(file, source, load_storage).load()
    except RedrafterError:
        raise
    except Exception as e:  # UnpicklingError, EOFError, TypeError, ... on bad bytes
        raise _corrupt(source, f"{type(e).__name__}: {e}") from None


def _read_storage_bytes(raw: bytes, storage: _Storage, big_endian: bool, source: str, key: str):
    dtype = np.dtype(storage.type.raw).newbyteorder(">" if big_endian else "<")
    if len(raw) != storage.numel * dtype.itemsize:
        raise _corrupt(source, f"storage {key} holds {len(raw)} bytes, expected {storage.numel * dtype.itemsize}")
    storage.data = np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="))


def _read_torch_zip(path: Path) -> dict:
    """torch >= 1.6 format: a zip of ``data.pkl`` and one raw file per storage."""
    source = str(path)
    with zipfile.ZipFile(path) as zf:
        pickles = [n for n in zf.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise _corrupt(source, "no single data.pkl in the zip")
        prefix = pickles[0][: -len("data.pkl")]
        names = set(zf.namelist())
        big = prefix + "byteorder" in names and zf.read(prefix + "byteorder").strip() == b"big"
        storages: Dict[str, _Storage] = {}

        def load_storage(pid):
            _, typ, key, _location, numel = pid[:5]
            key = str(key)
            if key not in storages:
                if f"{prefix}data/{key}" not in names:
                    raise _corrupt(source, f"storage {key} is missing")
                s = _Storage(typ, int(numel))
                _read_storage_bytes(zf.read(f"{prefix}data/{key}"), s, big, source, key)
                storages[key] = s
            return storages[key]

        return _unpickle(io.BytesIO(zf.read(pickles[0])), source, load_storage)


LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001


def _read_torch_legacy(path: Path) -> dict:
    """torch < 1.6 format: magic, version, sys-info and data pickles, the
    sorted storage keys, then each storage as an int64 count and raw bytes."""
    source = str(path)
    with open(path, "rb") as f:
        if _unpickle(f, source, _no_storage) != LEGACY_MAGIC:
            raise _not_torch(path)
        if _unpickle(f, source, _no_storage) != LEGACY_PROTOCOL:
            raise _corrupt(source, "unknown legacy protocol version")
        sys_info = _unpickle(f, source, _no_storage)
        big = isinstance(sys_info, dict) and sys_info.get("little_endian") is False
        roots: Dict[str, _Storage] = {}
        views: Dict[str, _Storage] = {}

        def load_storage(pid):
            _, typ, key, _location, numel = pid[:5]
            view = pid[5] if len(pid) > 5 else None
            root = roots.setdefault(str(key), _Storage(typ, int(numel)))
            if view is None:
                return root
            view_key, offset, view_size = view
            return views.setdefault(str(view_key), _Storage(typ, int(view_size), base=root, offset=int(offset)))

        obj = _unpickle(f, source, load_storage)
        keys = _unpickle(f, source, _no_storage)
        for key in keys if isinstance(keys, list) else []:
            s = roots.get(str(key))
            if s is None:
                raise _corrupt(source, f"unknown storage {key}")
            count = int.from_bytes(f.read(8), "big" if big else "little")
            if count != s.numel:  # checked before reading: the count comes from the file
                raise _corrupt(source, f"storage {key} holds {count} elements, expected {s.numel}")
            _read_storage_bytes(f.read(count * np.dtype(s.type.raw).itemsize), s, big, source, str(key))
        return obj


def _no_storage(pid):
    raise pickle.UnpicklingError("a storage outside the data pickle")


def _not_torch(path: Path) -> RedrafterError:
    return RedrafterError(
        f"{path} is not a PyTorch checkpoint this converter reads "
        "(torch.save zip format, or the legacy pre-1.6 format).",
        "Re-save the state dict with torch.save (torch >= 1.6) or as safetensors.",
    )


def read_torch_bin(path) -> Dict[str, SourceTensor]:
    """Tensors of a ``torch.save``-d state dict, without torch and without running the pickle."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(2)
    if zipfile.is_zipfile(path):
        try:
            obj = _read_torch_zip(path)
        except zipfile.BadZipFile as e:
            raise _corrupt(str(path), str(e)) from None
    elif head == b"\x80\x02":  # legacy files start with a protocol-2 pickle
        obj = _read_torch_legacy(path)
    elif head == b"PK":
        raise _corrupt(str(path), "an incomplete zip archive")
    else:
        raise _not_torch(path)
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, _LazyTensor) for k, v in obj.items()):
        what = type(obj).__name__ + (f" with keys {', '.join(map(str, list(obj)[:5]))}" if isinstance(obj, dict) else "")
        raise RedrafterError(
            f"{path} does not hold a state dict of tensors (it holds a {what}).",
            "Save the drafter with save_pretrained, or torch.save(drafter.state_dict(), path).",
        )
    try:
        return {k: v.materialize(str(path), k) for k, v in obj.items()}
    except RedrafterError:
        raise
    except Exception as e:  # a storage a hostile BUILD replaced, ...
        raise _corrupt(str(path), f"{type(e).__name__}: {e}") from None


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
        raise RedrafterError(f"{index} is not a valid shard index ({e}).", "Download or copy the checkpoint again.") from None
    files = [index.parent / f for f in dict.fromkeys(weight_map.values())]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise RedrafterError(f"{index} lists shards that are missing: {', '.join(missing)}.", "Download the missing shards.")
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
        raise RedrafterError(f"{path} lists tensors that no shard holds: {', '.join(absent)}.", "Download the shards again.")
    return tensors, files


def _find_weights(folder: Path) -> Path:
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
    tensors, files = read_weights(weights or _find_weights(folder))
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
            f"rounding error of the dtype change: max abs {self.max_abs_error:.3g}, max relative {self.max_rel_error:.3g}",
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
