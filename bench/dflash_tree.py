"""A DFlash drafter's block as one chain against the block as a tree, on
held-out prompts, greedy (every output checked against plain decoding).

Settings, each over the same prompts, plain decoding measured first and last
(the speed-ups are against their mean):

* **chain**: the block's argmax at every position, one row of ``L`` (the
  drafter's default, ``L = block_size - 1``), every node verified;
* **tree W** (fixed): the top ``W`` paths through the block's per-position
  distributions (draft/dflash_chain.py ``block_beams``), every node verified;
* **tree W auto**: the same rows as candidates, the cost-aware selection
  verifying the nodes this device's curve says pay (DDTree's best-first
  choice, priced: step/select.py);
* each with lookup's row beside it when ``--lookup`` is given;
* the defaults with the live choice (step/governor.py: plain decoding where
  drafting does not pay); the settings above draft every step.

Reports tokens per step, first-draft acceptance (the share of steps whose
first drafted token was accepted), DFlash's share of the tokens, tokens/s
and the speed-up over plain decoding.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        .venv/bin/python bench/dflash_tree.py --model default --drafter runs/dflash/dflash \\
        --prompts mt_bench --num-prompts 10 --max-tokens 128 --out bench/results/dflash/tree.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from mlx_redrafter import load_model
from mlx_redrafter.config import DraftConfig, resolve
from mlx_redrafter.hub.load import load_drafter
from mlx_redrafter.prompts import first_turn_ids, load_prompt_set, select_conversations
from mlx_redrafter.step.curve import curve_for
from mlx_redrafter.tuning.measure import run_pass, warm_up


def settings(drafter, widths, lookup: int, curve):
    """Each setting drafts every step (``always_draft``: the setting itself is
    measured, not the live choice), then the defaults with the live choice."""
    length = drafter.config.block_size - 1
    one = dict(head=drafter, head_length=length, lookup=lookup, always_draft=True)
    out = {"chain": DraftConfig(head_width=1, **one)}
    for w in widths:
        out[f"tree {w}"] = DraftConfig(head_width=w, **one)
        out[f"tree {w} auto"] = DraftConfig(head_width=w, tree="auto", curve=curve, **one)
    out["defaults (live choice)"] = resolve(drafter, lookup=lookup, curve=curve).draft  # as generate resolves it
    return out


def summary(p, plain_ids=None) -> dict:
    steps = [s for r in p.runs for s in r.steps[1:]]
    first = [s.accepted >= 1 and s.source not in ("", "lookup", "datastore") for s in steps]  # the drafter's
    dflash = sum(s.accepted for s in steps if s.source == "dflash")
    tokens = sum(len(r.tokens) for r in p.runs)
    out = {
        "tokens_per_s": p.tokens_per_s,
        "tokens_per_step": p.tokens_per_step,
        "first_draft_acceptance": float(np.mean(first)) if steps else 0.0,
        "dflash_share": dflash / max(tokens, 1),
        "mean_tree_size": float(np.mean([s.tree_size for s in steps])) if steps else 1.0,
    }
    if plain_ids is not None:
        out["identical_outputs"] = sum(r.tokens == ref for r, ref in zip(p.runs, plain_ids))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--widths", default="2,4")
    ap.add_argument("--lookup", type=int, default=0)
    ap.add_argument(
        "--compare",
        default="",
        help="Other drafters (folders, comma-separated: a ReDrafter drafter, an EAGLE-3 head), each in its "
        "default shape drafting every step, beside the block's settings.",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model, tok = load_model(args.model)
    drafter = load_drafter(args.drafter).bind(model)
    convs = select_conversations(load_prompt_set(args.prompts), args.num_prompts)
    ids = first_turn_ids(tok, convs)
    eos = sorted(tok.eos_token_ids)
    curve = curve_for(model, args.model)
    cells = settings(drafter, [int(w) for w in args.widths.split(",")], args.lookup, curve)
    for path in filter(None, args.compare.split(",")):
        other = load_drafter(path)
        other = other.bind(model) if hasattr(other, "bind") else other
        cells[f"{Path(path).name} (every step)"] = resolve(other, lookup=args.lookup, always_draft=True).draft
    warm_up(model, ids[0], None)
    for d in cells.values():
        warm_up(model, ids[0], d)
    plain = run_pass(model, ids, None, max_tokens=args.max_tokens, eos_ids=eos)
    ref = [r.tokens for r in plain.runs]
    results = {}
    for name, d in cells.items():
        results[name] = summary(run_pass(model, ids, d, max_tokens=args.max_tokens, eos_ids=eos), ref)
    again = run_pass(model, ids, None, max_tokens=args.max_tokens, eos_ids=eos)
    base = (plain.tokens_per_s + again.tokens_per_s) / 2
    print(f"plain {plain.tokens_per_s:.1f} / {again.tokens_per_s:.1f} tok/s (load {os.getloadavg()[0]:.1f})")
    print(
        "setting | tokens/step | first-draft acceptance | dflash share | tree size | tok/s | speed-up | "
        "step cost (plain steps) | identical"
    )
    for name, r in results.items():
        r["speedup"] = r["tokens_per_s"] / base
        r["step_cost"] = r["tokens_per_step"] / r["speedup"]  # a step's time over a plain step's
        print(
            f"{name} | {r['tokens_per_step']:.2f} | {r['first_draft_acceptance']:.3f} | {r['dflash_share']:.3f} | "
            f"{r['mean_tree_size']:.1f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['step_cost']:.2f} | "
            f"{r['identical_outputs']}/{len(ids)}"
        )
    write_out(args, [plain.tokens_per_s, again.tokens_per_s], results=results)


def write_out(args, plain_tokens_per_s, **measured) -> None:
    """``--out`` (when given): the arguments, plain decoding's two passes, what was measured and the load."""
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        out = {"args": {k: str(v) for k, v in vars(args).items()}, "plain_tokens_per_s": plain_tokens_per_s}
        args.out.write_text(json.dumps({**out, **measured, "load_average": os.getloadavg()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
