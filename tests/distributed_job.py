"""One rank of a distributed distill or train run on a tiny random model.

Run by tests/test_distributed.py under ``mlx.launch`` (or alone: a world of
one). ``python distributed_job.py distill|train|hang FOLDER [options]``. User
errors print ``Error: ...`` and exit 1, like the CLI.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import mlx.core as mx  # noqa: E402
from helpers import VOCAB, tiny_model  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_redrafter.errors import RedrafterError  # noqa: E402
from mlx_redrafter.train import trainer  # noqa: E402
from mlx_redrafter.train.distill import DistillConfig, distill  # noqa: E402
from mlx_redrafter.train.world import world  # noqa: E402

EOS = 2


class CharTokenizer:
    """Just enough of a tokenizer for distillation: a chat template over characters."""

    eos_token_ids = {EOS}
    bos_token = None
    has_chat_template = True

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return self.encode(text) if tokenize else text

    def encode(self, text, add_special_tokens=True):
        return [3 + ord(c) % (VOCAB - 3) for c in text]

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def say(what: str) -> None:
    """A progress line: the test tells a hung launch from a slow one by these."""
    print(f"rank {world().rank}/{world().size}: {what}", flush=True)


def model_for_this_rank(bad_rank: int):
    say("building the model")
    return tiny_model("llama", seed=1 if world().rank == bad_rank else 0)


def run_distill(folder: Path, prompts: Path, bad_rank: int = -1):
    cfg = DistillConfig(batch_size=3, max_new_tokens=12, shard_sequences=2)
    model = model_for_this_rank(bad_rank)
    say("distilling")
    return distill(
        "tiny",
        prompts,
        folder / "data",
        cfg,
        model=model,
        tokenizer=CharTokenizer(),
        progress=lambda manifest, running: say(f"distilled {manifest.sequences} sequence(s)"),
    )


def train_config(**kw):
    base = dict(
        exit_dim=32,
        num_draft_layers=1,
        draft_vocab_size=48,
        depth=3,
        batch_size=16,
        lr=3e-3,
        warmup_steps=2,
        max_steps=4,
        eval_every=1000,
        checkpoint_every=1000,
        eval_fraction=0.25,
    )
    return trainer.TrainConfig(**{**base, **kw})


def run_train(folder: Path, out: Path, stop_at: int = 0, resume: bool = False, bad_rank: int = -1):
    """Train; every rank dumps its weights whenever the run finishes or is
    interrupted (``weights-step{S}-rank{R}.safetensors`` in ``folder``)."""
    w = world()
    finish = trainer.Writer.finish

    def dump_then_finish(self, drafter, optimizer, step, seconds):
        mx.save_safetensors(
            str(folder / f"weights-step{step}-rank{w.rank}.safetensors"), dict(tree_flatten(drafter.parameters()))
        )
        finish(self, drafter, optimizer, step, seconds)

    def stop(step, total, loss):
        say(f"step {step}/{total}")
        if step == stop_at:
            raise KeyboardInterrupt

    trainer.Writer.finish = dump_then_finish
    try:
        model = model_for_this_rank(bad_rank)
        say("training")
        trainer.train(model, folder / "data", out, train_config(), resume=resume, eos_ids=[EOS], progress=stop)
    finally:
        trainer.Writer.finish = finish


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["distill", "train", "hang"])
    p.add_argument("folder", type=Path)
    p.add_argument("--prompts", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--stop-at", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--bad-rank", type=int, default=-1, help="This rank loads a different model.")
    a = p.parse_args(argv)
    say(f"started ({a.mode})")
    try:
        if a.mode == "hang":  # the launcher's hang detection, tested
            say("waiting forever")
            world().barrier()
            threading.Event().wait()
        elif a.mode == "distill":
            run_distill(a.folder, a.prompts, a.bad_rank)
        else:
            run_train(a.folder, a.out, a.stop_at, a.resume, a.bad_rank)
    except RedrafterError as e:
        print(f"Error: {e.problem}\nFix: {e.fix}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        # mlx.launch stops every rank once one exits non-zero: wait until
        # rank 0 has written its checkpoint.
        world().barrier()
        print(f"rank {world().rank}/{world().size} interrupted", flush=True)
        return 130
    print(f"rank {world().rank}/{world().size} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
