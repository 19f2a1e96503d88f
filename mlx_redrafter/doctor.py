"""Facts about this machine that decide inference speed: versions, device, dtype, BLAS."""

from __future__ import annotations

import os
import platform
import re
import time
from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx

BLIS_PATH = "/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3"
# Where Debian and Ubuntu put it, for any architecture (the Makefile looks there too).
BLIS_GLOB = "/usr/lib/*-linux-gnu/blis-pthread/libblas.so.3"
SLOW_GFLOPS = 10.0


@dataclass
class BlasInfo:
    name: str  # "BLIS", "OpenBLAS", "Accelerate", "bundled reference BLAS", "GPU", ...
    library: Optional[str]
    slow: bool


def _loaded_libraries() -> list:
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if ".so" in line})
    except OSError:
        return []


def blas_info() -> BlasInfo:
    """Which BLAS MLX's CPU backend calls. A library in ``LD_PRELOAD`` wins the
    symbol lookup; otherwise the ``mlx-cpu`` wheel's bundled netlib BLAS is used."""
    if platform.system() == "Darwin":
        return BlasInfo("Accelerate", None, False)
    for lib in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":"):
        real = os.path.realpath(lib).lower() if lib else ""
        for pattern, name in (("blis", "BLIS"), ("openblas", "OpenBLAS"), ("mkl", "MKL")):
            if pattern in real:
                return BlasInfo(name, lib, False)
    bundled = [lib for lib in _loaded_libraries() if re.search(r"mlx_cpu\.libs/libblas", lib)]
    if bundled:
        return BlasInfo("bundled reference BLAS (netlib)", bundled[0], True)
    return BlasInfo("system BLAS", None, False)


def installed_blis() -> Optional[str]:
    """The BLIS library installed on this machine (pthread build), or None."""
    import glob

    found = sorted(glob.glob(BLIS_GLOB))
    return found[0] if found else None


def blis_fix(installed: Optional[str] = None) -> List[str]:
    """The commands that give MLX BLIS here: preloading it when it is
    ``installed`` (default: :func:`installed_blis`; ``""``: not installed),
    else installing it first."""
    installed = installed_blis() if installed is None else installed
    if installed:
        return [f"export LD_PRELOAD={installed}"]
    return ["sudo apt-get install libblis4-pthread", f"export LD_PRELOAD={BLIS_PATH}"]


def slow_blas_warning(info: Optional[BlasInfo] = None, device=None, installed: Optional[str] = None) -> Optional[str]:
    """One line to print when a command starts on MLX's CPU backend with the
    bundled reference BLAS (decoding is about 3.5x slower than with BLIS), or
    None when the BLAS is fine: the fix preloads BLIS when it is
    ``installed`` (default: :func:`installed_blis`; ``""``: not installed),
    installs it first when not. ``info`` and ``device`` default to this process's."""
    device = mx.default_device() if device is None else device
    if device != mx.cpu:
        return None
    info = blas_info() if info is None else info
    if not info.slow:
        return None
    installed = installed_blis() if installed is None else installed
    fix = (
        f"BLIS is installed: run with LD_PRELOAD={installed}"
        if installed
        else f"sudo apt-get install libblis4-pthread, then run with LD_PRELOAD={BLIS_PATH}"
    )
    return (
        f"Warning: MLX runs on the CPU with the {info.name}, about 3.5x slower than with BLIS. "
        f"Fix: {fix} (make chat/serve/test do this for you)."
    )


def matmul_gflops(n: int = 768, repeats: int = 5) -> float:
    """Measured float32 matmul speed of the default device."""
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a @ b)
    tic = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    dt = (time.perf_counter() - tic) / repeats
    return 2 * n**3 / dt / 1e9


def report() -> dict:
    """Everything ``mlx-redrafter doctor`` prints, as a dict (also stored with benchmarks)."""
    import mlx_lm

    from .llm.load import default_dtype

    device = mx.default_device()
    info = {
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}",
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "device": str(device),
        "default_dtype": str(default_dtype()).split(".")[-1],
        "cpu_count": os.cpu_count(),
    }
    if device == mx.gpu:
        info["blas"] = "GPU (MLX kernels)"
        info["blas_slow"] = False
    else:
        blas = blas_info()
        info["blas"] = blas.name
        info["blas_library"] = blas.library
        info["blas_slow"] = blas.slow
    return info
