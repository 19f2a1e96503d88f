"""Write a whole output folder or nothing."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


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
