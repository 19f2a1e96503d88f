"""What a draft tree costs on a hybrid model (issue 43), against the model's own chain.

A random model of Qwen3.5-0.8B's shape (24 layers, hidden 1024, three gated
delta net layers to one attention layer, GDN 16 x 128 heads, vocabulary
248320, tied, float32; random weights: only costs are measured). After
``--context`` tokens of context, each a median of ``--reps`` synchronous
calls (build + eval), as ratios of one plain token's forward:

- chain(N): the model's own forward over N new tokens (mlx-lm's layers, no hooks);
- tree(N):  a verify call over a tree of N tokens (g0, then rows of up to 4
  tokens), every recurrent layer through step/mixers.py;
- hooked chain(N): a single path of N tokens through the same hooks (W=1);
- the W=1 L=1 step: a generation whose drafts are never accepted (a random
  drafter), per step, against plain decoding (per token), end to end;
- the memory each tree node's recurrent states take while a tree is verified.

Run on a quiet machine, BLIS preloaded:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        .venv/bin/python bench/hybrid_cost.py --out bench/out/hybrid_cost.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from mlx_lm.utils import _get_classes

from mlx_redrafter.config import DraftConfig
from mlx_redrafter.draft.redrafter import Drafter, DrafterConfig
from mlx_redrafter.generate import generate_tokens
from mlx_redrafter.llm.cache import rewinder
from mlx_redrafter.llm.parts import model_parts
from mlx_redrafter.llm.recurrent import recurrent_leaves
from mlx_redrafter.step.tree import Tree, layout
from mlx_redrafter.step.verify import tree_hooks

QWEN35_08B = dict(
    model_type="qwen3_5",
    text_config=dict(
        model_type="qwen3_5_text",
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        rms_norm_eps=1e-6,
        full_attention_interval=4,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        max_position_embeddings=262144,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_theta=10000000.0, partial_rotary_factor=0.25, rope_type="default"),
    ),
)


def random_model(config: dict):
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    model.update(tree_map(lambda p: p * 0.02 if p.ndim == 2 else p, model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def tree_of(n: int, rows_of: int = 4) -> Tree:
    """``n`` tokens: g0, then rows of up to ``rows_of`` tokens (the loops' shapes)."""
    tokens = mx.arange(n, dtype=mx.int32) % 1000 + 1
    rows, left = [], n - 1
    while left > 0:
        rows.append(min(rows_of, left))
        left -= rows[-1]
    lay = layout(tuple(rows))
    return Tree(tokens, lay.depth, lay.parent, lay.node_index, lay.mask, levels=max(rows) + 1, host=lay.host)


def median_s(call, reps: int) -> float:
    call()  # shapes compiled, buffers allocated
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        call()
        times.append(time.perf_counter() - tic)
    return sorted(times)[len(times) // 2]


def forward_costs(model, context: int, sizes, reps: int) -> dict:
    """Seconds of each call kind at each size, after ``context`` tokens."""
    _, backbone, head = model_parts(model)
    cache = make_prompt_cache(model)
    mx.eval(backbone(mx.arange(context)[None] % 1000, cache=cache))
    rewind = rewinder(cache)

    def own(n):
        def call():
            mx.eval(head(backbone(mx.arange(n)[None] % 1000 + 1, cache=cache)))
            rewind()

        return call

    def hooked(tree, chain):
        def call():
            with tree_hooks(model, cache, tree, chain=chain):
                out = head(backbone(tree.tokens[None], cache=cache))
            mx.eval(out, [c.pending for c in recurrent_leaves(cache)])
            rewind()

        return call

    out = {"chain": {}, "tree": {}, "tree_padded": {}, "hooked_chain": {}}
    for n in sizes:
        out["chain"][n] = median_s(own(n), reps)
        if n > 1:
            tree = tree_of(n)
            out["tree"][n] = median_s(hooked(tree, False), reps)
            # The same tree with its shape unknown to the host (a packed or selected tree): one padded call.
            out["tree_padded"][n] = median_s(hooked(dataclasses.replace(tree, host=None), False), reps)
            out["hooked_chain"][n] = median_s(hooked(tree_of(n, rows_of=n), True), reps)
    return out


def state_bytes_per_node(model) -> int:
    """Bytes of every recurrent layer's state for one tree node (conv window + recurrent state)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2]]), cache=cache))
    return sum(e.nbytes for c in cache if isinstance(c, ArraysCache) for e in c.cache if e is not None)


def never_accepted_step(model, tokens: int, reps: int) -> dict:
    """Per-token seconds of plain decoding and per-step seconds of W=1 L=1 with
    a random drafter (never accepted: one token a step), interleaved."""
    hidden, vocab = 1024, 248320
    mx.random.seed(1)
    drafter = Drafter(DrafterConfig(vocab_size=vocab, hidden_size=hidden, exit_dim=256, num_draft_layers=1))
    drafter.draft_vocab = mx.arange(4096, dtype=mx.int32)
    mx.eval(drafter.parameters())
    prompt = list(range(1, 257))
    w1l1 = DraftConfig(drafter, 1, 1)
    totals = {"plain": 0.0, "w1l1": 0.0}
    steps = 0
    generate_tokens(model, prompt, max_tokens=4)
    generate_tokens(model, prompt, draft=w1l1, max_tokens=4)
    for _ in range(reps):  # each run's first token (the prompt's prefill) is timed apart and left out
        for name, draft in (("plain", None), ("w1l1", w1l1)):
            tic = time.perf_counter()
            generate_tokens(model, prompt, draft=draft, max_tokens=1)
            first = time.perf_counter() - tic
            tic = time.perf_counter()
            _, stats = generate_tokens(model, prompt, draft=draft, max_tokens=tokens + 1)
            totals[name] += time.perf_counter() - tic - first
        steps += len(stats) - 1
    per_token = totals["plain"] / (reps * tokens)
    return {"plain_ms_per_token": 1000 * per_token, "w1l1_step_over_plain": totals["w1l1"] / steps / per_token}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per generation of the W=1 L=1 comparison")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model = random_model(QWEN35_08B)
    sizes = [int(s) for s in a.sizes.split(",")]
    costs = forward_costs(model, a.context, sizes, a.reps)
    base = costs["chain"][1]
    print(f"random Qwen3.5-0.8B shape, float32, after {a.context} tokens: 1 token {1000 * base:.0f} ms")
    print("N | chain (mlx-lm) | tree, by depth | tree, padded | chain (hooks) | tree / chain")
    for n in sizes[1:]:
        c, t, h = costs["chain"][n] / base, costs["tree"][n] / base, costs["hooked_chain"][n] / base
        p = costs["tree_padded"][n] / base
        print(f"{n} | {c:.2f} | {t:.2f} | {p:.2f} | {h:.2f} | {t / c:.2f}")
    per_node = state_bytes_per_node(model)
    print(
        f"recurrent state per tree node: {per_node / 2**20:.2f} MiB (a tree of 8 nodes: {8 * per_node / 2**20:.1f} MiB)"
    )
    step = never_accepted_step(model, a.tokens, max(1, a.reps // 2))
    print(
        f"plain decoding {step['plain_ms_per_token']:.0f} ms/token; W=1 L=1 never accepted: "
        f"{step['w1l1_step_over_plain']:.2f} plain steps per step"
    )
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"costs": costs, "state_bytes_per_node": per_node, **step}, indent=1))


if __name__ == "__main__":
    main()
