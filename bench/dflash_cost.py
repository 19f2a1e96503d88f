"""What a DFlash drafter costs per step, against the model's plain step, at
the real shape of Qwen3.5-0.8B (random weights: no real weights can be
fetched here, so nothing about acceptance is measured).

The model: bench/mtp_cost.py's (mlx-lm's ``qwen3_5`` at Qwen3.5-0.8B's
shape, float32). The drafter (draft/dflash.py) at the target's width (1024,
8 query and 2 KV heads of 128, MLP 3584, five taps), with 1, 3 or 5 layers,
random weights; its LM head is the target's (248,320 rows) or, as vLLM
speculators' checkpoints have it, its own reduced one (``--draft-vocab``
rows). After a prompt of ``--context`` tokens, medians over ``--reps``
rounds (every call once per round, interleaved, after two warm-up rounds) of:

* **plain step**: the model's forward of one token;
* **DFlash draft of L** (a block of ``L + 1``): one step's drafting as the
  sourced loop runs it (draft/dflash_chain.py): the context of the step's
  two accepted positions appended, the block forward, its L positions'
  logits and the one row's argmax;
* **verify of 1 + L**: the step's verify of ``g0`` and the block as one
  chain (step/verify.py, through the hybrid's recurrent layers);
* **step** = draft + verify.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        .venv/bin/python bench/dflash_cost.py --out bench/results/dflash/dflash_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mtp_cost import build, snapshot, time_ms

from mlx_redrafter.doctor import report
from mlx_redrafter.draft.dflash import DFlashConfig, DFlashDrafter
from mlx_redrafter.draft.dflash_chain import BlockChain
from mlx_redrafter.llm.parts import model_parts
from mlx_redrafter.step.tree import layout
from mlx_redrafter.step.verify import verify

TAPS = (1, 6, 11, 16, 21)  # z-lab's spacing of five taps over 24 layers (build_target_layer_ids)


def drafter(model, layers: int, block: int, draft_vocab=None) -> DFlashDrafter:
    config = DFlashConfig(
        hidden_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=3584,
        vocab_size=248320,
        target_layer_ids=TAPS,
        mask_token_id=248077,
        block_size=block,
        draft_vocab_size=draft_vocab,
    )
    mx.random.seed(layers)
    d = DFlashDrafter(config)
    d.update(tree_map(lambda p: 0.02 * mx.random.normal(p.shape) if p.ndim == 2 else p, d.parameters()))
    d.set_dtype(mx.float32)
    mx.eval(d.parameters())
    return d.bind(model)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", default="1,3,5")
    ap.add_argument("--lengths", default="3,7,15")
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model, _ = build()
    layers = [int(x) for x in args.layers.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    _, backbone, lm_head = model_parts(model)
    wide = model_parts(model, list(TAPS))[1]
    cache = model.make_cache()
    prompt = mx.random.randint(0, 248320, (1, args.context)).astype(mx.int32)
    taps = wide(prompt, cache=cache)
    chains = {}
    for n in layers:
        for vocab in (None, args.draft_vocab):
            c = BlockChain(drafter(model, n, max(lengths) + 1, vocab), 1, max(lengths))
            c.cache = c.make_cache()
            c.head.context(taps[:, :-2], c.cache)
            chains[(n, vocab)] = c
    mx.eval([c.state for c in cache] + [lc.state for ch in chains.values() for lc in ch.cache])
    rewind = snapshot(cache + [lc for ch in chains.values() for lc in ch.cache])
    step_taps = taps[0, -2:]  # the step's two accepted positions
    g0 = mx.array([[7]], mx.int32)

    def draft(c, length):
        c.length = length
        c.extend([5, 7], step_taps)
        return c.draft(7).tokens

    def chain(length):
        tree = layout((length,)).tree(mx.array([[3] * length], mx.int32), mx.array(7, mx.int32))
        return verify(model, backbone, lm_head, cache, tree, chain=True)[0]

    calls = {"plain": lambda: lm_head(backbone(g0, cache=cache))}
    for (n, vocab), c in chains.items():
        for length in lengths:
            calls[f"draft n{n} v{vocab or 'full'} L{length}"] = lambda c=c, length=length: draft(c, length)
    calls.update({f"verify L{length}": (lambda length=length: chain(length)) for length in lengths})
    times = {k: [] for k in calls}
    for round_ in range(args.reps + 2):
        for name, fn in calls.items():
            ms = time_ms(fn, rewind)
            if round_ >= 2:
                times[name].append(ms)
    med = {k: float(np.median(v)) for k, v in times.items()}
    plain = med["plain"]
    out = {"machine": report(), "context": args.context, "reps": args.reps, "load_average": os.getloadavg()}
    out["plain_ms"], out["rows"] = plain, []
    print(f"plain step {plain:.1f} ms (context {args.context}, load {os.getloadavg()[0]:.1f})")
    print("layers | LM head | L | draft ms (x plain) | verify 1+L ms (x plain) | step (x plain)")
    for n, vocab in chains:
        for length in lengths:
            d, v = med[f"draft n{n} v{vocab or 'full'} L{length}"], med[f"verify L{length}"]
            row = {"layers": n, "lm_head_rows": vocab or 248320, "length": length, "draft_ms": d, "verify_ms": v}
            out["rows"].append(row)
            head = f"{vocab} rows" if vocab else "target's"
            print(f"{n} | {head} | {length} | {d:.1f} ({d / plain:.2f}) | {v:.1f} ({v / plain:.2f}) | "
                  f"{d + v:.1f} ({(d + v) / plain:.2f})")  # fmt: skip
    out["samples_ms"] = times
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
