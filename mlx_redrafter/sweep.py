"""``mlx-redrafter sweep``: ReDrafter over a beam width x length grid, against
plain mlx-lm decoding measured in the same run.

The measuring core works on token ids (``measure``, ``run_pass``,
``run_sweep``), so that it runs on tiny random models without a tokenizer;
``prompts.chat_prompt_ids`` is the thin layer that turns conversations into ids
through a real model's chat template. ``bench/run.py`` reuses the same core.

Plain decoding drifts with the machine (thermal state, other processes), so
the baseline is measured before the grid and again after every
``baseline_every`` cells, and every cell is compared with the baseline
passes right before and after it.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .errors import RedrafterError
from .files import write_json_atomic
from .generate import DraftConfig, SamplingConfig, StepStats, generate_tokens

RESULTS_VERSION = 1
# Figures: sizes in inches that are exact binary fractions, so the PNG's
# pixel size is exactly inches * DPI (tests check it).
DPI = 80
HEATMAPS = {
    # key in the cell records: (file name, title, number format)
    "speedup": ("speedup.png", "Speedup over plain mlx-lm decoding", "{:.2f}x"),
    "tokens_per_s": ("tokens_per_s.png", "Tokens per second", "{:.1f}"),
    "tokens_per_step": ("tokens_per_step.png", "Tokens per step", "{:.2f}"),
}
PHASES = ("draft", "pack", "verify", "accept", "other")

Progress = Callable[[int, int, str], None]  # (units done, units in all, label)


# --------------------------------------------------------------------------- input


@dataclass
class SweepConfig:
    """What a sweep measures. ``beam_length`` counts drafted tokens only."""

    widths: List[int]
    lengths: List[int]
    max_tokens: int = 128
    baseline_every: int = 4  # a baseline pass after every k cells
    profile: bool = True  # split the step time into phases (adds 4 syncs per step)
    memory_limit_gb: Optional[float] = None  # None: what the device has
    temp: float = 0.0  # > 0: sampled (distribution-exact) instead of greedy
    top_p: float = 0.0
    seed: int = 0  # with temp > 0, prompt i is sampled from seed + i, for every pass

    def cells(self) -> List[Tuple[int, int]]:
        return [(w, l) for w in self.widths for l in self.lengths]

    def check(self) -> None:
        if not self.widths or not self.lengths:
            raise RedrafterError("The grid is empty.", "Give at least one width and one length, e.g. --widths 1,2 --lengths 2,4.")
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


def resolve_drafter_path(model_spec: str, drafter: Optional[str]) -> Path:
    """``--drafter``, else the drafter shipped for ``model_spec``, else a clear error."""
    from .session import shipped_drafter_path

    if drafter is not None:
        path = Path(drafter).expanduser()
        if not path.exists():
            raise RedrafterError(f"Drafter path does not exist: {drafter}", "Check the --drafter path.")
        return path
    path = shipped_drafter_path(model_spec)
    if path is None:
        hint = "(the default model's drafter is not installed yet)" if model_spec == "default" else f"for {model_spec!r}"
        raise RedrafterError(
            f"No drafter given and none ships {hint}.",
            "Pass --drafter PATH (train one with `mlx-redrafter distill` + `mlx-redrafter train`).",
        )
    return path


# --------------------------------------------------------------------------- measuring core


@dataclass
class Run:
    """One greedy generation and its timings (seconds)."""

    tokens: List[int]
    steps: List[StepStats]  # steps[0] is the prefill (+ the first draft)
    wall_time: float
    peak_memory: int  # bytes, mx.get_peak_memory() over this generation

    @property
    def ttft(self) -> float:
        """Time to the first token."""
        return self.steps[0].step_time if self.steps else self.wall_time

    @property
    def decode_tokens(self) -> int:
        return max(len(self.tokens) - 1, 0)

    @property
    def decode_time(self) -> float:
        return max(self.wall_time - self.ttft, 0.0)

    def step_tokens(self) -> List[Tuple[int, StepStats]]:
        """``(tokens emitted, stats)`` of each decode step. The last step may
        be cut by ``max_tokens`` or EOS; a step that emitted nothing is left out."""
        left = self.decode_tokens
        out = []
        for s in self.steps[1:]:
            n = min(1 + s.accepted, left)
            left -= n
            if n > 0:
                out.append((n, s))
        return out

    def token_latencies(self) -> List[float]:
        """Per-token latency: each decode step's time shared by the tokens it emitted."""
        return [s.step_time / n for n, s in self.step_tokens() for _ in range(n)]


def measure(
    model,
    prompt: Sequence[int],
    drafter=None,
    beam_width: int = 1,
    beam_length: int = 1,
    max_tokens: int = 128,
    eos_ids: Sequence[int] = (),
    profile: bool = False,
    temp: float = 0.0,
    top_p: float = 0.0,
    controller=None,
    lookup: int = 0,
) -> Run:
    """Generate from token ids (greedy unless ``temp > 0``) and time it.

    ``drafter=None, lookup=0`` is plain mlx-lm decoding: ``generate_tokens``
    then runs mlx-lm's own ``generate_step`` on the same model object, not
    our loop. ``lookup`` is the number of lookup beams.
    """
    mx.reset_peak_memory()
    tic = time.perf_counter()
    draft = DraftConfig(drafter, beam_width, beam_length, controller=controller, lookup=lookup)
    tokens, steps = generate_tokens(
        model, list(prompt), draft=draft, max_tokens=max_tokens, eos_ids=eos_ids,
        temp=temp, top_p=top_p, profile=profile,
    )
    wall = time.perf_counter() - tic
    return Run(tokens, steps, wall, mx.get_peak_memory())


@dataclass
class Pass:
    """One configuration (the baseline or one cell) over every prompt."""

    runs: List[Run]

    @property
    def peak_memory(self) -> int:
        return max((r.peak_memory for r in self.runs), default=0)


def run_pass(model, prompts, drafter, width, length, config: SweepConfig, eos_ids=(), tick=None, controller=None) -> Pass:
    """Measure every prompt once; ``tick()`` after each."""
    runs = []
    for i, p in enumerate(prompts):
        if config.temp > 0:
            mx.random.seed(config.seed + i)  # the same draws for every pass
        runs.append(measure(model, p, drafter, width, length, config.max_tokens, eos_ids,
                            config.profile and drafter is not None, config.temp, config.top_p,
                            controller if drafter is not None else None))
        if tick:
            tick()
    return Pass(runs)


def warm_up(model, prompt, drafter, width: int, length: int) -> None:
    """One short untimed generation each way: the first call in a process
    pays for allocations and kernel set-up that later calls do not."""
    measure(model, prompt, None, max_tokens=4)
    measure(model, prompt, drafter, width, length, max_tokens=4)


# --------------------------------------------------------------------------- summaries


def _gb(n: float) -> float:
    return round(n / 1e9, 6)


def summarize_baseline(p: Pass, seq: int) -> dict:
    """The baseline record: throughput over all prompts (decode only: the
    prefill is the same work for both ways of decoding)."""
    tokens = sum(r.decode_tokens for r in p.runs)
    secs = sum(r.decode_time for r in p.runs)
    return {
        "seq": seq,
        "tokens": sum(len(r.tokens) for r in p.runs),
        "decode_time_s": secs,
        "tokens_per_s": tokens / secs if secs > 0 else 0.0,
        "ttft_s": float(np.mean([r.ttft for r in p.runs])),
        "wall_time_s": sum(r.wall_time for r in p.runs),
        "peak_memory_gb": _gb(p.peak_memory),
        "finished_at": time.time(),
    }


def summarize_cell(p: Pass, width: int, length: int, seq: int, reference: Optional[List[List[int]]] = None) -> dict:
    """Everything measured for one (W, L) cell, except the speedup, which
    needs the baseline passes on both sides (see :func:`attach_speedups`)."""
    steps = [s for r in p.runs for s in r.steps[1:]]
    emitted = [n for r in p.runs for n, _ in r.step_tokens()]
    tokens = sum(r.decode_tokens for r in p.runs)
    secs = sum(r.decode_time for r in p.runs)
    tree = float(np.mean([s.tree_size for s in steps])) if steps else 1.0
    rec = {
        "width": width,
        "length": length,
        "status": "ok",
        "seq": seq,
        "tokens": sum(len(r.tokens) for r in p.runs),
        "decode_time_s": secs,
        "tokens_per_s": tokens / secs if secs > 0 else 0.0,
        "tokens_per_step": float(np.mean(emitted)) if emitted else 0.0,
        # Fraction of steps whose accepted run reached depth d (d = 1..L).
        "acceptance_by_depth": [float(np.mean([s.accepted >= d for s in steps])) if steps else 0.0 for d in range(1, length + 1)],
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


def time_split_ms(steps: List[StepStats]) -> Dict[str, float]:
    """Mean milliseconds per step in draft / pack / verify / accept, and the
    rest of the step ("other": host sync, cache bookkeeping, Python)."""
    if not steps:
        return {k: 0.0 for k in PHASES}
    n = len(steps)
    out = {
        "draft": sum(s.draft_time for s in steps),
        "pack": sum(s.pack_time for s in steps),
        "verify": sum(s.verify_time for s in steps),
        "accept": sum(s.accept_time for s in steps),
    }
    out["other"] = max(sum(s.step_time for s in steps) - sum(out.values()), 0.0)
    return {k: 1000 * v / n for k, v in out.items()}


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


def best_cell(results: dict) -> Optional[dict]:
    """The measured cell with the highest speedup."""
    ok = [c for c in results["cells"] if c["status"] == "ok" and "speedup" in c]
    return max(ok, key=lambda c: c["speedup"]) if ok else None


# --------------------------------------------------------------------------- memory estimate


def _nbytes(tree) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(tree) if isinstance(v, mx.array))


def kv_bytes_per_token(model) -> int:
    """KV-cache bytes per token over all layers, measured with a one-token
    forward (for every cache type and head layout). Caches allocate in
    blocks, so each array's bytes are divided by its rows along the
    sequence axis (-2 in mlx-lm's ``[B, heads, S, D]`` layout)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    arrays = [a for c in cache for _, a in tree_flatten(c.state) if isinstance(a, mx.array) and a.ndim >= 2]
    mx.eval(arrays)
    return sum(a.nbytes // a.shape[-2] for a in arrays)


def estimate_cell_bytes(model, drafter, width: int, length: int, prompt_tokens: int, max_tokens: int, kv_per_token: Optional[int] = None) -> int:
    """An upper estimate of the memory one cell needs: the weights, the KV
    cache for prompt + max_tokens + one tree, the tree's logits (N x V,
    float32, plus as much again for the acceptance temporaries) and the
    drafter's beam scores (W x draft vocabulary per depth, with the
    softmax and top-k temporaries)."""
    from .models import model_parts

    embed, _, _ = model_parts(model)
    vocab = int(embed.weight.shape[0])
    hidden = int(drafter.config.hidden_size)
    head = int(getattr(drafter.config, "head_size", vocab))
    n = 1 + width * length
    kv = (kv_per_token if kv_per_token is not None else kv_bytes_per_token(model)) * (prompt_tokens + max_tokens + n)
    tree = 2 * n * vocab * 4 + 4 * n * hidden * 4
    beams = 3 * width * length * head * 4
    weights = _nbytes(model.parameters()) + (_nbytes(drafter.parameters()) if hasattr(drafter, "parameters") else 0)
    return weights + kv + tree + beams


def memory_budget_bytes(limit_gb: Optional[float] = None) -> int:
    """``limit_gb``, else the GPU's recommended working set, else what the
    OS can still give (MemAvailable) plus what MLX already holds."""
    if limit_gb is not None:
        return int(limit_gb * 1e9)
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        return avail + mx.get_active_memory()
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --------------------------------------------------------------------------- results file


def prompts_digest(prompts: List[List[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def sweep_key(config: SweepConfig, prompts: List[List[int]], meta: dict) -> dict:
    """What must match for a results file to be resumed. The memory limit
    and the baseline schedule do not change what a cell measures."""
    return {
        "widths": list(config.widths),
        "lengths": list(config.lengths),
        "max_tokens": config.max_tokens,
        "profile": config.profile,
        "temp": config.temp,
        "top_p": config.top_p,
        "seed": config.seed,
        "prompts_digest": prompts_digest(prompts),
        "num_prompts": len(prompts),
        **meta,
    }


def new_results(key: dict) -> dict:
    from .doctor import report

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
    results["cells"].sort(key=lambda c: (c["width"], c["length"]))
    best = best_cell(results)
    results["best"] = None if best is None else {k: best[k] for k in ("width", "length", "speedup", "tokens_per_s", "tokens_per_step")}
    write_json_atomic(Path(out_dir) / "results.json", results)


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
) -> dict:
    """Measure every cell of the grid not already in ``out_dir/results.json``
    (written after every pass, so an interrupted sweep resumes), interleaved
    with baseline passes; then write the CSV and the heatmaps.

    ``prompts`` are token-id lists; ``meta`` (model, drafter, dtype, ...)
    goes into the config that a resumed sweep must match. With a
    ``controller`` (adaptive depth) each cell's length is the maximum depth.
    """
    config.check()
    if not prompts:
        raise RedrafterError("No prompts to measure.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = json.loads(json.dumps(sweep_key(config, prompts, meta or {})))  # as it reads back from JSON
    results = load_results(out_dir, key, fresh)
    done = {(c["width"], c["length"]) for c in results["cells"]}
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
    if todo:
        warm_up(model, prompts[0], drafter, *todo[0])
    reference = None
    for i, (w, l) in enumerate(todo):
        if i % config.baseline_every == 0:
            reference, seq = _baseline(model, prompts, config, eos_ids, results, out_dir, seq, stage, tick)
        stage(f"W={w} L={l}")
        p = run_pass(model, prompts, drafter, w, l, config, eos_ids, tick, controller)
        results["cells"].append(summarize_cell(p, w, l, seq, reference if config.temp == 0 else None))
        seq += 1
        save_results(out_dir, results)
    if todo:
        _baseline(model, prompts, config, eos_ids, results, out_dir, seq, stage, tick)
    write_outputs(results, out_dir, config)
    return results


def _baseline(model, prompts, config, eos_ids, results, out_dir, seq, stage, tick):
    stage("baseline (plain mlx-lm)")
    p = run_pass(model, prompts, None, 1, 1, config, eos_ids, tick)
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
    for w, l in cells:
        need = estimate_cell_bytes(model, drafter, w, l, longest, config.max_tokens, kv)
        if need > budget:
            results["cells"].append({
                "width": w, "length": l, "status": "skipped",
                "estimated_memory_gb": _gb(need),
                "note": f"skipped: needs about {need / 1e9:.2f} GB, the budget is {budget / 1e9:.2f} GB",
            })
        else:
            keep.append((w, l))
    return keep


# --------------------------------------------------------------------------- outputs


CSV_FIELDS = [
    "kind", "width", "length", "status", "seq", "tokens", "tokens_per_s", "baseline_tokens_per_s",
    "speedup", "tokens_per_step", "tree_size", "compression", "verified_depth",
    *[f"{p}_ms" for p in PHASES], "ttft_s", "peak_memory_gb", "memory_overhead_gb",
    "estimated_memory_gb", "identical_outputs", "note",
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
    head = ("| W | L | speedup | tok/s | tokens/step | acceptance by depth | packed size | compression "
            "| draft / pack / verify / accept / other ms | peak GB |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for c in sorted(results["cells"], key=lambda c: (c["width"], c["length"])):
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
            f"| {c['tree_size']:.1f} | {c['compression']:.2f} | {split} | {c['peak_memory_gb']:.2f} |"
        )
    base = [f"{b['tokens_per_s']:.1f}" for b in results["baselines"]]
    lines.append("")
    lines.append(f"Plain decoding baselines (tok/s, in run order): {', '.join(base)}")
    return "\n".join(lines) + "\n"


def grid_matrix(results: dict, key: str, widths: List[int], lengths: List[int]) -> np.ndarray:
    """``[len(widths), len(lengths)]`` of a cell metric; NaN where a cell was skipped or not measured."""
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


def plot_heatmap(matrix: np.ndarray, widths, lengths, title: str, path, fmt: str = "{:.2f}", center: Optional[float] = None) -> np.ndarray:
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


def write_outputs(results: dict, out_dir, config: SweepConfig) -> Dict[str, np.ndarray]:
    """results.csv, results.md and the three heatmap PNGs; returns the matrices drawn, by metric."""
    out_dir = Path(out_dir)
    save_results(out_dir, results)
    write_csv(results, out_dir / "results.csv")
    (out_dir / "results.md").write_text(markdown_table(results))
    drawn = {}
    for key, (name, title, fmt) in HEATMAPS.items():
        m = grid_matrix(results, key, config.widths, config.lengths)
        drawn[key] = plot_heatmap(m, config.widths, config.lengths, title, out_dir / name, fmt,
                                  center=1.0 if key == "speedup" else None)
    return drawn


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


# --------------------------------------------------------------------------- command-line layer


def fit_prompts(prompts: List[List[int]], model, max_tokens: int, tree_tokens: int) -> Tuple[List[List[int]], int]:
    """Drop prompts that leave no room in the model's context for
    ``max_tokens`` and one verified tree; return ``(kept, dropped)``."""
    from .generate import context_limit

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
    from .models import default_dtype, parse_dtype
    from .profiles import drafter_id, device_id

    return {
        "model": str(model_spec),
        "drafter": drafter_id(drafter_path),
        "prompt_set": str(prompt_set),
        "dtype": str(parse_dtype(dtype) or default_dtype()).split(".")[-1],
        "device": device_id(),
    }


def print_summary(console, results: dict, config: SweepConfig, out_dir) -> None:
    """Heatmaps in the terminal, the best cell, the notes and the files."""
    for key in ("speedup", "tokens_per_step", "tokens_per_s"):
        _, title, fmt = HEATMAPS[key]
        m = grid_matrix(results, key, config.widths, config.lengths)
        console.print(heatmap_table(m, config.widths, config.lengths, title, fmt, center=1.0 if key == "speedup" else None))
    base = [b["tokens_per_s"] for b in results["baselines"]]
    if base:
        console.print(f"plain mlx-lm decoding: {np.mean(base):.1f} tok/s (mean of {len(base)} passes, "
                      f"{min(base):.1f}-{max(base):.1f})")
    for c in results["cells"]:
        if c["status"] != "ok":
            console.print(f"[yellow]W={c['width']} L={c['length']}: {c['note']}[/yellow]")
        elif c.get("identical_outputs") is not None and c["identical_outputs"] < results["config"]["num_prompts"]:
            console.print(f"[yellow]W={c['width']} L={c['length']}: {c['identical_outputs']}/{results['config']['num_prompts']} "
                          "outputs equal plain greedy decoding (expected all in float32)[/yellow]")
    best = results.get("best")
    if best:
        console.print(f"best: W={best['width']} L={best['length']}, {best['speedup']:.2f}x, "
                      f"{best['tokens_per_s']:.1f} tok/s, {best['tokens_per_step']:.2f} tokens/step")
    names = ["results.json", "results.csv", "results.md"] + [v[0] for v in HEATMAPS.values()]
    console.print(f"wrote {', '.join(str(Path(out_dir) / n) for n in names)}")


def save_best_profile(results: dict, model_spec: str, drafter_path, out_dir) -> Optional[Path]:
    """Store the best (W, L) as the tuned profile of this device + model + drafter."""
    from .profiles import save_profile

    best = results.get("best")
    if best is None:
        return None
    return save_profile(
        model_spec, drafter_path, best["width"], best["length"],
        speedup=best["speedup"], tokens_per_s=best["tokens_per_s"],
        sweep=str((Path(out_dir) / "results.json").resolve()), saved_at=time.time(),
    )
