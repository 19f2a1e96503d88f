"""tree="auto" against tree="fixed" and plain decoding, interleaved in one run (issue 27).

Groups: MT-Bench first turns, Spec-Bench categories and copy-heavy prompts
(bench/lookup.py's), greedy. Modes on the float32 model: plain; ``fixed``
and ``auto`` with the default shape (W=2 L=1, one lookup row); ``auto_caps``
(W=3 L=2 + lookup as caps); ``lookup`` and ``lookup_auto`` (no drafter).
With ``--adaptive`` the float32 modes are the depth controller's comparison
instead: plain, ``fixed`` and ``auto`` (W=2 L=1), ``auto_deep`` (the
selection alone, W=2 L=4 + lookup as caps), ``radar`` (the shipped RADAR
controller alone: it picks the depth of W=2 L=4, every drafted node is
verified) and ``radar_auto`` (both: the controller picks the depth, the
selection the nodes). ``--modes`` names any list of these.
With ``--q4``, the default model quantized to 4 bits (group 64) too: plain,
fixed, auto and ``default`` (no flags: the model's default tree, here
``auto``, on the stored or built-in curve). Each model's verify-cost curve is measured first (<= 30 s)
and printed; the auto modes use it. Every run's tokens are checked against
plain decoding.

    python bench/auto_tree.py --mt-bench 4 --per-task 1 --copy 1 --max-tokens 64 --q4
    python bench/auto_tree.py --mt-bench 6 --per-task 1 --copy 1 --max-tokens 64 --adaptive
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lookup import Tally, groups  # noqa: E402  (bench/lookup.py's prompt groups and totals)

BENCH_DIR = Path(__file__).resolve().parent


MODES = ["plain", "fixed", "auto", "auto_caps", "lookup", "lookup_auto"]
ADAPTIVE_MODES = ["plain", "fixed", "auto", "auto_deep", "radar", "radar_auto"]


def drafts(model, drafter, curve, controller=None):
    from mlx_redrafter.config import DraftConfig, library_draft
    from mlx_redrafter.keywords import tree_kw, with_curve

    # The controller's own shape (the W x L it was trained for: 2 x 4 shipped).
    cw, cl = (controller.config.beam_width, controller.config.beam_length) if controller else (2, 4)
    return {
        # What a user gets with no flags: the tuned profile or built-in shape,
        # the model's default tree and this device's stored (else built-in) curve.
        "default": with_curve(model, library_draft(model, drafter, None, None, None, **tree_kw(None, model))),
        "plain": DraftConfig(),
        "fixed": DraftConfig(drafter, 2, 1, lookup=1),
        "auto": DraftConfig(drafter, 2, 1, lookup=1, tree="auto", curve=curve),
        "auto_caps": DraftConfig(drafter, 3, 2, lookup=1, tree="auto", curve=curve),
        "lookup": DraftConfig(lookup=1),
        "lookup_auto": DraftConfig(lookup=1, tree="auto", curve=curve),
        "auto_deep": DraftConfig(drafter, cw, cl, lookup=1, tree="auto", curve=curve),
        "radar": DraftConfig(drafter, cw, cl, lookup=1, controller=controller),
        "radar_auto": DraftConfig(drafter, cw, cl, lookup=1, controller=controller, tree="auto", curve=curve),
    }


def run_model(label, model, drafter, sets, modes, max_tokens, eos, controller=None):
    """Interleaved runs of ``modes`` over every prompt: per-group rows."""
    from mlx_redrafter.step.curve import format_curve
    from mlx_redrafter.tuning.calibrate import measure_curve
    from mlx_redrafter.tuning.measure import measure

    curve = measure_curve(model)
    print(f"[{label}] {format_curve(curve)}", file=sys.stderr, flush=True)
    configs = drafts(model, drafter, curve, controller)
    first = next(iter(sets.values()))[0]
    for m in modes:  # untimed warm-up
        measure(model, first, draft=configs[m], max_tokens=4, eos_ids=eos)
    totals, k = {g: {m: Tally() for m in modes} for g in sets}, 0
    for g, prompts in sets.items():
        for p in prompts:
            order = modes[k % len(modes) :] + modes[: k % len(modes)]
            k += 1
            runs = {m: measure(model, p, draft=configs[m], max_tokens=max_tokens, eos_ids=eos) for m in order}
            sizes = {m: sum(s.tree_size for s in r.steps[1:]) / max(len(r.steps) - 1, 1) for m, r in runs.items()}
            for m in modes:
                totals[g][m].add(runs[m], runs[m].tokens == runs["plain"].tokens)
                totals[g][m].tree = getattr(totals[g][m], "tree", []) + [sizes[m]]
            print(f"[{label}] {g}: {k} prompts done", file=sys.stderr, flush=True)
    rows = {
        g: {m: {**t.row(ts["plain"]), "mean_tree": round(sum(t.tree) / len(t.tree), 2)} for m, t in ts.items()}
        for g, ts in totals.items()
    }
    every = {m: Tally() for m in modes}
    for ts in totals.values():
        for m, t in ts.items():
            for f in ("tokens", "time", "steps", "lookup_tokens", "drafter_tokens", "mismatches"):
                setattr(every[m], f, getattr(every[m], f) + getattr(t, f))
    rows["all"] = {m: t.row(every["plain"]) for m, t in every.items()}
    return {"curve": list(curve.costs), "groups": rows}


def markdown(label, res, modes) -> str:
    drafted = [m for m in modes if m != "plain"]
    lines = [
        f"**{label}** c(N) N=1..8: " + " ".join(f"{c:.2f}" for c in res["curve"][:8]),
        "",
        "| group | plain tok/s | " + " | ".join(f"{m}" for m in drafted) + " |",
        "|" + "---|" * (2 + len(drafted)),
    ]
    for g, row in res["groups"].items():
        cells = " | ".join(
            f"{row[m]['speedup']:.2f}x ({row[m]['tokens_per_step']:.2f} t/s"
            + (f", tree {row[m]['mean_tree']:.1f})" if "mean_tree" in row[m] else ")")
            for m in drafted
        )
        lines.append(f"| {g} | {row['plain']['tokens_per_s']:.1f} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mt-bench", type=int, default=4)
    ap.add_argument("--per-task", type=int, default=1)
    ap.add_argument("--copy", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--q4", action="store_true", help="Also the 4-bit quantized default model (plain, fixed, auto).")
    ap.add_argument(
        "--adaptive",
        action="store_true",
        help="float32 modes: " + ",".join(ADAPTIVE_MODES) + " (RADAR alone, auto alone, both).",
    )
    ap.add_argument("--modes", help="float32 modes, comma-separated (plain first); default " + ",".join(MODES) + ".")
    ap.add_argument("--out", type=Path, default=BENCH_DIR / "out" / "auto_tree")
    a = ap.parse_args(argv)
    modes = a.modes.split(",") if a.modes else ADAPTIVE_MODES if a.adaptive else MODES
    known = set(MODES + ADAPTIVE_MODES + ["default"])
    if modes[0] != "plain" or not set(modes) <= known:
        ap.error(f"--modes: plain first, then any of {', '.join(sorted(known - {'plain'}))}")
    import mlx.nn as nn

    from mlx_redrafter import load_drafter, load_model
    from mlx_redrafter.runtime import resolve_drafter_path

    model, tok = load_model("default")
    drafter_path = resolve_drafter_path("default", None)
    drafter = load_drafter(drafter_path)
    controller = None
    if any(m.startswith("radar") for m in modes):
        from mlx_redrafter.draft.controller import load_controller

        controller = load_controller(drafter_path)
    eos = sorted(tok.eos_token_ids)
    sets = groups(tok, a.mt_bench, a.per_task, a.copy)
    out = {"command": "python " + " ".join(shlex.quote(x) for x in [sys.argv[0], *(argv or sys.argv[1:])])}
    out["float32"] = run_model("float32", model, drafter, sets, modes, a.max_tokens, eos, controller)
    report = markdown("float32", out["float32"], modes)
    if a.q4:
        nn.quantize(model, group_size=64, bits=4)
        q_sets = {g: p for g, p in sets.items() if g in ("mt_bench", "copy")}
        out["q4"] = run_model("q4g64", model, drafter, q_sets, ["plain", "fixed", "auto", "default"], a.max_tokens, eos)
        report += "\n" + markdown("4-bit (q4g64)", out["q4"], ["plain", "fixed", "auto", "default"])
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    (a.out / "report.md").write_text(out["command"] + "\n\n" + report)
    print(report)
    bad = sum(r["mismatches"] for res in (out["float32"], out.get("q4")) if res for r in res["groups"]["all"].values())
    if bad:
        print(f"ERROR: {bad} runs differ from plain greedy decoding", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
