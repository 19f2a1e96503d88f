"""Drafter quality on MT-Bench first turns: acceptance by depth and tokens/step
of greedy decoding with one beam, for several drafters from one set of replies.

The LLM answers the MT-Bench first turns greedily (batched, with the
distiller's continuous batching) and the hidden state at every position is
kept (and the intermediate-layer features a fused drafter needs). From every
position each drafter drafts ``L`` tokens teacher-forced; with one greedy
beam, the draft accepted at a position is the longest prefix that matches the
LLM's reply, so this is what ``W=1`` decoding accepts there. A walk over each
reply (draft, accept, move on by ``1 + accepted``) gives the tokens per step
of ``W=1 L=1..5`` decoding with the drafter alone (no lookup). No decoding
loop runs, so every drafter is measured on the same replies in seconds; the
live check is ``mlx-redrafter sweep`` (see bench/RESULTS.md). An EAGLE-3 head
(a folder ``load_drafter`` reads as one) drafts from its own KV cache, fed
the prompt and the reply up to each position as the step loop feeds it, one
chained call per depth (minutes, not seconds).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 .venv/bin/python bench/acceptance.py \\
        --drafters shipped=mlx_redrafter/drafters/smollm2-135m-instruct,new=runs/drafter-v2 \\
        --out bench/results/acceptance
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import deque
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_redrafter import load_model
from mlx_redrafter.config import is_layer_head
from mlx_redrafter.hub.load import load_drafter
from mlx_redrafter.llm.parts import default_feature_layers, model_parts
from mlx_redrafter.prompts import load_prompt_set
from mlx_redrafter.train.distill import DistillConfig, Distiller

MAX_L = 5


REPLIES = Path("bench/out/acceptance/replies.safetensors")


def mt_bench_replies(model, tok, path: Path = REPLIES):
    """``(replies, layers)``: the MT-Bench first-turn replies (128 tokens)
    that every drafter bench measures on, cached in ``path``."""
    layers = reply_layers(model)
    return replies(model, tok, load_prompt_set("mt_bench"), 128, layers, path), layers


def reply_layers(model) -> list:
    """The replies keep the default feature layers' outputs too, so that fused
    and unfused drafters are measured on one cached set."""
    return default_feature_layers(len(model.model.layers))


class Replies(list):
    """``[(tokens [n], context [n, c])]``, and ``prompts``: each reply's
    templated prompt ids (what context lookup sees before the reply)."""

    def __init__(self, items, prompts):
        super().__init__(items)
        self.prompts = list(prompts)


def replies(model, tok, prompts, max_tokens: int, layers, cache: Path):
    """``[(tokens [n], context [n, c])]``: greedy replies and, at each
    position, the hidden state that produced the token there (features
    first when ``layers``), as :class:`Replies` (with each reply's prompt
    ids). Cached in ``cache`` (keyed by the settings)."""
    digest = hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[
        :16
    ]  # which prompts, not only how many
    key = {
        "prompts": len(prompts),
        "digest": digest,
        "max_tokens": max_tokens,
        "layers": list(layers),
        "with_prompts": 1,
    }
    if cache.exists():
        arrays, meta = mx.load(str(cache), return_metadata=True)
        if json.loads(meta["key"]) == key:
            offsets, p_off = np.array(arrays["offsets"]), np.array(arrays["prompt_offsets"])
            t, c, pt = np.array(arrays["tokens"]), np.array(arrays["context"]), np.array(arrays["prompt_tokens"])
            return Replies(
                [(t[a:b], c[a:b]) for a, b in zip(offsets[:-1], offsets[1:])],
                [pt[a:b] for a, b in zip(p_off[:-1], p_off[1:])],
            )
    cfg = DistillConfig(
        batch_size=40,
        max_new_tokens=max_tokens,
        prompt_positions=False,
        top_k=0,
        feature_layers=list(layers),
        stop_loops=0,
    )
    d = Distiller(model, tok, cfg)
    queue = deque((c, 0, []) for c in prompts)
    out = []

    asked = []

    def done(row, conv):
        if row is not None:
            ctx = np.stack(row.hidden)
            if layers:
                ctx = np.concatenate([np.stack(row.extra["features"]), ctx], axis=1)
            out.append((np.array(row.tokens, np.int32), ctx))
            asked.append(np.array(d.encode(row.messages), np.int32))

    tic = time.perf_counter()
    d.run(queue, done, lambda: False)
    print(
        f"{len(out)} replies, {sum(len(t) for t, _ in out)} tokens in {time.perf_counter() - tic:.0f} s",
        file=sys.stderr,
    )
    offsets = np.cumsum([0] + [len(t) for t, _ in out])
    cache.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(cache),
        {
            "tokens": mx.array(np.concatenate([t for t, _ in out])),
            "context": mx.array(np.concatenate([c for _, c in out])),
            "offsets": mx.array(offsets),
            "prompt_tokens": mx.array(np.concatenate(asked)),
            "prompt_offsets": mx.array(np.cumsum([0] + [len(a) for a in asked])),
        },
        {"key": json.dumps(key)},
    )
    return Replies(out, asked)


def rates(hits: np.ndarray, seen: np.ndarray) -> dict:
    """A calibration table: ``q`` (accepted share, None where nothing fell) and ``n`` (drafts counted)."""
    q = [[round(float(hi / n), 3) if n else None for hi, n in zip(hr, nr)] for hr, nr in zip(hits, seen)]
    return {"q": q, "n": seen.astype(int).tolist()}


def lookup_calibration(data: Replies, length: int = 4) -> dict:
    """Context lookup's side of the tree=auto calibration, offline: walking
    each reply token by token over its prompt and the reply so far (what
    draft/lookup.py's ``Lookup`` sees after emitting that token), the share
    of its draft's tokens at each depth accepted given the one before was,
    by the matched suffix length's bucket (step/select.py's lookup edges)."""
    from mlx_redrafter.draft.lookup import Lookup
    from mlx_redrafter.step.select import N_BUCKETS, bucket_of
    from mlx_redrafter.step.sources.lookup import PRIOR

    edges, src = np.array([PRIOR.edges], np.float32), 0
    hits, seen = np.zeros((length, N_BUCKETS)), np.zeros((length, N_BUCKETS))
    for (t, _), prompt in zip(data, data.prompts):
        look = Lookup(prompt.tolist())
        for pos in range(len(t) - 1):
            look.extend([int(t[pos])])
            rows = look.propose(length, 1)
            if not rows:
                continue
            b = int(bucket_of(np, edges, np.full(1, src), np.full(1, look.matched[0], np.float32))[0])
            for d, token in enumerate(rows[0][: len(t) - 1 - pos]):
                seen[d, b] += 1
                if token != t[pos + 1 + d]:
                    break
                hits[d, b] += 1
    return rates(hits, seen)


def pick(context: np.ndarray, have, want, hidden: int) -> np.ndarray:
    """The columns of ``context`` (``have`` layers' features, then the last
    state) that a drafter fusing ``want`` reads."""
    cols = [context[:, have.index(i) * hidden : (have.index(i) + 1) * hidden] for i in want]
    return np.concatenate(cols + [context[:, -hidden:]], axis=1)


def greedy_drafts(drafter, embed, tokens: np.ndarray, context: np.ndarray):
    """``(right, score)``, each ``[n, MAX_L]``: from every position, whether the
    greedy beam's draft at each depth equals the reply's token (False past the
    reply's end), and the draft's log-probability given its parent (the score
    tree="auto" buckets, step/auto.py's ``drafter_scores``)."""
    n = len(tokens)
    pad = np.concatenate([tokens, np.zeros(MAX_L + 1, np.int32)])
    at = np.arange(n)[:, None] + np.arange(MAX_L + 1)[None, :]
    ids = pad[at]
    ctx = mx.array(context).astype(mx.float32)
    logits = drafter(drafter.context(ctx), embed(mx.array(ids[:, :-1])))
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    drafted = np.array(drafter.token_ids(mx.argmax(logits, -1)))
    return (drafted == ids[:, 1:]) & (at[:, 1:] < n), np.array(logp.max(axis=-1))


def accepted_runs(drafter, embed, tokens: np.ndarray, context: np.ndarray) -> np.ndarray:
    """``[n]`` drafted tokens a single greedy beam of length ``MAX_L`` gets
    accepted from each position (capped by the reply's end)."""
    right, _ = greedy_drafts(drafter, embed, tokens, context)
    return np.cumprod(right, axis=1).sum(1)


def calibration(drafter, embed, data, layers=()) -> dict:
    """The acceptance tree="auto" calibrates, measured offline: of the greedy
    drafts at depth d whose parent was accepted, the share accepted, by score
    bucket (step/select.py's drafter edges). ``q`` [MAX_L, buckets] (None where
    nothing fell), ``n`` the drafts counted; step/select.py's drafter priors
    come from this table."""
    from mlx_redrafter.step.select import N_BUCKETS, bucket_of
    from mlx_redrafter.step.sources.redrafter import PRIOR

    edges = np.array([PRIOR.edges], np.float32)
    want, h = drafter.config.feature_layers or [], drafter.config.hidden_size
    hits, seen = np.zeros((MAX_L, N_BUCKETS)), np.zeros((MAX_L, N_BUCKETS))
    for t, c in data:
        right, score = greedy_drafts(drafter, embed, t, pick(c, list(layers), want, h))
        valid = (np.arange(len(t))[:, None] + np.arange(1, MAX_L + 1)[None, :]) < len(t)
        parent = np.concatenate([np.ones_like(right[:, :1]), np.cumprod(right, axis=1)[:, :-1]], axis=1).astype(bool)
        for d in range(MAX_L):
            m = parent[:, d] & valid[:, d]
            b = bucket_of(np, edges, np.zeros(int(m.sum()), np.int32), score[m, d])
            np.add.at(hits[d], b, right[m, d])
            np.add.at(seen[d], b, 1)
    return rates(hits, seen)


def walk(runs: np.ndarray, length: int) -> int:
    """Steps greedy decoding takes over a reply when it accepts
    ``min(runs[pos], length)`` drafts at ``pos`` and then moves on."""
    pos, steps = 0, 0
    while pos < len(runs) - 1:
        pos += 1 + min(int(runs[pos]), length)
        steps += 1
    return steps


def head_runs(model, head, prompt: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """:func:`accepted_runs` of a layer head (an EAGLE-3 head): its own KV cache
    fed the prompt and the reply up to each position, teacher-forced, as the
    step loop feeds it the accepted text; from each position one greedy chain
    of ``MAX_L`` calls (train/head_controller.py's ``_chain``), trimmed off again."""
    from mlx_redrafter.step.loop import columns
    from mlx_redrafter.train.head_controller import _chain

    full = np.concatenate([prompt, tokens]).astype(np.int32)
    layers = list(dict.fromkeys(head.taps))
    _, backbone, _ = model_parts(model, layers)
    wide = backbone(mx.array(full)[None])
    feats = mx.take(wide, columns(layers, head.taps, model.args.hidden_size, last=False), axis=-1)
    cache, p, n = head.make_cache(), len(prompt), len(tokens)
    if p > 1:  # pairs (token after j, features at j) of the prompt
        head(mx.array(full[1:p])[None], feats[:, : p - 1], cache, first=True)
    runs = np.zeros(n, np.int64)
    for i in range(n - 1):
        # Reply token i (g0) paired with the features that produced it; the chain drafts tokens i+1.. .
        logits, hidden = head(mx.array(full[p + i : p + i + 1])[None], feats[:, p + i - 1 : p + i], cache, first=True)
        drafts, _ = _chain(head, cache, logits[0, -1], hidden[:, -1:], MAX_L, 1)
        for c in cache:
            c.trim(MAX_L - 1)
        want = tokens[i + 1 : i + 1 + MAX_L]
        right = np.array(drafts)[: len(want)] == want
        runs[i] = int(np.cumprod(right).sum())
    return runs


def evaluate(drafter, embed, data, layers=(), model=None) -> dict:
    """Acceptance by depth and W=1 tokens/step of ``drafter`` on ``data``
    (replies whose contexts hold ``layers``' features, then the last state);
    a layer head (``model`` given) drafts from its own cache (:func:`head_runs`)."""
    if is_layer_head(drafter):
        drafter.bind(model)
        runs = [head_runs(model, drafter, q, t) for (t, _), q in zip(data, data.prompts)]
    else:
        want, h = drafter.config.feature_layers or [], drafter.config.hidden_size
        runs = [accepted_runs(drafter, embed, t, pick(c, list(layers), want, h)) for t, c in data]
    allr = np.concatenate([r[:-1] for r in runs])  # positions with at least one token after g0
    by_depth = [round(float((allr >= d).mean()), 4) for d in range(1, MAX_L + 1)]
    tokens = sum(len(r) - 1 for r in runs)
    tps = {f"W1L{L}": round(tokens / max(1, sum(walk(r, L) for r in runs)), 3) for L in range(1, MAX_L + 1)}
    return {
        "first_draft_accepted": by_depth[0],
        "acceptance_by_depth": by_depth,
        "tokens_per_step": tps,
        "positions": int(len(allr)),
    }


def load_prompts(spec: str) -> list:
    """A prompt set by name or file, or ``sharegpt-heldout:N``: the last ``N``
    ShareGPT conversations in the order the distiller (seed 0) answers them,
    which a distillation run stopped earlier never saw (the calibration is
    measured there, not on an evaluation set: prompts.py's eval-set guard)."""
    import random

    from mlx_redrafter.prompts import default_training_prompts, read_conversations

    if not spec.startswith("sharegpt-heldout:"):
        return load_prompt_set(spec)
    convs = read_conversations(default_training_prompts())
    random.Random(DistillConfig().seed).shuffle(convs)
    return convs[-int(spec.split(":", 1)[1]) :]


def calibration_table(name: str, cal: dict, heads=("p < 0.1", "0.1-0.25", "0.25-0.5", "0.5-0.75", ">= 0.75")) -> str:
    """Markdown: q (drafts counted) by depth and score bucket (the drafter's
    draft probability; lookup's matched suffix length)."""
    lines = [
        f"tree=auto calibration of {name}: accepted share (drafts counted) given the parent accepted",
        "",
        "| depth | " + " | ".join(heads) + " |",
        "|---|" + "---|" * len(heads),
    ]
    for d, (qs, ns) in enumerate(zip(cal["q"], cal["n"]), 1):
        lines.append(f"| {d} | " + " | ".join("-" if q is None else f"{q:.3f} ({n})" for q, n in zip(qs, ns)) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafters", required=True, help="name=folder,name=folder,...")
    ap.add_argument(
        "--prompts", default="mt_bench", help="A prompt set, a file, or sharegpt-heldout:N (for --calibration)."
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("bench/out/acceptance"))
    ap.add_argument(
        "--calibration",
        action="store_true",
        help="Also the tree=auto calibration table (acceptance by depth and score bucket) of each drafter.",
    )
    args = ap.parse_args()
    model, tok = load_model("default")
    embed, _, _ = model_parts(model)
    folders = dict(item.split("=", 1) for item in args.drafters.split(","))
    drafters = {name: load_drafter(folder, dtype="float32") for name, folder in folders.items()}
    fused = [i for d in drafters.values() for i in (getattr(d.config, "feature_layers", None) or [])]
    layers = sorted(set(fused) | set(reply_layers(model)))
    prompts = load_prompts(args.prompts)
    data = replies(model, tok, prompts, args.max_tokens, layers, args.out / "replies.safetensors")
    results = {}
    for name, d in drafters.items():
        tic = time.perf_counter()
        results[name] = {"folder": folders[name], **evaluate(d, embed, data, layers, model)}
        print(f"{name}: {time.perf_counter() - tic:.0f} s", file=sys.stderr)
        if args.calibration:
            results[name]["calibration"] = calibration(d, embed, data, layers)
    if args.calibration:
        results_lookup = lookup_calibration(data)
        print("lookup", json.dumps(results_lookup), file=sys.stderr)
        print(name, json.dumps(results[name]), file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "LD_PRELOAD=... .venv/bin/python " + " ".join(sys.argv)
    extra = {"lookup_calibration": results_lookup} if args.calibration else {}
    (args.out / "results.json").write_text(
        json.dumps(
            {"command": command, "prompts": args.prompts, "max_tokens": args.max_tokens, "drafters": results, **extra},
            indent=1,
        )
        + "\n"
    )
    lines = [
        f"`{command}`",
        "",
        "| drafter | first drafts accepted | acceptance by depth 1-5 | tokens/step W=1 L=1 / 2 / 3 / 4 / 5 |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['first_draft_accepted']:.3f} | "
            f"{' / '.join(f'{x:.3f}' for x in r['acceptance_by_depth'])} | "
            + " / ".join(f"{v:.2f}" for v in r["tokens_per_step"].values())
            + " |"
        )
    for name, r in results.items():
        if "calibration" in r:
            lines += ["", calibration_table(name, r["calibration"])]
    if args.calibration:
        lines += [
            "",
            calibration_table("context lookup (4-token drafts)", results_lookup, ["match 1", "2", "3", "4", "5+"]),
        ]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
