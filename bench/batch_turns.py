"""A chat's second turn in a drafting batch with a draft model (issue 57):
each row joins on the cache its first turn left, with the draft model's
caches the first turn left after the model's (``kept``: what
``BatchSteps`` takes since commit ``aad79f5``) or without them (``anew``:
the draft model sees the second turn alone, as before).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        python bench/batch_turns.py --rows 4 --max-tokens 48

The default model and a draft model made of its own first ``--draft-layers``
of 30 layers (3 tokens), every step verifying every node it drafts (``always_draft``,
the batch's width held to the widest: the acceptance is the point, not the
speed, which on this CPU a draft model does not pay); MT-Bench conversations, the first turn decoded
in one batch, each row's second turn (the conversation's, after the first
reply) joining a new batch on that row's cache. Reports the draft model's
accepted tokens over those it verified in the second turns and whether both
modes gave every row the same tokens. Greedy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlx_redrafter.config import DraftConfig, SamplingConfig
from mlx_redrafter.llm.cache import target_size
from mlx_redrafter.llm.recurrent import snapshot
from mlx_redrafter.prompts import first_turn_ids, load_prompt_set
from mlx_redrafter.runtime import load_runtime
from mlx_redrafter.step import batched
from mlx_redrafter.step.batched import BatchSteps, RowPlan
from mlx_redrafter.step.curve import builtin_curve

SOURCE = "draft-model"


def decode(bs, joins, max_tokens: int):
    """Add ``joins`` (``(cache, tokens, history)`` each) to ``bs`` and decode
    ``max_tokens`` a row; ``(tokens per row, the rows' caches as they left,
    accepted, verified)``."""
    outs, rows = [], []
    for cache, tokens, history in joins:
        row, first = bs.add(cache, tokens, RowPlan(SamplingConfig()), history=history)
        rows.append(row)
        outs.append(list(first.tokens))
    left, accepted, verified = [None] * len(rows), 0, 0
    while len(bs):
        for row, st in zip(list(bs.rows), bs.step()):
            i = rows.index(row)
            outs[i] += st.tokens
            if len(outs[i]) >= max_tokens:
                left[i] = bs.remove(row)
        accepted, verified = accepted + bs.accepted[SOURCE], verified + bs.verified[SOURCE]
    return [o[:max_tokens] for o in outs], left, accepted, verified


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--draft-layers", type=int, default=8, help="The draft model: the model's first N layers.")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from never_slower import _clear_state, own_layers, write_rows

    rt = load_runtime("default")
    model, tok = rt.model, rt.tokenizer
    draft = DraftConfig(draft_model=own_layers(model, args.draft_layers), draft_model_length=3, always_draft=True)
    convs = [c for c in load_prompt_set("mt_bench") if len(c["turns"]) > 1][: args.rows]
    _clear_state()
    # Every node verified: the width chooser (step/batch_budget.py) would narrow the trees of
    # a source whose drafts are rejected, so the two modes would verify different numbers.
    batched.choose_width = lambda ranked, cost: 1 + max((len(r) for r in ranked), default=0)
    new = lambda: BatchSteps(model, draft, curve=builtin_curve(), live=False)  # noqa: E731
    prompts = first_turn_ids(tok, convs)
    from mlx_lm.models.cache import make_prompt_cache

    firsts, caches, _, _ = decode(new(), [(make_prompt_cache(model), p, []) for p in prompts], args.max_tokens)
    # Each row's cache holds its prompt and reply but the last token; the second turn follows that token.
    turn = "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

    def joins(mode: str) -> list:
        """Each row's second turn on a copy of its first turn's cache (``anew``: the model's caches alone)."""
        out = []
        for p, reply, cache, c in zip(prompts, firsts, caches, convs):
            kept = snapshot(cache if mode == "kept" else cache[: target_size(model)])
            tokens = reply[-1:] + tok.encode(turn.format(c["turns"][1]), add_special_tokens=False)
            out.append((kept, tokens, p + reply[:-1]))
        return out

    rows, texts = [], {}
    for mode in ("kept", "anew"):
        texts[mode], _, acc, ver = decode(new(), joins(mode), args.max_tokens)
        rows.append({"mode": mode, "accepted": acc, "verified": ver})
        print(f"{mode}: draft model accepted {acc}/{ver} = {acc / max(ver, 1):.3f}")
    same = texts["kept"] == texts["anew"]
    print(f"same tokens: {same}")
    write_rows(args.out, rows + [{"same_tokens": same}])
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
