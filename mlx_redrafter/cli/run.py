"""The commands that run a model: ``generate``, ``chat``, ``serve`` and ``doctor``."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..errors import RedrafterError
from . import (AdaptiveOpt, BeamLengthOpt, BeamWidthOpt, DatastoreOpt, DrafterOpt, DtypeOpt, LookupOpt, NoHistoryOpt, MinPOpt, ModelOpt, NoDraftOpt, SeedOpt,
               SystemOpt, TempOpt, TopKOpt, TopPOpt, _runtime, _sampling, app, err, format_prompt, read_prompt)


@app.command()
def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text."),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="Read the prompt from a file."),
    model: str = ModelOpt,
    drafter: Optional[str] = DrafterOpt,
    no_draft: bool = NoDraftOpt,
    lookup: Optional[bool] = LookupOpt,
    beam_width: Optional[int] = BeamWidthOpt,
    beam_length: Optional[int] = BeamLengthOpt,
    max_tokens: int = typer.Option(128, "--max-tokens", "-n"),
    temp: float = TempOpt,
    top_p: float = TopPOpt,
    top_k: int = TopKOpt,
    min_p: float = MinPOpt,
    seed: Optional[int] = SeedOpt,
    system: Optional[str] = SystemOpt,
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    stop: List[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    dtype: Optional[str] = DtypeOpt,
    adaptive: bool = AdaptiveOpt,
    datastore: Optional[str] = DatastoreOpt,
):
    """Generate a reply and print tokens/s (plain mlx-lm decoding without a drafter)."""
    from ..generate import stream_generate
    from ..responses import Tally

    sampling = _sampling(temp, top_p, top_k, min_p)  # refuse bad values before the slow load
    text = read_prompt(prompt, file)
    rt = _runtime(model, drafter, no_draft, beam_width, beam_length, dtype, adaptive, lookup, datastore=datastore)
    full = format_prompt(rt.tokenizer, text, system, raw)
    tally = Tally()
    for r in stream_generate(rt.model, rt.tokenizer, full, max_tokens=max_tokens, seed=seed, stop=stop,
                             draft=rt.draft, sampling=sampling):
        print(r.text, end="", flush=True)
        tally.add(r)
    print()
    err.print(f"[dim]{tally.summary()}[/dim]")


@app.command()
def chat(
    model: str = ModelOpt,
    drafter: Optional[str] = DrafterOpt,
    no_draft: bool = NoDraftOpt,
    lookup: Optional[bool] = LookupOpt,
    beam_width: Optional[int] = BeamWidthOpt,
    beam_length: Optional[int] = BeamLengthOpt,
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Longest reply, in tokens."),
    temp: float = TempOpt,
    top_p: float = TopPOpt,
    top_k: int = TopKOpt,
    min_p: float = MinPOpt,
    seed: Optional[int] = SeedOpt,
    system: Optional[str] = SystemOpt,
    show_drafts: bool = typer.Option(False, "--show-drafts", help="Colour the tokens that came from accepted drafts."),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="Keep the conversation within this many tokens (default: the model's context)."),
    adaptive: bool = AdaptiveOpt,
    dtype: Optional[str] = DtypeOpt,
    datastore: Optional[str] = DatastoreOpt,
    no_history: bool = NoHistoryOpt,
):
    """Chat in the terminal: streamed replies, KV cache reused across turns, speed after each reply.

    With a pipe on stdin, each line is a turn (or a /command); replies go to
    stdout as plain text and status lines to stderr.
    """
    from ..chat import ChatSession, ChatSettings, run_chat
    from ..chat.settings import check_setting

    check_setting("max_tokens", max_tokens, name="--max-tokens")  # the checks of /set, before the slow load
    sampling = _sampling(temp, top_p, top_k, min_p, as_set=True)
    if max_context is not None and max_context < 2:
        raise RedrafterError(f"--max-context must be at least 2 (got {max_context}).")
    rt = _runtime(model, drafter, no_draft, beam_width, beam_length, dtype, adaptive, lookup, datastore=datastore,
                  history=not no_history)
    if seed is not None:
        import mlx.core as mx

        mx.random.seed(seed)
    settings = ChatSettings(max_tokens, sampling, show_drafts=show_drafts)
    conversation = ChatSession.from_runtime(rt, settings, system=system, max_context=max_context)
    code = run_chat(conversation)
    if code:
        raise typer.Exit(code)


def _check_port(host: str, port: int) -> None:
    """Fail before the slow model load when ``host:port`` cannot be listened on."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind((host, port))
        except OSError as e:
            raise RedrafterError(f"Cannot listen on {host}:{port}: {e.strerror or e}.",
                                 "Pick another --port (or stop what is using it).") from None


@app.command()
def serve(
    model: str = ModelOpt,
    drafter: Optional[str] = DrafterOpt,
    no_draft: bool = NoDraftOpt,
    beam_width: Optional[int] = BeamWidthOpt,
    beam_length: Optional[int] = BeamLengthOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 opens the server to your network)."),
    port: int = typer.Option(8080, "--port"),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Longest reply when a request does not say."),
    temp: float = TempOpt,
    top_p: float = TopPOpt,
    top_k: int = TopKOpt,
    min_p: float = MinPOpt,
    queue_size: int = typer.Option(16, "--queue-size", help="Requests that may wait for the model; past it the server answers 503."),
    adaptive: bool = AdaptiveOpt,
    dtype: Optional[str] = DtypeOpt,
    lookup: Optional[bool] = LookupOpt,
    datastore: Optional[str] = DatastoreOpt,
    no_history: bool = NoHistoryOpt,
):
    """Serve the model over OpenAI's HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health)."""
    # Every check before the slow imports and the model load.
    if queue_size < 1:
        raise RedrafterError(f"--queue-size must be at least 1 (got {queue_size}).")
    _check_port(host, port)
    from ..chat.settings import check_setting

    check_setting("max_tokens", max_tokens, name="--max-tokens")
    sampling = _sampling(temp, top_p, top_k, min_p, as_set=True)
    try:
        import uvicorn

        from ..serve.openai_api import create_app
    except ImportError as e:
        raise RedrafterError(f"The server needs packages that are not installed ({e.name}).",
                             "pip install 'mlx-redrafter[server]'") from None
    from ..serve import Engine

    rt = _runtime(model, drafter, no_draft, beam_width, beam_length, dtype, adaptive, lookup, datastore=datastore,
                  history=not no_history)
    app_ = create_app(Engine(rt, max_tokens=max_tokens, sampling=sampling, queue_size=queue_size))
    err.print(f"serving {rt.model_spec} at http://{host}:{port}/v1 (Ctrl-C stops)", soft_wrap=True)
    uvicorn.run(app_, host=host, port=port, log_level="warning")


@app.command()
def doctor():
    """Print versions, device, default dtype and BLAS (with the fix when it is slow)."""
    from ..doctor import BLIS_FIX, SLOW_GFLOPS, matmul_gflops, report

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
