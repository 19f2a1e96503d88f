"""Train an EAGLE-3 head for any mlx-lm model on distilled data, with
training-time test (train/ttt.py), the LLM frozen.

The data is what ``distill`` writes, with the head's three taps kept as
``features`` (:func:`distill_layers`). The head's shape comes from the model
(:func:`head_config`): its width, attention heads, RoPE and norm eps; a
reduced draft vocabulary of the most frequent reply tokens (``d2t`` maps it
back); and an MLP no wider than :data:`MLP_RATIO` times the width, so that a
draft call stays a small share of the model's decode step (bench/RESULTS.md
section 24 measures it). The head reads the model's own input embedding, and
is saved without one, in the speculators layout (draft/eagle3_io.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_unflatten

from ..draft.eagle3 import Eagle3Config, Eagle3Head
from ..draft.eagle3_io import read_eagle3, save_eagle3
from ..errors import RedrafterError
from ..files import atomic_file
from .examples import choose_draft_vocab, in_share, reply_tokens
from .shards import Corpus, read_corpus
from .trainer import CHECKPOINT, Writer, checkpoint_state, learning_rate, llm_output_rows
from .ttt import WindowBatcher, evaluate_ttt, ttt_loss, window_starts

MLP_RATIO = 2.0  # the head's MLP is at most this many times its width (the target's own, when narrower)


@dataclass
class Eagle3TrainConfig:
    """An EAGLE-3 head's training (``make-drafter --head eagle3``)."""

    draft_vocab_size: Optional[int] = 4096  # None: the full vocabulary
    intermediate_size: Optional[int] = None  # None: min(the target's, MLP_RATIO x width)
    depth: int = 5  # training-time test steps: draft calls trained, each on the previous one's output
    window: int = 128  # positions per training sequence
    batch_size: int = 4  # windows per step
    lr: float = 5e-4
    weight_decay: float = 0.01
    warmup_steps: int = 100
    epochs: float = 2.0
    max_steps: Optional[int] = None
    minutes: Optional[float] = None
    eval_fraction: float = 0.02
    eval_every: int = 200
    checkpoint_every: int = 200
    seed: int = 0
    soft_weight: float = 1.0  # KL to the LLM's top-k (when the data holds it)
    depth_decay: float = 0.8
    prompt_positions: bool = True  # train on the prompts' positions too
    data_fraction: float = 1.0
    init_head_from_llm: bool = True  # lm_head from the LLM's output rows of the draft vocabulary, norm from its own

    @property
    def positions_per_step(self) -> int:
        return self.window * self.batch_size


def layer_ids(num_layers: int) -> List[int]:
    """The hidden states a new head fuses: EAGLE-3's ``[2, L // 2, L - 3]``, kept inside tiny models."""
    return [min(2, num_layers), max(1, num_layers // 2), max(1, num_layers - 3)]


def distill_layers(num_layers: int) -> List[int]:
    """The layers whose outputs distillation keeps for a new head (hidden state ``k`` is layer ``k - 1``'s)."""
    return [i - 1 for i in layer_ids(num_layers)]


def head_config(model, vocab: int, cfg: Eagle3TrainConfig) -> Eagle3Config:
    """A new head's shape for ``model`` (see the module doc)."""
    args = model.args
    h = int(args.hidden_size)
    heads = int(args.num_attention_heads)
    inter = cfg.intermediate_size or min(int(getattr(args, "intermediate_size", 4 * h)), int(MLP_RATIO * h))
    dv = cfg.draft_vocab_size if cfg.draft_vocab_size and cfg.draft_vocab_size < vocab else vocab
    layers = len(model.model.layers)
    return Eagle3Config(
        hidden_size=h,
        vocab_size=vocab,
        draft_vocab_size=dv,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(args, "num_key_value_heads", None) or heads),
        head_dim=getattr(args, "head_dim", None) or h // heads,
        rms_norm_eps=float(getattr(args, "rms_norm_eps", 1e-6)),
        rope_theta=float(getattr(args, "rope_theta", 10000.0)),
        rope_scaling=getattr(args, "rope_scaling", None),
        max_position_embeddings=getattr(args, "max_position_embeddings", None),
        layer_ids=layer_ids(layers),
        norm_before_residual=True,  # vLLM's default for the speculators layout
    )


def new_head(model, corpus: Corpus, cfg: Eagle3TrainConfig, eos_ids=()) -> Eagle3Head:
    """A freshly initialized float32 head for ``model``, seeded by ``cfg.seed``, bound to it."""
    from ..llm.parts import model_parts

    embed = model_parts(model)[0]
    vocab = int(embed.weight.shape[0])
    mx.random.seed(cfg.seed)
    config = head_config(model, vocab, cfg)
    head = Eagle3Head(config, own_embedding=False)
    ids = None
    if head.reduced:
        ids = choose_draft_vocab(reply_tokens(corpus), config.draft_vocab_size, vocab, always=list(eos_ids))
        head.d2t = mx.array(ids - np.arange(len(ids)), dtype=mx.int32)
    h = config.hidden_size
    head.fc.weight = mx.concatenate([mx.zeros((h, 2 * h)), mx.eye(h)], axis=1)  # start from the highest tap
    if cfg.init_head_from_llm:
        head.lm_head.weight = llm_output_rows(model, None if ids is None else mx.array(ids))
        if "norm" in model.model:
            head.norm.weight = model.model.norm.weight.astype(mx.float32)
    head.set_dtype(mx.float32)
    return head.bind(model)


def check_data(model, corpus: Corpus, data_dir) -> None:
    """Refuse data without the head's taps (or of another model), before any step."""
    h, layers = int(model.args.hidden_size), len(model.model.layers)
    want = distill_layers(layers)
    if corpus.hidden_size != h:
        raise RedrafterError(
            f"The data in {data_dir} has hidden size {corpus.hidden_size} but the model's is {h}.",
            "Train with the --model the data was distilled from.",
        )
    if "features" not in corpus.extra or list(corpus.feature_layers) != want:
        raise RedrafterError(
            f"An EAGLE-3 head needs the outputs of layers {want} in the data, and {data_dir} holds "
            f"{list(corpus.feature_layers) or 'none'}.",
            f"Distill with --feature-layers {','.join(map(str, want))} into a new --out "
            "(make-drafter --head eagle3 does).",
        )


class HeadWriter(Writer):
    """The trainer's writer, saving an EAGLE-3 head (speculators layout) instead of a ReDrafter drafter."""

    def drafter(self, head, steps: int, record: Optional[dict] = None) -> None:
        if self.enabled:
            save_eagle3(
                head,
                self.out,
                dtype="float16",
                extra_config={"training": {**self.meta, "steps": steps, **(record or {})}},
            )

    def checkpoint(self, head, optimizer, step: int, seconds: float) -> None:
        from mlx.utils import tree_flatten

        from ..files import write_json_atomic

        ck = self.out / CHECKPOINT
        ck.mkdir(parents=True, exist_ok=True)
        save_eagle3(head, ck / "drafter", dtype="float32")
        state = dict(tree_flatten(optimizer.state))
        with atomic_file(ck / "optimizer.safetensors") as tmp:
            mx.save_safetensors(str(tmp), {k: v for k, v in state.items() if isinstance(v, mx.array)})
        meta = {**self.meta, "best_accepted": self.best}
        write_json_atomic(ck / "state.json", {"step": step, "seconds": seconds, "config": asdict(self.cfg), **meta})


def make_update(head: Eagle3Head, optimizer, cfg: Eagle3TrainConfig):
    """``step(window, lr) -> loss``: one optimizer update (compiled)."""
    loss_and_grad = nn.value_and_grad(head, ttt_loss)
    state = [head.state, optimizer.state]
    weights = mx.array(cfg.depth_decay ** np.arange(cfg.depth), dtype=mx.float32)

    @partial(mx.compile, inputs=state, outputs=state)
    def update(taps, tokens, targets, mask, valid, *soft):
        from .ttt import Window

        (loss, _), grads = loss_and_grad(
            head, Window(taps, tokens, targets, mask, valid, *soft), weights, cfg.soft_weight
        )
        optimizer.update(head, grads)
        return loss

    def step(w, lr: float) -> float:
        optimizer.learning_rate = mx.array(lr)
        soft = [w.soft_ids, w.soft_p] if w.soft_p is not None else []
        loss = update(w.taps, w.tokens, w.targets, w.mask, w.valid, *soft)
        mx.eval(loss, state)
        return float(loss)

    return step


def _batchers(corpus: Corpus, cfg: Eagle3TrainConfig, vmap: np.ndarray, data_dir):
    share = (lambda cid: in_share(cid, cfg.data_fraction)) if cfg.data_fraction < 1 else None
    train_w = window_starts(corpus, cfg.window, cfg.eval_fraction, held=False, share=share)
    held_w = window_starts(corpus, cfg.window, cfg.eval_fraction, held=True)
    if len(train_w[0]) == 0:
        raise RedrafterError(f"No training windows in {data_dir}.", "Distill more data.")
    everything = np.ones(len(corpus.tokens), bool)
    replies = corpus.reply if corpus.reply is not None else everything
    soft = bool(cfg.soft_weight) and corpus.soft_targets
    origins = everything if cfg.prompt_positions else replies
    train_b = WindowBatcher(corpus, *train_w, cfg.window, cfg.depth, vmap, origins, soft=soft)
    held_b = WindowBatcher(corpus, *held_w, cfg.window, cfg.depth, vmap, replies)
    held_b.taps = train_b.taps  # one copy of the taps on the device
    return train_b, held_b


def _begin(model, corpus, out: Path, cfg: Eagle3TrainConfig, resume: bool, eos_ids, extend: bool):
    state = checkpoint_state(out) if resume else {}
    if resume and not state:
        raise RedrafterError(f"No checkpoint to resume in {out / CHECKPOINT}.", "Drop --resume to start a new run.")
    start = (0, 0.0, -1.0)
    if state:
        budget = {k: getattr(cfg, k) for k in ("minutes", "max_steps", "epochs")} if extend else {}
        cfg = Eagle3TrainConfig(**{**state["config"], **budget})
        start = (state["step"], state.get("seconds", 0.0), state.get("best_accepted", -1.0))
        head = read_eagle3(out / CHECKPOINT / "drafter", dtype="float32").bind(model)
    else:
        head = new_head(model, corpus, cfg, eos_ids)
    optimizer = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
    optimizer.init(head.trainable_parameters())
    if state:
        saved = mx.load(str(out / CHECKPOINT / "optimizer.safetensors"))
        optimizer.state = tree_unflatten(list(saved.items()))
    return head, optimizer, cfg, start


def train_eagle3(
    model,
    data_dir,
    out,
    cfg: Eagle3TrainConfig,
    resume: bool = False,
    eos_ids=(),
    progress: Optional[Callable[[int, int, float], None]] = None,
    log_console: Optional[Callable[[str], None]] = None,
    extend: bool = False,
) -> Path:
    """Train (or resume training) an EAGLE-3 head for ``model`` and save the
    best one (by held-out accepted length) to ``out``; as
    :func:`~mlx_redrafter.train.trainer.train` does for the ReDrafter head,
    one process."""
    out, corpus = Path(out), read_corpus(data_dir)
    check_data(model, corpus, data_dir)
    head, optimizer, cfg, (step, seconds, best) = _begin(model, corpus, out, cfg, resume, eos_ids, extend)
    out.mkdir(parents=True, exist_ok=True)
    train_b, held_b = _batchers(corpus, cfg, head_vocab_map(head, head.config.vocab_size), data_dir)
    total = cfg.max_steps or int(math.ceil(cfg.epochs * max(1, len(train_b.starts) // cfg.batch_size)))
    meta = {
        "data": str(Path(data_dir).resolve()),
        "train_windows": len(train_b.starts),
        "held_windows": len(held_b.starts),
        "total_steps": total,
        "head": "eagle3",
    }
    writer = HeadWriter(out, cfg, meta, best=best, log_console=log_console)
    if step == 0:
        writer.log({"event": "start", "config": asdict(cfg), **meta, "params": head.num_params()})
    _steps(_Fit(head, optimizer, cfg, train_b, held_b, writer, total, seconds), step, progress)
    return out


@dataclass
class _Fit:
    """What the training loop works on."""

    head: Eagle3Head
    optimizer: object
    cfg: Eagle3TrainConfig
    train_b: WindowBatcher
    held_b: WindowBatcher
    writer: HeadWriter
    total: int
    seconds: float  # training time before this run (counts against the budget)

    def evaluate(self, step: int, running: list, seconds: float) -> None:
        """Log the held-out metrics; the best head so far (by accepted length) is the folder's."""
        rec = {"step": step, "train_loss": round(float(np.mean(running)), 4), "seconds": round(seconds, 1)}
        running.clear()
        rec.update(evaluate_ttt(self.head, self.held_b, self.cfg.batch_size) or {})
        if "eval_accepted_w1" in rec and rec["eval_accepted_w1"] > self.writer.best:
            self.writer.best = rec["eval_accepted_w1"]
            self.writer.drafter(self.head, step, rec)
            rec["saved"] = True
        self.writer.log(rec)


def _steps(fit: _Fit, step: int, progress) -> None:
    """Optimizer steps until the step count or the time budget ends the run; Ctrl-C saves a checkpoint."""
    cfg, writer = fit.cfg, fit.writer
    update = make_update(fit.head, fit.optimizer, cfg)
    rng = np.random.default_rng(cfg.seed + step)
    running, tic = [], time.perf_counter()
    spent = lambda: time.perf_counter() - tic + fit.seconds  # noqa: E731
    try:
        while step < fit.total:
            batch = fit.train_b.batch(rng.integers(0, len(fit.train_b.starts), cfg.batch_size))
            loss = update(batch, learning_rate(cfg, step, fit.total, spent()))
            step += 1
            running.append(loss)
            if progress:
                progress(step, fit.total, loss)
            if step % cfg.eval_every == 0 or step == fit.total:
                fit.evaluate(step, running, time.perf_counter() - tic)
            if step % cfg.checkpoint_every == 0:
                writer.checkpoint(fit.head, fit.optimizer, step, spent())
            if cfg.minutes is not None and spent() > 60 * cfg.minutes:
                writer.log({"event": "time budget reached", "step": step})
                if running:  # the final metrics, also when the budget ends the run
                    fit.evaluate(step, running, time.perf_counter() - tic)
                break
    except KeyboardInterrupt:
        writer.finish(fit.head, fit.optimizer, step, spent())
        writer.log({"event": "interrupted", "step": step})
        raise
    writer.finish(fit.head, fit.optimizer, step, spent())


def head_vocab_map(head: Eagle3Head, vocab: int) -> np.ndarray:
    """Full token id -> the head's draft id (-1: outside its draft vocabulary)."""
    ids = head.draft_to_target
    if ids is None:
        return np.arange(vocab)
    out = np.full(vocab, -1, np.int64)
    out[np.array(ids)] = np.arange(len(ids))
    return out


def measure_rate(model, cfg: Eagle3TrainConfig, steps: int = 3, top_k: int = 16) -> float:
    """Training positions per second of a head ``cfg`` for ``model`` here, on random data of the real shapes."""
    from ..llm.parts import model_parts

    embed = model_parts(model)[0]
    vocab, h = int(embed.weight.shape[0]), int(model.args.hidden_size)
    n = cfg.window * 4 + cfg.depth + 2
    rng = np.random.default_rng(0)
    corpus = Corpus(
        rng.integers(0, vocab, n).astype(np.int32),
        np.zeros((n, h), np.float16),
        np.array([0, n]),
        ["probe"],
        {"features": rng.standard_normal((n, 3 * h)).astype(np.float16)},
        distill_layers(len(model.model.layers)),
    )
    if top_k:
        corpus.extra["topk_ids"] = rng.integers(0, vocab, (n, top_k)).astype(np.int32)
        corpus.extra["topk_logits"] = rng.standard_normal((n, top_k)).astype(np.float32)
    probe = replace(cfg, init_head_from_llm=False, eval_fraction=0.0)
    head = new_head(model, corpus, probe)
    optimizer = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
    optimizer.init(head.trainable_parameters())
    train_b, _ = _batchers(corpus, probe, head_vocab_map(head, vocab), "probe")
    update = make_update(head, optimizer, probe)
    update(train_b.batch(rng.integers(0, len(train_b.starts), cfg.batch_size)), cfg.lr)  # compiles
    tic = time.perf_counter()
    for _ in range(steps):
        update(train_b.batch(rng.integers(0, len(train_b.starts), cfg.batch_size)), cfg.lr)
    return steps * cfg.positions_per_step / (time.perf_counter() - tic)
