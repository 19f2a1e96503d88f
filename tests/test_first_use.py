"""What a new user meets first: the slow-BLAS warning at start, the shipped
drafter from Python, API errors that name no CLI flag, unknown routes, and a
chat whose Ctrl-C keeps the KV cache (issue 26)."""

from __future__ import annotations

import mlx.core as mx

from mlx_redrafter.doctor import BLIS_PATH, BlasInfo, slow_blas_warning


def test_slow_blas_warning_names_the_fix_on_the_cpu():
    bundled = BlasInfo("bundled reference BLAS (netlib)", "/x/mlx_cpu.libs/libblas.so", True)
    line = slow_blas_warning(bundled, device=mx.cpu)
    assert line and "\n" not in line
    assert "bundled reference BLAS" in line and "libblis4-pthread" in line and BLIS_PATH in line


def test_no_blas_warning_with_blis_or_on_a_gpu():
    assert slow_blas_warning(BlasInfo("BLIS", BLIS_PATH, False), device=mx.cpu) is None
    bundled = BlasInfo("bundled reference BLAS (netlib)", "/x/libblas.so", True)
    assert slow_blas_warning(bundled, device=mx.gpu) is None
