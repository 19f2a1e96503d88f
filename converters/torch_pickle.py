"""Read PyTorch pickles (``pytorch_model.bin``) without executing them.

``.bin`` files (torch's zip format, and the legacy pre-1.6 format) are read
by an unpickler that resolves only the globals in :data:`ALLOWED_GLOBALS`
(tensor rebuilders, storage types, ``OrderedDict`` and plain builtins) and
builds arrays with numpy; torch is not needed. Any other global
(``os.system``, ``builtins.eval``, a class of the training code) stops the
read when the unpickler meets it, before anything could be called.
"""

from __future__ import annotations

import _compat_pickle
import builtins
import collections
import io
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import RedrafterError


@dataclass
class SourceTensor:
    """One checkpoint tensor as numpy (bfloat16 widened to float32, exactly)
    and the dtype it had in the file."""

    array: np.ndarray
    dtype: str

    @property
    def shape(self) -> Tuple[int, ...]:
        return self.array.shape


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
        what = type(obj).__name__ + (
            f" with keys {', '.join(map(str, list(obj)[:5]))}" if isinstance(obj, dict) else ""
        )
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
