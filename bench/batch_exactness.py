"""How often decoding in a batch changes a greedy reply (``serve``'s batching).

    python bench/batch_exactness.py                          # 64 prompts, 64 tokens, batches of 4 and 8
    python bench/batch_exactness.py --prompts 4 --max-tokens 8 --batch 2   # a smoke run

Batched matmuls sum in another order than one sequence's, so a logit can
round differently; where the top two logits are nearly tied, the argmax may
flip and the reply goes another way from there. This counts it: each prompt
(first turns of the shipped MT-Bench and AlpacaEval sets, templated) is
decoded greedily alone (plain decoding: mlx-lm's ``generate_step``)
and in batches of ``--batch`` requests decoded together as ``serve``
decodes concurrent requests (mlx-lm's ``BatchGenerator`` with the
server's settings; bench scripts do not import the server itself).
It reports the replies that differ (where, and the gap between the top two
log-probabilities alone there), the largest difference between a batched
log-probability and alone's (the rounding: a tie closer than that can
flip), and the smallest top-2 gaps seen alone (how close the ties come).
Prints one line per batch size and writes ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

BENCH_DIR = Path(__file__).resolve().parent


def prompts(tokenizer, n: int) -> List[List[int]]:
    from mlx_redrafter.prompts import first_turn_ids, load_prompt_set

    convs = load_prompt_set("mt_bench") + load_prompt_set("alpaca_eval")
    return first_turn_ids(tokenizer, convs[:n])


TOP = 8  # the logits compared at each position: alone's top 8


@dataclass
class Reply:
    """A greedy reply alone: its tokens and, at each, alone's top logits (ids, log-probabilities)."""

    tokens: List[int] = field(default_factory=list)
    top_ids: List[List[int]] = field(default_factory=list)
    top_logprobs: List[List[float]] = field(default_factory=list)

    def gaps(self) -> List[float]:
        """The gap between the top two log-probabilities at each token (0: a tie)."""
        return [a - b for a, b, *_ in self.top_logprobs]


def alone(model, ids: List[int], max_tokens: int, eos) -> Reply:
    """Plain greedy decoding of one sequence (mlx-lm's ``generate_step``, as ``serve``'s plain steps run it)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = Reply()
    for token, logprobs in generate_step(mx.array(ids), model, max_tokens=max_tokens):
        top = mx.argsort(-logprobs)[:TOP]
        out.top_ids.append(top.tolist())
        out.top_logprobs.append(logprobs[top].tolist())
        if int(token) in eos:
            break
        out.tokens.append(int(token))
    return out


def batched(model, batch: List[List[int]], refs: List[Reply], max_tokens: int, eos):
    """``(replies, largest difference)``: the greedy replies of ``batch``
    decoded together, as ``serve`` decodes concurrent requests (mlx-lm's
    ``BatchGenerator`` with the server's settings, serve/batch.py, every row
    inserted at once), and the largest difference between a batched
    log-probability and alone's (alone's top ``TOP`` at each position, while
    the reply still equals alone's)."""
    from mlx_lm.generate import BatchGenerator

    from mlx_redrafter.step.protocol import PREFILL_STEP

    gen = BatchGenerator(
        model, completion_batch_size=len(batch), prefill_batch_size=len(batch), prefill_step_size=PREFILL_STEP
    )
    uids = gen.insert(batch, max_tokens=[max_tokens + 1] * len(batch))
    row = {u: i for i, u in enumerate(uids)}
    out: List[List[int]] = [[] for _ in uids]
    ended, largest = set(), 0.0
    while len(ended) < len(uids):
        for r in gen.next_generated():
            i = row[r.uid]
            if i in ended:
                continue
            j, ref = len(out[i]), refs[i]
            if out[i] == ref.tokens[:j] and j < len(ref.top_ids):
                got = r.logprobs[ref.top_ids[j]].tolist()
                largest = max(largest, max(abs(a - b) for a, b in zip(got, ref.top_logprobs[j])))
            if r.token in eos or len(out[i]) >= max_tokens:
                ended.add(i)
            else:
                out[i].append(r.token)
    gen.close()
    return out, largest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "batch_exactness")
    args = ap.parse_args(argv)

    from mlx_redrafter.llm.load import load_model

    model, tokenizer = load_model(args.model)
    eos = set(tokenizer.eos_token_ids)
    ids = prompts(tokenizer, args.prompts)
    refs = [alone(model, p, args.max_tokens, eos) for p in ids]
    gaps = sorted(g for r in refs for g in r.gaps())
    report = {
        "command": "python " + " ".join(sys.argv),
        "model": args.model,
        "prompts": len(ids),
        "max_tokens": args.max_tokens,
        "positions": len(gaps),
        "smallest_top2_gaps_alone": gaps[:10],
        "batches": {},
    }
    print(
        f"alone: {len(gaps)} positions; the smallest top-2 log-probability gaps: "
        + ", ".join(f"{g:.2g}" for g in gaps[:5]),
        flush=True,
    )
    for size in args.batch:
        diffs, largest = [], 0.0
        for start in range(0, len(ids), size):
            got, err = batched(model, ids[start : start + size], refs[start : start + size], args.max_tokens, eos)
            largest = max(largest, err)
            for k, tokens in enumerate(got):
                ref = refs[start + k]
                if tokens != ref.tokens:
                    at = next(
                        (j for j, (a, b) in enumerate(zip(tokens, ref.tokens)) if a != b),
                        min(len(tokens), len(ref.tokens)),
                    )
                    diffs.append(
                        {"prompt": start + k, "at": at, "gap": ref.gaps()[at] if at < len(ref.gaps()) else None}
                    )
        report["batches"][size] = {
            "differ": len(diffs),
            "of": len(ids),
            "largest_logprob_difference": largest,
            "replies": diffs,
        }
        where = ", ".join(f"prompt {d['prompt']} at token {d['at']} (gap {d['gap']:.2g})" for d in diffs) or "none"
        print(
            f"batch {size}: {len(diffs)}/{len(ids)} greedy replies differ from alone ({args.max_tokens} tokens each): "
            f"{where}; largest log-probability difference {largest:.2g}",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
