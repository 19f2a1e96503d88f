"""Where files go and how they are written: the ground floor of the package.

Every writer here is atomic: it writes a temporary sibling and renames it
into place, so an interrupted run never leaves a half-written file or folder
behind. This module imports nothing from the rest of the package.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """Where converted models and tuned profiles live (``$MLX_REDRAFTER_CACHE``)."""
    env = os.environ.get("MLX_REDRAFTER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mlx-redrafter"


@contextmanager
def atomic_folder(dst):
    """Yield a temporary sibling of ``dst`` to write into; when the block
    succeeds it replaces ``dst``, otherwise it is removed. An interrupted
    conversion never leaves a half-written folder behind."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(dst):
    """Yield a temporary path next to ``dst`` to write; when the block
    succeeds it is renamed to ``dst``, otherwise removed.

    The temporary name keeps ``dst``'s suffix, because some writers
    (``mx.save_safetensors``) add their suffix when it is missing.
    """
    dst = Path(dst)
    tmp = dst.with_name(f".partial-{dst.name}")
    try:
        yield tmp
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path, data, indent=2) -> None:
    """Write ``data`` as JSON to ``path`` atomically."""
    write_text_atomic(path, json.dumps(data, indent=indent) + "\n")
