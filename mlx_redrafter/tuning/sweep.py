"""``mlx-redrafter sweep``: ReDrafter over a beam width x length grid, against
plain mlx-lm decoding measured in the same run.

The sweep works on token ids, so that it runs on tiny random models
without a tokenizer: the timing core is :mod:`~mlx_redrafter.tuning.measure` (which
``bench/`` shares), :mod:`~mlx_redrafter.prompts` templates conversations
into ids, :mod:`~mlx_redrafter.tuning.report` writes the CSV, Markdown and
heatmaps, summary.py what the results become (files, the terminal summary,
the tuned profile), results.py keeps the resumable results file and
memory.py skips cells that would not fit. This module holds the grid and the
baseline interleaving.

Plain decoding drifts with the machine (thermal state, other processes), so
the baseline is measured before the grid and again after every
``baseline_every`` cells, and every cell is compared with the baseline
passes right before and after it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..config import TREES, DraftConfig, SamplingConfig, is_layer_head
from ..errors import RedrafterError
from .measure import Pass, run_pass, time_split_ms, warm_up
from .memory import estimate_cell_bytes, kv_bytes_per_token, memory_budget_bytes
from .results import cell_key, cell_label, load_results, save_results, sweep_key
from .summary import write_outputs

Progress = Callable[[int, int, str], None]  # (units done, units in all, label)


# --------------------------------------------------------------------------- input


@dataclass
class SweepConfig:
    """What a sweep measures. ``beam_length`` counts drafted tokens only."""

    widths: List[int]
    lengths: List[int]
    max_tokens: int = 128
    baseline_every: int = 4  # a baseline pass after every k cells
    # Split the step time into phases: adds 4 syncs per step and runs the
    # synchronous loop, so the speedups are then that loop's, not the default's.
    timings: bool = False
    memory_limit_gb: Optional[float] = None  # None: what the device has
    temp: float = 0.0  # > 0: sampled (distribution-exact) instead of greedy
    top_p: float = 0.0
    seed: int = 0  # with temp > 0, prompt i is sampled from seed + i, for every pass
    lookups: List[int] = field(default_factory=lambda: [0])  # lookup beams: [0] off, [1] on, [0, 1] both
    tree: str = "fixed"  # "auto": each cell's W x L (+ lookup) are the caps of the cost-aware selection
    curve: object = None  # auto cells: the verify-cost curve (None: the built-in one)
    # tree="fixed": also one auto cell per width and lookup setting, its caps
    # W x the longest length: the "auto" column beside the fixed grid.
    auto_column: bool = False

    def cells(self) -> List[Tuple[int, int, int, str]]:
        """``(width, length, lookup beams, tree)`` of every cell."""
        grid = [(w, l, k, self.tree) for w in self.widths for l in self.lengths for k in self.lookups]
        if not self.auto_column_on():
            return grid
        return grid + [(w, max(self.lengths), k, "auto") for w in self.widths for k in self.lookups]

    def auto_column_on(self) -> bool:
        """Whether the auto column is measured (beside a fixed grid only: under tree="auto" every cell is auto)."""
        return self.tree == "fixed" and self.auto_column

    def has_auto(self) -> bool:
        """Whether any cell runs the cost-aware selection (and needs the curve)."""
        return any(t == "auto" for *_, t in self.cells())

    def check(self) -> None:
        if not self.widths or not self.lengths:
            raise RedrafterError(
                "The grid is empty.", "Give at least one width and one length, e.g. --widths 1,2 --lengths 2,4."
            )
        if min(self.widths) < 1 or min(self.lengths) < 1:
            raise RedrafterError(
                f"Beam widths and lengths must be at least 1 (got widths {self.widths}, lengths {self.lengths}).",
                "Use e.g. --widths 1,2,3,4 --lengths 2,3,4,5.",
            )
        if self.max_tokens < 1:
            raise RedrafterError(f"--max-tokens must be at least 1 (got {self.max_tokens}).")
        if self.baseline_every < 1:
            raise RedrafterError(f"--baseline-every must be at least 1 (got {self.baseline_every}).")
        SamplingConfig(self.temp, self.top_p)  # raises on a bad value
        if not self.lookups or min(self.lookups) < 0:
            raise RedrafterError(f"Lookup beams must be at least 0 (got {self.lookups}).")
        if self.tree not in TREES:
            raise RedrafterError(
                f"The sweep's tree must be fixed or auto (got {self.tree!r}).", "Use --tree fixed or --tree auto."
            )


def parse_grid(text: str, flag: str = "--widths") -> List[int]:
    """``"1,2,4"`` or ``"1-4"`` (or a mix, ``"1-3,5"``) -> sorted unique ints >= 1."""
    values = set()
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise RedrafterError(
                f"{flag}: {part!r} is not a whole number or a range.",
                f"Use a comma-separated list or a range, e.g. {flag} 1,2,3,4 or {flag} 1-4.",
            ) from None
        if a < 1 or b < 1:
            raise RedrafterError(f"{flag}: values must be at least 1 (got {part!r}).", f"Use e.g. {flag} 1,2,3,4.")
        if b < a:
            raise RedrafterError(f"{flag}: the range {part!r} is empty.", f"Write ranges low-high, e.g. {flag} 1-4.")
        values.update(range(a, b + 1))
    if not values:
        raise RedrafterError(f"{flag} is empty: the grid would have no cells.", f"Use e.g. {flag} 1,2,3,4.")
    return sorted(values)


# --------------------------------------------------------------------------- summaries


def _gb(n: float) -> float:
    return round(n / 1e9, 6)


def summarize_baseline(p: Pass, seq: int) -> dict:
    """The baseline record: throughput over all prompts (decode only: the
    prefill is the same work for both ways of decoding)."""
    return {
        "seq": seq,
        "tokens": sum(len(r.tokens) for r in p.runs),
        "decode_time_s": p.decode_time,
        "tokens_per_s": p.tokens_per_s,
        "ttft_s": float(np.mean([r.ttft for r in p.runs])),
        "wall_time_s": sum(r.wall_time for r in p.runs),
        "peak_memory_gb": _gb(p.peak_memory),
        "finished_at": time.time(),
    }


def summarize_cell(p: Pass, width: int, length: int, seq: int, reference: Optional[List[List[int]]] = None) -> dict:
    """Everything measured for one (W, L) cell, except the speedup, which
    needs the baseline passes on both sides (see :func:`attach_speedups`)."""
    steps = [s for r in p.runs for s in r.steps[1:]]
    tree = float(np.mean([s.tree_size for s in steps])) if steps else 1.0
    rec = {
        "width": width,
        "length": length,
        "status": "ok",
        "seq": seq,
        "tokens": sum(len(r.tokens) for r in p.runs),
        "decode_time_s": p.decode_time,
        "tokens_per_s": p.tokens_per_s,
        "tokens_per_step": p.tokens_per_step,
        # Fraction of steps whose accepted run reached depth d (d = 1..L).
        "acceptance_by_depth": [
            float(np.mean([s.accepted >= d for s in steps])) if steps else 0.0 for d in range(1, length + 1)
        ],
        "tree_size": tree,
        "compression": (tree - 1) / (width * length),
        # Drafted depth actually verified (= length unless a controller picks it).
        "verified_depth": float(np.mean([s.depth for s in steps])) if steps else float(length),
        "time_split_ms": time_split_ms(steps),
        "ttft_s": float(np.mean([r.ttft for r in p.runs])),
        "peak_memory_gb": _gb(p.peak_memory),
        "finished_at": time.time(),
    }
    if reference is not None:
        # Greedy ReDrafter must reproduce plain decoding token for token.
        rec["identical_outputs"] = sum(r.tokens == ref for r, ref in zip(p.runs, reference))
    return rec


# --------------------------------------------------------------------------- the sweep


def baseline_count(n_cells: int, every: int) -> int:
    """Baseline passes for ``n_cells`` cells: one before, one after every ``every`` cells and after the last."""
    return 0 if n_cells == 0 else 1 + math.ceil(n_cells / every)


def run_sweep(
    model,
    prompts: List[List[int]],
    drafter,
    config: SweepConfig,
    out_dir,
    meta: Optional[dict] = None,
    eos_ids: Sequence[int] = (),
    progress: Optional[Progress] = None,
    fresh: bool = False,
    controller=None,
    make_draft: Optional[Callable[[int, int, int, str], DraftConfig]] = None,
) -> dict:
    """Measure every cell of the grid not already in ``out_dir/results.json``
    (written after every pass, so an interrupted sweep resumes), interleaved
    with baseline passes; then write the CSV and the heatmaps.

    ``prompts`` are token-id lists; ``meta`` (model, drafter, dtype, ...)
    goes into the config that a resumed sweep must match. With a
    ``controller`` (adaptive depth) each cell's length is the maximum depth.
    ``make_draft(w, l, lookup, tree)``: each cell's draft when the grid is
    another source's (an MTP head's depth, a draft model's length).
    """
    config.check()
    if not prompts:
        raise RedrafterError("No prompts to measure.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = json.loads(json.dumps(sweep_key(config, prompts, meta or {})))  # as it reads back from JSON
    results = load_results(out_dir, key, fresh)
    done = {cell_key(c) for c in results["cells"]}
    todo = [c for c in config.cells() if c not in done]
    todo = skip_oversized(model, drafter, todo, prompts, config, results)
    save_results(out_dir, results)

    units = (len(todo) + baseline_count(len(todo), config.baseline_every)) * len(prompts)
    state = {"done": 0, "label": ""}

    def tick():
        state["done"] += 1
        if progress:
            progress(state["done"], units, state["label"])

    def stage(label):
        state["label"] = label
        if progress:
            progress(state["done"], units, label)

    seq = 1 + max([b["seq"] for b in results["baselines"]] + [c.get("seq", 0) for c in results["cells"]], default=0)

    def draft(w, l, k, tree):
        # A cell measures its setting: every step drafts (no live choice of plain decoding, step/governor.py).
        if make_draft is not None:
            return replace(make_draft(w, l, k, tree), always_draft=True)
        if is_layer_head(drafter):  # an EAGLE-3 head: its beams are the draft's layer head's
            head = {"head": drafter, "head_width": w, "head_length": l}
            return DraftConfig(
                controller=controller, lookup=k, tree=tree, curve=config.curve, always_draft=True, **head
            )
        return DraftConfig(
            drafter, w, l, controller=controller, lookup=k, tree=tree, curve=config.curve, always_draft=True
        )

    if todo:
        warm_up(model, prompts[0], draft(*todo[0]))
    reference = None
    for i, (w, l, k, tree) in enumerate(todo):
        if i % config.baseline_every == 0:
            reference, seq = _baseline(model, prompts, config, eos_ids, results, out_dir, seq, stage, tick)
        stage(cell_label(w, l, k, tree))
        p = _pass(model, prompts, draft(w, l, k, tree), config, eos_ids, tick)
        results["cells"].append(
            {**summarize_cell(p, w, l, seq, reference if config.temp == 0 else None), "lookup": k, "tree": tree}
        )
        seq += 1
        save_results(out_dir, results)
    if todo:
        _baseline(model, prompts, config, eos_ids, results, out_dir, seq, stage, tick)
    write_outputs(results, out_dir, config)
    return results


def _pass(model, prompts, draft: Optional[DraftConfig], config: SweepConfig, eos_ids, tick) -> Pass:
    return run_pass(
        model,
        prompts,
        draft,
        max_tokens=config.max_tokens,
        eos_ids=eos_ids,
        temp=config.temp,
        top_p=config.top_p,
        seed=config.seed,
        timings=config.timings,
        tick=tick,
    )


def _baseline(model, prompts, config, eos_ids, results, out_dir, seq, stage, tick):
    stage("baseline (plain mlx-lm)")
    p = _pass(model, prompts, None, config, eos_ids, tick)
    results["baselines"].append(summarize_baseline(p, seq))
    save_results(out_dir, results)
    return [r.tokens for r in p.runs], seq + 1


def skip_oversized(model, drafter, cells, prompts, config: SweepConfig, results: dict) -> list:
    """Record the cells whose estimated memory exceeds the budget as skipped;
    return the others."""
    budget = memory_budget_bytes(config.memory_limit_gb)
    longest = max(len(p) for p in prompts)
    kv = kv_bytes_per_token(model)
    keep = []
    for w, l, k, tree in cells:
        need = estimate_cell_bytes(model, drafter, w, l, longest, config.max_tokens, kv)
        if need > budget:
            results["cells"].append(
                {
                    "width": w,
                    "length": l,
                    "lookup": k,
                    "tree": tree,
                    "status": "skipped",
                    "estimated_memory_gb": _gb(need),
                    "note": f"skipped: needs about {need / 1e9:.2f} GB, the budget is {budget / 1e9:.2f} GB",
                }
            )
        else:
            keep.append((w, l, k, tree))
    return keep


# --------------------------------------------------------------------------- command-line layer


def fit_prompts(prompts: List[List[int]], model, max_tokens: int, tree_tokens: int) -> Tuple[List[List[int]], int]:
    """Drop prompts that leave no room in the model's context for
    ``max_tokens`` and one verified tree; return ``(kept, dropped)``."""
    from ..llm.parts import context_limit

    limit = context_limit(model)
    if not limit:
        return list(prompts), 0
    kept = [p for p in prompts if len(p) + max_tokens + tree_tokens <= limit]
    if not kept:
        raise RedrafterError(
            f"No prompt fits the model's context of {limit} tokens with --max-tokens {max_tokens}.",
            "Lower --max-tokens, or use shorter prompts.",
        )
    return kept, len(prompts) - len(kept)


def sweep_meta(model_spec: str, drafter_path, prompt_set: str, dtype) -> dict:
    """What identifies the measured system, stored with the results (and
    matched when a sweep resumes)."""
    from ..llm.load import default_dtype, parse_dtype
    from ..profiles import device_id, drafter_id

    return {
        "model": str(model_spec),
        "drafter": drafter_id(drafter_path),
        "prompt_set": str(prompt_set),
        "dtype": str(parse_dtype(dtype) or default_dtype()).split(".")[-1],
        "device": device_id(),
    }
