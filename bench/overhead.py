"""Per-step cost of ReDrafter's phases against plain decoding, in one run.

Uses a random drafter (its drafts are never accepted, so every step verifies
a full tree and no KV rows move): this measures pure overhead, not speedup. Phases are timed with
``profile=True`` (one extra sync per phase); the plain-decoding time per token
is measured with mlx-lm's own ``stream_generate`` in the same process
(on the same templated prompt),
before and after the grid, and the ratios use their mean.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        .venv/bin/python bench/overhead.py --tokens 48
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np
from mlx_lm import stream_generate as mlx_stream_generate

from mlx_redrafter import load_model
from mlx_redrafter.doctor import report
from mlx_redrafter.drafter import Drafter, DrafterConfig
from mlx_redrafter.generate import DraftConfig
from mlx_redrafter.measure import measure
from mlx_redrafter.prompts import build_messages, chat_prompt_ids, render_messages

PROMPT = "Write a short story about a robot who learns to paint."
HEADS = {
    "official default (E=1152, 2 layers, full vocab)": dict(exit_dim=1152, num_draft_layers=2),
    "shipped preset (E=576, 1 layer, 4096-token vocab)": dict(exit_dim=576, num_draft_layers=1, draft_vocab_size=4096),
}


def plain_ms_per_token(model, tok, prompt, n):
    tic, count = None, 0
    for r in mlx_stream_generate(model, tok, prompt, max_tokens=n):
        if tic is None:
            tic = time.perf_counter()  # exclude the prompt
        else:
            count += 1
    return 1000 * (time.perf_counter() - tic) / max(count, 1)


def step_phases(model, ids, drafter, width, length, n):
    run = measure(model, ids, draft=DraftConfig(drafter, width, length), max_tokens=n, profile=True)
    s = run.steps[2:]  # skip the prefill step and the first (warm-up) step
    med = lambda xs: float(np.median(xs)) * 1000  # noqa: E731
    out = {
        "step_ms": med([x.step_time for x in s]),
        "draft_ms": med([x.draft_time for x in s]),
        "pack_ms": med([x.pack_time for x in s]),
        "verify_ms": med([x.verify_time for x in s]),
        "accept_ms": med([x.accept_time for x in s]),
        "tree_size": float(np.mean([x.tree_size for x in s])),
    }
    out["other_ms"] = out["step_ms"] - sum(out[k] for k in ("draft_ms", "pack_ms", "verify_ms", "accept_ms"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--grid", default="1x2,1x4,2x4,4x4,4x5")
    ap.add_argument("--out", default=None, help="write JSON results here")
    args = ap.parse_args()
    model, tok = load_model("default")
    messages = build_messages(None, [], PROMPT)
    prompt, ids = render_messages(tok, messages), chat_prompt_ids(tok, messages)
    grid = [tuple(int(v) for v in cell.split("x")) for cell in args.grid.split(",")]
    base = [plain_ms_per_token(model, tok, prompt, args.tokens)]
    rows = []
    for name, kw in HEADS.items():
        mx.random.seed(0)
        d = Drafter(DrafterConfig(vocab_size=model.args.vocab_size, hidden_size=model.args.hidden_size, **kw))
        mx.eval(d.parameters())
        for w, l in grid:
            r = step_phases(model, ids, d, w, l, args.tokens)
            rows.append({"head": name, "params_M": round(d.num_params() / 1e6, 1), "W": w, "L": l, **r})
    base.append(plain_ms_per_token(model, tok, prompt, args.tokens))
    plain = float(np.mean(base))
    print(f"plain mlx-lm decoding: {plain:.1f} ms/token (runs: {', '.join(f'{b:.1f}' for b in base)})")
    print("| head | W | L | tree | step ms | break-even tokens/step | draft | pack | verify | accept | other |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['head']} | {r['W']} | {r['L']} | {r['tree_size']:.0f} | {r['step_ms']:.1f} | {r['step_ms'] / plain:.2f} | "
            f"{r['draft_ms']:.1f} | {r['pack_ms']:.1f} | {r['verify_ms']:.1f} | {r['accept_ms']:.1f} | {r['other_ms']:.1f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": report(), "plain_ms_per_token": base, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
