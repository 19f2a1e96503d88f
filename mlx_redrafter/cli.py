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
