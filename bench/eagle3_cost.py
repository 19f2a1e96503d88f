"""What an EAGLE-3 head's draft call costs against the model's own decode step,
for several head sizes (issue 45: the head's size is chosen per model and
measured here).

A step of EAGLE-3 drafting makes two kinds of head call: the *commit* call
over the positions the target just accepted (their taps; 2 here, one accepted
draft and the target's own token) and one *chained* call per further depth,
one token per beam over the head's KV cache. Both are timed (median ms, after
a context of ``--context`` positions), next to one plain decode step of the
model in the same run, with the analytic share of multiply-accumulates
(parameters used per token) beside them.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        .venv/bin/python bench/eagle3_cost.py --model default
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from mlx_redrafter import load_model
from mlx_redrafter.draft.eagle3 import Eagle3Head
from mlx_redrafter.llm.cache import warm_cache
from mlx_redrafter.llm.parts import model_parts
from mlx_redrafter.train.eagle3_trainer import MLP_RATIO, Eagle3TrainConfig, head_config
from mlx_redrafter.tuning.cost import decode_step_cost, median_ms


def head_macs(head: Eagle3Head) -> int:
    """Parameters one token uses in a chained call (fc left out: the commit call alone uses it)."""
    from mlx.utils import tree_flatten

    skip = ("embed_tokens.weight", "d2t", "fc.weight")
    return sum(v.size for k, v in tree_flatten(head.parameters()) if k not in skip)


def time_head(model, config, context: int, width: int, repeats: int) -> dict:
    head = Eagle3Head(config, own_embedding=False).bind(model)
    head.set_dtype(mx.float32)
    mx.eval(head.parameters())
    h = config.hidden_size
    cache = head.make_cache()
    mx.eval(head(mx.zeros((1, context), mx.int32), mx.zeros((1, context, 3 * h)), cache, first=True))

    def rewind():
        for c in cache:
            c.trim(c.offset - context)

    commit = median_ms(
        lambda: mx.eval(head(mx.zeros((1, 2), mx.int32), mx.zeros((1, 2, 3 * h)), cache, first=True)),
        repeats,
        after=rewind,
    )
    beams = head.make_cache()  # each beam's copy of the context, as the beam search makes them
    mx.eval(head(mx.zeros((width, context), mx.int32), mx.zeros((width, context, 3 * h)), beams, first=True))
    state = mx.zeros((width, 1, h))

    def chained():
        logits, hid = head(mx.zeros((width, 1), mx.int32), state, beams, first=False)
        mx.eval(logits, hid)

    def rewind_beams():
        for c in beams:
            c.trim(c.offset - context)

    chain = median_ms(chained, repeats, after=rewind_beams)
    return {"commit_ms": commit, "chained_ms": chain, "macs": head_macs(head)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    model, _ = load_model(args.model)
    embed, backbone, lm_head = model_parts(model)
    vocab, h = int(embed.weight.shape[0]), int(model.args.hidden_size)
    cache, rewind = warm_cache(model, backbone, args.context)
    plain = median_ms(lambda: mx.eval(lm_head(backbone(mx.array([[1]]), cache=cache))), args.repeats, after=rewind)
    decode = decode_step_cost(model).macs
    inter = int(getattr(model.args, "intermediate_size", 4 * h))
    rows = []
    for mlp in sorted({inter, int(MLP_RATIO * h), h}, reverse=True):
        for dv in (4096, 8192):
            config = head_config(model, vocab, Eagle3TrainConfig(intermediate_size=mlp, draft_vocab_size=dv))
            t = time_head(model, config, args.context, args.width, args.repeats)
            rows.append(
                {
                    "intermediate": mlp,
                    "draft_vocab": dv,
                    "macs_share": round(t["macs"] / decode, 4),
                    "commit_vs_plain": round(t["commit_ms"] / plain, 3),
                    "chained_vs_plain": round(t["chained_ms"] / plain, 3),
                    **{k: round(v, 2) for k, v in t.items() if k.endswith("_ms")},
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"plain_ms": round(plain, 2), "model": args.model, "width": args.width, "context": args.context}))
    print("| MLP | draft vocab | MACs / decode step | commit call / plain step | chained call (W beams) / plain step |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['intermediate']} | {r['draft_vocab']} | {r['macs_share']:.3f} | {r['commit_vs_plain']:.2f} "
            f"({r['commit_ms']:.1f} ms) | {r['chained_vs_plain']:.2f} ({r['chained_ms']:.1f} ms) |"
        )
    print(f"plain step {plain:.1f} ms; median of {args.repeats}, context {args.context}, W={args.width}")


if __name__ == "__main__":
    main()
