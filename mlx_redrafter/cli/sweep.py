"""``mlx-redrafter sweep``: the beam width x length grid measured against plain
decoding on this device (the work is in tuning/sweep.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from ..errors import RedrafterError
from .options import (
    DraftModelOpt,
    DtypeOpt,
    ModelOpt,
    MtpOpt,
    NeededDrafterOpt,
    TempOpt,
    TopPOpt,
    _runtime,
    app,
    err,
    progress_bar,
)

GRIDS = ("drafter", "mtp", "draft-model")

# sweep's own flags (the shared ones are in options.py)
LengthsOpt = typer.Option("2,3,4,5", "--lengths", help="Beam lengths (drafted tokens, g0 not counted), e.g. 2,3,4,5.")
PromptsOpt = typer.Option(
    "mt_bench", "--prompts", help="mt_bench | spec_bench | alpaca_eval | a .jsonl/.json/.txt file."
)
NumPromptsOpt = typer.Option(8, "--num-prompts", help="Prompts per cell (first turns, round-robin over categories).")
OutOpt = typer.Option(Path("sweep-results"), "--out", "-o", help="Output folder; an interrupted sweep resumes there.")
SaveProfileOpt = typer.Option(
    False, "--save-profile", help="Store the best (W, L) for this device + model + drafter; generate and chat use it."
)
MemoryLimitOpt = typer.Option(
    None, "--memory-limit", help="GB one cell may use (default: what the device has); larger cells are skipped."
)
TimingsOpt = typer.Option(
    False,
    "--timings/--no-timings",
    "--profile/--no-profile",
    help="Split each step into draft / pack / verify / accept: a sync per phase, "
    "in the synchronous step loop, so the speedups are that loop's (--profile: the old name).",
)
SweepAdaptiveOpt = typer.Option(
    False, "--adaptive", help="Let the drafter's trained controller pick the depth (lengths become maxima)."
)
SweepLookupOpt = typer.Option(
    None, "--lookup/--no-lookup", help="Measure every cell with lookup drafts only, or only without (default: both)."
)
GridOpt = typer.Option(
    "drafter",
    "--grid",
    help="Whose beams the width x length grid shapes: drafter, mtp (the model's MTP head: its depth is L) "
    "or draft-model (--draft-model's; its draft length is L). mtp and draft-model draft beside --drafter "
    "only when one is given.",
)
SweepTreeOpt = typer.Option(
    None,
    "--tree",
    help="fixed: the fixed W x L grid only; auto: every cell runs the cost-aware selection "
    "(W and L become caps); default: the fixed grid and an auto column beside it (caps W x the longest L).",
)


@app.command()
def sweep(
    model: str = ModelOpt,
    drafter: Optional[str] = NeededDrafterOpt,
    widths: str = typer.Option("1,2,3,4", "--widths", help="Beam widths: a list or a range, e.g. 1,2,3,4 or 1-4."),
    lengths: str = LengthsOpt,
    prompts: str = PromptsOpt,
    num_prompts: int = NumPromptsOpt,
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="Tokens generated per prompt."),
    out: Path = OutOpt,
    baseline_every: int = typer.Option(4, "--baseline-every", help="Measure plain decoding again after every k cells."),
    save_profile: bool = SaveProfileOpt,
    memory_limit: Optional[float] = MemoryLimitOpt,
    timings: bool = TimingsOpt,
    fresh: bool = typer.Option(False, "--fresh", help="Start over instead of resuming the results in --out."),
    temp: float = TempOpt,
    top_p: float = TopPOpt,
    seed: int = typer.Option(0, "--seed", help="With --temp > 0, prompt i is sampled from seed + i in every pass."),
    adaptive: bool = SweepAdaptiveOpt,
    lookup: Optional[bool] = SweepLookupOpt,
    dtype: Optional[str] = DtypeOpt,
    tree: Optional[str] = SweepTreeOpt,
    grid: str = GridOpt,
    mtp: Optional[str] = MtpOpt,
    draft_model: Optional[str] = DraftModelOpt,
):
    """Measure ReDrafter over a beam width x length (x lookup on/off) grid against plain mlx-lm decoding: heatmaps, CSV, JSON."""  # noqa: E501 (one line: typer shows newlines)
    from ..prompts import load_prompt_set, select_conversations
    from ..tuning import sweep as sw
    from ..tuning.summary import print_summary

    # Every check that needs no model comes before the slow load.
    config = _sweep_config(widths, lengths, max_tokens, baseline_every, timings, memory_limit, temp, top_p, seed)
    config.lookups = [0, 1] if lookup is None else [int(lookup)]
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
    results = _run_sweep(s, _sweep_prompts(s, convs, config), config, out, meta, fresh, make_draft)
    print_summary(Console(), results, config, out)  # the tables are the command's output: stdout
    if save_profile:
        _save_profile(results, model, drafter_path, out, grid)


def _sweep_config(widths, lengths, max_tokens, baseline_every, timings, memory_limit, temp, top_p, seed):
    """The grid and the measuring flags as one SweepConfig (the grids parsed, not yet checked)."""
    from ..tuning.sweep import SweepConfig, parse_grid

    grid = (parse_grid(widths, "--widths"), parse_grid(lengths, "--lengths"))
    return SweepConfig(*grid, max_tokens, baseline_every, timings, memory_limit, temp, top_p, seed)


def _sweep_prompts(rt, convs, config) -> list:
    """The prompts' ids, those that cannot fit the model's context with the largest cell's tree left out (and said)."""
    from ..config import LOOKUP_LENGTH
    from ..prompts import first_turn_ids
    from ..tuning.sweep import fit_prompts

    tree = 1 + max(config.widths) * max(config.lengths) + max(config.lookups) * LOOKUP_LENGTH
    ids, dropped = fit_prompts(first_turn_ids(rt.tokenizer, convs), rt.model, config.max_tokens, tree)
    if dropped:
        err.print(
            f"[yellow]{dropped} prompts do not fit the model's context "
            f"with --max-tokens {config.max_tokens}; left out.[/yellow]"
        )
    return ids


def _run_sweep(rt, ids, config, out: Path, meta: dict, fresh: bool, make_draft=None) -> dict:
    """Run the sweep under a progress bar; Ctrl-C keeps the finished cells in ``out``."""
    from ..tuning.sweep import run_sweep

    # The drafter's grid: an EAGLE-3 drafter is the draft's layer head (its cells shape that head's beams).
    drafter = rt.drafter if rt.drafter is not None or make_draft is not None else rt.draft.head
    with progress_bar("count", eta=True) as bar:
        task = bar.add_task("sweep", total=None)
        try:
            return run_sweep(
                rt.model,
                ids,
                drafter,
                config,
                out,
                meta,
                eos_ids=sorted(rt.tokenizer.eos_token_ids),
                progress=lambda done, total, label: bar.update(task, completed=done, total=total, description=label),
                fresh=fresh,
                controller=rt.controller,
                make_draft=make_draft,
            )
        except KeyboardInterrupt:
            err.print(f"Interrupted: finished cells are saved in {out}/results.json; rerun the same command to resume.")
            raise typer.Exit(130)


def _grid_runtime(sw, config, grid_args, out, fresh):
    """``(runtime, make_draft, path, meta)`` of a sweep, a resumed sweep's
    results checked against ``meta`` (a drafter's grid before the slow load)."""
    from ..draft.stateful import SourceFlags
    from ..runtime import LoadOptions, resolve_drafter_path
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
        rt = _runtime(
            LoadOptions(model, str(path), dtype=dtype, adaptive=adaptive, tree=tree, sources=flags), announce=False
        )
    return rt, make_draft, path, meta


def _source_grid(sw, config, grid, model, drafter, mtp, draft_model, dtype, adaptive, tree, prompts):
    """``(runtime, make_draft, path, meta)`` of a grid of an MTP head's or a
    draft model's width x length (beside ``--drafter`` only when one is
    given); that source's folder keys the results and the profile."""
    import dataclasses

    from ..draft.stateful import SourceFlags
    from ..runtime import LoadOptions

    if grid == "draft-model" and not draft_model:
        raise RedrafterError("--grid draft-model needs --draft-model.", "Name the draft model with --draft-model M.")
    flags = SourceFlags(mtp=mtp if grid == "mtp" else (mtp or "none"), draft_model=draft_model)
    rt = _runtime(
        LoadOptions(model, drafter or "none", dtype=dtype, adaptive=adaptive, tree=tree, sources=flags), announce=False
    )
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


def _save_profile(results, model, drafter_path, out, grid="drafter") -> None:
    from ..tuning.results import cell_key, cell_label
    from ..tuning.summary import save_best_profile

    path = save_best_profile(results, model, drafter_path, out, grid=grid)
    if path is None:
        err.print("[yellow]No cell was measured: no profile saved.[/yellow]")
    else:
        best = results["best"]
        note = "" if best["speedup"] > 1 else " (slower than plain decoding here: consider --no-draft)"
        err.print(f"saved profile {path}: {cell_label(*cell_key(best))}{note}")
