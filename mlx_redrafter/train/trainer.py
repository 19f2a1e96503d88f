"""Train a drafter on distilled data, with the LLM frozen.

Each example is a position ``i`` of a distilled reply: the drafter gets the
LLM's hidden state ``hidden[i]`` (which produced ``g0 = tokens[i]``) and,
teacher-forced, the embeddings of ``tokens[i..i+T-1]``; it predicts
``tokens[i+1..i+T]`` (paper Eq. 2). The loss at each depth is the
cross-entropy of the LLM's token plus, when the data holds the LLM's top-k
logits, ``soft_weight`` times the KL divergence from the LLM's distribution
(restricted to those top-k ids in the draft vocabulary) to the drafter's;
depth ``d`` (from 0) weighs ``depth_decay ** d``. Targets outside a reduced
draft vocabulary cannot be predicted and are left out of the loss (but count
as misses in the accuracy).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..draft.redrafter import Drafter, DrafterConfig, read_drafter, save_drafter
from ..errors import RedrafterError
from ..files import atomic_file, write_json_atomic
from ..llm.parts import hidden_size, model_parts
from .examples import Batch, Batcher, choose_draft_vocab, reply_tokens, split_examples
from .loss import depth_weights, drafter_loss, evaluate
from .shards import Corpus, read_corpus
from .world import World, digest, model_fingerprint, world

LOG = "train_log.jsonl"
CHECKPOINT = "checkpoint"


# Head shapes by name (`train --preset`). Chosen by bench/heads.py
# (bench/RESULTS.md): best held-out accuracy per training minute.
PRESETS = {
    "default": dict(exit_dim=576, num_draft_layers=1, draft_vocab_size=4096, skip_repeats=5),
}


@dataclass
class TrainConfig:
    exit_dim: int = 576
    num_draft_layers: int = 1
    rnn: bool = True
    draft_vocab_size: Optional[int] = 8192  # None: the full vocabulary
    depth: int = 5  # T: tokens predicted per example
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 200
    epochs: float = 2.0
    max_steps: Optional[int] = None
    minutes: Optional[float] = None
    eval_fraction: float = 0.02
    eval_every: int = 500
    checkpoint_every: int = 500
    seed: int = 0
    # Start the final projection from the LLM's own output embedding (rows of
    # the draft vocabulary) when exit_dim equals the LLM's hidden size.
    init_head_from_llm: bool = True
    # Leave out training positions whose g0 + next n tokens repeat earlier in the reply (0: keep all).
    skip_repeats: int = 0
    # Weight of the KL to the LLM's top-k distribution (0: hard labels only;
    # used when the data holds top-k logits).
    soft_weight: float = 1.0
    # Depth d (from 0) weighs depth_decay ** d in the loss: early drafts decide
    # how many later ones are ever used.
    depth_decay: float = 0.8
    # Fuse the intermediate-layer features the data holds into the context
    # (EAGLE-3 style; see llm/parts.py).
    fuse_features: bool = False
    # Train on this share of the training conversations (nested: the 1/4
    # share is inside the 1/2 one), for data-scaling curves.
    data_fraction: float = 1.0
    # Train on the prompts' positions too, when the data holds them.
    prompt_positions: bool = True


def llm_output_rows(model, token_ids=None) -> mx.array:
    """The LLM's output projection (``lm_head`` or the tied embedding) as a
    float32 ``[V, h]`` matrix, optionally restricted to ``token_ids``."""
    embed, _, _ = model_parts(model)
    language = getattr(model, "language_model", model)  # Qwen3.5 holds its head one level down
    layer = language.lm_head if "lm_head" in language else embed
    if "scales" in layer:
        w = mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
    else:
        w = layer.weight
    # A copy: the drafter trains it, while the LLM's own array stays frozen in the
    # compiled step (one array as both would be an input and a constant there).
    w = mx.array(w.astype(mx.float32) + 0)
    return w if token_ids is None else w[token_ids]


def learning_rate(cfg: TrainConfig, step: int, total: int, elapsed: float) -> float:
    """Linear warmup, then cosine decay to 5% over the run. With a time
    budget the run's progress is the larger of steps and time used, so the
    decay completes when the budget does."""
    warm = max(1, min(cfg.warmup_steps, total // 10))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    done = step / total
    if cfg.minutes:
        done = max(done, elapsed / (60 * cfg.minutes))
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))


@dataclass
class Start:
    """Where a run begins: step 0, or the step of the checkpoint it resumes."""

    step: int = 0
    seconds: float = 0.0  # training time already spent (counts against --minutes)
    best_accepted: float = -1.0  # the held-out score of the drafter saved in the output folder


@dataclass
class Writer:
    """Everything a run writes: the log, checkpoints and the drafter. Under
    ``mlx.launch`` only rank 0 writes (``enabled``); the others keep nothing."""

    out: Path
    cfg: TrainConfig
    meta: dict
    enabled: bool = True
    best: float = -1.0
    log_console: Optional[Callable[[str], None]] = None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.out / LOG, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.log_console:
            self.log_console(json.dumps(record))

    def drafter(self, drafter, steps: int, record: Optional[dict] = None) -> None:
        """The usable drafter (float16) in the output folder."""
        if self.enabled:
            save_drafter(
                drafter,
                self.out,
                dtype="float16",
                extra_config={"training": {**self.meta, "steps": steps, **(record or {})}},
            )

    def checkpoint(self, drafter, optimizer, step: int, seconds: float) -> None:
        """Everything ``--resume`` needs: float32 weights, optimizer state, step."""
        if not self.enabled:
            return
        ck = self.out / CHECKPOINT
        ck.mkdir(parents=True, exist_ok=True)
        save_drafter(drafter, ck / "drafter", dtype="float32")
        state = dict(tree_flatten(optimizer.state))
        with atomic_file(ck / "optimizer.safetensors") as tmp:
            mx.save_safetensors(str(tmp), {k: v for k, v in state.items() if isinstance(v, mx.array)})
        meta = {**self.meta, "best_accepted": self.best}
        write_json_atomic(ck / "state.json", {"step": step, "seconds": seconds, "config": asdict(self.cfg), **meta})

    def finish(self, drafter, optimizer, step: int, seconds: float) -> None:
        """A checkpoint, and the final weights as the drafter when no held-out
        score chose one (no held-out split, or stopped before the first eval)."""
        self.checkpoint(drafter, optimizer, step, seconds)
        if self.best < 0:
            self.drafter(drafter, step)


def new_drafter(model, corpus: Corpus, cfg: TrainConfig, eos_ids=()) -> Drafter:
    """A freshly initialized float32 drafter for ``model``, seeded by ``cfg.seed``."""
    embed, _, _ = model_parts(model)
    vocab, hidden = int(embed.weight.shape[0]), corpus.hidden_size
    dv = cfg.draft_vocab_size if cfg.draft_vocab_size and cfg.draft_vocab_size < vocab else None
    mx.random.seed(cfg.seed)
    drafter = Drafter(
        DrafterConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            exit_dim=cfg.exit_dim,
            num_draft_layers=cfg.num_draft_layers,
            rnn=cfg.rnn,
            draft_vocab_size=dv,
            feature_layers=list(corpus.feature_layers) if cfg.fuse_features else None,
        )
    )
    if cfg.fuse_features:
        # Start as the unfused drafter (the last layer passes through) and
        # learn what the other layers add.
        n = len(corpus.feature_layers)
        drafter.fuse.weight = mx.concatenate([mx.zeros((hidden, n * hidden)), mx.eye(hidden)], axis=1)
    if dv:
        drafter.draft_vocab = mx.array(choose_draft_vocab(reply_tokens(corpus), dv, vocab, always=list(eos_ids)))
    if cfg.init_head_from_llm and cfg.exit_dim == hidden:
        drafter.lm_head[-1].weight = llm_output_rows(model, drafter.draft_vocab if dv else None)
    drafter.set_dtype(mx.float32)
    return drafter


def vocab_map(drafter: Drafter, vocab: int) -> np.ndarray:
    """Full token id -> the drafter's output index (-1: outside its draft vocabulary)."""
    if not drafter.config.draft_vocab_size:
        return np.arange(vocab)
    ids = np.array(drafter.draft_vocab)
    out = np.full(vocab, -1, np.int64)
    out[ids] = np.arange(len(ids))
    return out


def _check_inputs(model, corpus: Corpus, data_dir, cfg: TrainConfig, w: World) -> None:
    """Refuse data from another model, and (under ``mlx.launch``) a rank whose
    model, data or settings differ from rank 0's, before any training step."""
    error = None
    if corpus.hidden_size != hidden_size(model):
        error = RedrafterError(
            f"The data in {data_dir} has hidden size {corpus.hidden_size} but the model's is {hidden_size(model)}.",
            "Train with the --model the data was distilled from.",
        )
    elif cfg.fuse_features and "features" not in corpus.extra:
        error = RedrafterError(
            f"--fuse-features needs intermediate-layer features, and the data in {data_dir} has none.",
            "Distill with --feature-layers default (or a list of layers) into a new --out.",
        )
    elif cfg.batch_size % w.size:
        error = RedrafterError(
            f"--batch-size {cfg.batch_size} does not split evenly over {w.size} processes.",
            f"Use a multiple of {w.size}: it is the total over all processes.",
        )
    w.check(error)
    h = corpus.hidden
    w.agree(
        {
            "model": model_fingerprint(model),
            "training data": digest(corpus.tokens, corpus.offsets, json.dumps(corpus.ids), h.shape, h[:4], h[-4:]),
        }
    )


# What ``train(extend=True)`` takes from its own config when it resumes a checkpoint.
BUDGET_FIELDS = ("minutes", "max_steps", "epochs")


def checkpoint_state(out: Path) -> dict:
    """The state of the training checkpoint in ``out`` (step, seconds, config), ``{}`` without one."""
    path = out / CHECKPOINT / "state.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _begin(model, corpus: Corpus, out: Path, cfg: TrainConfig, resume: bool, eos_ids, w: World, extend: bool = False):
    """The drafter, optimizer, config and :class:`Start` of a new or resumed
    run, identical on every rank: rank 0 reads the checkpoint (it alone wrote
    it) and its weights and optimizer state are sent to the others."""
    ck = out / CHECKPOINT
    state = (checkpoint_state(out) or None) if resume and w.rank == 0 else None
    state = w.share_json(state)
    if resume and state is None:
        raise RedrafterError(f"No checkpoint to resume in {ck}.", "Drop --resume to start a new run.")
    start = Start()
    if state is not None:
        budget = {k: getattr(cfg, k) for k in BUDGET_FIELDS} if extend else {}
        cfg = TrainConfig(**{**state["config"], **budget})
        start = Start(state["step"], state.get("seconds", 0.0), state.get("best_accepted", -1.0))
    if state is not None and w.rank == 0:
        drafter = read_drafter(ck / "drafter", dtype="float32")
    else:  # also the skeleton that receives rank 0's weights
        drafter = new_drafter(model, corpus, cfg, eos_ids)
    optimizer = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
    optimizer.init(drafter.trainable_parameters())
    if state is not None and w.rank == 0:
        saved = mx.load(str(ck / "optimizer.safetensors"))
        optimizer.state = tree_unflatten(list(saved.items()))
    if w.size > 1:
        drafter.update(w.from_rank0(drafter.parameters()))
        optimizer.state = w.from_rank0(optimizer.state)
    return drafter, optimizer, cfg, start


def make_step(drafter: Drafter, embed, optimizer, w: World, cfg: TrainConfig):
    """``step(batch, lr) -> loss``: one optimizer update from this rank's
    slice of a batch, with the gradients averaged over the ranks; the loss
    returned is the whole batch's."""
    loss_and_grad = nn.value_and_grad(drafter, drafter_loss)
    state = [drafter.state, optimizer.state]
    weights = depth_weights(cfg)

    @partial(mx.compile, inputs=state, outputs=state)
    def update(count, *arrays):
        (loss, _), grads = loss_and_grad(drafter, embed, Batch(*arrays), count, weights, cfg.soft_weight)
        optimizer.update(drafter, w.mean(grads))  # the only collective in here: see World.mean
        return loss

    def step(batch: Batch, lr: float) -> float:
        # Loss denominators over the whole batch (all ranks), so that the
        # averaged gradient is the one-process gradient.
        count = mx.maximum(w.sum(batch.mask.sum(0).astype(mx.float32)), 1) / w.size
        mx.eval(count)
        optimizer.learning_rate = mx.array(lr)
        arrays = [batch.context, batch.inputs, batch.targets, batch.mask, batch.valid]
        if batch.soft_p is not None:
            arrays += [batch.soft_ids, batch.soft_p]
        loss = update(count, *arrays)
        mx.eval(loss, state)
        return float(w.sum(loss) / w.size)

    return step


def _batchers(corpus: Corpus, cfg: TrainConfig, vmap: np.ndarray, data_dir):
    """Training and held-out batchers (sharing the hidden states on device).
    Held-out batches carry no soft targets: the held-out metrics are the hard
    labels', comparable between runs with and without them."""
    train_ex, eval_ex = split_examples(
        corpus, cfg.eval_fraction, cfg.skip_repeats, cfg.data_fraction, cfg.prompt_positions
    )
    if len(train_ex.positions) == 0:
        raise RedrafterError(f"No training examples in {data_dir}.", "Distill more data.")
    soft = bool(cfg.soft_weight) and corpus.soft_targets
    train_b = Batcher(corpus, train_ex, cfg.depth, vmap, soft=soft, fuse=cfg.fuse_features)
    eval_b = Batcher(corpus, eval_ex, cfg.depth, vmap, fuse=cfg.fuse_features)
    eval_b.hidden = train_b.hidden
    return train_b, eval_b


def log_evaluation(writer: Writer, drafter, embed, batcher: Batcher, cfg: TrainConfig, record: dict) -> None:
    """Add the held-out metrics to ``record`` and log it. The output folder
    holds the best drafter so far (by held-out accepted length), so
    overfitting late in a long run costs nothing."""
    record.update(evaluate(drafter, embed, batcher, cfg.batch_size) or {})
    score = record.get("eval_accepted_w1", 0.0)
    if score > writer.best:
        writer.best = score
        writer.drafter(drafter, record["step"], record)
        record["saved"] = True
    writer.log(record)


def _run_meta(data_dir, corpus: Corpus, vmap: np.ndarray, train_b: Batcher, eval_b: Batcher, total: int) -> dict:
    """What the log's start record says about the data."""
    return {
        "data": str(Path(data_dir).resolve()),
        "train_examples": int(len(train_b.examples.positions)),
        "eval_examples": int(len(eval_b.examples.positions)),
        "draft_vocab_coverage": round(float((vmap[reply_tokens(corpus)] >= 0).mean()), 4),
        "soft_targets": train_b.soft is not None,
        "total_steps": total,
    }


def train(
    model,
    data_dir,
    out,
    cfg: TrainConfig,
    resume: bool = False,
    eos_ids=(),
    progress: Optional[Callable[[int, int, float], None]] = None,
    log_console: Optional[Callable[[str], None]] = None,
    extend: bool = False,
) -> Path:
    """Train (or resume training) a drafter for ``model`` and save it to ``out``.

    Under ``mlx.launch`` the run is data-parallel: every rank draws the same
    batch indices, computes the gradient of its slice of each batch
    (``cfg.batch_size`` is the total), and the gradients are averaged, so the
    weights match a one-process run; rank 0 alone writes ``out``.

    A resumed run keeps the checkpoint's settings; with ``extend`` it takes
    its budget (``minutes``, ``max_steps``, ``epochs``) from ``cfg``, so a
    larger budget trains on (``make-drafter`` reruns), on the data folder as
    it is now (a rerun may have distilled more).
    """
    w, out, corpus = world(), Path(out), read_corpus(data_dir)
    _check_inputs(model, corpus, data_dir, cfg, w)
    embed, _, _ = model_parts(model)
    drafter, optimizer, cfg, start = _begin(model, corpus, out, cfg, resume, eos_ids, w, extend)
    if w.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    vmap = vocab_map(drafter, int(embed.weight.shape[0]))
    train_b, eval_b = _batchers(corpus, cfg, vmap, data_dir)
    n_train = len(train_b.examples.positions)
    total = cfg.max_steps or int(math.ceil(cfg.epochs * max(1, n_train // cfg.batch_size)))
    embed.freeze()
    step_fn = make_step(drafter, embed, optimizer, w, cfg)
    meta = _run_meta(data_dir, corpus, vmap, train_b, eval_b, total)
    writer = Writer(out, cfg, meta, enabled=w.rank == 0, best=start.best_accepted, log_console=log_console)
    if start.step == 0:
        writer.log(
            {"event": "start", "config": asdict(cfg), **meta, "params": drafter.num_params(), "world_size": w.size}
        )

    rng = np.random.default_rng(cfg.seed + start.step)
    step, running, elapsed, tic = start.step, [], start.seconds, time.perf_counter()

    def log_eval():
        rec = {
            "step": step,
            "train_loss": round(float(np.mean(running)), 4),
            "seconds": round(time.perf_counter() - tic, 1),
        }
        running.clear()
        if w.rank == 0:  # the others go on to the next step's collectives
            log_evaluation(writer, drafter, embed, eval_b, cfg, rec)

    try:
        while step < total:
            idx = rng.integers(0, n_train, cfg.batch_size)
            loss = step_fn(train_b.batch(idx.reshape(w.size, -1)[w.rank]), learning_rate(cfg, step, total, elapsed))
            # Every rank takes rank 0's clock, so that all agree on the
            # learning rate and on when the time budget ends the run.
            elapsed = float(w.from_rank0(mx.array(time.perf_counter() - tic + start.seconds)).item())
            step += 1
            running.append(loss)
            if progress:
                progress(step, total, loss)
            if step % cfg.eval_every == 0 or step == total:
                log_eval()
            if step % cfg.checkpoint_every == 0:
                writer.checkpoint(drafter, optimizer, step, elapsed)
            if cfg.minutes is not None and elapsed > 60 * cfg.minutes:
                writer.log({"event": "time budget reached", "step": step})
                if running:  # the final metrics, also when the budget ends the run
                    log_eval()
                break
    except KeyboardInterrupt:
        writer.finish(drafter, optimizer, step, time.perf_counter() - tic + start.seconds)
        writer.log({"event": "interrupted", "step": step})
        raise
    writer.finish(drafter, optimizer, step, time.perf_counter() - tic + start.seconds)
    return out
