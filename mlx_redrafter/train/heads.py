"""``make-drafter``'s draft heads (``--head``): which kinds a run trains, where
each lives in the work folder, and the EAGLE-3 head's settings and training
stage (the ReDrafter head's are in train/recipe.py, as before).

* ``redrafter`` (the default): the recurrent ReDrafter head, in ``OUT/drafter``;
* ``eagle3``: an EAGLE-3 head (draft/eagle3.py) trained with training-time
  test (train/eagle3_trainer.py), in ``OUT/eagle3``, in the speculators layout;
* ``dflash``: a DFlash block drafter (draft/dflash.py) trained on random
  anchor blocks (train/dflash_trainer.py), in ``OUT/dflash``, in z-lab's layout;
* ``auto``: all three, on the same distilled data, each with its share of the
  training time; the verdict measures them and installs the fastest
  (:func:`~mlx_redrafter.tuning.verdict.chosen`).

Distillation keeps the three taps an EAGLE-3 head reads when it trains one
of the layer heads (a DFlash drafter reads the same three).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from typing import Tuple

from ..errors import RedrafterError
from ..profiles import drafter_id
from .recipe_state import Status

REDRAFTER, EAGLE3, DFLASH, AUTO = "redrafter", "eagle3", "dflash", "auto"
CHOICES = (REDRAFTER, EAGLE3, DFLASH, AUTO)
FOLDERS = {REDRAFTER: "drafter", EAGLE3: "eagle3", DFLASH: "dflash"}
VERDICT_KEYS = {REDRAFTER: "drafter", EAGLE3: "eagle3", DFLASH: "dflash"}  # tuning/verdict.py's candidates
LAYER_HEADS = (EAGLE3, DFLASH)  # the heads that read the model's taps (distilled as features)
BUDGET_FIELDS = ("minutes", "max_steps", "epochs")


DEFAULT_VOCAB = 4096  # the default preset's draft vocabulary (bench/RESULTS.md section 12)
LARGE_VOCAB = 65536  # past this many tokens the draft vocabulary doubles


def draft_vocab_size(vocab: int):
    """Either head's draft vocabulary for a model of ``vocab`` tokens: 4096, or 8192
    past 65536 (Gemma 3's 262144 spreads the same text over more ids; a
    doubling costs 1.7x the draft time, section 12's vocabulary table); None
    when that is the whole vocabulary."""
    draft = DEFAULT_VOCAB if vocab <= LARGE_VOCAB else 2 * DEFAULT_VOCAB
    return draft if draft < vocab else None


def heads_of(choice: str) -> Tuple[str, ...]:
    """The kinds ``--head choice`` trains."""
    if choice not in CHOICES:
        raise RedrafterError(f"Unknown --head {choice!r}.", f"Use one of: {', '.join(CHOICES)}.")
    return (REDRAFTER, EAGLE3, DFLASH) if choice == AUTO else (choice,)


def kind_of_key(key: str) -> str:
    """The head kind of a verdict key."""
    return {v: k for k, v in VERDICT_KEYS.items()}[key]


def eagle3_settings(run):
    """The EAGLE-3 head's training settings: the recipe's, the config's
    overrides, fixed by the folder's first run (the budget fields excepted)."""
    from .eagle3_trainer import Eagle3TrainConfig

    vocab = draft_vocab_size(run.identity.vocab_size)
    base = asdict(Eagle3TrainConfig(draft_vocab_size=vocab, eval_fraction=run.source.held_out, seed=run.cfg.seed))
    base = {k: v for k, v in base.items() if k not in BUDGET_FIELDS}
    fixed = {k: v for k, v in run.cfg.eagle3.items() if k not in BUDGET_FIELDS}
    budget = {"epochs": 1000.0, **{k: v for k, v in run.cfg.eagle3.items() if k in BUDGET_FIELDS}}
    return Eagle3TrainConfig(**{**run.state.pin("eagle3", {**base, **fixed}, fixed), **budget})


def dflash_settings(run):
    """The DFlash drafter's training settings: the recipe's, the config's
    overrides (``run.cfg.dflash``), fixed by the folder's first run (the budget fields excepted)."""
    from .dflash_trainer import DFlashTrainConfig

    base = asdict(DFlashTrainConfig(eval_fraction=run.source.held_out, seed=run.cfg.seed))
    base = {k: v for k, v in base.items() if k not in BUDGET_FIELDS}
    given = getattr(run.cfg, "dflash", None) or {}
    fixed = {k: v for k, v in given.items() if k not in BUDGET_FIELDS}
    budget = {"epochs": 1000.0, **{k: v for k, v in given.items() if k in BUDGET_FIELDS}}
    return DFlashTrainConfig(**{**run.state.pin("dflash", {**base, **fixed}, fixed), **budget})


def _trainer(run, kind: str):
    """``(train function, settings, the config's overrides, rate attribute, positions per step, label)`` of a kind."""
    from .dflash_trainer import train_dflash
    from .eagle3_trainer import train_eagle3
    from .trainer import train

    if kind == EAGLE3:
        cfg = run.eagle3_cfg
        return train_eagle3, cfg, run.cfg.eagle3, "eagle3_positions_per_s", cfg.positions_per_step, "EAGLE-3 head"
    if kind == DFLASH:
        cfg = run.dflash_cfg
        given = getattr(run.cfg, "dflash", None) or {}
        return train_dflash, cfg, given, "dflash_positions_per_s", cfg.positions_per_step, "DFlash drafter"
    return train, run.train_cfg, run.cfg.train, "train_steps_per_s", 1, None


def train_head(run, kind: str, left: float) -> None:
    """Train (or go on training) the ``kind`` head for ``left`` more seconds
    (at least one step), its progress told and its measured rate kept. The
    two kinds differ in their trainer, their settings, and their rate: the
    ReDrafter head's in steps per second, the EAGLE-3 head's in positions (a
    step's window of chained positions varies with its settings)."""
    from .trainer import checkpoint_state

    trainer, cfg, given, rate_name, per_step, name = _trainer(run, kind)
    folder = run.head_dirs[kind]
    rate = getattr(run.rates, rate_name)
    ck = checkpoint_state(folder)
    saved = drafter_id(folder) if (folder / "model.safetensors").is_file() else None  # the head the folder holds
    steps = max(int(left * rate / per_step), 1)
    every = cfg.eval_every if "eval_every" in given else max(10, steps // 8)
    cfg = replace(cfg, minutes=(ck.get("seconds", 0.0) + left) / 60, eval_every=every, checkpoint_every=every)
    # The ReDrafter head is the one make-drafter trains by default: its lines name no head.
    label, whose = (f"{name}: ", f"the {name} ") if name else ("", "")
    tic = time.perf_counter()

    def progress(step, total, loss):
        e = time.perf_counter() - tic
        acc = "" if run.held_acc is None else f", held-out first-draft accuracy {run.held_acc:.3f}"
        info = f"{label}step {step}, loss {loss:.3f}{acc}"
        run.tell(Status("train", min(e / max(left, 1e-9), 1.0), left - e, left - e + run.fixed_todo_s(), info))

    def log_console(line: str) -> None:
        rec = json.loads(line)
        if rec.get("eval_acc"):
            run.held_acc = rec["eval_acc"][0]

    with run.state.timed("train"):
        trainer(
            run.model,
            run.data,
            folder,
            cfg,
            resume=bool(ck),
            extend=True,
            eos_ids=sorted(run.tokenizer.eos_token_ids),
            progress=progress,
            log_console=log_console,
        )
    after = checkpoint_state(folder)
    added, secs = after.get("step", 0) - ck.get("step", 0), after.get("seconds", 0.0) - ck.get("seconds", 0.0)
    if added > 1 and secs > 0:
        setattr(run.rates, rate_name, added * per_step / secs)
    line = f"trained {whose}{added} steps in {secs / 60:.1f} min ({after.get('step', 0)} in all)"
    if saved is not None and added > 0 and drafter_id(folder) == saved:
        # The folder keeps the head with the best held-out score: these steps did not beat it.
        run.kept += (kind,)
        best, what = ck.get("best_accepted", 0.0), name or "drafter"
        line += (
            f"; no step of this run scored better on the held-out conversations than the {what} it started "
            f"from (held-out accepted length {best:.3f}), so that one is kept"
        )
    run.tell(Status("train", 1.0, line=line))


def redrafter_recipe(run) -> dict:
    keys = ("exit_dim", "num_draft_layers", "rnn", "draft_vocab_size", "depth", "batch_size", "lr")
    return {k: getattr(run.train_cfg, k) for k in keys + ("skip_repeats", "soft_weight", "depth_decay")}


def eagle3_recipe(run) -> dict:
    """The EAGLE-3 head's training settings and its shape (intermediate size, draft vocabulary)."""
    keys = ("depth", "window", "batch_size", "lr", "soft_weight", "depth_decay")
    out = {k: getattr(run.eagle3_cfg, k) for k in keys}
    config = json.loads((run.head_dirs["eagle3"] / "config.json").read_text())
    layer = config.get("transformer_layer_config") or {}
    out.update(
        intermediate_size=layer.get("intermediate_size"),
        draft_vocab_size=config.get("draft_vocab_size"),
        layer_ids=config.get("eagle_aux_hidden_state_layer_ids"),
    )
    return out


def dflash_recipe(run) -> dict:
    """The DFlash drafter's training settings and its shape (layers, block, taps, mask token)."""
    keys = ("block_size", "window", "anchors", "batch_size", "lr", "gamma")
    out = {k: getattr(run.dflash_cfg, k) for k in keys}
    config = json.loads((run.head_dirs["dflash"] / "config.json").read_text())
    out.update(
        num_hidden_layers=config.get("num_hidden_layers"),
        intermediate_size=config.get("intermediate_size"),
        **(config.get("dflash_config") or {}),
    )
    return out


def train_recipe(run, kind: str) -> dict:
    """What a head's model card says of its training (``make-drafter``'s metadata)."""
    return {EAGLE3: eagle3_recipe, DFLASH: dflash_recipe}.get(kind, redrafter_recipe)(run)
