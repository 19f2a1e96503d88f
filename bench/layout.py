"""The CPU's weight layout (mlx_redrafter/llm/layout.py): the float weights
row-major, as ``mlx_lm.load`` leaves them, against column-major, as
``load_model`` lays them out on the CPU; the same values, in one run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        python bench/layout.py --num-prompts 6 --max-tokens 128

Two measurements (``--forward-only``: the first alone):

* **a forward** of 1 to 4 tokens after 200 tokens of context (the median of
  ``--reps`` calls, the cache rewound after each): what a plain step and a
  tree of 2-4 tokens cost in each layout;
* **decoding** of MT-Bench first turns, four modes per prompt, their order
  rotating from one prompt to the next: plain mlx-lm decoding
  (``mlx_lm.stream_generate``) and the defaults drafting every step
  (``always_draft=True``: the same schedule in both layouts), each on the
  row-major and on the column-major model. Tokens per second after the
  first token; every mode's tokens are checked identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from never_slower import _clear_state, _tokens_per_second, measure  # noqa: E402


def row_major_copy(model):
    """``model`` with every weight back in row-major order (what ``mlx_lm.load`` gives)."""
    import copy

    other = copy.deepcopy(model)
    for _, m in other.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            m.weight = mx.contiguous(m.weight)
            mx.eval(m.weight)
    return other


def forward_ms(model, sizes=(1, 2, 3, 4), reps: int = 40, context: int = 200) -> dict:
    """Median milliseconds of one forward of ``n`` tokens after ``context`` tokens, per ``n``."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([list(range(100, 100 + context))]), cache=cache)
    mx.eval([c.state for c in cache])
    out = {}
    for n in sizes:
        tokens, times = mx.array([list(range(1000, 1000 + n))]), []
        for _ in range(reps + 5):
            tic = time.perf_counter()
            mx.eval(model(tokens, cache=cache))
            times.append(time.perf_counter() - tic)
            for c in cache:
                c.offset = context
        out[n] = sorted(times[5:])[reps // 2] * 1e3
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--forward-only", action="store_true", help="time the forwards, not decoding")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    import mlx_lm

    from mlx_redrafter import load_model, stream_generate
    from mlx_redrafter.prompts import first_turn_ids, load_prompt_set

    col, tok = load_model(args.model)
    row = row_major_copy(col)
    forward = {name: forward_ms(m, reps=args.reps) for name, m in (("row", row), ("column", col))}
    for name, ms in forward.items():
        print(
            f"{name}-major forward, ms (of one token's): "
            + ", ".join(f"{n}: {v:.1f} ({v / ms[1]:.2f})" for n, v in ms.items())
        )

    if args.forward_only:
        return _write(args.out, argv, {"forward_ms": forward})
    prompts = first_turn_ids(tok, load_prompt_set("mt_bench")[: args.num_prompts])
    _clear_state()
    texts = {}

    def mode(name, model, drafted):
        def run(prompt):
            gen = (
                stream_generate(model, tok, prompt, max_tokens=args.max_tokens, always_draft=True)
                if drafted
                else mlx_lm.stream_generate(model, tok, prompt, max_tokens=args.max_tokens)
            )
            for r in gen:
                texts.setdefault(name, []).append(r.token)
                yield r

        return run, None

    modes = {
        "plain": mode("plain", row, False),
        "plain-column": mode("plain-column", col, False),
        "always": mode("always", row, True),
        "always-column": mode("always-column", col, True),
    }
    result = measure(modes, prompts, _tokens_per_second)
    same = len({tuple(v) for v in texts.values()}) == 1
    tps = result["tokens_per_second"]
    print(
        f"decoding, tok/s: plain {tps['plain']:.1f} | plain, column-major {tps['plain-column'] / tps['plain']:.3f}x | "
        f"always drafting {tps['always'] / tps['plain']:.3f}x | always, column-major "
        f"{tps['always-column'] / tps['plain-column']:.3f}x of plain column-major, "
        f"{tps['always-column'] / tps['always']:.3f}x of always row-major | tokens identical: {same}"
    )
    _write(args.out, argv, {"forward_ms": forward, **result, "tokens_identical": same})
    return 0 if same else 1


def _write(out, argv, report: dict) -> int:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(["bench/layout.py", *(sys.argv[1:] if argv is None else argv)])
        out.write_text(json.dumps({"command": command, **report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
