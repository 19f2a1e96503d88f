"""``mlx-redrafter make-drafter``: the whole drafter recipe for one model, in one
resumable command (train/recipe.py), with one progress display."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..errors import RedrafterError
from .options import ModelOpt, app, err


def _clock(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-:--"
    s = max(int(seconds), 0)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _command(model, minutes, hours, out, prompts, max_conversations, head="redrafter") -> str:
    """The command line as the user would type it again (recorded in the drafter's metadata)."""
    parts = ["mlx-redrafter", "make-drafter", "--model", model]
    parts += ["--hours", f"{hours:g}"] if hours is not None else ["--minutes", f"{minutes:g}"]
    extra = (("--out", out), ("--prompts", prompts), ("--max-conversations", max_conversations))
    extra += (("--head", None if head == "redrafter" else head),)
    for flag, value in extra:
        if value is not None:
            parts += [flag, str(value)]
    return " ".join(shlex.quote(p) for p in parts)


@app.command("make-drafter")
def make_drafter_cmd(
    model: str = ModelOpt,
    minutes: Optional[float] = typer.Option(
        None,
        "--minutes",
        help="Time budget in minutes, over every run into the work folder: "
        "a rerun continues within it, a larger one adds data and training.",
    ),
    hours: Optional[float] = typer.Option(None, "--hours", help="The budget in hours (instead of --minutes)."),
    out: Optional[Path] = typer.Option(
        None,
        "--out",
        "-o",
        help="Work folder (default: one under the cache folder for this model and prompt source, "
        "so the same command continues there).",
    ),
    prompts: Optional[str] = typer.Option(
        None,
        "--prompts",
        help="Training prompts: the ShareGPT ones shipped with the package (default), "
        "a .jsonl/.json/.txt file of your own, or 'history': the conversations chat and serve kept for the model "
        "(the drafter is then private: upload refuses it).",
    ),
    max_conversations: Optional[int] = typer.Option(
        None,
        "--max-conversations",
        help="Distil at most this many conversations, over all runs (default: as many as the budget allows).",
    ),
    head: str = typer.Option(
        "redrafter",
        "--head",
        help="The draft head to train: 'redrafter' (the recurrent ReDrafter head), 'eagle3' (an EAGLE-3 head, "
        "trained with training-time test and saved in vLLM's speculators layout), 'dflash' (a DFlash block "
        "drafter, saved in z-lab's layout), or 'auto' (all three, each with a share of the training time, on the "
        "same data; the verdict installs the fastest).",
    ),
):
    """Make a drafter for any mlx-lm model: distil, train, fit the depth controller, calibrate this
    device, measure the drafter against decoding without one on held-out prompts, and install it
    for the model if it is faster. Ctrl-C keeps everything; the same command continues."""
    from ..train.heads import heads_of
    from ..train.recipe import RecipeConfig, make_drafter

    if (minutes is None) == (hours is None):
        raise RedrafterError(
            "Give the time budget once: --minutes N or --hours H.",
            "E.g. --hours 1.5 (a rerun with a larger budget continues).",
        )
    heads_of(head)  # an unknown --head fails before anything loads
    budget = minutes if minutes is not None else 60 * hours
    if budget <= 0 or (max_conversations is not None and max_conversations < 1):
        raise RedrafterError("The budget must be positive and --max-conversations at least 1.")
    cfg = RecipeConfig(
        model,
        budget,
        out,
        prompts,
        max_conversations,
        command=_command(model, minutes, hours, out, prompts, max_conversations, head),
        head=head,
    )
    try:
        report = _run(cfg, make_drafter)
    except KeyboardInterrupt:
        err.print(
            "Interrupted: everything finished so far is kept in the work folder; rerun the same command to continue."
        )
        raise typer.Exit(130)
    _print_report(report, cfg)


def _run(cfg, make_drafter):
    """The recipe under one progress display: the stage, its ETA and the whole run's."""
    from rich.progress import BarColumn, Progress, TextColumn

    columns = [
        TextColumn("[bold]{task.fields[stage]:<10}"),
        BarColumn(bar_width=24),
        TextColumn("{task.fields[info]}"),
        TextColumn("[dim]stage ETA {task.fields[stage_eta]}, all {task.fields[total_eta]}[/dim]"),
    ]
    with Progress(*columns, console=err) as bar:
        task = bar.add_task("make-drafter", total=1.0, stage="starting", info="", stage_eta="-:--", total_eta="-:--")

        def show(status):
            if status.line:
                bar.console.print(escape(status.line), soft_wrap=True)
                return
            bar.update(
                task,
                completed=status.fraction or 0.0,
                stage=status.stage,
                info=escape(status.info),
                stage_eta=_clock(status.stage_eta),
                total_eta=_clock(status.total_eta),
            )

        return make_drafter(cfg, progress=show)


def _print_report(report, cfg) -> None:
    v = report.verdict
    if report.already_done:
        err.print(
            f"Already done: {report.out} finished every stage for a {cfg.minutes:g}-minute budget "
            "(a larger --minutes adds data and training)."
        )
    elif report.kept:
        stands = (
            "measured again below"
            if report.verdict_measured
            else f"its verdict of {v.get('date', 'the last run')} stands, as below"
        )
        err.print(
            "This run's training scored no better on the held-out conversations than the drafter it continued: "
            f"that drafter is kept, unchanged ({stands}).",
            soft_wrap=True,
        )
    plain = v.get("plain", {})
    err.print(f"verdict on {v.get('prompts')} held-out prompts, {v.get('max_tokens')} tokens each, {v.get('device')}:")
    err.print(f"  plain decoding   {plain.get('tokens_per_second', 0):.1f} tok/s")
    labels = {
        "lookup": "lookup alone",
        "drafter": "new drafter",
        "eagle3": "new EAGLE-3 head",
        "dflash": "new DFlash drafter",
        "existing": "drafter in use",
    }
    for name, label in labels.items():
        if name in v:
            r = v[name]
            err.print(
                f"  {label:<16} {r['speedup']:.2f}x, {r['tokens_per_step']:.2f} tokens/step, "
                f"{r['identical_outputs']}/{v['prompts']} outputs identical to plain"
            )
    if report.installed:
        err.print(
            f"[green]Installed[/green] ({escape(v.get('reason', ''))}): {escape(str(report.installed))}; "
            f"chat, generate and serve use it for {escape(cfg.model)}.",
            soft_wrap=True,
        )
        return
    err.print(f"[yellow]Not installed: {escape(v.get('reason', ''))}.[/yellow]", soft_wrap=True)
    need = v.get("needs") or {}
    if need.get("message"):
        err.print(f"More data? {escape(need['message'])}.", soft_wrap=True)
    if need.get("more_minutes"):
        more = _command(
            cfg.model,
            round(cfg.minutes + need["more_minutes"]),
            None,
            cfg.out,
            cfg.prompts,
            cfg.max_conversations,
            cfg.head,
        )
        err.print(f"To go on: {escape(more)}", soft_wrap=True)
    err.print(f"The drafter stays in {escape(str(report.drafter))} (with its metadata).", soft_wrap=True)
