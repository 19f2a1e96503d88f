"""A source with caches of its own in a drafting batch (issue 57): the
default model's rows decoded together (step/batched.py ``BatchSteps``, as
``serve --batch-drafts`` decodes them), with and without a draft model.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        python bench/batch_sources.py --rows 1,2,4 --max-tokens 64

Modes, per number of rows, their order rotating from one batch to the next:

* ``plain``: the defaults' batch with its governor pinned to plain decoding
  (every row's next token alone, each step queued before the last is read:
  mlx-lm's ``BatchGenerator``'s speed, bench/batch_plain.py);
* ``defaults``: the shipped drafter and lookup, governed (the batch's live choice);
* ``draft-model``: the same with a draft model (the default model's own
  first 8 of 30 layers, 3 tokens: each row's its own caches), governed;
* ``draft-model-always``: the same, every step drafting with every source.

Each batch decodes ``--batches`` groups of MT-Bench first turns, ``--max-tokens``
each, greedy; the prompts' prefill is not timed. Reports tokens per second
of the whole batch and the ratios to ``plain``, the draft model's accepted
tokens over those it verified, and whether every mode gave every row the same tokens.
Each mode keeps one batch for all its groups at a number of rows, as
``serve`` keeps one: its governors learn across the groups. Each number of
rows starts from nothing, or (``--alone-first``) from what one request
decoded alone first learned (step/batch_governors.py). The live state of
earlier runs is removed first.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx


def decode(bs, prompts, max_tokens: int):
    """``(tokens per row, tokens, seconds, verified, accepted)`` of one batch
    decoded by ``bs`` (a ``BatchSteps``; prefill not timed)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_redrafter.config import SamplingConfig
    from mlx_redrafter.step.batched import RowPlan

    model = bs.model
    outs = {}
    for p in prompts:
        row, first = bs.add(make_prompt_cache(model), p, RowPlan(SamplingConfig()))
        outs[row] = list(first.tokens)
    order = list(outs)
    verified, accepted = Counter(), Counter()
    tic = time.perf_counter()
    while len(bs):
        for row, st in zip(list(bs.rows), bs.step()):
            outs[row] += st.tokens
            if len(outs[row]) >= max_tokens:
                bs.remove(row)
        verified.update(bs.verified)
        accepted.update(bs.accepted)
    seconds = time.perf_counter() - tic
    texts = [outs[r][:max_tokens] for r in order]
    return texts, sum(len(outs[r]) - 1 for r in order), seconds, verified, accepted


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--batches", type=int, default=3, help="Batches per number of rows (each mode decodes each).")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--alone-first",
        action="store_true",
        help="Each mode first decodes one prompt alone (128 tokens), as serve's requests alone before a batch forms: "
        "the batch's governors start from what it learned.",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from never_slower import _clear_state, own_layers, pinned, write_rows

    from mlx_redrafter.prompts import first_turn_ids, load_prompt_set
    from mlx_redrafter.runtime import load_runtime
    from mlx_redrafter.step.batched import BatchSteps
    from mlx_redrafter.step.curve import builtin_curve

    rt = load_runtime("default")
    model, defaults = rt.model, rt.draft
    small = own_layers(model)
    drafts = {
        "plain": defaults,
        "defaults": defaults,
        "draft-model": copy.copy(defaults),
        "draft-model-always": copy.copy(defaults),
    }
    for name in ("draft-model", "draft-model-always"):
        drafts[name].draft_model, drafts[name].draft_model_length = small, 3
    drafts["draft-model-always"].always_draft = True
    counts, rows, names = [int(r) for r in args.rows.split(",")], [], list(drafts)
    prompts = first_turn_ids(rt.tokenizer, load_prompt_set("mt_bench")[: max(counts) * args.batches])
    decode(BatchSteps(model, None, curve=builtin_curve()), prompts[:1], 8)  # warm up
    _clear_state()  # no live state of earlier runs, in memory or on disk
    if args.alone_first:
        from mlx_redrafter.generate import generate_tokens

        alone = first_turn_ids(rt.tokenizer, load_prompt_set("alpaca_eval")[:1])[0]
        for m in names[1:]:
            generate_tokens(model, alone, draft=drafts[m], max_tokens=128)
    for n in counts:
        # One batch per mode for all its groups, as serve keeps one: its governors learn across them.
        batches = {m: BatchSteps(model, drafts[m], curve=builtin_curve()) for m in names}
        totals = {m: [0, 0.0] for m in names}
        same, verified, accepted = True, Counter(), Counter()
        for b in range(args.batches):
            group = prompts[b * n : (b + 1) * n]
            texts = {}
            k = b % len(names)
            for m in names[k:] + names[:k]:
                with pinned("plain" if m == "plain" else None):
                    texts[m], tokens, seconds, v, a = decode(batches[m], group, args.max_tokens)
                totals[m][0] += tokens
                totals[m][1] += seconds
                if m == "draft-model":
                    verified.update(v)
                    accepted.update(a)
            same &= all(t == texts["plain"] for t in texts.values())
        tps = {m: t / s for m, (t, s) in totals.items()}
        row = {
            "rows": n,
            "tokens_per_second": tps,
            "ratio": {m: tps[m] / tps["plain"] for m in names},
            "draft_model_accepted_over_verified": [accepted["draft-model"], verified["draft-model"]],
            "same_tokens": same,
        }
        rows.append(row)
        ratios = " | ".join(f"{m} {v:.2f}x" for m, v in row["ratio"].items() if m != "plain")
        print(
            f"{n} rows: plain {tps['plain']:.1f} tok/s | {ratios} | draft model accepted "
            f"{accepted['draft-model']}/{verified['draft-model']} | same tokens: {same}",
            flush=True,
        )
        mx.clear_cache()
    write_rows(args.out, rows)
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
