"""Data-scaling curve of the drafter: the same recipe trained on nested
shares of the distilled data (1/4, 1/2, all), then held-out ShareGPT and
MT-Bench acceptance against training tokens.

Each share trains for ``--minutes`` times its share (at least ``--min-minutes``):
the same number of passes over its data, and the best held-out checkpoint of
each run is the one measured. MT-Bench numbers come from bench/acceptance.py
(first drafts accepted and W=1 tokens/step, teacher-forced on the LLM's own
greedy replies). Writes ``results.json``, ``results.md`` and ``scaling.png``.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 .venv/bin/python bench/scaling.py \\
        --data runs/distill-v2 --minutes 24 --out bench/results/scaling
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from acceptance import REPLIES, evaluate, mt_bench_replies  # noqa: E402

from mlx_redrafter import load_model  # noqa: E402
from mlx_redrafter.hub.load import load_drafter  # noqa: E402
from mlx_redrafter.llm.parts import model_parts  # noqa: E402
from mlx_redrafter.train.trainer import PRESETS, TrainConfig, train  # noqa: E402


def best_record(folder: Path) -> dict:
    log = [json.loads(line) for line in open(folder / "train_log.jsonl")]
    start = log[0]
    best = max((r for r in log if "eval_accepted_w1" in r), key=lambda r: r["eval_accepted_w1"])
    return {"train_examples": start["train_examples"], **{k: best[k] for k in ("step", "eval_acc", "eval_accepted_w1")}}


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["train_examples"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(x, [r["eval_acc"][0] for r in rows], "o-", label="held-out ShareGPT, depth-1 accuracy")
    ax[0].plot(x, [r["mt_bench"]["first_draft_accepted"] for r in rows], "s-", label="MT-Bench, first drafts accepted")
    ax[0].set_ylabel("share accepted")
    ax[1].plot(x, [r["eval_accepted_w1"] + 1 for r in rows], "o-", label="held-out ShareGPT, W=1 L=5 (expected)")
    ax[1].plot(x, [r["mt_bench"]["tokens_per_step"]["W1L3"] for r in rows], "s-", label="MT-Bench, W=1 L=3 (walk)")
    ax[1].set_ylabel("tokens per step")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xlabel("training tokens (positions)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle("Drafter for SmolLM2-135M-Instruct: acceptance against distilled data")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--shares", default="0.25,0.5,1")
    ap.add_argument("--minutes", type=float, default=24.0, help="training budget of the full share")
    ap.add_argument("--min-minutes", type=float, default=6.0)
    ap.add_argument("--preset", default="default")
    ap.add_argument(
        "--fuse-features", action="store_true", help="train fused drafters (data distilled with --feature-layers)"
    )
    ap.add_argument(
        "--runs", type=Path, default=Path("runs/scaling"), help="where the drafters are trained (reused when present)"
    )
    ap.add_argument("--out", type=Path, default=Path("bench/out/scaling"))
    ap.add_argument("--replies", type=Path, default=REPLIES, help="MT-Bench replies cached by bench/acceptance.py")
    args = ap.parse_args()
    model, tok = load_model("default")
    embed, _, _ = model_parts(model)
    mt, layers = mt_bench_replies(model, tok, args.replies)
    rows = []
    for share in map(float, args.shares.split(",")):
        folder = args.runs / f"share-{share:g}"
        if not (folder / "model.safetensors").exists():
            minutes = max(args.min_minutes, args.minutes * share)
            cfg = TrainConfig(
                **PRESETS[args.preset],
                data_fraction=share,
                minutes=minutes,
                epochs=1000.0,
                eval_every=100,
                fuse_features=args.fuse_features,
            )
            train(model, args.data, folder, cfg, eos_ids=sorted(tok.eos_token_ids))
        row = {"share": share, "folder": str(folder), **best_record(folder)}
        row["mt_bench"] = evaluate(load_drafter(folder, dtype="float32"), embed, mt, layers)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "LD_PRELOAD=... .venv/bin/python " + " ".join(sys.argv)
    (args.out / "results.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    lines = [
        f"`{command}`",
        "",
        "| share | training positions | best step | held-out depth-1 acc | "
        "held-out W=1 L=5 tokens/step | MT-Bench first drafts accepted | MT-Bench W=1 L=3 tokens/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['share']:g} | {r['train_examples']} | {r['step']} | "
            f"{r['eval_acc'][0]:.3f} | {1 + r['eval_accepted_w1']:.2f} | "
            f"{r['mt_bench']['first_draft_accepted']:.3f} | {r['mt_bench']['tokens_per_step']['W1L3']:.2f} |"
        )
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out / "scaling.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
