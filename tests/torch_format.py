"""Writers of torch.save's file formats for tests, without torch.

A state dict pickles as ``OrderedDict`` of ``torch._utils._rebuild_tensor_v2``
calls whose first argument is a persistent id naming a storage
(``('storage', torch.FloatStorage, key, 'cpu', numel)``). To write those
global references without torch, stand-in functions are registered under
torch's module names in ``sys.modules`` for the duration of a write only;
the converter never resolves them (it has its own allow list). Checked once
against torch 2.13: ``torch.load(weights_only=True)`` reads these files and
returns the same tensors.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
import types
import zipfile
from contextlib import contextmanager

import numpy as np

STORAGES = {
    np.dtype("float32"): "FloatStorage",
    np.dtype("float16"): "HalfStorage",
    np.dtype("float64"): "DoubleStorage",
    np.dtype("int64"): "LongStorage",
    np.dtype("bool"): "BoolStorage",
}
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class BF16:
    """bfloat16 bit patterns (uint16), stored in a BFloat16Storage."""

    def __init__(self, bits: np.ndarray):
        self.bits = bits.astype(np.uint16)


@contextmanager
def torch_names():
    """Stand-ins for the torch globals of a state dict, registered in ``sys.modules``."""
    saved = {m: sys.modules.get(m) for m in ("torch", "torch._utils")}
    torch, utils = types.ModuleType("torch"), types.ModuleType("torch._utils")
    sys.modules.update({"torch": torch, "torch._utils": utils})

    def stand_in(module, name):
        def f(*args):
            raise AssertionError("a stand-in is never called")

        f.__module__, f.__qualname__, f.__name__ = module.__name__, name, name
        setattr(module, name, f)
        return f

    names = {"_rebuild_tensor_v2": stand_in(utils, "_rebuild_tensor_v2")}
    for name in (*STORAGES.values(), "BFloat16Storage"):
        names[name] = stand_in(torch, name)
    try:
        yield names
    finally:
        for m, mod in saved.items():
            if mod is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = mod


class _Storage:
    def __init__(self, key: str, kind, raw: np.ndarray):
        self.key, self.kind, self.raw = key, kind, raw


class _Tensor:
    def __init__(self, storage: _Storage, shape, rebuild):
        self.storage, self.shape, self.rebuild = storage, tuple(shape), rebuild

    def __reduce_ex__(self, protocol):
        stride = tuple(int(np.prod(self.shape[i + 1 :])) for i in range(len(self.shape)))
        return self.rebuild, (self.storage, 0, self.shape, stride, False, collections.OrderedDict())


def _state_dict(tensors: dict, names, shapes=None) -> tuple:
    """``OrderedDict`` of stand-in tensors and their storages (one per tensor);
    ``shapes`` overrides the size recorded for some keys (for damaged files)."""
    sd, storages = collections.OrderedDict(), []
    for i, (k, v) in enumerate(tensors.items()):
        if isinstance(v, BF16):
            kind, raw, shape = names["BFloat16Storage"], v.bits, v.bits.shape
        else:
            kind, raw, shape = names[STORAGES[v.dtype]], v, v.shape
        s = _Storage(str(i), kind, np.ascontiguousarray(raw).reshape(-1))
        storages.append(s)
        sd[k] = _Tensor(s, (shapes or {}).get(k, shape), names["_rebuild_tensor_v2"])
    return sd, storages


def _pickle(obj, persistent_id) -> bytes:
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=2)
    p.persistent_id = persistent_id
    p.dump(obj)
    return buf.getvalue()


def write_zip(path, tensors: dict, archive: str = "archive", data_pkl: bytes = None, shapes=None):
    """torch >= 1.6 format. ``data_pkl`` replaces the pickle (for hostile files)."""
    storages = []
    if data_pkl is None:
        with torch_names() as names:
            sd, storages = _state_dict(tensors, names, shapes)
            data_pkl = _pickle(
                sd, lambda o: ("storage", o.kind, o.key, "cpu", o.raw.size) if isinstance(o, _Storage) else None
            )
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{archive}/data.pkl", data_pkl)
        z.writestr(f"{archive}/byteorder", "little")
        for s in storages:
            z.writestr(f"{archive}/data/{s.key}", s.raw.astype(s.raw.dtype.newbyteorder("<")).tobytes())
        z.writestr(f"{archive}/version", "3\n")


def write_legacy(path, tensors: dict, data_pkl: bytes = None):
    """torch < 1.6 format: magic, protocol, sys info, data pickle, keys, raw storages."""
    with torch_names() as names:
        sd, storages = _state_dict(tensors, names)
        data = data_pkl or _pickle(
            sd, lambda o: ("storage", o.kind, o.key, "cpu", o.raw.size, None) if isinstance(o, _Storage) else None
        )
    sys_info = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}
    with open(path, "wb") as f:
        for header in (LEGACY_MAGIC, 1001, sys_info):
            pickle.dump(header, f, protocol=2)
        f.write(data)
        pickle.dump(sorted(s.key for s in storages), f, protocol=2)
        for s in sorted(storages, key=lambda s: s.key):
            f.write(struct.pack("<q", s.raw.size) + s.raw.astype(s.raw.dtype.newbyteorder("<")).tobytes())
