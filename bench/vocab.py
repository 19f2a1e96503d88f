"""Draft vocabulary size: coverage against cost.

A reduced draft vocabulary is the distilled replies' most frequent tokens. For
4k, 8k and 16k (and the full vocabulary) this reports the share of tokens it
covers in the distilled data and in the LLM's greedy MT-Bench replies (a
draft can only be right where the token is inside), the drafter's head
parameters, and the measured time of one beam search (W=2, L=3) of a drafter
with that head, next to one plain decode step timed in the same run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 .venv/bin/python bench/vocab.py \\
        --data runs/distill-v2 --out bench/results/vocab
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_redrafter import load_model
from mlx_redrafter.draft.redrafter import Drafter, DrafterConfig
from mlx_redrafter.llm.cache import warm_cache
from mlx_redrafter.llm.parts import model_parts
from mlx_redrafter.train.examples import choose_draft_vocab, reply_tokens
from mlx_redrafter.train.shards import read_corpus
from mlx_redrafter.tuning.cost import median_ms

SIZES = (4096, 8192, 16384, None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument(
        "--replies",
        type=Path,
        default=Path("bench/out/acceptance/replies.safetensors"),
        help="MT-Bench replies cached by bench/acceptance.py",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/out/vocab"))
    args = ap.parse_args()
    model, tok = load_model("default")
    embed, backbone, head = model_parts(model)
    vocab, hidden = embed.weight.shape
    corpus = read_corpus(args.data)
    distilled = reply_tokens(corpus)  # the drafter drafts replies: prompts' text does not count
    mt = np.array(mx.load(str(args.replies))["tokens"])
    cache, rewind = warm_cache(model, backbone)

    def plain():
        mx.eval(mx.argmax(head(backbone(mx.array([[1]]), cache=cache)), -1))

    plain_ms = median_ms(plain, 30, after=rewind)
    rows = []
    for size in SIZES:
        ids = choose_draft_vocab(distilled, size, vocab, always=sorted(tok.eos_token_ids)) if size else np.arange(vocab)
        inside = np.zeros(vocab, bool)
        inside[ids] = True
        mx.random.seed(0)
        d = Drafter(
            DrafterConfig(
                vocab_size=vocab, hidden_size=hidden, exit_dim=hidden, num_draft_layers=1, draft_vocab_size=size
            )
        )
        d.set_dtype(mx.float32)
        mx.eval(d.parameters())
        ctx, g0 = mx.random.normal((hidden,)), mx.array(42, mx.int32)
        beam_ms = median_ms(lambda: mx.eval(d.draft(embed, ctx, g0, 2, 3).tokens), 30)
        rows.append(
            {
                "draft_vocab": size or vocab,
                "distilled_coverage": round(float(inside[distilled].mean()), 4),
                "mt_bench_coverage": round(float(inside[mt].mean()), 4),
                "head_params": (size or vocab) * hidden,
                "beam_W2L3_ms": round(beam_ms, 2),
                "plain_step_ms": round(plain_ms, 2),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "LD_PRELOAD=... .venv/bin/python " + " ".join(sys.argv)
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "command": command,
                "distilled_tokens": int(len(distilled)),
                "mt_bench_tokens": int(len(mt)),
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    lines = [
        f"`{command}`",
        "",
        f"Distilled reply tokens: {len(distilled)}; MT-Bench greedy reply tokens: {len(mt)}; "
        f"one plain decode step: {plain_ms:.1f} ms.",
        "",
        "| draft vocabulary | distilled coverage | MT-Bench coverage | head parameters | beam search W=2 L=3, ms |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['draft_vocab']} | {r['distilled_coverage']:.3f} | {r['mt_bench_coverage']:.3f} | "
            f"{r['head_params'] / 1e6:.1f}M | {r['beam_W2L3_ms']:.1f} |"
        )
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
