"""The sweep's resumable results file: what must match to resume it, the
speedup of each cell against the baselines around it, the best cell."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..errors import RedrafterError
from ..files import write_json_atomic

RESULTS_VERSION = 1


def attach_speedups(results: dict) -> None:
    """Give every measured cell the mean of the baseline passes right before
    and right after it (only one when the sweep stopped in between)."""
    baselines = sorted(results["baselines"], key=lambda b: b["seq"])
    for cell in results["cells"]:
        if cell["status"] != "ok":
            continue
        before = [b for b in baselines if b["seq"] < cell["seq"]][-1:]
        after = [b for b in baselines if b["seq"] > cell["seq"]][:1]
        near = before + after
        if not near:
            continue
        base_tps = float(np.mean([b["tokens_per_s"] for b in near]))
        cell["baseline_seqs"] = [b["seq"] for b in near]
        cell["baseline_tokens_per_s"] = base_tps
        cell["speedup"] = cell["tokens_per_s"] / base_tps if base_tps > 0 else 0.0
        base_mem = float(np.mean([b["peak_memory_gb"] for b in near]))
        cell["memory_overhead_gb"] = round(cell["peak_memory_gb"] - base_mem, 4)


def cell_order(c: dict) -> tuple:
    """How cells are listed (results file, Markdown): the fixed grid by (W, L,
    lookup beams), then the auto cells (records without a tree are fixed)."""
    return c.get("tree", "fixed") != "fixed", c["width"], c["length"], c.get("lookup", 0)


def best_cell(results: dict) -> Optional[dict]:
    """The measured cell with the highest speedup."""
    ok = [c for c in results["cells"] if c["status"] == "ok" and "speedup" in c]
    return max(ok, key=lambda c: c["speedup"]) if ok else None


def prompts_digest(prompts: List[List[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def sweep_key(config, prompts: List[List[int]], meta: dict) -> dict:
    """What must match for a results file to be resumed (``config``: a
    :class:`~mlx_redrafter.tuning.sweep.SweepConfig`). The memory limit
    and the baseline schedule do not change what a cell measures."""
    return {
        "widths": list(config.widths),
        "lengths": list(config.lengths),
        "lookups": list(config.lookups),
        "max_tokens": config.max_tokens,
        "profile": config.timings,  # the results file's name for timings
        "temp": config.temp,
        "top_p": config.top_p,
        "seed": config.seed,
        **({"tree": config.tree} if config.tree != "fixed" else {}),  # older results files were all fixed
        "prompts_digest": prompts_digest(prompts),
        "num_prompts": len(prompts),
        **meta,
    }


def new_results(key: dict) -> dict:
    from ..doctor import report

    return {"version": RESULTS_VERSION, "config": key, "machine": report(), "baselines": [], "cells": [], "best": None}


def _read_results(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RedrafterError(f"Cannot read {path}: {e}", "Delete it, pass --fresh, or use another --out.") from None


def check_resumable(out_dir, key: dict, only: Optional[Sequence[str]] = None) -> None:
    """Raise unless ``out_dir`` holds no results or results with this config
    (compared on the keys ``only``, when given: the CLI checks what it can
    before loading the model)."""
    path = Path(out_dir) / "results.json"
    if not path.exists():
        return
    old = _read_results(path)
    stored = old.get("config", {}) if old.get("version") == RESULTS_VERSION else {}
    names = set(only) if only is not None else set(key) | set(stored)
    diff = sorted(k for k in names if stored.get(k) != key.get(k))
    if diff or not stored:
        raise RedrafterError(
            f"{path} holds a sweep with other settings (differs in: {', '.join(diff) or 'version'}).",
            "Use another --out, or pass --fresh to start over in this folder.",
        )


def load_results(out_dir: Path, key: dict, fresh: bool = False) -> dict:
    """The results of an interrupted sweep with the same config, or new ones."""
    path = Path(out_dir) / "results.json"
    if fresh or not path.exists():
        return new_results(key)
    check_resumable(out_dir, key)
    old = _read_results(path)
    old["cells"] = [c for c in old["cells"] if c["status"] == "ok"]  # skipped cells are estimated again
    return old


def save_results(out_dir: Path, results: dict) -> None:
    attach_speedups(results)
    results["cells"].sort(key=cell_order)
    best = best_cell(results)
    results["best"] = (
        None
        if best is None
        else {
            **{k: best[k] for k in ("width", "length", "speedup", "tokens_per_s", "tokens_per_step")},
            "lookup": best.get("lookup", 0),
        }
    )
    write_json_atomic(Path(out_dir) / "results.json", results)


def cell_key(c: dict) -> Tuple[int, int, int, str]:
    """``(width, length, lookup beams, tree)`` of a cell record (older records
    have no lookup: 0, and no tree: fixed)."""
    return c["width"], c["length"], c.get("lookup", 0), c.get("tree", "fixed")


def cell_label(width: int, length: int, lookup: int, tree: str = "fixed") -> str:
    label = f"W={width} L={length}" if tree == "fixed" else f"auto W<={width} L<={length}"
    return label + (f" +lookup{'' if lookup == 1 else lookup}" if lookup else "")
