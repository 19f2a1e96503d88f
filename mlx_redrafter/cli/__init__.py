"""The ``mlx-redrafter`` command line.

Every flag that several commands take is defined once below (``...Opt``);
a command lists the ones it takes. The drafting flags become one
:class:`~mlx_redrafter.runtime.Runtime` (:func:`_runtime`), the sampling
flags one :class:`~mlx_redrafter.config.SamplingConfig` (:func:`_sampling`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .config import DEFAULT_LENGTH, DEFAULT_WIDTH
from .errors import RedrafterError
from .train.trainer import PRESETS

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="ReDrafter speculative decoding for mlx-lm models: same tokens, fewer LLM calls.",
)
err = Console(stderr=True)

# --------------------------------------------------------------------------- shared flags

ModelOpt = typer.Option("default", "--model", "-m", help="'default', an mlx-lm folder, a Hub id or a .gguf file.")
DtypeOpt = typer.Option(None, "--dtype", help="float32 | float16 | bfloat16 (default: float16 on a GPU, float32 on the CPU).")
DrafterOpt = typer.Option(None, "--drafter", "-d", help="Drafter folder (default: the one shipped for the model, if any); 'none' for no drafter.")
NeededDrafterOpt = typer.Option(None, "--drafter", "-d", help="Drafter folder (default: the one shipped for the model).")
NoDraftOpt = typer.Option(False, "--no-draft", help="Plain decoding, even if a drafter is available.")
LookupOpt = typer.Option(
    None, "--lookup/--no-lookup",
    help="Add drafts copied from the prompt and reply (n-gram lookup) to the drafter's (default: tuned profile, "
    "else on with a drafter). With --drafter none: lookup drafts only.",
)
BeamWidthOpt = typer.Option(None, "--beam-width", "-W", help=f"Beams drafted per step (default: tuned profile, else {DEFAULT_WIDTH}).")
BeamLengthOpt = typer.Option(None, "--beam-length", "-L", help=f"Tokens drafted per beam, g0 not counted (default: tuned profile, else {DEFAULT_LENGTH}).")
AdaptiveOpt = typer.Option(False, "--adaptive", help="Let the drafter's trained controller decide the draft depth.")
TempOpt = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy; serve: when a request does not say).")
TopPOpt = typer.Option(0.0, "--top-p", help="Nucleus sampling (0 = off).")
TopKOpt = typer.Option(0, "--top-k", help="Sample from the k most likely tokens (0 = off).")
MinPOpt = typer.Option(0.0, "--min-p", help="Min-p sampling (0 = off).")
SeedOpt = typer.Option(None, "--seed")
SystemOpt = typer.Option(None, "--system", help="System message for the chat template.")


def _sampling(temp: float, top_p: float, top_k: int, min_p: float, as_set: bool = False):
    """The sampling flags as one :class:`~mlx_redrafter.config.SamplingConfig`,
    checked before the slow model load (``as_set``: with ``/set``'s messages,
    for the commands whose defaults ``/set`` or a request may change)."""
    from .config import SamplingConfig

    if as_set:
        from .chat.settings import check_setting

        for k, v in dict(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p).items():
            check_setting(k, v, name="--" + k.replace("_", "-"))
    return SamplingConfig(temp, top_p, min_p, top_k)


def _runtime(model, drafter, no_draft=False, beam_width=None, beam_length=None, dtype=None, adaptive=False,
             lookup=None, announce=True):
    """The drafting flags as one :class:`~mlx_redrafter.runtime.Runtime` (model loaded, draft resolved)."""
    from .runtime import load_runtime

    rt = load_runtime(model, drafter, no_draft, beam_width, beam_length, dtype, adaptive, lookup)
    if announce:
        rt.announce(err)
    return rt


# --------------------------------------------------------------------------- helpers


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
    from .prompts import build_messages, has_chat_template, render_messages

    if raw or not has_chat_template(tokenizer):  # a model without a template continues the text as given
        return text

    return render_messages(tokenizer, build_messages(system, [], text))


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
):
    """Generate a reply and print tokens/s (plain mlx-lm decoding without a drafter)."""
    from .generate import stream_generate
    from .responses import Tally

    sampling = _sampling(temp, top_p, top_k, min_p)  # refuse bad values before the slow load
    text = read_prompt(prompt, file)
    rt = _runtime(model, drafter, no_draft, beam_width, beam_length, dtype, adaptive, lookup)
    full = format_prompt(rt.tokenizer, text, system, raw)
    tally = Tally()
    for r in stream_generate(rt.model, rt.tokenizer, full, max_tokens=max_tokens, seed=seed, stop=stop,
                             draft=rt.draft, sampling=sampling):
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


def _feature_layers(spec: str, model: str) -> list:
    """``--feature-layers``: 'none', 'default' or comma-separated layer indices."""
    spec = spec.strip().lower()
    if spec in ("", "none"):
        return []
    if spec == "default":
        from .llm.load import resolve_model_path
        from .llm.parts import default_feature_layers

        config = json.loads((resolve_model_path(model) / "config.json").read_text())
        return default_feature_layers(int(config["num_hidden_layers"]))
    try:
        return sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise RedrafterError(f"--feature-layers {spec!r} is not 'none', 'default' or a list like 2,15.") from None


@app.command()
def distill(
    model: str = ModelOpt,
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL(.gz) of conversations (default: the ShareGPT prompts shipped with the package)."),
    out: Path = typer.Option(..., "--out", "-o", help="Data folder (resumable)."),
    turns: int = typer.Option(1, "--turns", help="User turns answered per conversation."),
    batch_size: int = typer.Option(48, "--batch-size"),
    max_new_tokens: int = typer.Option(192, "--max-new-tokens"),
    max_prompt_tokens: int = typer.Option(384, "--max-prompt-tokens"),
    minutes: Optional[float] = typer.Option(None, "--minutes", help="Time budget in minutes, over all runs into --out (a rerun resumes within it)."),
    max_conversations: Optional[int] = typer.Option(None, "--max-conversations"),
    system: Optional[str] = SystemOpt,
    seed: int = typer.Option(0, "--seed"),
    stop_loops: int = typer.Option(12, "--stop-loops", help="End a reply after N tokens in a row that repeat its own text (0 = never)."),
    top_k: int = typer.Option(16, "--top-k", help="Keep the LLM's top-k logits per token as soft targets (0 = none)."),
    feature_layers: str = typer.Option("none", "--feature-layers", help="Also keep these layers' hidden states for feature fusion: 'none', 'default' (a low and a middle layer) or indices like 2,15."),
    prompt_positions: bool = typer.Option(True, "--prompt-positions/--no-prompt-positions", help="Also keep the prompts' positions (computed by the prefill anyway; needs --top-k for their labels)."),
):
    """Answer training prompts with the LLM (greedy) and keep its tokens and hidden states."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .prompts import default_training_prompts
    from .train.distill import DistillConfig, distill as run_distill
    from .train.world import world

    if turns < 1 or batch_size < 1 or max_new_tokens < 1:
        raise RedrafterError("--turns, --batch-size and --max-new-tokens must be at least 1.")
    if not 0 <= top_k <= 256:
        raise RedrafterError(f"--top-k must be between 0 and 256 (got {top_k}).")
    layers = _feature_layers(feature_layers, model)
    prompts = prompts or default_training_prompts()
    if prompts is None:
        raise RedrafterError("No --prompts given and the ShareGPT prompts are missing from the package (mlx_redrafter/data).", "Reinstall mlx-redrafter, or pass --prompts FILE.jsonl.")
    cfg = DistillConfig(turns, batch_size, max_new_tokens, max_prompt_tokens, minutes, max_conversations,
                        system=system, seed=seed, stop_loops=stop_loops, top_k=top_k, feature_layers=layers,
                        prompt_positions=prompt_positions and top_k > 0)
    w = world()
    if w.size > 1:  # under mlx.launch: rank 0 shows the bar, every rank says where it is
        err.print(f"{w.label}: distilling its share of the prompts into {out}")
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=err, disable=w.rank != 0) as bar:
        task = bar.add_task("distilling" + (f" ({w.label})" if w.size > 1 else ""), total=None, info="loading")
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
    if w.rank != 0:
        err.print(f"{w.label}: done")
        return
    err.print(f"{out}: {m.sequences} replies, {m.tokens} tokens, {len(m.done)} conversations done, {m.elapsed / 60:.1f} min")


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
    skip_repeats: Optional[int] = typer.Option(None, "--skip-repeats", help="Leave out positions whose next N tokens repeat earlier in the reply (0 = keep all)."),
    batch_size: int = typer.Option(256, "--batch-size"),
    lr: float = typer.Option(1e-3, "--lr"),
    epochs: Optional[float] = typer.Option(None, "--epochs", help="Passes over the data (default 2; with --minutes, the time budget decides)."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps"),
    minutes: Optional[float] = typer.Option(None, "--minutes"),
    eval_every: int = typer.Option(500, "--eval-every"),
    checkpoint_every: int = typer.Option(500, "--checkpoint-every"),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT/checkpoint."),
    seed: int = typer.Option(0, "--seed"),
    soft_weight: float = typer.Option(1.0, "--soft-weight", help="Weight of the KL to the LLM's top-k probabilities, when the data holds them (0 = hard labels only)."),
    depth_decay: float = typer.Option(0.8, "--depth-decay", help="Loss weight of depth d is DECAY**d (1 = equal weights)."),
    fuse_features: bool = typer.Option(False, "--fuse-features", help="Fuse the intermediate-layer features the data holds (distill --feature-layers) into the context."),
    prompt_positions: bool = typer.Option(True, "--prompt-positions/--no-prompt-positions", help="Train on the prompts' positions too, when the data holds them."),
):
    """Train a drafter on distilled data (the LLM stays frozen)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .llm.load import load_model
    from .train.trainer import TrainConfig, train as run_train
    from .train.world import world

    base = dict(PRESETS.get(preset or "default", {}))
    if preset is not None and preset not in PRESETS:
        raise RedrafterError(f"Unknown preset {preset!r}.", f"Use one of: {', '.join(PRESETS)}.")
    for k, v in (("exit_dim", exit_dim), ("num_draft_layers", num_draft_layers), ("draft_vocab_size", draft_vocab_size), ("skip_repeats", skip_repeats)):
        if v is not None:
            base[k] = v if (k != "draft_vocab_size" or v > 0) else None
    epochs = epochs if epochs is not None else (1000.0 if minutes else 2.0)
    cfg = TrainConfig(**base, rnn=rnn, depth=depth, batch_size=batch_size, lr=lr, epochs=epochs,
                      max_steps=max_steps, minutes=minutes, eval_every=eval_every,
                      checkpoint_every=checkpoint_every, seed=seed, soft_weight=soft_weight,
                      depth_decay=depth_decay, fuse_features=fuse_features, prompt_positions=prompt_positions)
    if soft_weight < 0 or not 0 < depth_decay <= 1:
        raise RedrafterError(f"--soft-weight must be >= 0 and --depth-decay in (0, 1] (got {soft_weight}, {depth_decay}).")
    if not data.is_dir():
        raise RedrafterError(f"Data folder does not exist: {data}", "Run `mlx-redrafter distill --out DIR` first.")
    llm, tok = load_model(model)
    w = world()
    if w.size > 1:  # under mlx.launch: rank 0 shows the bar and writes OUT, every rank says where it is
        err.print(f"{w.label}: training on its slice of each batch of {batch_size}" + (f", rank 0 writes {out}" if w.rank else ""))
    label = "training" + (f" ({w.label})" if w.size > 1 else "")
    columns = [TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=err, disable=w.rank != 0) as bar:
        task = bar.add_task("train", total=None, loss=float("nan"))
        try:
            run_train(llm, data, out, cfg, resume=resume, eos_ids=sorted(tok.eos_token_ids),
                      progress=lambda s, n, loss: bar.update(task, completed=s, total=n, loss=loss),
                      log_console=lambda line: bar.console.print(f"[dim]{line}[/dim]"))
        except KeyboardInterrupt:
            err.print(f"Interrupted: checkpoint saved in {out}/checkpoint; resume with --resume.")
            raise typer.Exit(130)
    if w.rank != 0:
        err.print(f"{w.label}: done")
        return
    err.print(f"wrote drafter {out} (log: {out}/train_log.jsonl)")


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
):
    """Chat in the terminal: streamed replies, KV cache reused across turns, speed after each reply.

    With a pipe on stdin, each line is a turn (or a /command); replies go to
    stdout as plain text and status lines to stderr.
    """
    from .chat import ChatSession, ChatSettings, run_chat
    from .chat.settings import check_setting

    check_setting("max_tokens", max_tokens, name="--max-tokens")  # the checks of /set, before the slow load
    sampling = _sampling(temp, top_p, top_k, min_p, as_set=True)
    if max_context is not None and max_context < 2:
        raise RedrafterError(f"--max-context must be at least 2 (got {max_context}).")
    rt = _runtime(model, drafter, no_draft, beam_width, beam_length, dtype, adaptive, lookup)
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
):
    """Serve the model over OpenAI's HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health)."""
    # Every check before the slow imports and the model load.
    if queue_size < 1:
        raise RedrafterError(f"--queue-size must be at least 1 (got {queue_size}).")
    _check_port(host, port)
    from .chat.settings import check_setting

    check_setting("max_tokens", max_tokens, name="--max-tokens")
    sampling = _sampling(temp, top_p, top_k, min_p, as_set=True)
    try:
        import uvicorn

        from .serve.openai_api import create_app
    except ImportError as e:
        raise RedrafterError(f"The server needs packages that are not installed ({e.name}).",
                             "pip install 'mlx-redrafter[server]'") from None
    from .serve import Engine

    rt = _runtime(model, drafter, no_draft, beam_width, beam_length, dtype, adaptive, lookup)
    app_ = create_app(Engine(rt, max_tokens=max_tokens, sampling=sampling, queue_size=queue_size))
    err.print(f"serving {rt.model_spec} at http://{host}:{port}/v1 (Ctrl-C stops)", soft_wrap=True)
    uvicorn.run(app_, host=host, port=port, log_level="warning")


@app.command()
def sweep(
    model: str = ModelOpt,
    drafter: Optional[str] = NeededDrafterOpt,
    widths: str = typer.Option("1,2,3,4", "--widths", help="Beam widths: a list or a range, e.g. 1,2,3,4 or 1-4."),
    lengths: str = typer.Option("2,3,4,5", "--lengths", help="Beam lengths (drafted tokens, g0 not counted), e.g. 2,3,4,5."),
    prompts: str = typer.Option("mt_bench", "--prompts", help="mt_bench | spec_bench | alpaca_eval | a .jsonl/.json/.txt file."),
    num_prompts: int = typer.Option(8, "--num-prompts", help="Prompts per cell (first turns, round-robin over categories)."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="Tokens generated per prompt."),
    out: Path = typer.Option(Path("sweep-results"), "--out", "-o", help="Output folder; an interrupted sweep resumes there."),
    baseline_every: int = typer.Option(4, "--baseline-every", help="Measure plain decoding again after every k cells."),
    save_profile: bool = typer.Option(False, "--save-profile", help="Store the best (W, L) for this device + model + drafter; generate and chat use it."),
    memory_limit: Optional[float] = typer.Option(None, "--memory-limit", help="GB one cell may use (default: what the device has); larger cells are skipped."),
    timings: bool = typer.Option(False, "--timings/--no-timings", "--profile/--no-profile", help="Split each step into draft / pack / verify / accept: a sync per phase, in the synchronous step loop, so the speedups are that loop's (--profile: the old name)."),
    fresh: bool = typer.Option(False, "--fresh", help="Start over instead of resuming the results in --out."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature for every run (0 = greedy)."),
    top_p: float = TopPOpt,
    seed: int = typer.Option(0, "--seed", help="With --temp > 0, prompt i is sampled from seed + i in every pass."),
    adaptive: bool = typer.Option(False, "--adaptive", help="Let the drafter's trained controller pick the depth (lengths become maxima)."),
    lookup: Optional[bool] = typer.Option(None, "--lookup/--no-lookup", help="Measure every cell with lookup drafts only, or only without (default: both)."),
    dtype: Optional[str] = DtypeOpt,
):
    """Measure ReDrafter over a beam width x length (x lookup on/off) grid against plain mlx-lm decoding: heatmaps, CSV, JSON."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .config import LOOKUP_LENGTH
    from .prompts import first_turn_ids, load_prompt_set, select_conversations
    from .runtime import resolve_drafter_path
    from .tuning import sweep as sw

    # Every check that needs no model comes before the slow load.
    lookups = [0, 1] if lookup is None else [int(lookup)]
    config = sw.SweepConfig(sw.parse_grid(widths, "--widths"), sw.parse_grid(lengths, "--lengths"), max_tokens,
                            baseline_every, timings, memory_limit, temp, top_p, seed, lookups)
    config.check()
    if num_prompts < 1:
        raise RedrafterError(f"--num-prompts must be at least 1 (got {num_prompts}).")
    convs = select_conversations(load_prompt_set(prompts), num_prompts)
    drafter_path = resolve_drafter_path(model, drafter)
    meta = {**sw.sweep_meta(model, drafter_path, prompts, dtype), "adaptive": adaptive}
    if not fresh:  # a mismatched --out fails now, not after the model load
        partial = sw.sweep_key(config, [], meta)
        sw.check_resumable(out, partial, only=[k for k in partial if k not in ("prompts_digest", "num_prompts")])
    s = _runtime(model, str(drafter_path), dtype=dtype, adaptive=adaptive, announce=False)
    err.print(f"[dim]model {model}, drafter {drafter_path}: {len(config.cells())} cells x {len(convs)} prompts, "
              f"{max_tokens} tokens each[/dim]")
    ids, dropped = sw.fit_prompts(first_turn_ids(s.tokenizer, convs), s.model, max_tokens,
                                  1 + max(config.widths) * max(config.lengths) + max(lookups) * LOOKUP_LENGTH)
    if dropped:
        err.print(f"[yellow]{dropped} prompts do not fit the model's context with --max-tokens {max_tokens}; left out.[/yellow]")
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
    with Progress(*columns, console=err) as bar:
        task = bar.add_task("sweep", total=None)
        try:
            results = sw.run_sweep(
                s.model, ids, s.drafter, config, out, meta, eos_ids=sorted(s.tokenizer.eos_token_ids),
                progress=lambda done, total, label: bar.update(task, completed=done, total=total, description=label),
                fresh=fresh, controller=s.controller,
            )
        except KeyboardInterrupt:
            err.print(f"Interrupted: finished cells are saved in {out}/results.json; rerun the same command to resume.")
            raise typer.Exit(130)
    sw.print_summary(Console(), results, config, out)  # the tables are the command's output: stdout
    if save_profile:
        path = sw.save_best_profile(results, model, drafter_path, out)
        if path is None:
            err.print("[yellow]No cell was measured: no profile saved.[/yellow]")
        else:
            best = results["best"]
            note = "" if best["speedup"] > 1 else " (slower than plain decoding here: consider --no-draft)"
            err.print(f"saved profile {path}: {sw.cell_label(*sw.cell_key(best))}{note}")


@app.command()
def convert(
    src: str = typer.Argument(..., help="Drafter folder (safetensors or pytorch_model.bin, sharded too), a weights file, or a Hub repo id."),
    dst: Path = typer.Argument(..., help="Output drafter folder (config.json + model.safetensors)."),
    dtype: str = typer.Option("float16", "--dtype", help="float32 | float16 | bfloat16."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Check that the drafter fits this LLM."),
):
    """Convert a PyTorch-trained drafter into MLX (pickles are read, never executed)."""
    from .converters.drafter import convert_drafter

    report = convert_drafter(src, dst, dtype=dtype, model=model)
    print("\n".join(report.lines()))


@app.command("inspect")
def inspect_cmd(
    drafter: str = typer.Argument(..., help="Drafter folder (MLX or PyTorch format) or Hub repo id."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Also show the cost of a draft step relative to this LLM."),
    dtype: Optional[str] = DtypeOpt,
):
    """Print a drafter's config, parameter count, size and dtype (and its cost per step with --model)."""
    from .converters.drafter import inspect_drafter

    print("\n".join(inspect_drafter(drafter, model=model, dtype=dtype).lines()))

@app.command("train-controller")
def train_controller_cmd(
    model: str = ModelOpt,
    drafter: Optional[str] = NeededDrafterOpt,
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Training prompts, JSONL (default: held-out ShareGPT conversations)."),
    num_prompts: int = typer.Option(48, "--num-prompts"),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n"),
    beam_width: Optional[int] = typer.Option(None, "--beam-width", "-W", help=f"Default: tuned profile, else {DEFAULT_WIDTH}."),
    beam_length: int = typer.Option(4, "--beam-length", "-L", help="Maximum depth the controller may choose."),
    epochs: int = typer.Option(100, "--epochs"),
    alpha: float = typer.Option(0.05, "--alpha", help="Penalty per drafted level."),
    seed: int = typer.Option(0, "--seed"),
):
    """Train the adaptive-depth controller for a drafter on this device (saved next to the drafter)."""
    import random

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .prompts import default_training_prompts, first_turn_ids, read_conversations, refuse_eval_set
    from .train.controller import fit_and_save
    from .train.trainer import is_eval_conversation

    if num_prompts < 1 or max_tokens < 1 or epochs < 1:
        raise RedrafterError("--num-prompts, --max-tokens and --epochs must be at least 1.")
    source = prompts or default_training_prompts()
    if source is None:
        raise RedrafterError("No --prompts given and the ShareGPT prompts are missing from the package (mlx_redrafter/data).", "Reinstall mlx-redrafter, or pass --prompts FILE.jsonl.")
    convs = read_conversations(source)
    refuse_eval_set(source, convs)
    if prompts is None:  # ShareGPT: the conversations held out from drafter training
        convs = [c for c in convs if is_eval_conversation(c["id"], 0.02)]
    random.Random(seed).shuffle(convs)
    s = _runtime(model, drafter, beam_width=beam_width, beam_length=beam_length, announce=False)
    if s.drafter is None:
        raise RedrafterError("train-controller needs a drafter.", "Pass --drafter PATH.")
    s.announce(err)
    ids = first_turn_ids(s.tokenizer, convs)
    ids = [p for p in ids if len(p) <= 512][:num_prompts]
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=err) as bar:
        task = bar.add_task("recording", total=len(ids))
        fit = fit_and_save(s.model, s.drafter, s.drafter_path, ids, s.beam_width, s.beam_length, max_tokens,
                           eos_ids=s.tokenizer.eos_token_ids, epochs=epochs, alpha=alpha, seed=seed,
                           progress=lambda stage, done, total: bar.update(task, description=stage, completed=done, total=total))
    err.print(f"{fit.steps} steps recorded; offline tokens per plain-step time: "
              + ", ".join(f"L={d}: {v:.2f}" for d, v in fit.fixed.items()) + f", adaptive: {fit.learned:.2f}")
    if not fit.beats_fixed:
        err.print(f"[yellow]The controller does not beat the fixed depth L={fit.best_depth} on the recorded steps; keep using fixed (W, L).[/yellow]")
    err.print(f"saved {fit.path} (use it with --adaptive)")


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point: user errors print one message, no traceback, exit 1."""
    try:
        app(args=argv)
    except RedrafterError as e:
        # soft_wrap: never break a path or a command in the message across lines
        err.print(f"[bold red]Error:[/bold red] {escape(e.problem)}", soft_wrap=True)
        if e.fix:
            err.print(f"[bold]Fix:[/bold] {escape(e.fix)}", soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        err.print("Interrupted.")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
