"""What every command of the ``mlx-redrafter`` command line shares: the
typer ``app`` the commands register on, the error console, the flags that
several commands take (each defined once, ``...Opt``; a command lists the
ones it takes), and the helpers that turn the drafting flags into one
:class:`~mlx_redrafter.runtime.Runtime` (:func:`_runtime`) and the sampling
flags into one :class:`~mlx_redrafter.config.SamplingConfig` (:func:`_sampling`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from ..config import DEFAULT_DRAFT_MODEL_LENGTH, DEFAULT_HEAD_LENGTH, DEFAULT_LENGTH, DEFAULT_TREE, DEFAULT_WIDTH
from ..errors import RedrafterError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="ReDrafter speculative decoding for mlx-lm models: same tokens, fewer LLM calls.",
)


class _ErrorConsole(Console):
    """The error console: on a terminal rich wraps lines at its width; into a
    file or a pipe (a log, ``2>&1 | tee``) each message stays one line, as
    rich would otherwise break it at 80 columns, mid-phrase."""

    def print(self, *objects, soft_wrap=None, **kw) -> None:
        if soft_wrap is None and not self.is_terminal:
            soft_wrap = True
        super().print(*objects, soft_wrap=soft_wrap, **kw)


err = _ErrorConsole(stderr=True)

# --------------------------------------------------------------------------- shared flags

ModelOpt = typer.Option("default", "--model", "-m", help="'default', an mlx-lm folder, a Hub id or a .gguf file.")
DtypeOpt = typer.Option(
    None, "--dtype", help="float32 | float16 | bfloat16 (default: float16 on a GPU, float32 on the CPU)."
)
DrafterOpt = typer.Option(
    None,
    "--drafter",
    "-d",
    help="A drafter folder, a Hub repo id (org/name) or a name from `mlx-redrafter drafters list` (default: the "
    "drafter store's for the model, else the one shipped for it, "
    "else lookup drafts where they pay); 'none' for no drafter.",
)
NeededDrafterOpt = typer.Option(
    None,
    "--drafter",
    "-d",
    help="A drafter folder, a Hub repo id (org/name) or a name from `mlx-redrafter drafters list` (default: the "
    "drafter store's for the model, else the one shipped for it).",
)
NoDraftOpt = typer.Option(False, "--no-draft", help="Plain decoding, even if a drafter is available.")
LookupOpt = typer.Option(
    None,
    "--lookup/--no-lookup",
    help="Add drafts copied from the prompt and reply (n-gram lookup) to the drafter's (default: tuned profile, "
    "else on with a drafter). With --drafter none: lookup drafts only.",
)
BeamWidthOpt = typer.Option(
    None, "--beam-width", "-W", help=f"Beams drafted per step (default: tuned profile, else {DEFAULT_WIDTH})."
)
BeamLengthOpt = typer.Option(
    None,
    "--beam-length",
    "-L",
    help=f"Tokens drafted per beam, g0 not counted (default: tuned profile, else {DEFAULT_LENGTH}).",
)
TreeOpt = typer.Option(
    None,
    "--tree",
    help="auto: verify only the draft nodes expected to pay on this device's measured verify cost "
    "(width and length become caps); fixed: every drafted node (default: auto for a model kept quantized, "
    + DEFAULT_TREE
    + " otherwise).",
)
MtpOpt = typer.Option(
    None,
    "--mtp",
    help="The model's native multi-token-prediction head (Qwen3.5/3.6/3.8, Qwen3-Next, DeepSeek-V3, GLM-4.5+, "
    "MiMo): a checkpoint folder that holds it or a split MTP folder (default: the model's own checkpoint's, "
    "when it ships one); 'none' to leave it out.",
)
MtpDepthOpt = typer.Option(
    None, "--mtp-depth", help=f"Tokens the MTP head drafts per step, chained (default {DEFAULT_HEAD_LENGTH})."
)
DraftModelOpt = typer.Option(
    None,
    "--draft-model",
    help="A smaller model with the same tokenizer that drafts beside the rest (mlx-lm's --draft-model): "
    "a folder, a Hub id or a .gguf file.",
)
NumDraftTokensOpt = typer.Option(
    None,
    "--num-draft-tokens",
    help=f"Tokens the draft model drafts per step (default {DEFAULT_DRAFT_MODEL_LENGTH}).",
)
AdaptiveOpt = typer.Option(False, "--adaptive", help="Let the drafter's trained controller decide the draft depth.")
TempOpt = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy; serve: when a request does not say).")
TopPOpt = typer.Option(0.0, "--top-p", help="Nucleus sampling (0 = off).")
TopKOpt = typer.Option(0, "--top-k", help="Sample from the k most likely tokens (0 = off).")
MinPOpt = typer.Option(0.0, "--min-p", help="Min-p sampling (0 = off).")
SeedOpt = typer.Option(None, "--seed")
# serve's
MaxTokensCapOpt = typer.Option(
    None,
    "--max-tokens-cap",
    help="Longest reply whatever a request asks (its max_tokens is cut to it; the reply ends with "
    "finish 'length'). Default: the room the context leaves.",
)
CapEndsTurnOpt = typer.Option(
    False,
    "--cap-ends-turn",
    help="Report a reply cut by --max-tokens-cap as a finished turn (finish 'stop', 'end_turn'), not as cut: "
    "for a base model, which never ends a turn, whose cut replies agents such as Claude Code take for errors.",
)
ServedModelNameOpt = typer.Option(
    [],
    "--served-model-name",
    help="A name the model answers to (repeatable; the first is the one the server reports). "
    "Always answered: the --model as given and its short name (file or repo stem).",
)
SystemOpt = typer.Option(None, "--system", help="System message for the chat template.")
DatastoreOpt = typer.Option(
    None,
    "--datastore",
    help="Draft from a datastore of past outputs where context lookup finds nothing: a store file, 'default' "
    "(the model's own stores: history, built, corpus; see `mlx-redrafter datastore info`) or 'none' (the default).",
)
NoHistoryOpt = typer.Option(
    False,
    "--no-history",
    help="Write nothing of this session to disk. By default each prompt and reply is appended to the model's "
    "history under the cache folder (said at start; for datastore drafts and make-drafter --prompts history).",
)


def _sampling(temp: float, top_p: float, top_k: int, min_p: float, as_set: bool = False):
    """The sampling flags as one :class:`~mlx_redrafter.config.SamplingConfig`,
    checked before the slow model load (``as_set``: with ``/set``'s messages,
    for the commands whose defaults ``/set`` or a request may change)."""
    from ..config import SamplingConfig

    if as_set:
        from ..chat.settings import check_setting

        for k, v in dict(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p).items():
            check_setting(k, v, name="--" + k.replace("_", "-"))
    return SamplingConfig(temp, top_p, min_p, top_k)


# The model and drafting flags of the commands that run a model, as
# :func:`drafting` adds them: each flag's name (its LoadOptions or SourceFlags
# field), its type and its option.
DRAFT_FLAGS = (
    ("model", str, ModelOpt),
    ("drafter", Optional[str], DrafterOpt),
    ("no_draft", bool, NoDraftOpt),
    ("lookup", Optional[bool], LookupOpt),
    ("beam_width", Optional[int], BeamWidthOpt),
    ("beam_length", Optional[int], BeamLengthOpt),
    ("dtype", Optional[str], DtypeOpt),
    ("adaptive", bool, AdaptiveOpt),
    ("tree", Optional[str], TreeOpt),
    ("datastore", Optional[str], DatastoreOpt),
    ("mtp", Optional[str], MtpOpt),
    ("mtp_depth", Optional[int], MtpDepthOpt),
    ("draft_model", Optional[str], DraftModelOpt),
    ("num_draft_tokens", Optional[int], NumDraftTokensOpt),
)


def draft_options(flags: dict, history: bool = False):
    """The :class:`~mlx_redrafter.runtime.LoadOptions` of the drafting
    flags :func:`drafting` collected (``flags``: by :data:`DRAFT_FLAGS` name)."""
    from ..draft.stateful import SourceFlags
    from ..runtime import LoadOptions

    sources = SourceFlags(flags["mtp"], flags["mtp_depth"], flags["draft_model"], flags["num_draft_tokens"])
    f = flags
    return LoadOptions(
        f["model"], f["drafter"], f["no_draft"], f["beam_width"], f["beam_length"], f["dtype"], f["adaptive"],
        f["lookup"], f["tree"], f["datastore"], history, sources,
    )  # fmt: skip


def drafting(command):
    """A command that runs a model: it takes every flag of :data:`DRAFT_FLAGS`
    (added to its signature, for typer) and gets them as one
    ``options`` (:class:`~mlx_redrafter.runtime.LoadOptions`), built here by
    each flag's own name: no command lists them, none can miss or rename one."""
    import functools
    import inspect

    sig = inspect.signature(command)
    own = [p for p in sig.parameters.values() if p.name != "options"]
    added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=o, annotation=t) for n, t, o in DRAFT_FLAGS]
    names = [n for n, _, _ in DRAFT_FLAGS]

    @functools.wraps(command)
    def run(*args, **kw):
        flags = {n: kw.pop(n) for n in names}
        return command(*args, options=draft_options(flags), **kw)

    run.__signature__ = sig.replace(parameters=[*own, *added])
    run.__annotations__ = {**{k: v for k, v in command.__annotations__.items() if k != "options"}}
    run.__annotations__.update((n, t) for n, t, _ in DRAFT_FLAGS)
    return run


def _runtime(options, announce: bool = True):
    """The :class:`~mlx_redrafter.runtime.Runtime` that a command's
    :class:`~mlx_redrafter.runtime.LoadOptions` describe (model loaded, draft
    resolved), announced on the error console unless ``announce`` is False."""
    from ..doctor import slow_blas_warning
    from ..runtime import open_runtime

    warning = slow_blas_warning()  # decoding is ~3.5x slower: say so before anything else
    if warning:
        err.print(f"[yellow]{escape(warning)}[/yellow]", soft_wrap=True)
    rt = open_runtime(options)
    if announce:
        rt.announce(err)
    return rt


# --------------------------------------------------------------------------- helpers


def progress_bar(*middle: str, eta: bool = False, disable: bool = False):
    """A rich progress bar on the error console: the task's description, a bar,
    ``middle`` (``"count"``: done of total; any other string: a text column's
    format), the time elapsed, ("ETA" with ``eta``) and the time remaining."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [TextColumn("{task.description}"), BarColumn()]
    columns += [MofNCompleteColumn() if m == "count" else TextColumn(m) for m in middle]
    columns += [TimeElapsedColumn()] + ([TextColumn("ETA")] if eta else []) + [TimeRemainingColumn()]
    return Progress(*columns, console=err, disable=disable)


def read_prompt(prompt: Optional[str], file: Optional[Path]) -> str:
    """The prompt from --prompt, --file, or standard input; an empty one
    (or only white space) is refused, naming where it came from."""
    if prompt is not None and file is not None:
        raise RedrafterError("Give either --prompt or --file, not both.")
    if file is not None:
        if not file.is_file():
            raise RedrafterError(f"Prompt file does not exist: {file}", "Check the --file path.")
        text, where = file.read_text(), f"The prompt file {file}"
    elif prompt is not None:
        text, where = prompt, "The --prompt"
    elif sys.stdin.isatty():
        raise RedrafterError("No prompt given.", "Use --prompt TEXT, --file PATH, or pipe text on stdin.")
    else:
        text, where = sys.stdin.read(), "The prompt read from standard input"
    if not text.strip():
        raise RedrafterError(
            f"{where} is empty.", "Give the text to answer: --prompt TEXT, --file PATH, or pipe it in."
        )
    return text


def format_prompt(tokenizer, text: str, system: Optional[str], raw: bool):
    """Apply the chat template (unless ``raw`` or the model has none)."""
    from ..prompts import build_messages, has_chat_template, render_messages

    if raw or not has_chat_template(tokenizer):  # a model without a template continues the text as given
        return text

    return render_messages(tokenizer, build_messages(system, [], text))
