"""The ``mlx-redrafter`` command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from .errors import RedrafterError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="ReDrafter speculative decoding for mlx-lm models: same tokens, fewer LLM calls.",
)
err = Console(stderr=True)

ModelOpt = typer.Option("default", "--model", "-m", help="'default', an mlx-lm folder, a Hub id or a .gguf file.")
DtypeOpt = typer.Option(None, "--dtype", help="float32 | float16 | bfloat16 (default: float16 on a GPU, float32 on the CPU).")


def read_prompt(prompt: Optional[str], file: Optional[Path]) -> str:
    """The prompt from --prompt, --file, or standard input."""
    if prompt is not None and file is not None:
        raise RedrafterError("Give either --prompt or --file, not both.")
    if file is not None:
        if not file.is_file():
            raise RedrafterError(f"Prompt file does not exist: {file}", "Check the --file path.")
        return file.read_text()
    if prompt is not None:
        return prompt
    if sys.stdin.isatty():
        raise RedrafterError("No prompt given.", "Use --prompt TEXT, --file PATH, or pipe text on stdin.")
    return sys.stdin.read()


def format_prompt(tokenizer, text: str, system: Optional[str], raw: bool):
    """Apply the chat template (unless ``raw`` or the model has none)."""
    if raw or not getattr(tokenizer, "has_chat_template", False):
        return text
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@app.command()
def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text."),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="Read the prompt from a file."),
    model: str = ModelOpt,
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d", help="Drafter folder (enables ReDrafter)."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Plain decoding, even if a drafter is available."),
    beam_width: Optional[int] = typer.Option(None, "--beam-width", "-W", help="Beams drafted per step."),
    beam_length: Optional[int] = typer.Option(None, "--beam-length", "-L", help="Tokens drafted per beam (g0 not counted)."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n"),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(0.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    min_p: float = typer.Option(0.0, "--min-p"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    system: Optional[str] = typer.Option(None, "--system", help="System message for the chat template."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    stop: List[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    dtype: Optional[str] = DtypeOpt,
    adaptive: bool = typer.Option(False, "--adaptive", help="Let the trained controller decide the draft depth."),
):
    """Generate a reply and print tokens/s (plain mlx-lm decoding without a drafter)."""
    from .generate import Tally, stream_generate
    from .session import resolve_session

    text = read_prompt(prompt, file)
    s = resolve_session(model, drafter, no_draft, beam_width, beam_length, dtype, adaptive)
    s.announce(err)
    full = format_prompt(s.tokenizer, text, system, raw)
    tally = Tally()
    for r in stream_generate(
        s.model, s.tokenizer, full, drafter=s.drafter, beam_width=s.beam_width,
        beam_length=s.beam_length, max_tokens=max_tokens, temp=temp, top_p=top_p,
        top_k=top_k, min_p=min_p, seed=seed, stop=stop, controller=s.controller,
    ):
        print(r.text, end="", flush=True)
        tally.add(r)
    print()
    err.print(f"[dim]{tally.summary()}[/dim]")


@app.command()
def doctor():
    """Print versions, device, default dtype and BLAS (with the fix when it is slow)."""
    from .doctor import BLIS_FIX, SLOW_GFLOPS, matmul_gflops, report

    info = report()
    for k, v in info.items():
        if v is not None and k != "blas_slow":
            print(f"{k:>14}: {v}")
    gflops = matmul_gflops()
    print(f"{'matmul':>14}: {gflops:.1f} GFLOPS (float32, 768x768)")
    if info.get("blas_slow") or (info["device"].startswith("Device(cpu") and gflops < SLOW_GFLOPS):
        err.print(
            f"[yellow]The CPU backend uses {info['blas']} ({gflops:.1f} GFLOPS); "
            "a good BLAS is about 20x faster here. Fix:[/yellow]\n" + BLIS_FIX
        )


@app.command("convert-gguf")
def convert_gguf_cmd(
    src: Path = typer.Argument(..., help="A .gguf file."),
    dst: Path = typer.Argument(..., help="Output folder (an mlx-lm model)."),
):
    """Convert a GGUF model (llama, gemma3) into an mlx-lm folder."""
    from rich.progress import Progress

    from .converters.gguf import convert_gguf

    with Progress(transient=True, console=err) as progress:
        task = progress.add_task("converting tensors", total=None)
        out = convert_gguf(src, dst, progress=lambda i, n: progress.update(task, completed=i, total=n))
    err.print(f"wrote {out} (open it with mlx_lm.load or --model {out})")


# Presets for `train`: the head sizes measured in bench/RESULTS.md.
TRAIN_PRESETS = {
    "default": dict(exit_dim=576, num_draft_layers=1, draft_vocab_size=8192),
}


@app.command()
def distill(
    model: str = ModelOpt,
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL(.gz) of conversations (default: ../shared ShareGPT prompts)."),
    out: Path = typer.Option(..., "--out", "-o", help="Data folder (resumable)."),
    turns: int = typer.Option(1, "--turns", help="User turns answered per conversation."),
    batch_size: int = typer.Option(48, "--batch-size"),
    max_new_tokens: int = typer.Option(192, "--max-new-tokens"),
    max_prompt_tokens: int = typer.Option(384, "--max-prompt-tokens"),
    minutes: Optional[float] = typer.Option(None, "--minutes", help="Stop (resumably) after this many minutes."),
    max_conversations: Optional[int] = typer.Option(None, "--max-conversations"),
    system: Optional[str] = typer.Option(None, "--system"),
    seed: int = typer.Option(0, "--seed"),
):
    """Answer training prompts with the LLM (greedy) and keep its tokens and hidden states."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .prompts import default_training_prompts
    from .train.distill import DistillConfig, distill as run_distill

    if turns < 1 or batch_size < 1 or max_new_tokens < 1:
        raise RedrafterError("--turns, --batch-size and --max-new-tokens must be at least 1.")
    prompts = prompts or default_training_prompts()
    if prompts is None:
        raise RedrafterError("No --prompts given and the ShareGPT prompts (../shared/data) are not next to the repo.", "Pass --prompts FILE.jsonl.")
    cfg = DistillConfig(turns, batch_size, max_new_tokens, max_prompt_tokens, minutes, max_conversations, system=system, seed=seed)
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=err) as bar:
        task = bar.add_task("distilling", total=None, info="loading")
        t0 = [None, 0]

        def progress(m, running):
            import time as _t

            if t0[0] is None:
                t0[0], t0[1] = _t.perf_counter(), m.tokens + running
            done_tokens = m.tokens + running
            rate = (done_tokens - t0[1]) / max(_t.perf_counter() - t0[0], 1e-9)
            total = None if minutes else cfg.max_conversations
            bar.update(task, completed=len(m.done) if not minutes else min(_t.perf_counter() - t0[0], 60 * minutes),
                       total=(60 * minutes) if minutes else total,
                       info=f"{len(m.done)} conversations, {done_tokens} tokens, {rate:.0f} tok/s")

        try:
            m = run_distill(model, prompts, out, cfg, progress=progress)
        except KeyboardInterrupt:
            err.print(f"Interrupted: finished replies are saved in {out}; rerun the same command to resume.")
            raise typer.Exit(130)
    err.print(f"{out}: {m.sequences} replies, {m.tokens} tokens, {len(m.done)} conversations done, {m.elapsed / 60:.1f} min")


@app.command()
def train(
    model: str = ModelOpt,
    data: Path = typer.Option(..., "--data", help="Folder written by `distill`."),
    out: Path = typer.Option(..., "--out", "-o", help="Drafter folder to write."),
    preset: Optional[str] = typer.Option(None, "--preset", help=f"Head size preset: {', '.join(TRAIN_PRESETS)}."),
    exit_dim: Optional[int] = typer.Option(None, "--exit-dim"),
    num_draft_layers: Optional[int] = typer.Option(None, "--num-draft-layers"),
    rnn: bool = typer.Option(True, "--rnn/--no-rnn"),
    draft_vocab_size: Optional[int] = typer.Option(None, "--draft-vocab-size", help="0 = the full vocabulary."),
    depth: int = typer.Option(5, "--depth", help="Tokens predicted per example (T)."),
    batch_size: int = typer.Option(256, "--batch-size"),
    lr: float = typer.Option(1e-3, "--lr"),
    epochs: float = typer.Option(2.0, "--epochs"),
    max_steps: Optional[int] = typer.Option(None, "--max-steps"),
    minutes: Optional[float] = typer.Option(None, "--minutes"),
    eval_every: int = typer.Option(500, "--eval-every"),
    checkpoint_every: int = typer.Option(500, "--checkpoint-every"),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT/checkpoint."),
    seed: int = typer.Option(0, "--seed"),
):
    """Train a drafter on distilled data (the LLM stays frozen)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .models import load_model
    from .train.trainer import TrainConfig, train as run_train

    base = dict(TRAIN_PRESETS.get(preset or "default", {}))
    if preset is not None and preset not in TRAIN_PRESETS:
        raise RedrafterError(f"Unknown preset {preset!r}.", f"Use one of: {', '.join(TRAIN_PRESETS)}.")
    for k, v in (("exit_dim", exit_dim), ("num_draft_layers", num_draft_layers), ("draft_vocab_size", draft_vocab_size)):
        if v is not None:
            base[k] = v if (k != "draft_vocab_size" or v > 0) else None
    cfg = TrainConfig(**base, rnn=rnn, depth=depth, batch_size=batch_size, lr=lr, epochs=epochs,
                      max_steps=max_steps, minutes=minutes, eval_every=eval_every,
                      checkpoint_every=checkpoint_every, seed=seed)
    if not data.is_dir():
        raise RedrafterError(f"Data folder does not exist: {data}", "Run `mlx-redrafter distill --out DIR` first.")
    llm, tok = load_model(model)
    columns = [TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=err) as bar:
        task = bar.add_task("train", total=None, loss=float("nan"))
        try:
            run_train(llm, data, out, cfg, resume=resume, eos_ids=sorted(tok.eos_token_ids),
                      progress=lambda s, n, loss: bar.update(task, completed=s, total=n, loss=loss),
                      log_console=lambda line: bar.console.print(f"[dim]{line}[/dim]"))
        except KeyboardInterrupt:
            err.print(f"Interrupted: checkpoint saved in {out}/checkpoint; resume with --resume.")
            raise typer.Exit(130)
    err.print(f"wrote drafter {out} (log: {out}/train_log.jsonl)")


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point: user errors print one message, no traceback, exit 1."""
    try:
        app(args=argv)
    except RedrafterError as e:
        err.print(f"[bold red]Error:[/bold red] {e.problem}")
        if e.fix:
            err.print(f"[bold]Fix:[/bold] {e.fix}")
        return 1
    except KeyboardInterrupt:
        err.print("Interrupted.")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
