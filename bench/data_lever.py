"""The data lever (issue 45 item 5): training positions from generated replies
against teacher-forced positions over fixed text, at equal CPU time.

* ``generated``: what ``make-drafter`` distils today: the model answers the
  first user turn of each training conversation (greedy), keeping its
  prompt's positions and its reply's.
* ``teacher-forced``: every user turn of the training conversations, each as a
  one-turn chat prompt, run through the model's prefill (one decode step
  each): every position keeps the taps and top-k logits, labelled with the
  model's own top-1, and nothing is generated.

Each source distils for ``--minutes`` of wall time; an EAGLE-3 head (and the
ReDrafter head, with ``--redrafter``) trains the same number of steps on each;
both are scored on the same held-out generated replies (conversations neither
source trains on): per-depth top-1 accuracy and the expected accepted length
of one greedy chain.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        .venv/bin/python bench/data_lever.py --out runs/lever --minutes 8 --steps 600
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import numpy as np

from mlx_redrafter import load_model
from mlx_redrafter.draft.eagle3_io import read_eagle3
from mlx_redrafter.train.distill import DistillConfig, distill
from mlx_redrafter.train.eagle3_trainer import Eagle3TrainConfig, distill_layers, head_vocab_map, train_eagle3
from mlx_redrafter.train.examples import is_eval_conversation
from mlx_redrafter.train.shards import Manifest, read_corpus
from mlx_redrafter.train.ttt import WindowBatcher, evaluate_ttt, window_starts

PROMPTS = Path(__file__).resolve().parents[1] / "mlx_redrafter" / "data" / "sharegpt_train_prompts.jsonl.gz"
HELD = 0.02  # the held-out share by conversation id (make-drafter's split)


def write_prompts(out: Path, eval_n: int) -> dict:
    """Three prompt files: held-out first turns (the eval set), training first turns, training user turns."""
    convs = [json.loads(x) for x in gzip.open(PROMPTS, "rt")]
    held = [c for c in convs if is_eval_conversation(c["id"], HELD)][:eval_n]
    train = [c for c in convs if not is_eval_conversation(c["id"], HELD)]
    turns = [{"id": f"{c['id']}#{i}", "turns": [t]} for c in train for i, t in enumerate(c["turns"])]
    files = {"eval": held, "generated": train, "teacher-forced": turns}
    paths = {}
    for name, rows in files.items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def distil(model, tok, prompts: Path, out: Path, seconds, layers, new_tokens: int, batch: int):
    """Distil for ``seconds`` (None: every prompt), then finish the replies under
    way (as make-drafter drains): no generated token is thrown away."""
    cfg = DistillConfig(batch_size=batch, max_new_tokens=new_tokens, feature_layers=layers)
    tic = time.perf_counter()
    late = None if seconds is None else (lambda replies: time.perf_counter() - tic > seconds)
    m = distill("default", prompts, out, cfg, model, tok, drain=late)
    secs = time.perf_counter() - tic
    n = m.tokens + m.prompt_tokens
    return {"positions": n, "reply_positions": m.tokens, "seconds": round(secs, 1), "per_s": round(n / secs, 1)}


def score(model, head_dir: Path, eval_corpus, depth: int) -> dict:
    head = read_eagle3(head_dir, dtype="float32").bind(model)
    vmap = head_vocab_map(head, head.config.vocab_size)
    starts, ends = window_starts(eval_corpus, 128, 1.0, held=True)
    replies = eval_corpus.reply if eval_corpus.reply is not None else np.ones(len(eval_corpus.tokens), bool)
    batcher = WindowBatcher(eval_corpus, starts, ends, 128, depth, vmap, replies)
    return evaluate_ttt(head, batcher, 4, max_windows=10_000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=8.0, help="distillation wall time of each source")
    ap.add_argument("--steps", type=int, default=600, help="EAGLE-3 training steps on each source")
    ap.add_argument("--eval-conversations", type=int, default=40)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, tok = load_model("default")
    layers = distill_layers(len(model.model.layers))
    paths = write_prompts(args.out, args.eval_conversations)
    results = {"minutes": args.minutes, "steps": args.steps}
    if not (args.out / "eval" / "progress.json").is_file():
        results["eval_data"] = distil(model, tok, paths["eval"], args.out / "eval", None, layers, 128, 40)
    # Generation first; the teacher-forced source then gets the wall time generation took, draining included.
    seconds = 60 * args.minutes
    for name, new_tokens in (("generated", 192), ("teacher-forced", 1)):
        if not Manifest.load(args.out / name):
            data = distil(model, tok, paths[name], args.out / name, seconds, layers, new_tokens, 32)
            results[name] = {"data": data}
            seconds = data["seconds"]
    eval_corpus = read_corpus(args.out / "eval")
    for name in ("generated", "teacher-forced"):
        cfg = Eagle3TrainConfig(max_steps=args.steps, eval_fraction=0.0, eval_every=10**9, checkpoint_every=10**9)
        tic = time.perf_counter()
        head = train_eagle3(model, args.out / name, args.out / f"{name}-head", cfg, eos_ids=sorted(tok.eos_token_ids))
        results.setdefault(name, {})["train_seconds"] = round(time.perf_counter() - tic, 1)
        results[name]["held_out"] = score(model, head, eval_corpus, cfg.depth)
        print(json.dumps({name: results[name]}), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
