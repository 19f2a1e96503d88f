"""Benchmark: lookup drafts against plain decoding, the drafter alone, and both.

    python bench/lookup.py --quick     # a smoke run: 1 prompt per group, 32 tokens
    python bench/lookup.py             # 8 MT-Bench first turns, 4 per Spec-Bench task, every copy prompt, 128 tokens

Four modes on the same prompts, in one run: ``plain`` (mlx-lm decoding),
``drafter`` (the shipped drafter, lookup off), ``lookup`` (no drafter,
lookup drafts only), ``merged`` (the drafter's beams and lookup beams in
one tree: the default) and ``merged_sync`` (the same in the synchronous step
loop, ``DraftConfig(pipelined=False)``, the loop before step/pipelined.py).
Groups: MT-Bench first turns, the Spec-Bench tasks
(summarization, rag, translation, qa, math_reasoning) and a copy-heavy task
(rewrite a given paragraph with one change, prompts below). Greedy; every
mode's tokens are checked against plain decoding. The modes rotate their
order from one prompt to the next, so that machine drift hits all alike.

Reports tokens per step and speedup (decode throughput over plain's, prefill
excluded) per group, in ``--out``/report.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

BENCH_DIR = Path(__file__).resolve().parent
MODES = ("plain", "drafter", "lookup", "merged", "merged_sync")
SPEC_TASKS = ("summarization", "rag", "translation", "qa", "math_reasoning")

PARAGRAPHS = [
    "The city council met on Tuesday evening to discuss the new bicycle lanes on Main Street. Several residents "
    "spoke in favour of the plan, saying that the lanes would make the street safer for children. Shop owners were "
    "worried that the loss of parking spaces would drive customers away. After two hours of debate, the council "
    "voted to build the lanes but to add a small parking area behind the library.",
    "Photosynthesis is the process by which green plants turn light into chemical energy. Inside the leaves, "
    "chlorophyll absorbs sunlight and uses its energy to split water molecules. The oxygen is released into the air, "
    "while the hydrogen is combined with carbon dioxide to make glucose. The plant then uses this sugar to grow, "
    "to build new cells and to store energy for the night.",
    "def average(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n"
    "def largest(values):\n    best = values[0]\n    for v in values:\n        if v > best:\n            best = v\n"
    "    return best\n",
    "Dear Ms. Patel, thank you for your letter of March 3. We have checked your order and found that the blue chair "
    "was sent to the wrong address. A new chair will leave our warehouse on Monday and should reach you by Thursday. "
    "We are sorry for the trouble and have refunded the delivery cost to your card. Kind regards, Tom Green.",
]
CHANGES = [
    "Rewrite this paragraph exactly, but change 'Tuesday' to 'Wednesday':",
    "Rewrite this paragraph exactly, but replace 'green plants' with 'plants and algae':",
    "Rewrite this code exactly, but rename the function 'average' to 'mean':",
    "Rewrite this letter exactly, but change the delivery day from Thursday to Friday:",
]
COPY_PROMPTS = [f"{c}\n\n{p}" for c, p in zip(CHANGES, PARAGRAPHS)]


@dataclass
class Tally:
    """Totals of one (group, mode)."""

    tokens: int = 0  # decode tokens (the first token, from the prefill, excluded)
    time: float = 0.0  # decode seconds
    steps: int = 0
    lookup_tokens: int = 0
    drafter_tokens: int = 0
    mismatches: int = 0

    def add(self, run, same: bool) -> None:
        self.tokens += run.decode_tokens
        self.time += run.decode_time
        for n, s in run.step_tokens():
            self.steps += 1
            drafted = n - 1 if n == 1 + s.accepted else n
            if s.source == "lookup":
                self.lookup_tokens += drafted
            elif s.source == "drafter":
                self.drafter_tokens += drafted
        self.mismatches += not same

    def row(self, plain: "Tally") -> dict:
        tps = self.tokens / self.time if self.time else 0.0
        base = plain.tokens / plain.time if plain.time else 0.0
        return {
            "tokens": self.tokens,
            "decode_s": round(self.time, 3),
            "tokens_per_s": round(tps, 2),
            "tokens_per_step": round(self.tokens / max(self.steps, 1), 3),
            "speedup": round(tps / base, 3) if base else None,
            "lookup_share": round(self.lookup_tokens / max(self.tokens, 1), 3),
            "drafter_share": round(self.drafter_tokens / max(self.tokens, 1), 3),
            "mismatches": self.mismatches,
        }


def groups(tokenizer, mt: int, per_task: int, copy: int) -> Dict[str, List[List[int]]]:
    """Prompt ids per reported group (first turns, chat-templated)."""
    from mlx_redrafter.prompts import first_turn_ids, load_prompt_set

    spec = load_prompt_set("spec_bench")
    out = {"mt_bench": load_prompt_set("mt_bench")[:mt]}
    for task in SPEC_TASKS:
        out[task] = [c for c in spec if c["category"] == task][:per_task]
    out["copy"] = [{"turns": [p]} for p in COPY_PROMPTS[:copy]]
    return {k: first_turn_ids(tokenizer, v) for k, v in out.items() if v}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--drafter", default=None, help="Drafter folder (default: the one shipped for the model).")
    ap.add_argument("--mt-bench", type=int, default=8, help="MT-Bench first turns.")
    ap.add_argument("--per-task", type=int, default=4, help="Prompts per Spec-Bench task.")
    ap.add_argument("--copy", type=int, default=len(COPY_PROMPTS), help="Copy-heavy prompts (at most 4).")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lookup", type=int, default=1, help="Lookup beams in the lookup and merged modes.")
    ap.add_argument(
        "--lookup-length", type=int, default=None, help="Tokens per lookup draft (default: lookup.LOOKUP_LENGTH)."
    )
    ap.add_argument("--modes", default=",".join(MODES), help="Comma-separated subset of " + ",".join(MODES) + ".")
    ap.add_argument("--quick", action="store_true", help="Smoke run: 1 prompt per group, 32 tokens.")
    ap.add_argument("--out", type=Path, default=None, help="Output folder (default bench/out/lookup[-quick]).")
    a = ap.parse_args(argv)
    if a.quick:
        a.mt_bench, a.per_task, a.copy, a.max_tokens = 1, 1, 1, 32
    a.modes = [m for m in a.modes.split(",") if m]
    if "plain" not in a.modes or any(m not in MODES for m in a.modes):
        ap.error(f"--modes: a subset of {','.join(MODES)} that includes plain")
    a.out = a.out or BENCH_DIR / "out" / ("lookup-quick" if a.quick else "lookup")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)

    from mlx_redrafter import load_drafter, load_model
    from mlx_redrafter.config import DEFAULT_LENGTH, DEFAULT_WIDTH, LOOKUP_LENGTH, DraftConfig
    from mlx_redrafter.llm.parts import context_limit
    from mlx_redrafter.runtime import resolve_drafter_path
    from mlx_redrafter.tuning.measure import measure

    model, tok = load_model(a.model)
    drafter = load_drafter(resolve_drafter_path(a.model, a.drafter))
    eos = sorted(tok.eos_token_ids)
    W, L, K = DEFAULT_WIDTH, DEFAULT_LENGTH, a.lookup_length or LOOKUP_LENGTH
    drafts = {
        "plain": DraftConfig(),
        "drafter": DraftConfig(drafter, W, L),
        "lookup": DraftConfig(lookup=a.lookup, lookup_length=K),
        "merged": DraftConfig(drafter, W, L, lookup=a.lookup, lookup_length=K),
        "merged_sync": DraftConfig(drafter, W, L, lookup=a.lookup, lookup_length=K, pipelined=False),
    }

    def run(mode, prompt, max_tokens):
        return measure(model, prompt, draft=drafts[mode], max_tokens=max_tokens, eos_ids=eos)

    # Prompts that leave no room in the context for the reply and a tree are left out.
    limit, room = context_limit(model), a.max_tokens + 1 + W * L + a.lookup * K
    sets, dropped = {}, 0
    for g, prompts in groups(tok, a.mt_bench, a.per_task, a.copy).items():
        fit = [p for p in prompts if not limit or len(p) + room <= limit]
        dropped += len(prompts) - len(fit)
        if fit:
            sets[g] = fit
    if dropped:
        print(f"{dropped} prompts do not fit the model's context ({limit} tokens); left out", file=sys.stderr)
    if not sets:
        print("Error: no prompt fits the model's context.", file=sys.stderr)
        return 1
    first = next(iter(sets.values()))[0]
    for mode in a.modes:  # untimed: allocations and kernel set-up
        run(mode, first, 4)
    totals = {g: {m: Tally() for m in a.modes} for g in sets}
    k = 0
    for g, prompts in sets.items():
        for p in prompts:
            order = a.modes[k % len(a.modes) :] + a.modes[: k % len(a.modes)]
            k += 1
            runs = {m: run(m, p, a.max_tokens) for m in order}
            for m in a.modes:
                totals[g][m].add(runs[m], runs[m].tokens == runs["plain"].tokens)
            print(f"{g}: {k} prompts done", file=sys.stderr, flush=True)
    results = {
        "command": "python " + " ".join(shlex.quote(x) for x in [sys.argv[0], *(argv or sys.argv[1:])]),
        "model": a.model,
        "beam_width": W,
        "beam_length": L,
        "lookup_beams": a.lookup,
        "lookup_length": K,
        "max_tokens": a.max_tokens,
        "prompts": {g: len(p) for g, p in sets.items()},
        "dropped_prompts": dropped,
        "groups": {g: {m: t.row(totals[g]["plain"]) for m, t in ts.items()} for g, ts in totals.items()},
    }
    all_modes = {m: Tally() for m in a.modes}
    for ts in totals.values():
        for m, t in ts.items():
            for f in ("tokens", "time", "steps", "lookup_tokens", "drafter_tokens", "mismatches"):
                setattr(all_modes[m], f, getattr(all_modes[m], f) + getattr(t, f))
    results["groups"]["all"] = {m: t.row(all_modes["plain"]) for m, t in all_modes.items()}
    return save(a.out, results, markdown(results, a.modes))


def save(out: Path, results: dict, report: str) -> int:
    """Write ``results.json`` and ``report.md`` under ``out``, print the
    report, and return the exit status: 1 if any run's tokens differ from
    plain greedy decoding (``results["groups"]["all"]``'s mismatches)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "report.md").write_text(report)
    print(report)
    bad = sum(r["mismatches"] for r in results["groups"]["all"].values())
    if bad:
        print(f"ERROR: {bad} runs differ from plain greedy decoding", file=sys.stderr)
    return 1 if bad else 0


def markdown(results: dict, modes: List[str]) -> str:
    drafted = [m for m in modes if m != "plain"]
    head = "| group | prompts | plain tok/s | " + " | ".join(f"{m} tok/step | {m} speedup" for m in drafted) + " |"
    lines = [
        f"Command: `{results['command']}`",
        f"Model {results['model']}, drafter W={results['beam_width']} L={results['beam_length']}, "
        f"{results['lookup_beams']} lookup beam(s) of {results['lookup_length']} tokens, "
        f"{results['max_tokens']} tokens, greedy.",
        "",
        head,
        "|" + "---|" * (3 + 2 * len(drafted)),
    ]
    for g, row in results["groups"].items():
        n = results["prompts"].get(g, sum(results["prompts"].values()))
        cells = " | ".join(f"{row[m]['tokens_per_step']:.2f} | {row[m]['speedup']:.2f}x" for m in drafted)
        lines.append(f"| {g} | {n} | {row['plain']['tokens_per_s']:.1f} | {cells} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
