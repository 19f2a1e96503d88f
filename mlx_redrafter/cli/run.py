"""The commands that run a model: ``generate``, ``chat``, ``serve`` and ``doctor`` (in doctor.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from ..errors import RedrafterError
from ..runtime import LoadOptions
from .doctor import doctor
from .options import (
    CapEndsTurnOpt,
    MaxTokensCapOpt,
    MinPOpt,
    NoHistoryOpt,
    SeedOpt,
    ServedModelNameOpt,
    SystemOpt,
    TempOpt,
    TopKOpt,
    TopPOpt,
    _runtime,
    _sampling,
    app,
    drafting,
    err,
    format_prompt,
    read_prompt,
)


@app.command()
@drafting
def generate(
    options: LoadOptions,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text."),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="Read the prompt from a file."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="Longest reply, in tokens."),
    temp: float = TempOpt,
    top_p: float = TopPOpt,
    top_k: int = TopKOpt,
    min_p: float = MinPOpt,
    seed: Optional[int] = SeedOpt,
    system: Optional[str] = SystemOpt,
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    stop: List[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    json_any: bool = typer.Option(False, "--json", help="Constrain the reply to a JSON object."),
    json_schema: Optional[Path] = typer.Option(
        None, "--json-schema", help="Constrain the reply to this JSON Schema (a file)."
    ),
):
    """Generate a reply and print tokens/s; it drafts by default (the model's drafter, else lookup; --no-draft: plain).

    With --json or --json-schema the reply is structured output (exactly
    plain constrained decoding; drafting runs the synchronous loop); cut by
    --max-tokens before the JSON closes, it exits with status 1."""
    from ..chat.settings import check_setting
    from ..generate import stream_generate
    from ..output import Tally

    check_setting("max_tokens", max_tokens, name="--max-tokens")  # refuse bad values before the slow load
    sampling = _sampling(temp, top_p, top_k, min_p)
    grammar = _grammar(json_any, json_schema)  # and a bad schema
    text = read_prompt(prompt, file)
    rt = _runtime(options)
    full = format_prompt(rt.tokenizer, text, system, raw)
    tally = Tally()
    for r in stream_generate(
        rt.model,
        rt.tokenizer,
        full,
        max_tokens=max_tokens,
        seed=seed,
        stop=stop,
        draft=rt.draft,
        sampling=sampling,
        grammar=grammar,
    ):
        print(r.text, end="", flush=True)
        tally.add(r)
    print()
    cut = tally.last is not None and tally.last.incomplete
    if cut:
        err.print(
            f"[bold red]Error:[/bold red] the reply stopped ({tally.last.finish_reason}) before the "
            f"JSON was complete: it will not parse. Raise --max-tokens (now {max_tokens}).",
            soft_wrap=True,
        )
    err.print(f"[dim]{tally.summary()}[/dim]")
    if cut:  # a script reading the JSON learns it from the exit status, not from its parser
        raise typer.Exit(1)


def _grammar(json_any: bool, schema_file: Optional[Path]):
    """The grammar of --json / --json-schema (None: free text), checked before the model loads."""
    import json

    from ..step.grammar import check_grammar

    if json_any and schema_file is not None:
        raise RedrafterError(
            "Give either --json or --json-schema, not both.", "--json-schema FILE already makes the reply JSON."
        )
    if schema_file is None:
        return "json" if json_any else None
    try:
        schema = json.loads(Path(schema_file).read_text())
    except OSError as e:
        raise RedrafterError(
            f"Cannot read the JSON Schema file {schema_file}: {e.strerror}.", "Check the --json-schema path."
        ) from None
    except ValueError as e:
        raise RedrafterError(f"The JSON Schema file {schema_file} is not valid JSON: {e}.", "Fix the file.") from None
    if not isinstance(schema, dict):
        raise RedrafterError(
            f"The JSON Schema in {schema_file} is not an object (it is {type(schema).__name__}).",
            'Give a schema such as {"type": "object", "properties": {...}}.',
        )
    check_grammar(schema)
    return schema


@app.command()
@drafting
def chat(
    options: LoadOptions,
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Longest reply, in tokens."),
    temp: float = TempOpt,
    top_p: float = TopPOpt,
    top_k: int = TopKOpt,
    min_p: float = MinPOpt,
    seed: Optional[int] = SeedOpt,
    system: Optional[str] = SystemOpt,
    show_drafts: bool = typer.Option(False, "--show-drafts", help="Colour the tokens that came from accepted drafts."),
    max_context: Optional[int] = typer.Option(
        None, "--max-context", help="Keep the conversation within this many tokens (default: the model's context)."
    ),
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
    rt = _runtime(replace(options, history=not no_history))
    announce_history(rt)
    if seed is not None:
        import mlx.core as mx

        mx.random.seed(seed)
    settings = ChatSettings(max_tokens, sampling, show_drafts=show_drafts)
    conversation = ChatSession.from_runtime(rt, settings, system=system, max_context=max_context)
    code = run_chat(conversation)
    if code:
        raise typer.Exit(code)


def announce_history(rt) -> None:
    """Say, at start, what ``chat`` and ``serve`` write to disk (the
    conversations' text, unasked for otherwise), where, and the flag that
    turns it off."""
    if rt.history is None:
        return
    from ..draft.datastore.index import default_path

    folder = default_path(rt.model_spec, "history").parent
    err.print(
        f"History: each prompt and reply is appended to {escape(str(folder))}/ (kept on this machine only, for "
        "datastore drafts and `make-drafter --prompts history`). --no-history turns it off; "
        "`mlx-redrafter datastore clear` deletes it.",
        soft_wrap=True,
    )


def _check_port(host: str, port: int) -> None:
    """Fail before the slow model load when ``host:port`` cannot be listened on."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind((host, port))
        except OSError as e:
            raise RedrafterError(
                f"Cannot listen on {host}:{port}: {e.strerror or e}.", "Pick another --port (or stop what is using it)."
            ) from None


def _cache_bytes(text: Optional[str]) -> int:
    """--prompt-cache-bytes as a number (no bound when not given)."""
    from ..llm.prompt_cache import NO_BYTE_BOUND

    return NO_BYTE_BOUND if text is None else _size(text, "--prompt-cache-bytes")


def _size(text: str, flag: str) -> int:
    """A size flag's value as a number of bytes (mlx_lm.server's sizes: 100, 512MB, 2GB)."""
    from mlx_lm.utils import _parse_size

    try:
        size = _parse_size(text)
    except (ArithmeticError, KeyError, ValueError):  # not digits, or an unknown unit
        size = 0
    if size < 1:
        raise RedrafterError(f"{flag} {text!r} is not a size.", "Give bytes, or e.g. 512MB or 2GB.")
    return size


# serve's own flags (the shared ones are in options.py)
HostOpt = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 opens the server to your network).")
QueueSizeOpt = typer.Option(
    16,
    "--queue-size",
    help="Requests that may wait while --max-batch others decode; past both the server answers 503 with Retry-After.",
)
MaxBatchOpt = typer.Option(
    8,
    "--max-batch",
    help="Requests decoded at once, batched when that pays on this device (1: one at a time, each drafted).",
)
# Off by default: on this project's 2-core CPU a drafting batch ran at 0.92x of
# batched plain decoding at 4 clients (bench/RESULTS.md section 34, quiet).
BatchDraftsOpt = typer.Option(
    False,
    "--batch-drafts/--no-batch-drafts",
    help="Requests decoded together draft, each its own tree, all verified in one forward "
    "(default off: measured slower than batched plain decoding on a CPU, bench/RESULTS.md section 34).",
)
PromptCacheSizeOpt = typer.Option(
    10, "--prompt-cache-size", help="Conversations whose KV cache is kept (the least recently stored dropped first)."
)
PromptCacheBytesOpt = typer.Option(
    None, "--prompt-cache-bytes", help="Most bytes of kept KV caches, e.g. 2GB (default: no bound)."
)
MaxBodyBytesOpt = typer.Option(
    None,
    "--max-body-bytes",
    help="Largest request body read, e.g. 4MB; a larger one is a 413, its body unread "
    "(default: 64 bytes per token of the model's context, at least 1MB).",
)
ApiKeyOpt = typer.Option(
    None,
    "--api-key",
    help="Require this key on every route but the chat page and /health, "
    "as 'Authorization: Bearer KEY' or 'x-api-key: KEY' (default: $MLX_REDRAFTER_API_KEY, else no key).",
)
AllowHostOpt = typer.Option(
    [],
    "--allow-host",
    help="Also answer to this Host name (repeatable; '*.lan': a domain, '*': any). "
    "Always answered: localhost, 127.0.0.1, [::1] and the --host address.",
)
AllowOriginOpt = typer.Option(
    [],
    "--allow-origin",
    help="Let web pages from this origin use the server, with CORS (repeatable, e.g. http://localhost:3000; "
    "'*': any page; also $MLX_REDRAFTER_ORIGINS, comma-separated). "
    "The chat page's own origin always may.",
)


@app.command()
@drafting
def serve(
    options: LoadOptions,
    host: str = HostOpt,
    port: int = typer.Option(8080, "--port"),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Longest reply when a request does not say."),
    max_tokens_cap: Optional[int] = MaxTokensCapOpt,
    cap_ends_turn: bool = CapEndsTurnOpt,
    served_model_name: List[str] = ServedModelNameOpt,
    temp: float = TempOpt,
    top_p: float = TopPOpt,
    top_k: int = TopKOpt,
    min_p: float = MinPOpt,
    queue_size: int = QueueSizeOpt,
    max_batch: int = MaxBatchOpt,
    batch_drafts: bool = BatchDraftsOpt,
    prompt_cache_size: int = PromptCacheSizeOpt,
    prompt_cache_bytes: Optional[str] = PromptCacheBytesOpt,
    max_body_bytes: Optional[str] = MaxBodyBytesOpt,
    no_ui: bool = typer.Option(False, "--no-ui", help="Serve only the API, without the chat page at /."),
    no_history: bool = NoHistoryOpt,
    api_key: Optional[str] = ApiKeyOpt,
    allow_host: List[str] = AllowHostOpt,
    allow_origin: List[str] = AllowOriginOpt,
):
    """Serve the model over HTTP: OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models), OpenAI's Responses API (/v1/responses), Anthropic's Messages API (/v1/messages), Ollama's API (/api/chat, /api/generate, /api/tags, ...), a chat page at /, and /health and /metrics.

    Other Host names and web pages' origins are refused (403) unless allowed; --api-key guards every route but the page."""  # noqa: E501 (typer shows newlines)
    # Every check before the slow imports and the model load.
    cache_bytes = _check_serve_flags(
        host, port, max_tokens, queue_size, max_batch, prompt_cache_size, prompt_cache_bytes
    )
    body_bytes = _check_reply_flags(max_tokens_cap, cap_ends_turn, served_model_name, max_body_bytes)
    sampling = _sampling(temp, top_p, top_k, min_p, as_set=True)
    uvicorn, create_app, security = _server_parts(host, api_key, allow_host, allow_origin)
    from ..serve import Engine

    rt = _runtime(replace(options, history=not no_history))
    announce_history(rt)
    engine = Engine(
        rt,
        max_tokens=max_tokens,
        sampling=sampling,
        queue_size=queue_size,
        max_batch=max_batch,
        prompt_cache_size=prompt_cache_size,
        prompt_cache_bytes=cache_bytes,
        max_tokens_cap=max_tokens_cap,
        served_names=served_model_name,
        cap_ends_turn=cap_ends_turn,
        batch_drafts=batch_drafts,
    )
    app_ = create_app(engine, ui=not no_ui, security=security, max_body_bytes=body_bytes)
    page = "" if no_ui else f", chat page at http://{host}:{port}/"
    err.print(f"serving {', '.join(engine.names)} at http://{host}:{port}/v1{page} (Ctrl-C stops)", soft_wrap=True)
    uvicorn.run(app_, host=host, port=port, log_level="warning")


def _check_serve_flags(host, port, max_tokens, queue_size, max_batch, cache_size, cache_bytes) -> int:
    """serve's own flags checked (and the port free), before the slow load; the cache's bound in bytes."""
    from ..chat.settings import check_setting

    if queue_size < 1:
        raise RedrafterError(f"--queue-size must be at least 1 (got {queue_size}).")
    if max_batch < 1:
        raise RedrafterError(f"--max-batch must be at least 1 (got {max_batch}).", "1 serves one request at a time.")
    size = _cache_bytes(cache_bytes)
    if cache_size < 1:
        raise RedrafterError(f"--prompt-cache-size must be at least 1 (got {cache_size}).")
    _check_port(host, port)
    check_setting("max_tokens", max_tokens, name="--max-tokens")
    return size


def _check_reply_flags(max_tokens_cap, cap_ends_turn: bool, served_model_name: List[str], max_body_bytes):
    """--max-tokens-cap, --cap-ends-turn and --served-model-name checked; --max-body-bytes in bytes (or None)."""
    from ..chat.settings import check_setting

    if max_tokens_cap is not None:
        check_setting("max_tokens", max_tokens_cap, name="--max-tokens-cap")
    elif cap_ends_turn:
        raise RedrafterError("--cap-ends-turn needs --max-tokens-cap.", "Give the cap, e.g. --max-tokens-cap 64.")
    if any(not n.strip() for n in served_model_name):
        raise RedrafterError("--served-model-name cannot be empty.", "Give the name clients will send as 'model'.")
    return None if max_body_bytes is None else _size(max_body_bytes, "--max-body-bytes")


def _server_parts(host: str, api_key, allow_host, allow_origin):
    """``(uvicorn, create_app, security)``: the server's packages (or the error
    naming the extra to install), and who may use the server, its warnings printed."""
    try:
        import uvicorn

        from ..serve.app import create_app
        from ..serve.security import SecurityConfig
    except ImportError as e:
        raise RedrafterError(
            f"The server needs packages that are not installed ({e.name}).", "pip install 'mlx-redrafter[server]'"
        ) from None
    security = SecurityConfig.resolve(host, api_key, allow_host, allow_origin)
    for warning in security.warnings():
        err.print(f"[bold yellow]Warning:[/bold yellow] {escape(warning)}", soft_wrap=True)
    return uvicorn, create_app, security


app.command()(doctor)  # after serve, where --help lists it
