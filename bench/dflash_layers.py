"""DFlash drafter sizes at equal data and training time: the number of draft
layers ``make-drafter`` chooses for a model against the others.

Each size is trained on the same distilled folder (``make-drafter``'s
``data/``: it holds the taps a DFlash drafter reads) for the same minutes,
then measured on held-out prompts, greedy (every output checked against
plain decoding):

* held-out accuracy of the block's first draft and the accepted length of
  one chain (the trainer's own evaluation of the saved drafter);
* the block as one chain, every node verified, drafting every step: tokens
  per step, first-draft acceptance and the speed against plain decoding;
* the defaults as ``generate`` resolves them for the drafter (its block,
  ``--tree auto``, the live choice): the speed against plain decoding.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        .venv/bin/python bench/dflash_layers.py --data runs/dflash_auto/data --layers 1,2,3 --minutes 8 \\
        --work runs/dflash_layers --out bench/results/dflash/layers.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from dflash_tree import summary, write_out

from mlx_redrafter import load_model
from mlx_redrafter.config import DraftConfig, resolve
from mlx_redrafter.hub.load import load_drafter
from mlx_redrafter.prompts import first_turn_ids, load_prompt_set, select_conversations
from mlx_redrafter.step.curve import curve_for
from mlx_redrafter.train.dflash_trainer import DFlashTrainConfig, drafter_layers, train_dflash
from mlx_redrafter.tuning.measure import run_pass, warm_up


def train(model, tok, data: Path, folder: Path, layers: int, minutes: float, eval_every: int) -> dict:
    """Train a drafter of ``layers`` for ``minutes`` into ``folder`` (kept: a
    rerun measures it again); its best evaluation."""
    if not (folder / "model.safetensors").is_file():
        cfg = DFlashTrainConfig(layers=layers, minutes=minutes, eval_every=eval_every, checkpoint_every=10_000)
        train_dflash(model, data, folder, cfg, eos_ids=sorted(tok.eos_token_ids))
    log = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in log if "eval_accepted_w1" in r]
    best = max(evals, key=lambda r: r["eval_accepted_w1"])
    steps = max((r.get("step", 0) for r in log), default=0)
    return {"steps": steps, "best_step": best["step"], "eval_acc_first": best["eval_acc"][0], **best}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--data", type=Path, required=True, help="make-drafter's data folder (with the DFlash taps).")
    ap.add_argument("--layers", default="1,2,3")
    ap.add_argument("--minutes", type=float, default=8.0, help="Training minutes of each size.")
    ap.add_argument("--eval-every", type=int, default=50, help="Training steps between evaluations (make-drafter: 75).")
    ap.add_argument("--work", type=Path, default=Path("runs/dflash_layers"))
    ap.add_argument("--prompts", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model, tok = load_model(args.model)
    sizes = [int(n) for n in args.layers.split(",")]
    trained = {
        n: train(model, tok, args.data, args.work / f"layers{n}", n, args.minutes, args.eval_every) for n in sizes
    }
    convs = select_conversations(load_prompt_set(args.prompts), args.num_prompts)
    ids, eos = first_turn_ids(tok, convs), sorted(tok.eos_token_ids)
    curve = curve_for(model, args.model)
    cells = {}
    for n in sizes:
        drafter = load_drafter(str(args.work / f"layers{n}")).bind(model)
        length = drafter.config.block_size - 1
        cells[(n, "chain")] = DraftConfig(head=drafter, head_length=length, always_draft=True)
        cells[(n, "defaults")] = resolve(drafter, curve=curve).draft
    warm_up(model, ids[0], None)
    for d in cells.values():
        warm_up(model, ids[0], d)
    plain = run_pass(model, ids, None, max_tokens=args.max_tokens, eos_ids=eos)
    ref = [r.tokens for r in plain.runs]
    measured = {
        k: summary(run_pass(model, ids, d, max_tokens=args.max_tokens, eos_ids=eos), ref) for k, d in cells.items()
    }
    again = run_pass(model, ids, None, max_tokens=args.max_tokens, eos_ids=eos)
    base = (plain.tokens_per_s + again.tokens_per_s) / 2
    chosen = drafter_layers(len(model.model.layers))
    print(f"plain {plain.tokens_per_s:.1f} / {again.tokens_per_s:.1f} tok/s (load {os.getloadavg()[0]:.1f})")
    print(
        "layers | train steps | held-out first-draft acc | held-out accepted (chain) | chain: tokens/step | "
        "chain: first-draft acceptance | chain speed-up | defaults speed-up | identical"
    )
    rows = {}
    for n in sizes:
        t, c, d = trained[n], measured[(n, "chain")], measured[(n, "defaults")]
        rows[n] = {"trained": t, "chain": c, "defaults": d, "chosen": n == chosen}
        c["speedup"], d["speedup"] = c["tokens_per_s"] / base, d["tokens_per_s"] / base
        print(
            f"{n}{' (chosen)' if n == chosen else ''} | {t['steps']} | {t['eval_acc_first']:.3f} | "
            f"{t['eval_accepted_w1']:.3f} | {c['tokens_per_step']:.2f} | {c['first_draft_acceptance']:.3f} | "
            f"{c['speedup']:.2f}x | {d['speedup']:.2f}x | {c['identical_outputs']}/{len(ids)}, "
            f"{d['identical_outputs']}/{len(ids)}"
        )
    write_out(args, [plain.tokens_per_s, again.tokens_per_s], sizes=rows)


if __name__ == "__main__":
    main()
