"""Does ``mx.compile`` pay for the step's small fixed-shape pieces? Each piece is
built and evaluated alone, eagerly and compiled, on the default model's
shapes (the shipped drafter's beam search, greedy acceptance over a default
tree with a lookup row, the unpacked tree's tokens); median of 200 calls.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 .venv/bin/python bench/compile.py
"""

from __future__ import annotations

import time

import mlx.core as mx

from mlx_redrafter import load_model
from mlx_redrafter.hub.load import load_drafter
from mlx_redrafter.llm.parts import model_parts
from mlx_redrafter.runtime import shipped_drafter_path
from mlx_redrafter.step.accept import accept_greedy
from mlx_redrafter.step.tree import layout


def median_ms(f, n: int = 200) -> float:
    for _ in range(5):
        mx.eval(f())
    times = []
    for _ in range(n):
        tic = time.perf_counter()
        mx.eval(f())
        times.append(time.perf_counter() - tic)
    return sorted(times)[n // 2] * 1000


def main():
    model, _ = load_model("default")
    embed, _, _ = model_parts(model)
    drafter = load_drafter(shipped_drafter_path("default"))
    mx.random.seed(0)
    context, g0 = mx.random.normal((model.args.hidden_size,)), mx.array(42, mx.int32)
    print("| piece | eager ms | compiled ms |")
    print("|---|---|---|")
    for w, l in ((1, 1), (2, 1), (2, 3)):

        def eager(w=w, l=l):
            return drafter.draft(embed, context, g0, w, l).tokens

        compiled = mx.compile(lambda c, g, w=w, l=l: drafter.draft(embed, c, g, w, l).tokens)
        print(f"| beam search W={w} L={l} | {median_ms(eager):.2f} | {median_ms(lambda: compiled(context, g0)):.2f} |")
    lay = layout((1, 1, 4))  # the default tree: two one-token beams and a lookup row
    beams = mx.array([[5, -1, -1, -1], [6, -1, -1, -1], [7, 8, 9, 10]], mx.int32)
    logits = mx.random.normal((lay.size, model.args.vocab_size))

    def accept(b, lg):
        a = accept_greedy(b, lay.node_index, lg)
        return mx.concatenate([mx.stack([a.n, a.beam, a.next_token]), a.path, b[a.beam]])

    c_accept = mx.compile(accept)
    print(
        f"| greedy acceptance, tree of 7 | {median_ms(lambda: accept(beams, logits)):.2f} | "
        f"{median_ms(lambda: c_accept(beams, logits)):.2f} |"
    )
    c_tree = mx.compile(lambda b, g: lay.tree(b, g).tokens)
    print(
        f"| unpacked tree tokens | {median_ms(lambda: lay.tree(beams, g0).tokens):.2f} | "
        f"{median_ms(lambda: c_tree(beams, g0)):.2f} |"
    )


if __name__ == "__main__":
    main()
