"""Distillation throughput: decode tokens/s of the distiller's batch at several
batch sizes, and the cost of keeping soft targets.

For each batch size the distiller's batch is filled with ShareGPT prompts
(each prefilled alone, as ``distill`` does), grown by 20 decode steps, then 30
decode steps are timed. Separately, on random ``[48, V]`` logits: the top-k
as probabilities (a softmax over the full vocabulary) against the top-k
logits alone (what ``distill --top-k`` keeps).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 .venv/bin/python bench/distill.py \\
        --batch-sizes 48,96,160
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from mlx_redrafter.llm.load import load_model
from mlx_redrafter.prompts import default_training_prompts, read_conversations
from mlx_redrafter.train.distill import DistillConfig, Distiller, _messages
from mlx_redrafter.tuning.cost import median_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="48,96,160")
    ap.add_argument("--top-k", type=int, default=16)
    args = ap.parse_args()
    model, tok = load_model("default")
    convs = read_conversations(default_training_prompts())
    for B in map(int, args.batch_sizes.split(",")):
        d = Distiller(
            model,
            tok,
            DistillConfig(batch_size=B, max_new_tokens=10_000, top_k=args.top_k, stop_loops=0, prompt_positions=False),
        )
        items = [(c, 0, _messages(c, 0, [], None)) for c in convs[:B]]
        items = [it for it in items if len(d.encode(it[2])) < 384][:B]
        tic = time.perf_counter()
        d._prefill(items)
        prefill = time.perf_counter() - tic
        for _ in range(20):
            d.step()
        tic, n = time.perf_counter(), 30
        for _ in range(n):
            d.step()
        dt = time.perf_counter() - tic
        print(
            f"batch {len(d.rows)}: prefill {prefill / len(items):.2f} s per prompt, "
            f"decode step {1000 * dt / n:.0f} ms, {len(d.rows) * n / dt:.0f} tokens/s",
            flush=True,
        )
    logits = mx.random.normal((48, model.args.vocab_size))
    mx.eval(logits)
    k = args.top_k

    def probs():
        top = mx.argpartition(logits, -k, axis=-1)[:, -k:]
        mx.eval(top, mx.take_along_axis(mx.softmax(logits, axis=-1), top, axis=-1))

    def raw():
        top = mx.argpartition(logits, -k, axis=-1)[:, -k:]
        mx.eval(top, mx.take_along_axis(logits, top, axis=-1))

    def argmax():
        mx.eval(mx.argmax(logits, axis=-1))

    print(
        f"top-{k} of [48, {model.args.vocab_size}] logits: as probabilities {median_ms(probs):.1f} ms, "
        f"as logits {median_ms(raw):.1f} ms, argmax alone {median_ms(argmax):.1f} ms"
    )


if __name__ == "__main__":
    main()
