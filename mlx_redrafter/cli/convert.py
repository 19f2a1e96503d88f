"""The converters' commands: ``convert`` (a PyTorch drafter into MLX),
``inspect`` (a drafter's config, size and cost) and ``convert-gguf`` (a GGUF
model into an mlx-lm folder); the work is in converters/."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .options import DtypeOpt, app, err

CONVERTERS = "Converters"  # their panel in `mlx-redrafter --help`, below the main commands


@app.command(rich_help_panel=CONVERTERS)
def convert(
    src: str = typer.Argument(
        ..., help="Drafter folder (safetensors or pytorch_model.bin, sharded too), a weights file, or a Hub repo id."
    ),
    dst: Path = typer.Argument(..., help="Output drafter folder (config.json + model.safetensors)."),
    dtype: str = typer.Option("float16", "--dtype", help="float32 | float16 | bfloat16."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Check that the drafter fits this LLM."),
):
    """Convert a PyTorch-trained drafter into MLX (pickles are read, never executed)."""
    from ..converters.drafter import convert_drafter

    report = convert_drafter(src, dst, dtype=dtype, model=model)
    print("\n".join(report.lines()))


@app.command("inspect", rich_help_panel=CONVERTERS)
def inspect_cmd(
    drafter: str = typer.Argument(..., help="Drafter folder (MLX or PyTorch format) or Hub repo id."),
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="Also show the cost of a draft step relative to this LLM."
    ),
    dtype: Optional[str] = DtypeOpt,
):
    """Print a drafter's config, parameter count, size and dtype (and its cost per step with --model)."""
    from ..converters.drafter import inspect_drafter

    print("\n".join(inspect_drafter(drafter, model=model, dtype=dtype).lines()))


@app.command("convert-gguf", rich_help_panel=CONVERTERS)
def convert_gguf_cmd(
    src: Path = typer.Argument(..., help="A .gguf file."),
    dst: Path = typer.Argument(..., help="Output folder (an mlx-lm model)."),
):
    """Convert a GGUF model (llama, gemma3) into an mlx-lm folder."""
    from rich.progress import Progress

    from ..converters.gguf import convert_gguf

    with Progress(transient=True, console=err) as progress:
        task = progress.add_task("converting tensors", total=None)
        out = convert_gguf(src, dst, progress=lambda i, n: progress.update(task, completed=i, total=n))
    err.print(f"wrote {out} (open it with mlx_lm.load or --model {out})")
