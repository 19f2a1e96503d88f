"""What a native MTP head costs per step, against the model's plain step, at
the real shape of Qwen3.5-0.8B (random weights: no real weights can be
fetched here, so nothing about acceptance is measured).

The model: mlx-lm's ``qwen3_5`` at Qwen3.5-0.8B's shape (hidden 1024, 24
layers, one full-attention layer in four: 8 query and 2 KV heads of 256,
gated delta net 16 x 128 heads, MLP 3584, vocabulary 248,320, tied),
float32; its MTP head (draft/mtp.py: ``fc``, two norms, one full-attention
decoder layer, the norm, the shared LM head) with random weights. After a
prompt of ``--context`` tokens, medians over ``--reps`` rounds (each round
times every call once, interleaved, after two warm-up rounds) of:

* **plain step**: the model's forward of one token (what plain decoding
  pays per token);
* **MTP draft at depth L** (L = 1, 2, 3): one step's drafting as the sourced
  loop runs it (draft/chain.py): the head fed the step's accepted token and
  ``g0`` with the model's hidden states (2 positions, the vocabulary
  projected for the last only), then chained ``L - 1`` times on its own
  hidden state, one beam, its cache trimmed back;
* **verify of 1 + L tokens**: the step's verify of ``g0`` and one beam of L
  drafts (step/verify.py, as the loops call it: through the hybrid's
  recurrent layers node by node);
* **causal forward of 1 + L tokens**: the same tokens as one plain forward,
  without the tree hooks (what the verify would cost if a hybrid's recurrent
  layers did not keep each node's state);
* **step at depth L** = draft + verify: the step's device work without
  acceptance and cache moves (small next to these).

Every timed call starts from the same cache (the model's cache, recurrent
state included, and the head's are put back after each call).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        .venv/bin/python bench/mtp_cost.py --out bench/results/mtp/mtp_cost.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from mlx_redrafter.doctor import report
from mlx_redrafter.draft.head import head_beams
from mlx_redrafter.draft.mtp import MTPHead
from mlx_redrafter.llm.parts import model_parts
from mlx_redrafter.step.tree import layout
from mlx_redrafter.step.verify import verify

QWEN35_08B = {
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 1024,
        "intermediate_size": 3584,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "linear_num_value_heads": 16,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "tie_word_embeddings": True,
        "mtp_num_hidden_layers": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    },
}


def build():
    """The model and its MTP head (random), laid out as ``load_model`` lays them out here."""
    from mlx_lm.utils import _get_classes

    from mlx_redrafter.llm.load import apply_dtype

    model_cls, args_cls = _get_classes(QWEN35_08B)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(json.loads(json.dumps(QWEN35_08B))))
    apply_dtype(model, "float32")
    head = MTPHead(model, "qwen3_5")
    head.update(tree_map(lambda p: 0.02 * mx.random.normal(p.shape) if p.ndim == 2 else p, head.parameters()))
    return model, apply_dtype(head, "float32")


def snapshot(caches):
    """A function putting every cache back as it is now (arrays are immutable: references suffice)."""
    saved = [copy.copy(vars(c)) for c in caches]
    saved = [{k: (list(v) if isinstance(v, list) else v) for k, v in s.items()} for s in saved]

    def rewind():
        for c, s in zip(caches, saved):
            c.__dict__.update({k: (list(v) if isinstance(v, list) else v) for k, v in s.items()})

    return rewind


def time_ms(fn, rewind) -> float:
    """One timed call of ``fn`` from the rewound cache, evaluated."""
    rewind()
    tic = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - tic) * 1000


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model, head = build()
    _, backbone, lm_head = model_parts(model)
    cache, head_cache = model.make_cache(), head.make_cache()
    prompt = mx.random.randint(0, 248320, (1, args.context)).astype(mx.int32)
    hidden = backbone(prompt, cache=cache)
    head(prompt[:, 1:], hidden[:, :-1], head_cache, first=True)
    mx.eval([c.state for c in cache + head_cache])
    rewind = snapshot(cache + head_cache)
    g0 = mx.array([[7]], mx.int32)
    feats = hidden[:, -2:]
    out = {"machine": report(), "context": args.context, "reps": args.reps, "config": QWEN35_08B}
    out["load_average"] = os.getloadavg()

    def draft(depth):
        logits, hid = head(mx.array([[5, 7]], mx.int32), feats, head_cache, first=True, last=True)
        beams, written = head_beams(head, logits[0, -1], hid[0, -1], head_cache, 1, depth)
        for c in head_cache if written else ():
            c.trim(written)
        return beams.tokens

    def chain(depth):  # the step's verify of one beam, as the loops call it (hybrid layers included)
        tree = layout((depth,)).tree(mx.array([[3] * depth], mx.int32), mx.array(7, mx.int32))
        logits, _ = verify(model, backbone, lm_head, cache, tree, chain=True)
        return logits

    # Interleaved: every round times each call once, so a busy machine slows them alike.
    calls = {"plain": lambda: lm_head(backbone(g0, cache=cache))}
    calls.update({f"draft{d}": (lambda d=d: draft(d)) for d in (1, 2, 3)})
    calls.update({f"chain{d}": (lambda d=d: chain(d)) for d in (1, 2, 3)})
    calls.update(  # the same tokens as one causal forward (what a verify would cost without tree hooks)
        {
            f"forward{d}": (lambda d=d: lm_head(backbone(mx.array([[7] + [3] * d], mx.int32), cache=cache)))
            for d in (1, 2, 3)
        }
    )
    times = {k: [] for k in calls}
    for round_ in range(args.reps + 2):
        for name, fn in calls.items():
            ms = time_ms(fn, rewind)
            if round_ >= 2:  # two warm-up rounds
                times[name].append(ms)
    med = {k: float(np.median(v)) for k, v in times.items()}
    out["plain_ms"] = med["plain"]
    out["rows"] = [
        {
            "depth": d,
            "draft_ms": med[f"draft{d}"],
            "verify_ms": med[f"chain{d}"],
            "causal_forward_ms": med[f"forward{d}"],
            "step_ms": med[f"draft{d}"] + med[f"chain{d}"],
        }
        for d in (1, 2, 3)
    ]
    out["samples_ms"] = times
    rows = out["rows"]
    plain = out["plain_ms"]
    print(f"plain step {plain:.1f} ms (context {args.context})")
    print("depth | MTP draft ms (x plain) | verify 1+L ms (x plain) | causal forward 1+L (x plain) | step (x plain)")
    for r in rows:
        cells = [r[k] for k in ("draft_ms", "verify_ms", "causal_forward_ms", "step_ms")]
        print(f"{r['depth']} | " + " | ".join(f"{v:.1f} ({v / plain:.2f})" for v in cells))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
