"""``mlx-redrafter doctor``: this machine's versions, device, dtype and BLAS
(with the fix when it is slow), and the verify-cost curve ``--tree auto`` uses.
Registered by run.py, after ``serve`` (where ``--help`` lists it)."""

from __future__ import annotations

from typing import Optional

import typer
from rich.markup import escape

from .options import DtypeOpt, ModelOpt, err


def doctor(
    calibrate: bool = typer.Option(
        False,
        "--calibrate",
        help="Measure this device's verify-cost curve c(N) for --tree auto "
        "and its batched-decoding gains for serve (<= 40 s), and store them.",
    ),
    model: str = ModelOpt,
    dtype: Optional[str] = DtypeOpt,
):
    """Print versions, device, default dtype and BLAS (with the fix when it is slow), and the verify-cost curve."""
    from ..doctor import SLOW_GFLOPS, blis_fix, installed_blis, matmul_gflops, report

    info = report()
    for k, v in info.items():
        if v is not None and k != "blas_slow":
            print(f"{k:>14}: {v}")
    gflops = matmul_gflops()
    print(f"{'matmul':>14}: {gflops:.1f} GFLOPS (float32, 768x768)")
    if info.get("blas_slow") or (info["device"].startswith("Device(cpu") and gflops < SLOW_GFLOPS):
        installed = installed_blis() or ""
        how = f"BLIS is installed here ({installed}): preload it" if installed else "Fix"
        err.print(
            f"[yellow]The CPU backend uses {info['blas']} ({gflops:.1f} GFLOPS); "
            f"a good BLAS is about 20x faster here. {escape(how)}:[/yellow]\n" + "\n".join(blis_fix(installed))
        )
    _show_curve(model, dtype, calibrate)


def _show_curve(model_spec: str, dtype: Optional[str], calibrate: bool) -> None:
    """The verify-cost curve ``--tree auto`` uses for this model here; ``calibrate``: measure and store it first."""
    from ..llm.load import load_model
    from ..step.curve import curve_for, format_curve, save_curve

    model, _ = load_model(model_spec, dtype=dtype)
    if calibrate:
        from ..tuning.calibrate import measure_curve

        err.print("measuring the verify-cost curve and the batch curve (at most 40 s)...")
        path = save_curve(measure_curve(model, model_spec), model, model_spec)
        err.print(f"saved {path}")
    curve = curve_for(model, model_spec)
    print(format_curve(curve))
    if curve.builtin:
        print(
            "  (no curve measured on this device for this model: --tree auto uses the built-in one; "
            "measure it with `mlx-redrafter doctor --calibrate`)"
        )
