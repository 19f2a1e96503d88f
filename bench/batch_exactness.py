"""How often decoding in a batch changes a greedy reply (``serve``'s batching).

    python bench/batch_exactness.py                          # 64 prompts, 64 tokens, batches of 4 and 8
    python bench/batch_exactness.py --prompts 4 --max-tokens 8 --batch 2   # a smoke run

Batched matmuls sum in another order than one sequence's, so a logit can
round differently; where the top two logits are nearly tied, the argmax may
flip and the reply goes another way from there. This counts it: each prompt
(first turns of the shipped MT-Bench and AlpacaEval sets, templated) is
decoded greedily alone (plain decoding, ``stream_generate(drafter=None)``)
and in batches of ``--batch`` requests through the server's own engine
(``Engine``, no drafting, all submitted at once so they decode together).
For each reply that differs it records where, and the gap between the top
two logits alone at that token (a near tie is a gap of ~1e-5 or less).
Prints one line per batch size and writes ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path
from typing import List

BENCH_DIR = Path(__file__).resolve().parent


def prompts(tokenizer, n: int) -> List[List[int]]:
    from mlx_redrafter.prompts import first_turn_ids, load_prompt_set

    convs = load_prompt_set("mt_bench") + load_prompt_set("alpaca_eval")
    return first_turn_ids(tokenizer, convs[:n])


def alone(model, tokenizer, ids: List[int], max_tokens: int) -> List[int]:
    from mlx_redrafter.generate import stream_generate

    out = [r.token for r in stream_generate(model, tokenizer, ids, drafter=None, lookup=False, max_tokens=max_tokens)]
    return [t for t in out if t not in tokenizer.eos_token_ids]


def batched(engine, batch: List[List[int]], max_tokens: int) -> List[List[int]]:
    """Replies of ``batch`` submitted together to ``engine`` (they decode as one batch)."""
    from mlx_redrafter.serve.engine import GenParams

    results, done = [None] * len(batch), [threading.Event() for _ in batch]

    def emit(i):
        def on(kind, value):
            if kind != "text":
                results[i] = value
                done[i].set()
        return on

    jobs = [engine.job(ids, GenParams(max_tokens), emit(i)) for i, ids in enumerate(batch)]
    for job in jobs:
        engine.submit(job)
    engine.start()
    try:
        for d in done:
            d.wait()
    finally:
        engine.stop()
    bad = [r for r in results if isinstance(r, BaseException)]
    if bad:
        raise bad[0]
    assert all(r.batched_tokens == len(r.tokens) for r in results), "a row did not decode in the batch"
    return [r.tokens for r in results]


def top_gap(model, ids: List[int]) -> float:
    """The gap between the top two logits after ``ids`` (one sequence)."""
    import mlx.core as mx

    logits = model(mx.array(ids)[None])[0, -1].astype(mx.float32)
    top = mx.sort(logits)[-2:].tolist()
    return float(top[1] - top[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "batch_exactness")
    args = ap.parse_args(argv)

    from mlx_redrafter.config import DraftConfig
    from mlx_redrafter.llm.load import load_model
    from mlx_redrafter.runtime import Runtime
    from mlx_redrafter.serve.engine import Engine

    model, tokenizer = load_model(args.model)
    ids = prompts(tokenizer, args.prompts)
    refs = [alone(model, tokenizer, p, args.max_tokens) for p in ids]
    report = {"model": args.model, "prompts": len(ids), "max_tokens": args.max_tokens, "batches": {}}
    for size in args.batch:
        rt = Runtime(model, tokenizer, args.model, draft=DraftConfig())  # plain decoding: every group batches
        diffs = []
        for start in range(0, len(ids), size):
            engine = Engine(rt, max_batch=size, queue_size=size, prompt_cache_size=1)
            for k, got in enumerate(batched(engine, ids[start:start + size], args.max_tokens)):
                i = start + k
                if got != refs[i]:
                    at = next((j for j, (a, b) in enumerate(zip(got, refs[i])) if a != b), min(len(got), len(refs[i])))
                    diffs.append({"prompt": i, "at": at, "gap": top_gap(model, ids[i] + refs[i][:at])})
        report["batches"][size] = {"differ": len(diffs), "of": len(ids), "replies": diffs}
        gaps = ", ".join(f"{d['gap']:.2g}" for d in diffs) or "-"
        print(f"batch {size}: {len(diffs)}/{len(ids)} greedy replies differ from alone "
              f"({args.max_tokens} tokens each); top-2 logit gaps at the first difference: {gaps}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
