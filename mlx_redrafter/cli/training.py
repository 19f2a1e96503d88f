"""The training commands: ``distill``, ``train`` and ``train-controller``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..config import is_layer_head
from ..errors import RedrafterError
from ..train.trainer import PRESETS
from .options import BeamWidthOpt, ModelOpt, NeededDrafterOpt, SystemOpt, _runtime, app, err, progress_bar


def _feature_layers(spec: str, model: str) -> list:
    """``--feature-layers``: 'none', 'default' or comma-separated layer indices."""
    spec = spec.strip().lower()
    if spec in ("", "none"):
        return []
    if spec == "default":
        from ..llm.load import resolve_model_path
        from ..llm.parts import default_feature_layers

        config = json.loads((resolve_model_path(model) / "config.json").read_text())
        return default_feature_layers(int(config["num_hidden_layers"]))
    try:
        return sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise RedrafterError(f"--feature-layers {spec!r} is not 'none', 'default' or a list like 2,15.") from None


@app.command()
def distill(
    model: str = ModelOpt,
    prompts: Optional[Path] = typer.Option(
        None, "--prompts", help="JSONL(.gz) of conversations (default: the ShareGPT prompts shipped with the package)."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Data folder (resumable)."),
    turns: int = typer.Option(1, "--turns", help="User turns answered per conversation."),
    batch_size: int = typer.Option(48, "--batch-size"),
    max_new_tokens: int = typer.Option(192, "--max-new-tokens"),
    max_prompt_tokens: int = typer.Option(384, "--max-prompt-tokens"),
    minutes: Optional[float] = typer.Option(
        None, "--minutes", help="Time budget in minutes, over all runs into --out (a rerun resumes within it)."
    ),
    max_conversations: Optional[int] = typer.Option(None, "--max-conversations"),
    system: Optional[str] = SystemOpt,
    seed: int = typer.Option(0, "--seed"),
    stop_loops: int = typer.Option(
        12, "--stop-loops", help="End a reply after N tokens in a row that repeat its own text (0 = never)."
    ),
    top_k: int = typer.Option(16, "--top-k", help="Keep the LLM's top-k logits per token as soft targets (0 = none)."),
    feature_layers: str = typer.Option(
        "none",
        "--feature-layers",
        help="Also keep these layers' hidden states for feature fusion: "
        "'none', 'default' (a low and a middle layer) or indices like 2,15.",
    ),
    prompt_positions: bool = typer.Option(
        True,
        "--prompt-positions/--no-prompt-positions",
        help="Also keep the prompts' positions (computed by the prefill anyway; needs --top-k for their labels).",
    ),
):
    """Answer training prompts with the LLM (greedy) and keep its tokens and hidden states."""
    from ..train.distill import DistillConfig

    if turns < 1 or batch_size < 1 or max_new_tokens < 1:
        raise RedrafterError("--turns, --batch-size and --max-new-tokens must be at least 1.")
    if not 0 <= top_k <= 256:
        raise RedrafterError(f"--top-k must be between 0 and 256 (got {top_k}).")
    cfg = DistillConfig(
        turns,
        batch_size,
        max_new_tokens,
        max_prompt_tokens,
        minutes,
        max_conversations,
        system=system,
        seed=seed,
        stop_loops=stop_loops,
        top_k=top_k,
        feature_layers=_feature_layers(feature_layers, model),
        prompt_positions=prompt_positions and top_k > 0,
    )
    _run_distill(model, _training_prompts(prompts), out, cfg)


def _training_prompts(prompts: Optional[Path]) -> Path:
    """``--prompts``, else the ShareGPT prompts shipped with the package."""
    from ..prompts import default_training_prompts

    source = prompts or default_training_prompts()
    if source is None:
        raise RedrafterError(
            "No --prompts given and the ShareGPT prompts are missing from the package (mlx_redrafter/data).",
            "Reinstall mlx-redrafter, or pass --prompts FILE.jsonl.",
        )
    return source


def _run_distill(model: str, prompts: Path, out: Path, cfg) -> None:
    """Distil under a progress bar (rank 0's, under mlx.launch); Ctrl-C keeps the finished replies."""
    from ..train.distill import distill as run_distill
    from ..train.world import world

    w = world()
    if w.size > 1:  # under mlx.launch: rank 0 shows the bar, every rank says where it is
        err.print(f"{w.label}: distilling its share of the prompts into {out}")
    with progress_bar("{task.fields[info]}", disable=w.rank != 0) as bar:
        task = bar.add_task("distilling" + (f" ({w.label})" if w.size > 1 else ""), total=None, info="loading")
        try:
            m = run_distill(model, prompts, out, cfg, progress=_distill_progress(bar, task, cfg))
        except KeyboardInterrupt:
            err.print(f"Interrupted: finished replies are saved in {out}; rerun the same command to resume.")
            raise typer.Exit(130)
    if w.rank != 0:
        err.print(f"{w.label}: done")
        return
    err.print(
        f"{out}: {m.sequences} replies, {m.tokens} tokens, {len(m.done)} conversations done, {m.elapsed / 60:.1f} min"
    )


def _distill_progress(bar, task, cfg):
    """The distiller's progress callback: conversations done (or minutes spent, with a budget) and tokens/s."""
    import time

    minutes, t0 = cfg.minutes, [None, 0]

    def progress(m, running):
        if t0[0] is None:
            t0[0], t0[1] = time.perf_counter(), m.tokens + running
        done_tokens = m.tokens + running
        rate = (done_tokens - t0[1]) / max(time.perf_counter() - t0[0], 1e-9)
        bar.update(
            task,
            completed=len(m.done) if not minutes else min(time.perf_counter() - t0[0], 60 * minutes),
            total=(60 * minutes) if minutes else cfg.max_conversations,
            info=f"{len(m.done)} conversations, {done_tokens} tokens, {rate:.0f} tok/s",
        )

    return progress


@app.command()
def train(
    model: str = ModelOpt,
    data: Path = typer.Option(..., "--data", help="Folder written by `distill`."),
    out: Path = typer.Option(..., "--out", "-o", help="Drafter folder to write."),
    preset: Optional[str] = typer.Option(None, "--preset", help=f"Head size preset: {', '.join(PRESETS)}."),
    exit_dim: Optional[int] = typer.Option(None, "--exit-dim"),
    num_draft_layers: Optional[int] = typer.Option(None, "--num-draft-layers"),
    rnn: bool = typer.Option(True, "--rnn/--no-rnn"),
    draft_vocab_size: Optional[int] = typer.Option(None, "--draft-vocab-size", help="0 = the full vocabulary."),
    depth: int = typer.Option(5, "--depth", help="Tokens predicted per example (T)."),
    skip_repeats: Optional[int] = typer.Option(
        None,
        "--skip-repeats",
        help="Leave out positions whose next N tokens repeat earlier in the reply (0 = keep all).",
    ),
    batch_size: int = typer.Option(256, "--batch-size"),
    lr: float = typer.Option(1e-3, "--lr"),
    epochs: Optional[float] = typer.Option(
        None, "--epochs", help="Passes over the data (default 2; with --minutes, the time budget decides)."
    ),
    max_steps: Optional[int] = typer.Option(None, "--max-steps"),
    minutes: Optional[float] = typer.Option(None, "--minutes"),
    eval_every: int = typer.Option(500, "--eval-every"),
    checkpoint_every: int = typer.Option(500, "--checkpoint-every"),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT/checkpoint."),
    seed: int = typer.Option(0, "--seed"),
    soft_weight: float = typer.Option(
        1.0,
        "--soft-weight",
        help="Weight of the KL to the LLM's top-k probabilities, when the data holds them (0 = hard labels only).",
    ),
    depth_decay: float = typer.Option(
        0.8, "--depth-decay", help="Loss weight of depth d is DECAY**d (1 = equal weights)."
    ),
    fuse_features: bool = typer.Option(
        False,
        "--fuse-features",
        help="Fuse the intermediate-layer features the data holds (distill --feature-layers) into the context.",
    ),
    prompt_positions: bool = typer.Option(
        True,
        "--prompt-positions/--no-prompt-positions",
        help="Train on the prompts' positions too, when the data holds them.",
    ),
):
    """Train a drafter on distilled data (the LLM stays frozen)."""
    cfg = _train_config(
        preset,
        exit_dim=exit_dim,
        num_draft_layers=num_draft_layers,
        draft_vocab_size=draft_vocab_size,
        skip_repeats=skip_repeats,
        rnn=rnn,
        depth=depth,
        batch_size=batch_size,
        lr=lr,
        epochs=epochs if epochs is not None else (1000.0 if minutes else 2.0),
        max_steps=max_steps,
        minutes=minutes,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        seed=seed,
        soft_weight=soft_weight,
        depth_decay=depth_decay,
        fuse_features=fuse_features,
        prompt_positions=prompt_positions,
    )
    _run_train(model, data, out, cfg, resume)


SIZE_FLAGS = ("exit_dim", "num_draft_layers", "draft_vocab_size", "skip_repeats")  # None: the preset's


def _train_config(preset: Optional[str], **flags):
    """``train``'s flags as one TrainConfig: the preset's sizes, those given
    overriding them (``--draft-vocab-size 0``: the full vocabulary), checked."""
    from ..train.trainer import TrainConfig

    if preset is not None and preset not in PRESETS:
        raise RedrafterError(f"Unknown preset {preset!r}.", f"Use one of: {', '.join(PRESETS)}.")
    base = dict(PRESETS[preset or "default"])
    for k in SIZE_FLAGS:
        v = flags.pop(k)
        if v is not None:
            base[k] = v if (k != "draft_vocab_size" or v > 0) else None
    if flags["soft_weight"] < 0 or not 0 < flags["depth_decay"] <= 1:
        raise RedrafterError(
            f"--soft-weight must be >= 0 and --depth-decay in (0, 1] (got {flags['soft_weight']}, "
            f"{flags['depth_decay']})."
        )
    return TrainConfig(**base, **flags)


def _run_train(model: str, data: Path, out: Path, cfg, resume: bool) -> None:
    """Train under a progress bar (rank 0's, under mlx.launch); Ctrl-C keeps the last checkpoint."""
    from ..llm.load import load_model
    from ..train.trainer import train as run_train
    from ..train.world import world

    if not data.is_dir():
        raise RedrafterError(f"Data folder does not exist: {data}", "Run `mlx-redrafter distill --out DIR` first.")
    llm, tok = load_model(model)
    w = world()
    if w.size > 1:  # under mlx.launch: rank 0 shows the bar and writes OUT, every rank says where it is
        err.print(
            f"{w.label}: training on its slice of each batch of {cfg.batch_size}"
            + (f", rank 0 writes {out}" if w.rank else "")
        )
    with progress_bar("count", "loss {task.fields[loss]:.3f}", disable=w.rank != 0) as bar:
        label = "training" + (f" ({w.label})" if w.size > 1 else "")
        task = bar.add_task(label, total=None, loss=float("nan"))
        try:
            run_train(
                llm,
                data,
                out,
                cfg,
                resume=resume,
                eos_ids=sorted(tok.eos_token_ids),
                progress=lambda s, n, loss: bar.update(task, completed=s, total=n, loss=loss),
                log_console=lambda line: bar.console.print(f"[dim]{line}[/dim]"),
            )
        except KeyboardInterrupt:
            err.print(f"Interrupted: checkpoint saved in {out}/checkpoint; resume with --resume.")
            raise typer.Exit(130)
    if w.rank != 0:
        err.print(f"{w.label}: done")
        return
    err.print(f"wrote drafter {out} (log: {out}/train_log.jsonl)")


@app.command("train-controller")
def train_controller_cmd(
    model: str = ModelOpt,
    drafter: Optional[str] = NeededDrafterOpt,
    prompts: Optional[Path] = typer.Option(
        None, "--prompts", help="Training prompts, JSONL (default: held-out ShareGPT conversations)."
    ),
    num_prompts: int = typer.Option(48, "--num-prompts"),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n"),
    beam_width: Optional[int] = BeamWidthOpt,
    beam_length: int = typer.Option(4, "--beam-length", "-L", help="Maximum depth the controller may choose."),
    epochs: int = typer.Option(100, "--epochs"),
    alpha: float = typer.Option(0.05, "--alpha", help="Penalty per drafted level."),
    seed: int = typer.Option(0, "--seed"),
):
    """Train the adaptive-depth controller for a drafter on this device (saved next to the drafter)."""
    from ..prompts import first_turn_ids
    from ..runtime import LoadOptions
    from ..step.curve import load_curve
    from ..train.controller import fit_and_save

    if num_prompts < 1 or max_tokens < 1 or epochs < 1:
        raise RedrafterError("--num-prompts, --max-tokens and --epochs must be at least 1.")
    convs = _controller_conversations(prompts, seed)
    s = _runtime(LoadOptions(model, drafter, beam_width=beam_width, beam_length=beam_length), announce=False)
    head = s.draft.head if s.drafter is None and is_layer_head(s.draft.head) else None  # an EAGLE-3 drafter
    if s.drafter is None and head is None:
        raise RedrafterError("train-controller needs a drafter.", "Pass --drafter PATH.")
    s.announce(err)
    ids = first_turn_ids(s.tokenizer, convs)
    ids = [p for p in ids if len(p) <= 512][:num_prompts]
    with progress_bar("count") as bar:
        task = bar.add_task("recording", total=len(ids))
        tell = lambda stage, done, total: bar.update(task, description=stage, completed=done, total=total)  # noqa: E731
        if head is not None:  # one beam, each depth a call of the head (train/head_controller.py)
            from ..train.head_controller import fit_head_controller

            fit = fit_head_controller(
                s.model, head, s.drafter_path, ids, beam_length, max_tokens, s.tokenizer.eos_token_ids,
                epochs=epochs, alpha=alpha, seed=seed, progress=tell, curve=load_curve(s.model, model),
            )  # fmt: skip
            return _report_fit(fit)
        fit = fit_and_save(
            s.model,
            s.drafter,
            s.drafter_path,
            ids,
            s.beam_width,
            s.beam_length,
            max_tokens,
            eos_ids=s.tokenizer.eos_token_ids,
            epochs=epochs,
            alpha=alpha,
            seed=seed,
            curve=load_curve(s.model, model),  # doctor --calibrate's; None: the latencies timed here
            progress=tell,
        )
    _report_fit(fit)


def _controller_conversations(prompts: Optional[Path], seed: int) -> list:
    """The controller's training conversations, shuffled: ``--prompts`` (refused
    if it is an evaluation set), else the ShareGPT ones held out from drafter training."""
    import random

    from ..prompts import read_conversations, refuse_eval_set
    from ..train.examples import is_eval_conversation

    source = _training_prompts(prompts)
    convs = read_conversations(source)
    refuse_eval_set(source, convs)
    if prompts is None:  # ShareGPT: the conversations held out from drafter training
        convs = [c for c in convs if is_eval_conversation(c["id"], 0.02)]
    random.Random(seed).shuffle(convs)
    return convs


def _report_fit(fit) -> None:
    """The controller against each fixed depth on the recorded steps, and where it was saved."""
    err.print(
        f"{fit.steps} steps recorded; offline tokens per plain-step time: "
        + ", ".join(f"L={d}: {v:.2f}" for d, v in fit.fixed.items())
        + f", adaptive: {fit.learned:.2f}"
    )
    if not fit.beats_fixed:
        err.print(
            f"[yellow]The controller does not beat the fixed depth L={fit.best_depth} on the recorded steps; "
            "keep using fixed (W, L).[/yellow]"
        )
    err.print(f"saved {fit.path} (use it with --adaptive)")
