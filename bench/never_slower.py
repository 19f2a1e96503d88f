"""Never slower than plain decoding (issue 55): the defaults against plain
mlx-lm decoding of the same model, in one run, per condition.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        python bench/never_slower.py --conditions default,q4,draft-model --num-prompts 6 --max-tokens 128

Three modes per prompt, their order rotating from one prompt to the next so
that drift hits all alike:

* ``plain``: ``mlx_lm.stream_generate`` (mlx-lm's own loop, no drafting);
* ``governed``: ``mlx_redrafter.stream_generate`` with the defaults (the
  shipped drafter, lookup, the live choice of step/governor.py);
* ``always``: the same with ``always_draft=True`` (every step drafts: what the
  defaults did before the live choice).

Conditions: ``default`` (the default model, MT-Bench first turns), ``q4``
(the same model quantized to 4 bits in memory), ``draft-model`` (the default
model with a draft model that does not pay: its own first 8 of 30 layers,
3 tokens), ``long`` and ``longer`` (each prompt after 600 and 1,500 tokens
of earlier context: the other prompts, repeated),
``qwen35-mtp`` (a hybrid at Qwen3.5-0.8B's shape, random weights, its MTP
head and lookup; the step loops timed on token ids, plain being mlx-lm's
``generate_step``).
No calibration is used: the live state of earlier runs (``live-*.json``) is
removed first, so the governed mode starts from nothing; it carries across
the prompts of one run, as across the turns of a chat.
Reports decoding's tokens per second per mode (the tokens after the first
over their time, summed over prompts: the prompt's prefill is not counted)
and the ratios to plain; writes ``--out`` (JSON) when given.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

CONDITIONS = ("default", "q4", "draft-model", "long", "longer")
LONG = {"long": 600, "longer": 1500}  # tokens of earlier context before each prompt
# Conditions on random weights of a real model's shape (no tokenizer: the step loops are timed on token ids).
SHAPED = ("qwen35-mtp",)


def _tokens_per_second(gen) -> tuple:
    """Tokens after the first and the seconds they took: decoding, the prompt's prefill left out."""
    it = iter(gen)
    next(it)
    tic, n = time.perf_counter(), 0
    for _ in it:
        n += 1
    return n, time.perf_counter() - tic


def run_condition(name: str, prompts, model, tokenizer, max_tokens: int) -> dict:
    import mlx_lm

    from mlx_redrafter import stream_generate

    extra = {}
    if name == "q4":
        import mlx.nn as nn

        model = copy.deepcopy(model)
        nn.quantize(model, group_size=64, bits=4)
    if name == "draft-model":
        draft = copy.deepcopy(model)
        draft.model.layers = draft.model.layers[:8]
        extra = {"draft_model": draft, "num_draft_tokens": 3}
    if name in LONG:
        filler = []
        for p in prompts:
            filler += p
        prompts = [(filler * 20)[: LONG[name]] + p for p in prompts]

    modes = {
        "plain": lambda p: mlx_lm.stream_generate(model, tokenizer, p, max_tokens=max_tokens),
        "governed": lambda p: stream_generate(model, tokenizer, p, max_tokens=max_tokens, always_draft=False, **extra),
        "always": lambda p: stream_generate(model, tokenizer, p, max_tokens=max_tokens, always_draft=True, **extra),
    }
    _tokens_per_second(modes["plain"](prompts[0]))  # warm up
    totals = {m: [0, 0.0] for m in modes}
    names = list(modes)
    for i, p in enumerate(prompts):
        for m in names[i % 3 :] + names[: i % 3]:
            n, s = _tokens_per_second(modes[m](p))
            totals[m][0] += n
            totals[m][1] += s
    tps = {m: n / s for m, (n, s) in totals.items()}
    return {
        "condition": name,
        "tokens_per_second": tps,
        "ratio": {m: tps[m] / tps["plain"] for m in modes},
        "tokens": {m: totals[m][0] for m in modes},
    }


def _count(steps, n: int) -> tuple:
    """Tokens of the steps after the first (the prefill's) up to ``n``, and their seconds."""
    next(steps)
    tic, got = time.perf_counter(), 0
    for s in steps:
        got += len(s.tokens) if hasattr(s, "tokens") else 1
        if got >= n:
            break
    steps.close()
    return got, time.perf_counter() - tic


def run_qwen35_mtp(num_prompts: int, max_tokens: int) -> dict:
    """A hybrid at Qwen3.5-0.8B's shape, random weights, with its MTP head
    (random too: its drafts are rejected) and lookup, as the defaults draft
    for a model that ships one (one beam of 2, one lookup beam). Random
    weights fall into loops, which lookup copies: the case of issue 55."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_redrafter.config import DEFAULT_HEAD_LENGTH, DEFAULT_LOOKUP, DraftConfig, SamplingConfig
    from mlx_redrafter.step.dispatch import token_steps
    from mlx_redrafter.step.plan import make_plan

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mtp_cost import build

    model, head = build()
    mx.random.seed(1)
    prompts = [mx.random.randint(0, 248320, (64,)).astype(mx.int32) for _ in range(num_prompts)]

    def drafted(always: bool):
        draft = DraftConfig(head=head, head_length=DEFAULT_HEAD_LENGTH, lookup=DEFAULT_LOOKUP, always_draft=always)
        return lambda p: token_steps(
            model, p, make_prompt_cache(model), plan=make_plan(model, draft), sampling=SamplingConfig()
        )

    modes = {
        "plain": lambda p: generate_step(p, model, max_tokens=max_tokens),
        "governed": drafted(False),
        "always": drafted(True),
    }
    _count(modes["plain"](prompts[0]), 8)  # warm up
    totals = {m: [0, 0.0] for m in modes}
    names = list(modes)
    for i, p in enumerate(prompts):
        for m in names[i % 3 :] + names[: i % 3]:
            n, sec = _count(modes[m](p), max_tokens)
            totals[m][0] += n
            totals[m][1] += sec
    tps = {m: n / sec for m, (n, sec) in totals.items()}
    return {
        "condition": "qwen35-mtp",
        "tokens_per_second": tps,
        "ratio": {m: tps[m] / tps["plain"] for m in modes},
        "tokens": {m: totals[m][0] for m in modes},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from mlx_redrafter import load_model
    from mlx_redrafter.files import cache_root
    from mlx_redrafter.prompts import first_turn_ids, load_prompt_set

    names = args.conditions.split(",")
    if any(n not in SHAPED for n in names):
        model, tokenizer = load_model(args.model)
        prompts = first_turn_ids(tokenizer, load_prompt_set("mt_bench")[: args.num_prompts])
    rows = []
    for name in names:
        from mlx_redrafter.step import keep

        keep._KEPT.clear()  # each condition starts from nothing: no state in memory, none on disk
        for f in (cache_root() / "profiles").glob("live-*.json"):
            f.unlink()
        if name == "qwen35-mtp":
            row = run_qwen35_mtp(args.num_prompts, args.max_tokens)
        else:
            row = run_condition(name, prompts, model, tokenizer, args.max_tokens)
        rows.append(row)
        r = row["ratio"]
        print(
            f"{name}: plain {row['tokens_per_second']['plain']:.1f} tok/s | governed {r['governed']:.2f}x | "
            f"always drafting {r['always']:.2f}x",
            flush=True,
        )
        mx.clear_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
