"""What a sweep's results become: the heatmaps' grids (each width x length
once, its fastest lookup setting; the auto column last), the files written
(results.csv, results.md, the heatmap PNGs, through
:mod:`~mlx_redrafter.tuning.report`), the summary in the terminal, and the
best cell stored as this device's tuned profile. ``config`` is the sweep's
:class:`~mlx_redrafter.tuning.sweep.SweepConfig`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from .report import HEATMAPS, grid_matrix, heatmap_table, markdown_table, plot_heatmap, write_csv
from .results import cell_key, cell_label, save_results

AUTO = "auto"  # the heatmaps' label of the auto column


def best_per_shape(cells: List[dict], auto_column: bool = False) -> List[dict]:
    """For the width x length heatmaps: each (W, L) once, its fastest lookup
    setting. ``auto_column``: auto cells are kept apart, with their length
    set to :data:`AUTO` so that :func:`heatmap_lengths` draws them as a column
    of their own."""
    best: Dict[Tuple[int, object], dict] = {}
    for c in cells:
        if auto_column and c.get("tree") == "auto":
            c = {**c, "length": AUTO}
        shape = (c["width"], c["length"])
        old = best.get(shape)
        if old is None or (c.get("speedup") or -1.0) > (old.get("speedup") or -1.0):
            best[shape] = c
    return list(best.values())


def heatmap_lengths(config) -> list:
    """The heatmaps' columns: the lengths, then ``auto`` when the sweep has its auto column."""
    return list(config.lengths) + ([AUTO] if config.auto_column_on() else [])


def heatmap_matrices(results: dict, config, keys) -> Tuple[list, Dict[str, np.ndarray]]:
    """``(columns, {key: [widths, columns] matrix})`` that the heatmaps of
    ``keys`` draw: each shape's fastest lookup setting, the auto column last."""
    shown = {**results, "cells": best_per_shape(results["cells"], config.auto_column_on())}
    lengths = heatmap_lengths(config)
    return lengths, {key: grid_matrix(shown, key, config.widths, lengths) for key in keys}


def write_outputs(results: dict, out_dir, config) -> Dict[str, np.ndarray]:
    """results.csv, results.md and the three heatmap PNGs; returns the matrices drawn, by metric."""
    out_dir = Path(out_dir)
    save_results(out_dir, results)
    write_csv(results, out_dir / "results.csv")
    (out_dir / "results.md").write_text(markdown_table(results))
    drawn = {}
    lengths, matrices = heatmap_matrices(results, config, HEATMAPS)
    for key, (name, title, fmt) in HEATMAPS.items():
        drawn[key] = plot_heatmap(
            matrices[key],
            config.widths,
            lengths,
            _title(title, config),
            out_dir / name,
            fmt,
            center=1.0 if key == "speedup" else None,
        )
    return drawn


def _title(title: str, config) -> str:
    if len(config.lookups) > 1:
        title += " (the faster of lookup on/off)"
    if config.tree == "auto":
        title += " (tree auto: W x L are caps)"
    return title


def print_summary(console, results: dict, config, out_dir) -> None:
    """Heatmaps in the terminal, the best cell, the notes and the files."""
    keys = ("speedup", "tokens_per_step", "tokens_per_s")
    lengths, matrices = heatmap_matrices(results, config, keys)
    for key in keys:
        _, title, fmt = HEATMAPS[key]
        console.print(
            heatmap_table(
                matrices[key],
                config.widths,
                lengths,
                _title(title, config),
                fmt,
                center=1.0 if key == "speedup" else None,
            )
        )
    if config.auto_column_on():
        console.print(
            f"[dim]{AUTO}: the cost-aware selection (--tree auto) with W x L={max(config.lengths)} as caps[/dim]"
        )
    base = [b["tokens_per_s"] for b in results["baselines"]]
    if base:
        console.print(
            f"plain mlx-lm decoding: {np.mean(base):.1f} tok/s (mean of {len(base)} passes, "
            f"{min(base):.1f}-{max(base):.1f})"
        )
    for c in results["cells"]:
        if c["status"] != "ok":
            console.print(f"[yellow]{cell_label(*cell_key(c))}: {c['note']}[/yellow]")
        elif c.get("identical_outputs") is not None and c["identical_outputs"] < results["config"]["num_prompts"]:
            console.print(
                f"[yellow]{cell_label(*cell_key(c))}: {c['identical_outputs']}/{results['config']['num_prompts']} "
                "outputs equal plain greedy decoding (expected all in float32)[/yellow]"
            )
    best = results.get("best")
    if best:
        console.print(
            f"best: {cell_label(*cell_key(best))}, {best['speedup']:.2f}x, "
            f"{best['tokens_per_s']:.1f} tok/s, {best['tokens_per_step']:.2f} tokens/step"
        )
    names = ["results.json", "results.csv", "results.md"] + [v[0] for v in HEATMAPS.values()]
    console.print(f"wrote {', '.join(str(Path(out_dir) / n) for n in names)}")


def save_best_profile(results: dict, model_spec: str, drafter_path, out_dir, grid: str = "drafter") -> Optional[Path]:
    """Store the best (W, L, lookup) as the tuned profile of this device + model + drafter
    (``grid``: whose W x L they are; an MTP head's or a draft model's are keyed by its folder)."""
    from ..profiles import save_profile

    best = results.get("best")
    if best is None:
        return None
    return save_profile(
        model_spec,
        drafter_path,
        best["width"],
        best["length"],
        lookup=best.get("lookup", 0),
        tree=best.get("tree", "fixed"),
        grid=grid,
        speedup=best["speedup"],
        tokens_per_s=best["tokens_per_s"],
        sweep=str((Path(out_dir) / "results.json").resolve()),
        saved_at=time.time(),
    )
