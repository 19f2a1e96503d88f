"""The sweep's report writers: CSV, a Markdown table, and width x length
heatmaps (PNG, and rich tables for the terminal). They read the results
dict that ``sweep`` builds (``{"config", "baselines", "cells", ...}``).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from .measure import PHASES
from .results import cell_order

# Figures: sizes in inches that are exact binary fractions, so the PNG's
# pixel size is exactly inches * DPI (tests check it).
DPI = 80
HEATMAPS = {
    # key in the cell records: (file name, title, number format)
    "speedup": ("speedup.png", "Speedup over plain mlx-lm decoding", "{:.2f}x"),
    "tokens_per_s": ("tokens_per_s.png", "Tokens per second", "{:.1f}"),
    "tokens_per_step": ("tokens_per_step.png", "Tokens per step", "{:.2f}"),
}


CSV_FIELDS = [
    "kind",
    "width",
    "length",
    "lookup",
    "tree",
    "status",
    "seq",
    "tokens",
    "tokens_per_s",
    "baseline_tokens_per_s",
    "speedup",
    "tokens_per_step",
    "tree_size",
    "compression",
    "verified_depth",
    *[f"{p}_ms" for p in PHASES],
    "ttft_s",
    "peak_memory_gb",
    "memory_overhead_gb",
    "estimated_memory_gb",
    "identical_outputs",
    "note",
]


def csv_rows(results: dict) -> Tuple[List[dict], List[str]]:
    """One row per baseline pass, then one per cell; acceptance by depth in
    columns ``accept_ge_1 .. accept_ge_{max L}``."""
    max_len = max([c["length"] for c in results["cells"]], default=0)
    rows = []
    for b in results["baselines"]:
        rows.append({"kind": "baseline", **{k: b.get(k) for k in CSV_FIELDS if k in b}})
    for c in results["cells"]:
        row = {"kind": "cell", **{k: c.get(k) for k in CSV_FIELDS if k in c}}
        for p, v in c.get("time_split_ms", {}).items():
            row[f"{p}_ms"] = v
        for d, v in enumerate(c.get("acceptance_by_depth", []), 1):
            row[f"accept_ge_{d}"] = v
        rows.append(row)
    return rows, CSV_FIELDS + [f"accept_ge_{d}" for d in range(1, max_len + 1)]


def write_csv(results: dict, path: Path) -> None:
    rows, fields = csv_rows(results)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in fields})


def markdown_table(results: dict) -> str:
    """The cells as a Markdown table (for reports such as bench/RESULTS.md)."""
    head = (
        "| W | L | speedup | tok/s | tokens/step | acceptance by depth | packed size | compression "
        "| draft / pack / verify / accept / other ms | peak GB | lookup beams | tree |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for c in sorted(results["cells"], key=cell_order):
        if c["status"] != "ok":
            lines.append(f"| {c['width']} | {c['length']} | {c['status']}: {c.get('note', '')} |")
            continue
        sp = "" if c.get("speedup") is None else f"{c['speedup']:.2f}x"
        acc = " / ".join(f"{v:.2f}" for v in c["acceptance_by_depth"])
        split = " / ".join(f"{c.get('time_split_ms', {}).get(p, float('nan')):.1f}" for p in PHASES)
        if not results["config"].get("profile", True):  # --no-profile: only the whole step was timed
            split = f"step {sum(c.get('time_split_ms', {}).values()):.1f}"
        lines.append(
            f"| {c['width']} | {c['length']} | {sp} | {c['tokens_per_s']:.1f} | {c['tokens_per_step']:.2f} | {acc} "
            f"| {c['tree_size']:.1f} | {c['compression']:.2f} | {split} "
            f"| {c['peak_memory_gb']:.2f} | {c.get('lookup', 0)} "
            f"| {c.get('tree', 'fixed')} |"
        )
    base = [f"{b['tokens_per_s']:.1f}" for b in results["baselines"]]
    lines.append("")
    lines.append(f"Plain decoding baselines (tok/s, in run order): {', '.join(base)}")
    return "\n".join(lines) + "\n"


def grid_matrix(results: dict, key: str, widths: List[int], lengths: list) -> np.ndarray:
    """``[len(widths), len(lengths)]`` of a cell metric; NaN where a cell was
    skipped or not measured. A length may be a label (the sweep's ``auto``
    column), matched with the cells' ``length`` as it is."""
    m = np.full((len(widths), len(lengths)), np.nan)
    for c in results["cells"]:
        if c["status"] == "ok" and c.get(key) is not None and c["width"] in widths and c["length"] in lengths:
            m[widths.index(c["width"]), lengths.index(c["length"])] = c[key]
    return m


def heatmap_pixels(n_widths: int, n_lengths: int) -> Tuple[int, int]:
    """(width, height) in pixels of a heatmap PNG for a grid of that shape."""
    w_in, h_in = _figsize(n_widths, n_lengths)
    return int(w_in * DPI), int(h_in * DPI)


def _figsize(n_widths: int, n_lengths: int) -> Tuple[float, float]:
    return 3.0 + 1.0 * n_lengths, 1.5 + 0.75 * n_widths


def plot_heatmap(
    matrix: np.ndarray, widths, lengths, title: str, path, fmt: str = "{:.2f}", center: Optional[float] = None
) -> np.ndarray:
    """An annotated width x length heatmap (like the paper's Figure 7) as a
    PNG; returns the matrix that was drawn (read back from the image artist)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Figure + the Agg canvas directly: no pyplot global state, no display.
    fig = Figure(figsize=_figsize(len(widths), len(lengths)), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    data = np.ma.masked_invalid(np.asarray(matrix, dtype=float))
    norm = None
    if center is not None and data.count():
        from matplotlib.colors import TwoSlopeNorm

        lo, hi = float(data.min()), float(data.max())
        if lo < center < hi:
            norm = TwoSlopeNorm(vcenter=center, vmin=lo, vmax=hi)
    im = ax.imshow(data, cmap="RdYlGn" if center is not None else "viridis", norm=norm, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(v) for v in lengths])
    ax.set_yticks(range(len(widths)), [str(v) for v in widths])
    ax.set_xlabel("beam length L (drafted tokens)")
    ax.set_ylabel("beam width W")
    ax.set_title(title, fontsize=10)
    for i in range(len(widths)):
        for j in range(len(lengths)):
            v = matrix[i][j]
            if not np.isfinite(v):
                ax.text(j, i, "skipped", ha="center", va="center", fontsize=9, color="grey")
                continue
            r, g, b, _ = im.cmap(im.norm(v))
            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5  # white text on dark cells
            ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=9, color="white" if dark else "black")
    fig.colorbar(im, ax=ax)
    fig.savefig(path, dpi=DPI)
    return np.ma.filled(np.ma.asarray(im.get_array(), dtype=float), np.nan)


def heatmap_table(matrix: np.ndarray, widths, lengths, title: str, fmt: str = "{:.2f}", center: Optional[float] = None):
    """The same heatmap as a rich Table with coloured cells, for the terminal."""
    from rich.table import Table

    table = Table(title=title, min_width=len(title) + 4)  # a narrow grid would wrap the title
    table.add_column("W \\ L", justify="right", style="bold")
    for l in lengths:
        table.add_column(str(l), justify="right")
    finite = matrix[np.isfinite(matrix)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    for i, w in enumerate(widths):
        cells = []
        for j in range(len(lengths)):
            v = matrix[i][j]
            if not np.isfinite(v):
                cells.append("[dim]-[/dim]")
            else:
                cells.append(f"[{_colour(v, lo, hi, center)}]{fmt.format(v)}[/]")
        table.add_row(str(w), *cells)
    return table


def _colour(v: float, lo: float, hi: float, center: Optional[float]) -> str:
    """Background from red (worst) through yellow to green (best); around
    ``center`` when given, so that a speedup below 1 is always red."""
    if center is not None:
        span = max(abs(hi - center), abs(center - lo), 1e-9)
        t = 0.5 + 0.5 * (v - center) / span
    else:
        t = 0.5 if hi <= lo else (v - lo) / (hi - lo)
    t = min(max(t, 0.0), 1.0)
    r = int(255 * min(1.0, 2 * (1 - t)))
    g = int(255 * min(1.0, 2 * t))
    return f"black on #{r:02x}{g:02x}40"
