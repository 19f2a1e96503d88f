"""Tuned (beam width, beam length) profiles per device + model + drafter.

``mlx-redrafter sweep --save-profile`` writes one; ``generate`` and ``chat``
read it when no width or length is given. Profiles live in
``cache_root()/profiles`` (``$MLX_REDRAFTER_CACHE`` overrides the root).
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Optional

import mlx.core as mx

from .files import cache_root, write_json_atomic


def device_id() -> str:
    """The machine kind a measurement holds for: OS, CPU arch, MLX device, BLAS."""
    from .doctor import blas_info

    dev = mx.default_device()
    blas = "gpu" if dev == mx.gpu else blas_info().name.split(" ")[0]
    kind = getattr(dev.type, "name", str(dev.type))  # "cpu", not "DeviceType.cpu"
    return f"{platform.system()}-{platform.machine()}-{kind}-{blas}".lower()


def drafter_id(drafter_path) -> str:
    """The drafter's absolute folder plus its weights' size and mtime: a
    retrained drafter gets a new profile and sweep results key. A folder of
    several weight files (an MTP head in a sharded checkpoint, a draft
    model) is keyed by all of them."""
    p = Path(drafter_path).resolve()
    if (p / "model.safetensors").is_file():
        st = (p / "model.safetensors").stat()
        return f"{p}:{st.st_size}:{st.st_mtime_ns}"
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(p.glob("*.safetensors"))]
    return f"{p}:{hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]}"


def model_id(model_spec) -> str:
    """The identity of a model spec that what is kept per model (tuned
    profiles, datastores) is keyed by: a local model path in absolute form,
    so that ``./m`` and ``m`` share it; other specs (``default``, Hub ids)
    as they are."""
    spec = str(model_spec)
    path = Path(spec).expanduser()
    return str(path.resolve()) if spec != "default" and path.exists() else spec


def profile_path(model_spec: str, drafter_path) -> Path:
    key = json.dumps([device_id(), model_id(model_spec), drafter_id(drafter_path)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "profiles" / f"{digest}.json"


def save_profile(model_spec: str, drafter_path, beam_width: int, beam_length: int, **extra) -> Path:
    path = profile_path(model_spec, drafter_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "device": device_id(),
        "model": str(model_spec),
        "drafter": str(Path(drafter_path).resolve()),
        "beam_width": int(beam_width),
        "beam_length": int(beam_length),
        **extra,
    }
    write_json_atomic(path, data)  # a run killed mid-write leaves the old profile, never half a file
    return path


def lookup_profile(model_spec: str, drafter_path) -> Optional[dict]:
    path = profile_path(model_spec, drafter_path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    data["file"] = str(path)
    return data
