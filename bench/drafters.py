"""Benchmark: drafters against each other and against plain decoding, live, in one run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 .venv/bin/python bench/drafters.py \\
        --drafters previous=DIR,new=mlx_redrafter/drafters/smollm2-135m-instruct --num-prompts 20 \\
        --out bench/results/drafters

For every drafter, two settings on MT-Bench first turns: ``W=1 L=3`` with the
drafter alone (lookup off: what the drafter is worth) and the default
settings (the built-in beam shape with the lookup draft: what a user gets).
Greedy; every output is checked against plain decoding. The configurations
rotate their order from one prompt to the next, so that machine drift hits
all alike. Reports speedup (decode throughput over plain's, prefill
excluded), tokens per step and, for ``W=1 L=3``, acceptance by depth (the
share of steps that accepted at least d drafted tokens).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from lookup import Tally  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafters", required=True, help="name=folder,name=folder,...")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("bench/out/drafters"))
    a = ap.parse_args(argv)

    from mlx_redrafter import load_drafter, load_model
    from mlx_redrafter.config import DEFAULT_LENGTH, DEFAULT_LOOKUP, DEFAULT_WIDTH, DraftConfig
    from mlx_redrafter.prompts import first_turn_ids, load_prompt_set, select_conversations
    from mlx_redrafter.tuning.measure import measure

    model, tok = load_model("default")
    eos = sorted(tok.eos_token_ids)
    folders = dict(item.split("=", 1) for item in a.drafters.split(","))
    configs = {"plain": DraftConfig()}
    for name, folder in folders.items():
        d = load_drafter(folder)
        configs[f"{name} W1L3"] = DraftConfig(d, 1, 3)
        configs[f"{name} default"] = DraftConfig(d, DEFAULT_WIDTH, DEFAULT_LENGTH, lookup=DEFAULT_LOOKUP)
    prompts = first_turn_ids(tok, select_conversations(load_prompt_set("mt_bench"), a.num_prompts))
    names = list(configs)
    for n in names:  # untimed: allocations and kernel set-up
        measure(model, prompts[0], draft=configs[n], max_tokens=4, eos_ids=eos)
    totals = {n: Tally() for n in names}
    depth = {n: [] for n in names}
    for k, p in enumerate(prompts):
        order = names[k % len(names) :] + names[: k % len(names)]
        runs = {n: measure(model, p, draft=configs[n], max_tokens=a.max_tokens, eos_ids=eos) for n in order}
        for n in names:
            totals[n].add(runs[n], runs[n].tokens == runs["plain"].tokens)
            depth[n] += [s.accepted for _, s in runs[n].step_tokens()]
        print(f"{k + 1}/{len(prompts)} prompts", file=sys.stderr, flush=True)
    rows = {}
    for n in names:
        rows[n] = totals[n].row(totals["plain"])
        if n.endswith("W1L3"):
            acc = np.array(depth[n])
            rows[n]["acceptance_by_depth"] = [round(float((acc >= d).mean()), 3) for d in (1, 2, 3)]
    command = "LD_PRELOAD=... .venv/bin/python " + " ".join(
        shlex.quote(x) for x in [sys.argv[0], *(argv or sys.argv[1:])]
    )
    results = {
        "command": command,
        "drafters": folders,
        "prompts": len(prompts),
        "max_tokens": a.max_tokens,
        "default_shape": {"beam_width": DEFAULT_WIDTH, "beam_length": DEFAULT_LENGTH, "lookup": DEFAULT_LOOKUP},
        "rows": rows,
    }
    lines = [
        f"`{command}`",
        "",
        f"MT-Bench first turns: {len(prompts)} prompts, {a.max_tokens} new tokens, greedy.",
        "",
        "| configuration | speedup | tokens/step | acceptance by depth 1 / 2 / 3 | identical to plain |",
        "|---|---|---|---|---|",
    ]
    for n, r in rows.items():
        acc = " / ".join(f"{x:.3f}" for x in r.get("acceptance_by_depth", [])) or "-"
        lines.append(
            f"| {n} | {r['speedup']:.3f} | {r['tokens_per_step']:.2f} | {acc} | "
            f"{len(prompts) - r['mismatches']}/{len(prompts)} |"
        )
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (a.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any(r["mismatches"] for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
