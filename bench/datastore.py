"""Benchmark: drafts from a datastore of the model's own past outputs (issue 28).

    python bench/datastore.py --store built.bin            # the full run (see bench/RESULTS.md)
    python bench/datastore.py --store built.bin --quick    # a smoke run

Modes, in one run on the same prompts: ``plain`` (mlx-lm decoding),
``lookup`` (context lookup alone, no drafter), ``datastore`` (the datastore
alone), ``both`` (context lookup, and a datastore row where it finds
nothing), ``defaults`` (today's defaults: the shipped drafter + context
lookup) and ``all`` (``defaults`` + the datastore). Greedy; every mode's
tokens are checked against plain decoding; the modes rotate their order from
one prompt to the next, so that machine drift hits all alike.

The datastore is ``--store`` (built with ``mlx-redrafter datastore build``
from training prompts) plus a session history: after each prompt its reply
is appended, as chat and serve do, so later prompts draft from earlier
replies. Groups: MT-Bench first turns, the Spec-Bench categories, a
multi-turn run (the second turn asks to revise, shorten or translate the
first answer, which is in the context) and a replay of agent-style requests
(one system prompt and tool list, different questions).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Dict, List

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from lookup import save  # noqa: E402  (bench/lookup.py: results.json, report.md, the exactness check)

MODES = ("plain", "lookup", "datastore", "both", "defaults", "all")
SPEC_TASKS = ("summarization", "rag", "translation", "qa", "math_reasoning")
REVISE = [
    "Shorten your previous answer to half its length.",
    "Rewrite your previous answer in a more formal tone.",
    "Translate your previous answer into French.",
    "Revise your previous answer: fix any mistakes and keep the rest as it is.",
]
AGENT_SYSTEM = (
    "You are an assistant that answers by calling tools. Available tools, as JSON:\n"
    '[{"name": "get_weather", "description": "Current weather for a city", "parameters": {"city": "string"}},\n'
    ' {"name": "search_web", "description": "Search the web", "parameters": {"query": "string"}},\n'
    ' {"name": "send_email", "description": "Send an email", '
    '"parameters": {"to": "string", "subject": "string", "body": "string"}},\n'
    ' {"name": "create_event", "description": "Add a calendar event", '
    '"parameters": {"title": "string", "date": "YYYY-MM-DD"}}]\n'
    'Reply with one JSON object {"tool": NAME, "arguments": {...}} and nothing else.'
)
AGENT_QUESTIONS = [
    "What is the weather in Paris?",
    "Find recent news about electric cars.",
    "Email Anna that the meeting moved to 3pm.",
    "Put the dentist appointment on 2025-03-14 in my calendar.",
    "Is it raining in Tokyo?",
    "Search for a pancake recipe.",
    "Tell Bob by email that the report is ready.",
    "Schedule a team lunch on 2025-04-02.",
    "How warm is it in Cairo today?",
    "Look up the population of Canada.",
]


def groups(tok, a) -> Dict[str, List[List[int]]]:
    """Prompt ids per group. The revise turns need the model's first answers:
    ``a.first_answer`` greedy tokens, generated here."""
    from mlx_redrafter.prompts import build_messages, chat_prompt_ids, first_turn_ids, load_prompt_set

    mt, spec = load_prompt_set("mt_bench"), load_prompt_set("spec_bench")
    out = {"mt_bench": first_turn_ids(tok, mt[: a.mt_bench])}
    for task in SPEC_TASKS:
        out[task] = first_turn_ids(tok, [c for c in spec if c["category"] == task][: a.per_task])
    out["revise"] = [
        (c["turns"][0], REVISE[i % len(REVISE)]) for i, c in enumerate(mt[a.mt_bench : a.mt_bench + a.revise])
    ]
    out["agent"] = [chat_prompt_ids(tok, build_messages(AGENT_SYSTEM, [], q)) for q in AGENT_QUESTIONS[: a.agent]]
    return out


def revise_prompts(model, tok, pairs, max_tokens: int) -> List[List[int]]:
    from mlx_redrafter.generate import generate
    from mlx_redrafter.prompts import build_messages, chat_prompt_ids

    out = []
    for first, second in pairs:
        answer = generate(model, tok, chat_prompt_ids(tok, build_messages(None, [], first)), max_tokens=max_tokens)
        out.append(chat_prompt_ids(tok, build_messages(None, [(first, answer)], second)))
    return out


class Tally:
    def __init__(self):
        self.tokens, self.time, self.steps, self.mismatches = 0, 0.0, 0, 0
        self.by_source = {"drafter": 0, "lookup": 0, "datastore": 0}

    def add(self, run, same: bool) -> None:
        self.tokens += run.decode_tokens
        self.time += run.decode_time
        for n, s in run.step_tokens():
            self.steps += 1
            if s.source:
                self.by_source[s.source] += n - 1 if n == 1 + s.accepted else n
        self.mismatches += not same

    def merge(self, o: "Tally") -> None:
        self.tokens, self.time, self.steps = self.tokens + o.tokens, self.time + o.time, self.steps + o.steps
        self.mismatches += o.mismatches
        for k, v in o.by_source.items():
            self.by_source[k] += v

    def row(self, plain: "Tally") -> dict:
        tps = self.tokens / self.time if self.time else 0.0
        base = plain.tokens / plain.time if plain.time else 0.0
        return {
            "tokens": self.tokens,
            "tokens_per_s": round(tps, 2),
            "tokens_per_step": round(self.tokens / max(self.steps, 1), 3),
            "speedup": round(tps / base, 3) if base else None,
            "mismatches": self.mismatches,
            "share": {k: round(v / max(self.tokens, 1), 3) for k, v in self.by_source.items()},
        }


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--store", type=Path, required=True, help="A built datastore file (mlx-redrafter datastore build).")
    ap.add_argument("--mt-bench", type=int, default=8)
    ap.add_argument("--per-task", type=int, default=3)
    ap.add_argument("--revise", type=int, default=6)
    ap.add_argument("--agent", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--first-answer", type=int, default=96, help="Tokens of the first answer a revise turn works on.")
    ap.add_argument("--no-history", action="store_true", help="The built store alone (replies are not appended).")
    ap.add_argument(
        "--auto",
        action="store_true",
        help="Also both_auto and all_auto: both and all with tree='auto' on this device's curve.",
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=BENCH_DIR / "out" / "datastore")
    a = ap.parse_args(argv)
    if a.quick:
        a.mt_bench, a.per_task, a.revise, a.agent, a.max_tokens, a.first_answer = 1, 1, 1, 2, 24, 32
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    from mlx_redrafter import load_drafter, load_model
    from mlx_redrafter.config import DEFAULT_LENGTH, DEFAULT_WIDTH, DraftConfig
    from mlx_redrafter.draft.datastore.index import Datastore, model_key
    from mlx_redrafter.draft.datastore.use import Stores
    from mlx_redrafter.runtime import resolve_drafter_path
    from mlx_redrafter.tuning.measure import measure

    model, tok = load_model(a.model)
    drafter = load_drafter(resolve_drafter_path(a.model, None))
    built = Datastore.open(a.store, model_key(a.model))
    history = Datastore(model_id=model_key(a.model))
    store = Stores([built, history])
    W, L, eos = DEFAULT_WIDTH, DEFAULT_LENGTH, sorted(tok.eos_token_ids)
    drafts = {
        "plain": DraftConfig(),
        "lookup": DraftConfig(lookup=1),
        "datastore": DraftConfig(datastore=store),
        "both": DraftConfig(lookup=1, datastore=store),
        "defaults": DraftConfig(drafter, W, L, lookup=1),
        "all": DraftConfig(drafter, W, L, lookup=1, datastore=store),
    }
    modes = MODES
    if a.auto:  # the cost-aware selection chooses among the drafter's, lookup's and the store's nodes
        from mlx_redrafter.step.curve import curve_for

        curve = curve_for(model, a.model)
        print(f"tree auto on {'the built-in' if curve.builtin else 'the measured'} curve", file=sys.stderr)
        drafts["both_auto"] = DraftConfig(lookup=1, datastore=store, tree="auto", curve=curve)
        drafts["all_auto"] = DraftConfig(drafter, W, L, lookup=1, datastore=store, tree="auto", curve=curve)
        modes = MODES + ("both_auto", "all_auto")
    sets = groups(tok, a)
    sets["revise"] = revise_prompts(model, tok, sets["revise"], a.first_answer)
    for m in modes:  # untimed: allocations, kernels and the store's index
        measure(model, sets["mt_bench"][0], draft=drafts[m], max_tokens=4, eos_ids=eos)
    totals, k = {g: {m: Tally() for m in modes} for g in sets}, 0
    for g, prompts in sets.items():
        for p in prompts:
            order = modes[k % len(modes) :] + modes[: k % len(modes)]
            k += 1
            runs = {m: measure(model, p, draft=drafts[m], max_tokens=a.max_tokens, eos_ids=eos) for m in order}
            for m in modes:
                totals[g][m].add(runs[m], runs[m].tokens == runs["plain"].tokens)
            if not a.no_history:
                history.add(runs["plain"].tokens)  # as chat and serve append each reply
            print(f"{g}: {k} prompts done", file=sys.stderr, flush=True)
    every = {m: Tally() for m in modes}
    for ts in totals.values():
        for m, t in ts.items():
            every[m].merge(t)
    results = {
        "command": "python " + " ".join(shlex.quote(x) for x in [sys.argv[0], *(argv or sys.argv[1:])]),
        "modes": list(modes),
        "model": a.model,
        "beam_width": W,
        "beam_length": L,
        "max_tokens": a.max_tokens,
        "store": {
            "path": str(a.store),
            "sequences": len(built),
            "tokens": built.tokens,
            "bytes": a.store.stat().st_size,
            "history_sequences": len(history),
            "history_tokens": history.tokens,
        },
        "prompts": {g: len(p) for g, p in sets.items()},
        "groups": {g: {m: t.row(ts["plain"]) for m, t in ts.items()} for g, ts in totals.items()},
    }
    results["groups"]["all"] = {m: t.row(every["plain"]) for m, t in every.items()}
    return save(a.out, results, markdown(results))


def markdown(results: dict) -> str:
    drafted = [m for m in results.get("modes", MODES) if m != "plain"]
    s = results["store"]
    lines = [
        f"Command: `{results['command']}`",
        f"Model {results['model']}, {results['max_tokens']} tokens, greedy; store {s['sequences']} replies, "
        f"{s['tokens']} tokens, {s['bytes'] / 2**20:.2f} MiB "
        f"(+ a session history of {s['history_sequences']} replies).",
        "",
        "| group | prompts | plain tok/s | " + " | ".join(f"{m} tok/step, speedup" for m in drafted) + " |",
        "|" + "---|" * (3 + len(drafted)),
    ]
    for g, row in results["groups"].items():
        n = results["prompts"].get(g, sum(results["prompts"].values()))
        cells = " | ".join(f"{row[m]['tokens_per_step']:.2f}, {row[m]['speedup']:.2f}x" for m in drafted)
        lines.append(f"| {g} | {n} | {row['plain']['tokens_per_s']:.1f} | {cells} |")
    shares = results["groups"]["all"]
    lines += [
        "",
        "Share of tokens from datastore rows (all groups): "
        + ", ".join(f"{m} {shares[m]['share']['datastore']:.1%}" for m in drafted),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
