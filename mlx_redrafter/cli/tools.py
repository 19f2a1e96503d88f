"""The tools' commands: ``sweep`` (tuning) and the converters (``convert``, ``convert-gguf``, ``inspect``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from ..errors import RedrafterError
from .options import DraftModelOpt, DtypeOpt, ModelOpt, MtpOpt, NeededDrafterOpt, TempOpt, TopPOpt, _runtime, app, err

GRIDS = ("drafter", "mtp", "draft-model")


@app.command()
def sweep(
    model: str = ModelOpt,
    drafter: Optional[str] = NeededDrafterOpt,
    widths: str = typer.Option("1,2,3,4", "--widths", help="Beam widths: a list or a range, e.g. 1,2,3,4 or 1-4."),
    lengths: str = typer.Option(
        "2,3,4,5", "--lengths", help="Beam lengths (drafted tokens, g0 not counted), e.g. 2,3,4,5."
    ),
    prompts: str = typer.Option(
        "mt_bench", "--prompts", help="mt_bench | spec_bench | alpaca_eval | a .jsonl/.json/.txt file."
    ),
    num_prompts: int = typer.Option(
        8, "--num-prompts", help="Prompts per cell (first turns, round-robin over categories)."
    ),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="Tokens generated per prompt."),
    out: Path = typer.Option(
        Path("sweep-results"), "--out", "-o", help="Output folder; an interrupted sweep resumes there."
    ),
    baseline_every: int = typer.Option(4, "--baseline-every", help="Measure plain decoding again after every k cells."),
    save_profile: bool = typer.Option(
        False,
        "--save-profile",
        help="Store the best (W, L) for this device + model + drafter; generate and chat use it.",
    ),
    memory_limit: Optional[float] = typer.Option(
        None, "--memory-limit", help="GB one cell may use (default: what the device has); larger cells are skipped."
    ),
    timings: bool = typer.Option(
        False,
        "--timings/--no-timings",
        "--profile/--no-profile",
        help="Split each step into draft / pack / verify / accept: a sync per phase, "
        "in the synchronous step loop, so the speedups are that loop's (--profile: the old name).",
    ),
    fresh: bool = typer.Option(False, "--fresh", help="Start over instead of resuming the results in --out."),
    temp: float = TempOpt,
    top_p: float = TopPOpt,
    seed: int = typer.Option(0, "--seed", help="With --temp > 0, prompt i is sampled from seed + i in every pass."),
    adaptive: bool = typer.Option(
        False, "--adaptive", help="Let the drafter's trained controller pick the depth (lengths become maxima)."
    ),
    lookup: Optional[bool] = typer.Option(
        None,
        "--lookup/--no-lookup",
        help="Measure every cell with lookup drafts only, or only without (default: both).",
    ),
    dtype: Optional[str] = DtypeOpt,
    tree: Optional[str] = typer.Option(
        None,
        "--tree",
        help="fixed: the fixed W x L grid only; auto: every cell runs the cost-aware selection "
        "(W and L become caps); default: the fixed grid and an auto column beside it (caps W x the longest L).",
    ),
    grid: str = typer.Option(
        "drafter",
        "--grid",
        help="Whose beams the width x length grid shapes: drafter, mtp (the model's MTP head: its depth is L) "
        "or draft-model (--draft-model's; its draft length is L). mtp and draft-model draft beside --drafter "
        "only when one is given.",
    ),
    mtp: Optional[str] = MtpOpt,
    draft_model: Optional[str] = DraftModelOpt,
):
    """Measure ReDrafter over a beam width x length (x lookup on/off) grid against plain mlx-lm decoding: heatmaps, CSV, JSON."""  # noqa: E501 (one line: typer shows newlines)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from ..config import LOOKUP_LENGTH
    from ..prompts import first_turn_ids, load_prompt_set, select_conversations
    from ..tuning import sweep as sw

    # Every check that needs no model comes before the slow load.
    lookups = [0, 1] if lookup is None else [int(lookup)]
    config = sw.SweepConfig(
        sw.parse_grid(widths, "--widths"),
        sw.parse_grid(lengths, "--lengths"),
        max_tokens,
        baseline_every,
        timings,
        memory_limit,
        temp,
        top_p,
        seed,
        lookups,
    )
    config.tree, config.auto_column = tree or "fixed", tree is None
    config.check()
    if num_prompts < 1:
        raise RedrafterError(f"--num-prompts must be at least 1 (got {num_prompts}).")
    convs = select_conversations(load_prompt_set(prompts), num_prompts)
    grid_args = (grid, model, drafter, mtp, draft_model, dtype, adaptive, tree, prompts)
    s, make_draft, drafter_path, meta = _grid_runtime(sw, config, grid_args, out, fresh)
    config.curve = _sweep_curve(s, model, config.has_auto(), save_profile)
    err.print(
        f"[dim]model {model}, drafter {drafter_path}: {len(config.cells())} cells x {len(convs)} prompts, "
        f"{max_tokens} tokens each[/dim]"
    )
    ids, dropped = sw.fit_prompts(
        first_turn_ids(s.tokenizer, convs),
        s.model,
        max_tokens,
        1 + max(config.widths) * max(config.lengths) + max(lookups) * LOOKUP_LENGTH,
    )
    if dropped:
        err.print(
            f"[yellow]{dropped} prompts do not fit the model's context "
            f"with --max-tokens {max_tokens}; left out.[/yellow]"
        )
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=err) as bar:
        task = bar.add_task("sweep", total=None)
        try:
            results = sw.run_sweep(
                s.model,
                ids,
                s.drafter,
                config,
                out,
                meta,
                eos_ids=sorted(s.tokenizer.eos_token_ids),
                progress=lambda done, total, label: bar.update(task, completed=done, total=total, description=label),
                fresh=fresh,
                controller=s.controller,
                make_draft=make_draft,
            )
        except KeyboardInterrupt:
            err.print(f"Interrupted: finished cells are saved in {out}/results.json; rerun the same command to resume.")
            raise typer.Exit(130)
    sw.print_summary(Console(), results, config, out)  # the tables are the command's output: stdout
    if save_profile:
        _save_profile(sw, results, model, drafter_path, out, grid)


def _grid_runtime(sw, config, grid_args, out, fresh):
    """``(runtime, make_draft, path, meta)`` of a sweep, a resumed sweep's
    results checked against ``meta`` (a drafter's grid before the slow load)."""
    from ..draft.stateful import SourceFlags
    from ..runtime import resolve_drafter_path
    from ..tuning.results import check_resumable

    grid, model, drafter, mtp, draft_model, dtype, adaptive, tree, prompts = grid_args
    if grid not in GRIDS:
        raise RedrafterError(f"Unknown --grid {grid!r}.", f"Use one of: {', '.join(GRIDS)}.")
    if grid == "drafter":
        make_draft, path = None, resolve_drafter_path(model, drafter)
        meta = {**sw.sweep_meta(model, path, prompts, dtype), "adaptive": adaptive}
    else:  # the source's folder keys the results: known once the model is loaded
        rt, make_draft, path, meta = _source_grid(sw, config, *grid_args)
    if not fresh:  # a mismatched --out fails now
        partial = sw.sweep_key(config, [], meta)
        check_resumable(out, partial, only=[k for k in partial if k not in ("prompts_digest", "num_prompts")])
    if grid == "drafter":
        flags = SourceFlags(mtp=mtp or "none", draft_model=draft_model)  # beside the drafter only when named
        rt = _runtime(model, str(path), dtype=dtype, adaptive=adaptive, announce=False, tree=tree, sources=flags)
    return rt, make_draft, path, meta


def _source_grid(sw, config, grid, model, drafter, mtp, draft_model, dtype, adaptive, tree, prompts):
    """``(runtime, make_draft, path, meta)`` of a grid of an MTP head's or a
    draft model's width x length (beside ``--drafter`` only when one is
    given); that source's folder keys the results and the profile."""
    import dataclasses

    from ..draft.stateful import SourceFlags

    if grid == "draft-model" and not draft_model:
        raise RedrafterError("--grid draft-model needs --draft-model.", "Name the draft model with --draft-model M.")
    flags = SourceFlags(mtp=mtp if grid == "mtp" else (mtp or "none"), draft_model=draft_model)
    rt = _runtime(model, drafter or "none", dtype=dtype, adaptive=adaptive, announce=False, tree=tree, sources=flags)
    if grid == "mtp" and rt.draft.head is None:
        raise RedrafterError(
            f"{model} ships no MTP head.", "Point --mtp at its original checkpoint or a split MTP folder."
        )
    if grid == "mtp":
        path, shape = rt.draft.head.found.path, ("head_width", "head_length")
    else:
        from ..llm.load import resolve_model_path

        path, shape = resolve_model_path(draft_model), ("draft_model_width", "draft_model_length")
    meta = {**sw.sweep_meta(model, path, prompts, dtype), "adaptive": adaptive, "grid": grid}

    def make_draft(w, length, k, cell_tree):
        extra = {shape[0]: w, shape[1]: length}
        return dataclasses.replace(rt.draft, lookup=k, tree=cell_tree, curve=config.curve, **extra)

    return rt, make_draft, path, meta


def _sweep_curve(rt, model_spec, has_auto: bool, save_profile: bool):
    """The curve of the sweep's auto cells (None without any); ``--save-profile``
    first measures and stores it with the profile."""
    from ..step.curve import curve_for, format_curve, save_curve
    from ..tuning.calibrate import measure_curve

    if save_profile:
        curve = measure_curve(rt.model, model_spec)
        err.print(f"saved verify-cost curve {save_curve(curve, rt.model, model_spec)}\n{format_curve(curve)}")
    return curve_for(rt.model, model_spec) if has_auto else None


def _save_profile(sw, results, model, drafter_path, out, grid="drafter") -> None:
    path = sw.save_best_profile(results, model, drafter_path, out, grid=grid)
    if path is None:
        err.print("[yellow]No cell was measured: no profile saved.[/yellow]")
    else:
        best = results["best"]
        note = "" if best["speedup"] > 1 else " (slower than plain decoding here: consider --no-draft)"
        err.print(f"saved profile {path}: {sw.cell_label(*sw.cell_key(best))}{note}")


@app.command()
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


@app.command("inspect")
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


@app.command("convert-gguf")
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
