"""What a ReDrafter step costs against a plain decoding step, in one run.

For each draft shape the step is timed in both loops, the synchronous one
(``DraftConfig(pipelined=False)``: read step t, then build step t+1) and the
pipelined one (build step t+1, then read step t; step/pipelined.py, here even for
the wide trees it leaves to the synchronous loop by default), without
profiling syncs, and split into phases by a third, profiled run of the
synchronous loop (``timings=True`` adds a sync per phase). Shapes:

* **g0 only**: lookup drafts with the proposer switched off, so every step
  verifies the LLM's own token alone through our loop: the loop's tax;
* W x L trees of a random drafter (never accepted, so every step verifies a
  full tree) and of the shipped drafter (its real acceptance; its step
  sizes vary).

Plain decoding (mlx-lm's ``stream_generate`` on the same model object and
templated prompt) is timed before and after the grid; ratios use the mean
of those two runs' median per-token times (the same statistic as a step's).
End to end: the whole ``stream_generate`` call, prefill included, as a user
runs it, ours against mlx-lm's, per token emitted (a never-accepted drafter
emits one token per step, so that is per step).
The LLM's forward alone over 1, 2, 3, 7 and 15 tokens, pipelined, gives
the floor under a step that verifies that many tokens.
Step times are medians over the steps after the first two.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        .venv/bin/python bench/overhead.py --tokens 64 --out bench/results/overhead/overhead.json
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import stream_generate as mlx_stream_generate
from mlx_lm.models.cache import make_prompt_cache

from mlx_redrafter import load_model
from mlx_redrafter.config import DraftConfig
from mlx_redrafter.doctor import report
from mlx_redrafter.draft.lookup import Lookup
from mlx_redrafter.draft.redrafter import Drafter, DrafterConfig
from mlx_redrafter.hub.load import load_drafter
from mlx_redrafter.prompts import build_messages, chat_prompt_ids, render_messages
from mlx_redrafter.runtime import shipped_drafter_path
from mlx_redrafter.step import plan
from mlx_redrafter.tuning.measure import measure

PROMPT = "Write a short story about a robot who learns to paint."


def stream_ms(stream):
    """``(median ms between tokens after the first three, end-to-end ms per token)`` of a token stream;
    the end-to-end time runs from the call (prefill included) to the last token."""
    tic = last = time.perf_counter()
    deltas, count = [], 0
    for _ in stream:
        now = time.perf_counter()
        if count:
            deltas.append(now - last)
        last, count = now, count + 1
    return med(deltas[2:]), 1000 * (last - tic) / max(count, 1)


def plain_ms_per_token(model, tok, prompt, n):
    """Median ms per decode token of mlx-lm's own ``stream_generate``."""
    return stream_ms(mlx_stream_generate(model, tok, prompt, max_tokens=n))[0]


def end_to_end(model, tok, prompt, n, drafts):
    """End-to-end ms per token, plain (mlx-lm) and ours per draft, interleaved, plain first and last."""
    from mlx_redrafter.generate import stream_generate

    plain = [stream_ms(mlx_stream_generate(model, tok, prompt, max_tokens=n))[1]]
    ours = {k: stream_ms(stream_generate(model, tok, prompt, max_tokens=n, draft=d))[1] for k, d in drafts.items()}
    plain.append(stream_ms(mlx_stream_generate(model, tok, prompt, max_tokens=n))[1])
    return float(np.mean(plain)), ours


def forward_ms(model, ids, n_tokens, steps):
    """Median ms of the LLM's own forward over ``n_tokens`` tokens after the
    prompt, pipelined like mlx-lm (the next call queued before the last is
    read), the cache growing by one token per call: the floor under a step
    that verifies a tree of that size on this machine."""
    cache = make_prompt_cache(model)
    prompt = mx.array(ids, mx.int32)
    model(prompt[None], cache=cache)
    mx.eval([c.state for c in cache])
    tokens = mx.zeros((1, n_tokens), mx.int32)

    def call():
        out = mx.argmax(model(tokens, cache=cache)[0, -1]).reshape(1)
        for c in cache:
            c.trim(n_tokens - 1)
        return out

    times, pending = [], call()
    mx.async_eval(pending)
    for _ in range(steps):
        tic = time.perf_counter()
        following = call()
        mx.async_eval(following)
        pending.tolist()
        pending = following
        times.append(time.perf_counter() - tic)
    return med(times[2:])


@contextmanager
def no_proposals():
    """Lookup that never proposes: every step of a lookup-only run is g0 alone."""
    propose = Lookup.propose
    Lookup.propose = lambda self, length, k=1: []
    try:
        yield
    finally:
        Lookup.propose = propose


def med(xs) -> float:
    return float(np.median(xs)) * 1000


def time_steps(model, ids, draft, n, timings=False):
    run = measure(model, ids, draft=draft, max_tokens=n, timings=timings)
    s = run.steps[3:]  # skip the prefill step and two warm-up steps
    return run, s


@contextmanager
def always_pipelined():
    """Build ahead even for trees left to read-then-build (plan.MAX_SHARED_NODES)."""
    limit = plan.MAX_SHARED_NODES
    plan.MAX_SHARED_NODES = 10**9
    try:
        yield
    finally:
        plan.MAX_SHARED_NODES = limit


def row(model, ids, draft, n):
    ahead = plan.make_plan(model, draft, cache=make_prompt_cache(model)).schedule == plan.AHEAD
    out = {"default_loop": "pipelined" if ahead else "sync"}
    tokens = {}
    for name, pipelined in (("sync", False), ("pipelined", True)):
        with always_pipelined():
            run, s = time_steps(model, ids, DraftConfig(**{**draft.__dict__, "pipelined": pipelined}), n)
        out[f"{name}_step_ms"] = med([x.step_time for x in s])
        out[f"{name}_ms_per_token"] = 1000 * run.decode_time / max(run.decode_tokens, 1)
        out[f"{name}_tokens_per_step"] = float(np.mean([1 + x.accepted for x in s]))
        tokens[name] = run.tokens
    assert tokens["sync"] == tokens["pipelined"], "the two loops gave different tokens"
    _, s = time_steps(model, ids, DraftConfig(**{**draft.__dict__, "pipelined": False}), n, timings=True)
    for phase in ("draft", "pack", "verify", "accept"):
        out[f"{phase}_ms"] = med([getattr(x, f"{phase}_time") for x in s])
    out["profiled_step_ms"] = med([x.step_time for x in s])
    out["tree_size"] = float(np.mean([x.tree_size for x in s]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--grid", default="1x1,2x3,4x5")
    ap.add_argument("--out", default=None, help="write JSON results here")
    args = ap.parse_args()
    model, tok = load_model("default")
    messages = build_messages(None, [], PROMPT)
    prompt, ids = render_messages(tok, messages), chat_prompt_ids(tok, messages)
    grid = [tuple(int(v) for v in cell.split("x")) for cell in args.grid.split(",")]
    shipped = load_drafter(shipped_drafter_path("default"))
    mx.random.seed(0)
    rand = Drafter(DrafterConfig(**{**shipped.config.__dict__}))
    mx.eval(rand.parameters())
    base = [plain_ms_per_token(model, tok, prompt, args.tokens)]
    rows = []
    with no_proposals():
        rows.append(
            {
                "drafter": "none",
                "W": 0,
                "L": 0,
                "shape": "g0 only",
                **row(model, ids, DraftConfig(None, lookup=1), args.tokens),
            }
        )
    for name, d in (("random", rand), ("shipped", shipped)):
        for w, l in grid:
            rows.append(
                {
                    "drafter": name,
                    "W": w,
                    "L": l,
                    "shape": f"W={w} L={l}",
                    **row(model, ids, DraftConfig(d, w, l), args.tokens),
                }
            )
    rows.append(
        {
            "drafter": "shipped",
            "W": 2,
            "L": 1,
            "shape": "default: W=2 L=1 + lookup",
            **row(model, ids, DraftConfig(shipped, 2, 1, lookup=1), args.tokens),
        }
    )
    floors = {n: forward_ms(model, ids, n, args.tokens) for n in (1, 2, 3, 7, 15)}
    e2e_plain, e2e = end_to_end(
        model,
        tok,
        prompt,
        args.tokens,
        {
            "random W=1 L=1 (never accepted)": DraftConfig(rand, 1, 1),
            "default: shipped W=2 L=1 + lookup": DraftConfig(shipped, 2, 1, lookup=1),
            "default, tree=auto": DraftConfig(shipped, 2, 1, lookup=1, tree="auto"),
        },
    )
    base.append(plain_ms_per_token(model, tok, prompt, args.tokens))
    plain = float(np.mean(base))
    print("The LLM's forward alone, pipelined, per tree size (the floor under a step of that size):")
    print("| tokens | ms | / plain decoding step |")
    print("|---|---|---|")
    for n, ms in floors.items():
        print(f"| {n} | {ms:.1f} | {ms / plain:.2f} |")
    print()
    print(f"plain mlx-lm decoding: {plain:.1f} ms/token (runs: {', '.join(f'{b:.1f}' for b in base)})")
    print(
        "| drafter | shape | default loop | tree | step / plain, sync | step / plain, pipelined | tokens/step | "
        "token ms / plain, sync | token ms / plain, pipelined | "
        "draft | pack | verify | accept | other (ms, profiled sync) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        other = r["profiled_step_ms"] - sum(r[f"{p}_ms"] for p in ("draft", "pack", "verify", "accept"))
        print(
            f"| {r['drafter']} | {r['shape']} | {r['default_loop']} | {r['tree_size']:.1f} | "
            f"{r['sync_step_ms'] / plain:.2f} | "
            f"{r['pipelined_step_ms'] / plain:.2f} | {r['pipelined_tokens_per_step']:.2f} | "
            f"{r['sync_ms_per_token'] / plain:.2f} | {r['pipelined_ms_per_token'] / plain:.2f} | "
            f"{r['draft_ms']:.1f} | {r['pack_ms']:.1f} | {r['verify_ms']:.1f} | {r['accept_ms']:.1f} | {other:.1f} |"
        )
    print()
    print(f"End to end (stream_generate, prefill included): plain mlx-lm {e2e_plain:.1f} ms/token")
    print("| draft | ms/token | / plain |")
    print("|---|---|---|")
    for k, ms in e2e.items():
        print(f"| {k} | {ms:.1f} | {ms / e2e_plain:.2f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                {
                    "machine": report(),
                    "plain_ms_per_token": base,
                    "forward_ms": floors,
                    "rows": rows,
                    "end_to_end_plain_ms": e2e_plain,
                    "end_to_end_ms": e2e,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
