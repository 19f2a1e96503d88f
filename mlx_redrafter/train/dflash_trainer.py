"""Train a DFlash block drafter for any mlx-lm model on distilled data
(``make-drafter --head dflash``), the LLM frozen, as the method trains one
(arXiv 2602.06036; SpecForge, vLLM speculators):

* the data is what ``distill`` writes, with the target's taps kept as
  ``features`` (the same three layers an EAGLE-3 head reads:
  :func:`~mlx_redrafter.train.eagle3_trainer.distill_layers`, so one
  distillation serves both heads and ``--head auto``);
* each step takes windows of sequences and **random anchor positions** in
  them; a block is the anchor token and ``block_size - 1`` mask tokens at
  the positions after it;
* attention is **bidirectional inside a block and causal across blocks**:
  a block attends to the window's context at positions before its anchor
  (each draft layer's own keys and values of the fused taps) and to itself;
* slot ``k`` of a block is trained on the LLM's token ``k`` places after the
  anchor, by a **cross-entropy that decays over positions**,
  ``exp(-(k - 1) / gamma)`` (gamma 7 for blocks of 16, 5 for 10, 4 for 8).

The drafter's shape comes from the model (:func:`drafter_config`): its
width, heads and RoPE, an MLP no wider than twice the width, and a number
of layers chosen by the model's depth (:func:`drafter_layers`). It reads the
model's own embedding and LM head and is saved in z-lab's layout
(draft/dflash_io.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_unflatten

from ..draft.dflash import DFlashConfig, DFlashDrafter
from ..draft.dflash_io import read_dflash, save_dflash
from ..errors import RedrafterError
from ..files import atomic_file
from .dflash_blocks import BlockBatcher, Blocks, block_loss, evaluate
from .eagle3_trainer import distill_layers
from .examples import in_share
from .shards import Corpus, read_corpus
from .trainer import CHECKPOINT, Writer, checkpoint_state, learning_rate, llm_output_rows
from .ttt import window_starts

MLP_RATIO = 2.0  # the drafter's MLP is at most this many times its width (the target's own, when narrower)


@dataclass
class DFlashTrainConfig:
    """A DFlash drafter's training (``make-drafter --head dflash``)."""

    layers: Optional[int] = None  # draft layers (None: :func:`drafter_layers` of the model)
    block_size: int = 8  # the last verified token and 7 drafts
    intermediate_size: Optional[int] = None  # None: min(the target's, MLP_RATIO x width)
    gamma: Optional[float] = None  # the loss's decay over positions (None: the method's for the block size)
    window: int = 256  # positions of a sequence per training window
    anchors: int = 16  # blocks per window
    batch_size: int = 2  # windows per step
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup_steps: int = 100
    epochs: float = 2.0
    max_steps: Optional[int] = None
    minutes: Optional[float] = None
    eval_fraction: float = 0.02
    eval_every: int = 200
    checkpoint_every: int = 200
    seed: int = 0
    prompt_positions: bool = True  # anchors at the prompts' positions too
    data_fraction: float = 1.0
    mask_token_id: Optional[int] = None  # None: an id the data never holds (else its rarest)

    @property
    def positions_per_step(self) -> int:
        """Drafted positions trained per step (blocks x drafts)."""
        return self.batch_size * self.anchors * (self.block_size - 1)


def drafter_layers(num_layers: int) -> int:
    """Draft layers for a model of ``num_layers``: one per 24 of its layers,
    1 to 5. z-lab's drafters have 5 for 36 to 64 layers, trained for days on
    GPUs; on a user's machine a training run lasts minutes to an hour, and a
    smaller drafter trains more steps in it and costs less each draft: on the
    default model (30 layers), 1, 2 and 3 layers trained 16 minutes each
    accepted 0.157, 0.112 and 0.114 of the block's first drafts on MT-Bench
    (bench/RESULTS.md section 33)."""
    return max(1, min(5, num_layers // 24))


def default_gamma(block_size: int) -> float:
    """The method's decay: 7 for blocks of 16, 5 for 10, 4 for 8 (and in proportion)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2))


def drafter_config(model, vocab: int, cfg: DFlashTrainConfig, mask: int) -> DFlashConfig:
    """A new drafter's shape for ``model`` (see the module doc)."""
    args = model.args
    h, heads = int(args.hidden_size), int(args.num_attention_heads)
    n = len(model.model.layers)
    inter = cfg.intermediate_size or min(int(getattr(args, "intermediate_size", 4 * h)), int(MLP_RATIO * h))
    return DFlashConfig(
        hidden_size=h,
        num_hidden_layers=cfg.layers or drafter_layers(n),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(args, "num_key_value_heads", None) or heads),
        intermediate_size=inter,
        vocab_size=vocab,
        target_layer_ids=tuple(distill_layers(n)),
        mask_token_id=mask,
        block_size=cfg.block_size,
        head_dim=getattr(args, "head_dim", None) or h // heads,
        rms_norm_eps=float(getattr(args, "rms_norm_eps", 1e-6)),
        rope_theta=float(getattr(args, "rope_theta", 1000000.0)),
        rope_scaling=getattr(args, "rope_scaling", None),
        max_position_embeddings=int(getattr(args, "max_position_embeddings", None) or 40960),
        num_target_layers=n,
    )


def mask_token(corpus: Corpus, vocab: int) -> int:
    """The mask token of a new drafter: the highest id the data never holds, else its rarest."""
    counts = np.bincount(corpus.tokens, minlength=vocab)[:vocab]
    unseen = np.nonzero(counts == 0)[0]
    return int(unseen[-1]) if len(unseen) else int(np.argmin(counts))


def new_drafter(model, corpus: Corpus, cfg: DFlashTrainConfig) -> DFlashDrafter:
    """A freshly initialized float32 drafter for ``model``, seeded by ``cfg.seed``, bound to it."""
    from ..llm.parts import model_parts

    vocab = int(model_parts(model)[0].weight.shape[0])
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else mask_token(corpus, vocab)
    mx.random.seed(cfg.seed)
    drafter = DFlashDrafter(drafter_config(model, vocab, cfg, mask))
    if "norm" in model.model:  # the target's final norm: its LM head reads states so scaled
        drafter.norm.weight = model.model.norm.weight.astype(mx.float32)
    drafter.set_dtype(mx.float32)
    return drafter.bind(model)


def check_data(model, corpus: Corpus, data_dir) -> None:
    """Refuse data without the drafter's taps (or of another model), before any step."""
    h, want = int(model.args.hidden_size), distill_layers(len(model.model.layers))
    if corpus.hidden_size != h:
        raise RedrafterError(
            f"The data in {data_dir} has hidden size {corpus.hidden_size} but the model's is {h}.",
            "Train with the --model the data was distilled from.",
        )
    if "features" not in corpus.extra or list(corpus.feature_layers) != want:
        raise RedrafterError(
            f"A DFlash drafter needs the outputs of layers {want} in the data, and {data_dir} holds "
            f"{list(corpus.feature_layers) or 'none'}.",
            f"Distill with --feature-layers {','.join(map(str, want))} into a new --out "
            "(make-drafter --head dflash does).",
        )


# --------------------------------------------------------------------------- the run


class DrafterWriter(Writer):
    """The trainer's writer, saving a DFlash drafter (z-lab's layout) instead of a ReDrafter drafter."""

    def drafter(self, drafter, steps: int, record: Optional[dict] = None) -> None:
        if self.enabled:
            extra = {"training": {**self.meta, "steps": steps, **(record or {})}}
            save_dflash(drafter, self.out, dtype="float16", extra_config=extra)

    def checkpoint(self, drafter, optimizer, step: int, seconds: float) -> None:
        from mlx.utils import tree_flatten

        from ..files import write_json_atomic

        ck = self.out / CHECKPOINT
        ck.mkdir(parents=True, exist_ok=True)
        save_dflash(drafter, ck / "drafter", dtype="float32")
        state = dict(tree_flatten(optimizer.state))
        with atomic_file(ck / "optimizer.safetensors") as tmp:
            mx.save_safetensors(str(tmp), {k: v for k, v in state.items() if isinstance(v, mx.array)})
        meta = {**self.meta, "best_accepted": self.best}
        write_json_atomic(ck / "state.json", {"step": step, "seconds": seconds, "config": asdict(self.cfg), **meta})


def make_update(drafter: DFlashDrafter, optimizer, head_w: mx.array, cfg: DFlashTrainConfig):
    """``step(blocks, lr) -> loss``: one optimizer update."""
    loss_and_grad = nn.value_and_grad(drafter, block_loss)
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    weights = mx.array(np.exp(-np.arange(cfg.block_size - 1) / gamma), mx.float32)

    def step(b: Blocks, lr: float) -> float:
        optimizer.learning_rate = mx.array(lr)
        (loss, _), grads = loss_and_grad(drafter, head_w, b, weights)
        optimizer.update(drafter, grads)
        mx.eval(loss, drafter.parameters(), optimizer.state)
        return float(loss)

    return step


def _batchers(corpus: Corpus, cfg: DFlashTrainConfig, mask_id: int, data_dir):
    share = (lambda cid: in_share(cid, cfg.data_fraction)) if cfg.data_fraction < 1 else None
    train_w = window_starts(corpus, cfg.window, cfg.eval_fraction, held=False, share=share)
    held_w = window_starts(corpus, cfg.window, cfg.eval_fraction, held=True)
    if len(train_w[0]) == 0:
        raise RedrafterError(f"No training windows in {data_dir}.", "Distill more data.")
    everything = np.ones(len(corpus.tokens), bool)
    replies = corpus.reply if corpus.reply is not None else everything
    train_b = BlockBatcher(corpus, *train_w, cfg, mask_id, everything if cfg.prompt_positions else replies)
    held_b = BlockBatcher(corpus, *held_w, cfg, mask_id, replies)
    held_b.taps = train_b.taps  # one copy of the taps on the device
    return train_b, held_b


def _begin(model, corpus, out: Path, cfg: DFlashTrainConfig, resume: bool, extend: bool):
    state = checkpoint_state(out) if resume else {}
    if resume and not state:
        raise RedrafterError(f"No checkpoint to resume in {out / CHECKPOINT}.", "Drop --resume to start a new run.")
    start = (0, 0.0, -1.0)
    if state:
        budget = {k: getattr(cfg, k) for k in ("minutes", "max_steps", "epochs")} if extend else {}
        cfg = DFlashTrainConfig(**{**state["config"], **budget})
        start = (state["step"], state.get("seconds", 0.0), state.get("best_accepted", -1.0))
        drafter = read_dflash(out / CHECKPOINT / "drafter", dtype="float32").bind(model)
    else:
        drafter = new_drafter(model, corpus, cfg)
    optimizer = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
    optimizer.init(drafter.trainable_parameters())
    if state:
        saved = mx.load(str(out / CHECKPOINT / "optimizer.safetensors"))
        optimizer.state = tree_unflatten(list(saved.items()))
    return drafter, optimizer, cfg, start


def train_dflash(
    model,
    data_dir,
    out,
    cfg: DFlashTrainConfig,
    resume: bool = False,
    eos_ids=(),
    progress: Optional[Callable[[int, int, float], None]] = None,
    log_console: Optional[Callable[[str], None]] = None,
    extend: bool = False,
) -> Path:
    """Train (or resume training) a DFlash drafter for ``model`` and save the
    best one (by held-out accepted length) to ``out``, as
    :func:`~mlx_redrafter.train.eagle3_trainer.train_eagle3` does for an EAGLE-3 head."""
    out, corpus = Path(out), read_corpus(data_dir)
    check_data(model, corpus, data_dir)
    drafter, optimizer, cfg, (step, seconds, best) = _begin(model, corpus, out, cfg, resume, extend)
    out.mkdir(parents=True, exist_ok=True)
    train_b, held_b = _batchers(corpus, cfg, drafter.config.mask_token_id, data_dir)
    total = cfg.max_steps or int(math.ceil(cfg.epochs * max(1, len(train_b.starts) // cfg.batch_size)))
    meta = {
        "data": str(Path(data_dir).resolve()),
        "train_windows": len(train_b.starts),
        "held_windows": len(held_b.starts),
        "total_steps": total,
        "head": "dflash",
    }
    writer = DrafterWriter(out, cfg, meta, best=best, log_console=log_console)
    if step == 0:
        writer.log({"event": "start", "config": asdict(cfg), **meta, "params": drafter.num_params()})
    head_w = llm_output_rows(model)
    _steps(drafter, optimizer, head_w, cfg, train_b, held_b, writer, total, seconds, step, progress)
    return out


def _steps(drafter, optimizer, head_w, cfg, train_b, held_b, writer, total, before, step, progress) -> None:
    """Optimizer steps until the step count or the time budget ends the run; Ctrl-C saves a checkpoint."""
    update = make_update(drafter, optimizer, head_w, cfg)
    rng = np.random.default_rng(cfg.seed + step)
    running, tic = [], time.perf_counter()
    spent = lambda: time.perf_counter() - tic + before  # noqa: E731

    def evaluate_now():
        rec = {"step": step, "train_loss": round(float(np.mean(running)), 4), "seconds": round(spent(), 1)}
        running.clear()
        rec.update(evaluate(drafter, head_w, held_b, cfg.batch_size) or {})
        if "eval_accepted_w1" in rec and rec["eval_accepted_w1"] > writer.best:
            writer.best = rec["eval_accepted_w1"]
            writer.drafter(drafter, step, rec)
            rec["saved"] = True
        writer.log(rec)

    try:
        while step < total:
            batch = train_b.batch(rng.integers(0, len(train_b.starts), cfg.batch_size), rng)
            loss = update(batch, learning_rate(cfg, step, total, spent()))
            step += 1
            running.append(loss)
            if progress:
                progress(step, total, loss)
            if step % cfg.eval_every == 0 or step == total:
                evaluate_now()
            if step % cfg.checkpoint_every == 0:
                writer.checkpoint(drafter, optimizer, step, spent())
            if cfg.minutes is not None and spent() > 60 * cfg.minutes:
                writer.log({"event": "time budget reached", "step": step})
                if running:
                    evaluate_now()
                break
    except KeyboardInterrupt:
        writer.finish(drafter, optimizer, step, spent())
        writer.log({"event": "interrupted", "step": step})
        raise
    writer.finish(drafter, optimizer, step, spent())


def measure_rate(model, cfg: DFlashTrainConfig, steps: int = 3) -> float:
    """Trained positions (drafted slots) per second of a drafter ``cfg`` for ``model`` here, on random data."""
    from ..llm.parts import model_parts

    vocab, h = int(model_parts(model)[0].weight.shape[0]), int(model.args.hidden_size)
    n = cfg.window * 2 + 2
    rng = np.random.default_rng(0)
    layers = distill_layers(len(model.model.layers))
    corpus = Corpus(
        rng.integers(0, vocab, n).astype(np.int32),
        np.zeros((n, h), np.float16),
        np.array([0, n]),
        ["probe"],
        {"features": rng.standard_normal((n, len(layers) * h)).astype(np.float16)},
        layers,
    )
    probe = DFlashTrainConfig(**{**asdict(cfg), "eval_fraction": 0.0})
    drafter = new_drafter(model, corpus, probe)
    optimizer = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
    optimizer.init(drafter.trainable_parameters())
    train_b, _ = _batchers(corpus, probe, drafter.config.mask_token_id, "probe")
    update = make_update(drafter, optimizer, llm_output_rows(model), probe)
    update(train_b.batch(rng.integers(0, len(train_b.starts), cfg.batch_size), rng), cfg.lr)  # warms up
    tic = time.perf_counter()
    for _ in range(steps):
        update(train_b.batch(rng.integers(0, len(train_b.starts), cfg.batch_size), rng), cfg.lr)
    return steps * cfg.positions_per_step / (time.perf_counter() - tic)
