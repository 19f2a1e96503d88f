"""A batch held to plain decoding against mlx-lm's own batched decoding.

When the batch's governor parks drafting, ``serve --batch-drafts`` decodes
its rows plainly through :class:`~mlx_redrafter.step.batched.BatchSteps`;
that must run at the speed of mlx-lm's ``BatchGenerator`` (what
``--no-batch-drafts`` runs), or drafting in a batch costs even when it is
off. Three ways, interleaved each round, on the same prompts (MT-Bench first
turns, one a row), greedy, every answer compared with ``BatchGenerator``'s:

* ``mlx-lm``: ``BatchGenerator``;
* ``plain arm``: ``BatchSteps`` with the governor pinned to plain decoding;
* ``plain arm, tree hooks``: the same, its steps verified through the
  batched tree hooks (per-row mask and positions) as every step was before
  a plain step became mlx-lm's own batched step.

Decoding only: tokens/s over the steps after the first two (prefill and
warm-up left out).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        .venv/bin/python bench/batch_plain.py --rows 4 --max-tokens 64 --rounds 3 \\
        --out bench/results/batch_trees/plain_arm.json
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from dflash_tree import write_out
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from never_slower import pinned

from mlx_redrafter.config import SamplingConfig
from mlx_redrafter.llm import batch_cache
from mlx_redrafter.prompts import first_turn_ids, load_prompt_set, select_conversations
from mlx_redrafter.runtime import load_runtime
from mlx_redrafter.step.batched import BatchSteps, RowPlan

SKIP = 2  # steps left out of the timing (the first token comes with the prefill)


def mlx_lm_batch(model, prompts, n: int):
    """``BatchGenerator``: (tokens/s, each row's tokens)."""
    gen = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts))
    out = {u: [] for u in uids}
    count, tic, steps = 0, None, 0
    while any(len(t) < n for t in out.values()):
        responses = gen.next_generated()  # empty while prompts are processed
        if not responses:
            continue
        steps += 1
        for r in responses:
            out[r.uid].append(r.token)
        if steps == SKIP:  # the clock starts once the skipped steps' tokens are out; later ones count
            tic = time.perf_counter()
        elif steps > SKIP:
            count += len(responses)
    rate = count / (time.perf_counter() - tic)
    return rate, [out[u] for u in uids]


@contextmanager
def hooked():
    """Every plain step through the tree hooks (the rows never read as aligned)."""
    saved = batch_cache.Ragged.aligned
    batch_cache.Ragged.aligned = property(lambda self: False)
    try:
        yield
    finally:
        batch_cache.Ragged.aligned = saved


def plain_arm(model, draft, prompts, n: int, through_hooks: bool = False):
    """``BatchSteps`` pinned to plain decoding (``through_hooks``: every step
    through the tree hooks): (tokens/s, each row's tokens)."""
    with pinned("plain"), hooked() if through_hooks else nullcontext():
        batch = BatchSteps(model, draft, live=True)
        out = []
        for p in prompts:
            _, first = batch.add(make_prompt_cache(model), p, RowPlan(SamplingConfig()))
            out.append(list(first.tokens))
        count, tic = 0, None
        for step in range(n - 1):  # the first token came with the prefill
            if step == SKIP - 1:  # the clock starts once the skipped steps' tokens are out; later ones count
                tic, count = time.perf_counter(), 0
            for row, st in zip(out, batch.step()):
                row.extend(st.tokens)
                count += len(st.tokens)
    return count / (time.perf_counter() - tic), [r[:n] for r in out]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rt = load_runtime(args.model)
    model, tok = rt.model, rt.tokenizer
    convs = select_conversations(load_prompt_set("mt_bench"), args.rows)
    prompts = first_turn_ids(tok, convs)
    ways = {
        "mlx-lm": lambda: mlx_lm_batch(model, prompts, args.max_tokens),
        "plain arm": lambda: plain_arm(model, rt.draft, prompts, args.max_tokens),
        "plain arm, tree hooks": lambda: plain_arm(model, rt.draft, prompts, args.max_tokens, through_hooks=True),
    }
    for way in ways.values():  # warm-up: allocations and kernels
        way()
    rates = {k: [] for k in ways}
    same = {k: True for k in ways}
    for _ in range(args.rounds):
        ref = None
        for name, way in ways.items():
            rate, tokens = way()
            rates[name].append(rate)
            ref = tokens if ref is None else ref
            same[name] &= tokens == ref
        print(" | ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), f"(load {os.getloadavg()[0]:.1f})", flush=True)
    print("way | tokens/s per round | mean / mlx-lm's | same tokens")
    base = sum(rates["mlx-lm"]) / len(rates["mlx-lm"])
    for name, r in rates.items():
        print(f"{name} | {' / '.join(f'{x:.1f}' for x in r)} | {sum(r) / len(r) / base:.3f} | {same[name]}")
    write_out(args, rates["mlx-lm"], rates=rates, same_tokens=same)


if __name__ == "__main__":
    main()
