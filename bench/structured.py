"""Benchmark: structured output (JSON Schema), constrained plain decoding
against constrained drafting.

    python bench/structured.py               # 8 extraction prompts, 96 tokens
    python bench/structured.py --quick       # 2 prompts, 48 tokens

Modes, on the same prompts in one run: ``plain`` (mlx-lm's generate_step
with the grammar's mask as a logits processor: plain constrained
decoding), ``forced`` (the constrained loop with nothing drafting: only the
tokens the grammar forces are drafted), ``drafter`` (the shipped drafter),
``lookup`` (lookup drafts only) and ``merged`` (drafter + lookup). Greedy;
every mode's tokens are checked against plain's, and every output must
parse and validate against its schema. The modes rotate their order from
one prompt to the next, so that machine drift hits all alike.

Reports tokens per step, decode speedup over plain (prefill excluded), the
share of outputs that parse and validate, and the grammar's host time per
step (the masks of a step's tree, ``tree_masks``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
MODES = ("plain", "forced", "drafter", "lookup", "merged")

MONEY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "amount": {"type": "number"},
        "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
    },
    "required": ["name", "date", "amount", "currency"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 30},
        "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "attendees": {"type": "integer", "minimum": 0},
    },
    "required": ["event", "city", "date", "attendees"],
    "additionalProperties": False,
}
CONTACT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60},
        "phone": {"type": "string", "maxLength": 20},
        "company": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "email", "phone", "company"],
    "additionalProperties": False,
}
ITEMS = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "product": {"type": "string", "maxLength": 30},
                    "quantity": {"type": "integer", "minimum": 1},
                },
                "required": ["product", "quantity"],
                "additionalProperties": False,
            },
        },
        "total": {"type": "number"},
    },
    "required": ["items", "total"],
    "additionalProperties": False,
}

ASK = "Extract {what} from this text as JSON.\n\n"
PROMPTS = [
    (
        ASK.format(what="the name, the date (YYYY-MM-DD), the amount and the currency")
        + "On 3 March 2024 Maria Lopez paid 1,250.00 euros for the repair of her roof.",
        MONEY,
    ),
    (
        ASK.format(what="the event, the city, the date (YYYY-MM-DD) and the number of attendees")
        + "About 3,400 people came to the Northern Lights Jazz Festival in Tromso on July 14, 2023.",
        EVENT,
    ),
    (
        ASK.format(what="the name, email, phone and company")
        + "Hi, this is David Chen from Brightwave Solar. Reach me at d.chen@brightwave.io or +1 415 555 0199.",
        CONTACT,
    ),
    (
        ASK.format(what="the items with their quantities and the total")
        + "Order #5512: 2 blue notebooks, 3 gel pens and 1 desk lamp. Total charged: $48.70.",
        ITEMS,
    ),
    (
        ASK.format(what="the name, the date (YYYY-MM-DD), the amount and the currency")
        + "Invoice from Kenji Watanabe, dated 2023-11-30: consulting services, 180,000 yen, due in 30 days.",
        MONEY,
    ),
    (
        ASK.format(what="the event, the city, the date (YYYY-MM-DD) and the number of attendees")
        + "The 2022 Open Source Summit drew 1,200 developers to Dublin on September 13.",
        EVENT,
    ),
    (
        ASK.format(what="the name, email, phone and company")
        + "Contact: Aisha Bello, procurement lead at Greenfield Foods (aisha.bello@greenfield.ng, 0803 555 1234).",
        CONTACT,
    ),
    (
        ASK.format(what="the name, the date (YYYY-MM-DD), the amount and the currency")
        + "Refund of $89.99 issued to Thomas Meyer on 12/05/2024 for a returned pair of headphones.",
        MONEY,
    ),
]


class HostClock:
    """Wraps the grammar mask's ``tree_masks`` to total the grammar's host time."""

    def __init__(self):
        import mlx_redrafter.step.grammar as loop

        self.loop, self.inner, self.seconds, self.calls = loop, loop.tree_masks, 0.0, 0
        loop.tree_masks = self

    def __call__(self, *args):
        tic = time.perf_counter()
        out = self.inner(*args)
        self.seconds += time.perf_counter() - tic
        self.calls += 1
        return out


def run(model, prompt, grammar, draft, max_tokens):
    """``(tokens, steps, decode seconds)``: the first step (the prefill) is not timed."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_redrafter.config import SamplingConfig
    from mlx_redrafter.step.dispatch import token_steps
    from mlx_redrafter.step.plan import AFTER_READ, DraftPlan, TreePolicy, make_plan

    cache, sampling = make_prompt_cache(model), SamplingConfig()
    if draft is None:  # "forced": the grammar's forced tokens alone (the library would run plain)
        plan = DraftPlan((), TreePolicy("fixed", packed=True), AFTER_READ, structured=True)
    else:
        plan = make_plan(model, draft, grammar=True, cache=cache)
    steps = token_steps(model, mx.array(prompt), cache, plan=plan, sampling=sampling, grammar=grammar)
    tokens, n_steps, tic = [], 0, None
    for s in steps:
        tokens += s.tokens
        if tic is None:
            tic = time.perf_counter()
        else:
            n_steps += 1
        if tokens[-1] in grammar.eos_ids or len(tokens) >= max_tokens:
            break
    steps.close()
    return tokens[:max_tokens], n_steps, time.perf_counter() - tic


def valid(tokenizer, tokens, grammar, schema) -> bool:
    import jsonschema_rs

    if tokens[-1] not in grammar.eos_ids:
        return False
    try:
        jsonschema_rs.validate(schema, json.loads(tokenizer.decode(tokens[:-1])))
    except (ValueError, jsonschema_rs.ValidationError):
        return False
    return True


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--drafter", default=None, help="Drafter folder (default: the one shipped for the model).")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--quick", action="store_true", help="Smoke run: 2 prompts, 48 tokens.")
    ap.add_argument("--out", type=Path, default=None, help="Output folder (default bench/out/structured[-quick]).")
    a = ap.parse_args(argv)
    if a.quick:
        a.prompts, a.max_tokens = 2, 48
    a.out = a.out or BENCH_DIR / "out" / ("structured-quick" if a.quick else "structured")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    from mlx_redrafter import load_drafter, load_model
    from mlx_redrafter.config import DEFAULT_LENGTH, DEFAULT_LOOKUP, DEFAULT_WIDTH, DraftConfig
    from mlx_redrafter.prompts import chat_prompt_ids
    from mlx_redrafter.runtime import resolve_drafter_path
    from mlx_redrafter.step.grammar import compile_for_model

    model, tok = load_model(a.model)
    drafter = load_drafter(resolve_drafter_path(a.model, a.drafter))
    W, L, K = DEFAULT_WIDTH, DEFAULT_LENGTH, DEFAULT_LOOKUP
    drafts = {
        "plain": DraftConfig(),
        "forced": None,
        "drafter": DraftConfig(drafter, W, L),
        "lookup": DraftConfig(lookup=K),
        "merged": DraftConfig(drafter, W, L, lookup=K),
    }
    cases = [
        (chat_prompt_ids(tok, [{"role": "user", "content": p}]), compile_for_model(model, tok, s), s)
        for p, s in PROMPTS[: a.prompts]
    ]
    clock = HostClock()
    for m in MODES:  # untimed: allocations and kernel set-up
        run(model, cases[0][0], cases[0][1], drafts[m], 4)
    totals = {
        m: {"tokens": 0, "steps": 0, "time": 0.0, "valid": 0, "mismatches": 0, "host": 0.0, "calls": 0} for m in MODES
    }
    for k, (prompt, grammar, schema) in enumerate(cases):
        outs = {}
        for m in MODES[k % len(MODES) :] + MODES[: k % len(MODES)]:
            host, calls = clock.seconds, clock.calls
            tokens, steps, seconds = run(model, prompt, grammar, drafts[m], a.max_tokens)
            t = totals[m]
            outs[m] = tokens
            t["tokens"] += len(tokens) - 1
            t["steps"] += steps
            t["time"] += seconds
            t["valid"] += valid(tok, tokens, grammar, schema)
            t["host"] += clock.seconds - host
            t["calls"] += clock.calls - calls
        for m in MODES:
            totals[m]["mismatches"] += outs[m] != outs["plain"]
        print(f"{k + 1}/{len(cases)} prompts done", file=sys.stderr, flush=True)
    results = {
        "command": "python " + " ".join(shlex.quote(x) for x in [sys.argv[0], *(argv or sys.argv[1:])]),
        "model": a.model,
        "beam_width": W,
        "beam_length": L,
        "lookup_beams": K,
        "max_tokens": a.max_tokens,
        "prompts": len(cases),
        "modes": {m: _row(t, totals["plain"], len(cases)) for m, t in totals.items()},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    report = markdown(results)
    (a.out / "report.md").write_text(report)
    print(report)
    bad = sum(r["mismatches"] for r in results["modes"].values())
    invalid = sum(len(cases) - round(r["valid_share"] * len(cases)) for r in results["modes"].values())
    if bad or invalid:
        print(
            f"ERROR: {bad} runs differ from plain constrained decoding, {invalid} outputs do not validate",
            file=sys.stderr,
        )
    return 1 if bad or invalid else 0


def _row(t: dict, plain: dict, n: int) -> dict:
    tps = t["tokens"] / t["time"] if t["time"] else 0.0
    base = plain["tokens"] / plain["time"] if plain["time"] else 0.0
    return {
        "tokens": t["tokens"],
        "decode_s": round(t["time"], 3),
        "tokens_per_s": round(tps, 2),
        "tokens_per_step": round(t["tokens"] / max(t["steps"], 1), 3),
        "speedup": round(tps / base, 3) if base else None,
        "valid_share": t["valid"] / n,
        "mismatches": t["mismatches"],
        "grammar_ms_per_step": round(1e3 * t["host"] / t["calls"], 3) if t["calls"] else None,
    }


def markdown(results: dict) -> str:
    lines = [
        f"Command: `{results['command']}`",
        f"Model {results['model']}, drafter W={results['beam_width']} L={results['beam_length']}, "
        f"{results['lookup_beams']} lookup beam(s), {results['prompts']} prompts, {results['max_tokens']} "
        "tokens at most, greedy, JSON Schema constrained.",
        "",
        "| mode | tokens | tok/s | tokens/step | speedup | parse + validate | same as plain | grammar ms/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, r in results["modes"].items():
        host = f"{r['grammar_ms_per_step']:.2f}" if r["grammar_ms_per_step"] is not None else "(mlx-lm processor)"
        lines.append(
            f"| {m} | {r['tokens']} | {r['tokens_per_s']:.1f} | {r['tokens_per_step']:.2f} | "
            f"{r['speedup']:.2f}x | {r['valid_share']:.0%} | {results['prompts'] - r['mismatches']}/"
            f"{results['prompts']} | {host} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
