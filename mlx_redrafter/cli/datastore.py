"""``mlx-redrafter datastore build|add|info|clear``: the model's datastores
(draft/datastore/use.py says where they live and what they hold)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import RedrafterError
from .options import ModelOpt, app, err

store_app = typer.Typer(no_args_is_help=True, help="The model's datastores: drafts from its own past outputs.")
app.add_typer(store_app, name="datastore")

OutOpt = typer.Option(None, "--out", "-o", help="Store file (default: the model's own, under the cache folder).")


@store_app.command()
def build(
    model: str = ModelOpt,
    prompts: Path = typer.Option(
        ..., "--prompts", help="Training prompts (.jsonl/.json/.txt, optionally .gz); evaluation sets are refused."
    ),
    minutes: Optional[float] = typer.Option(
        None, "--minutes", help="Stop after this many minutes (default: every prompt)."
    ),
    batch_size: int = typer.Option(16, "--batch-size", help="Prompts answered at once."),
    max_new_tokens: int = typer.Option(192, "--max-new-tokens", help="Longest reply, in tokens."),
    max_conversations: Optional[int] = typer.Option(
        None, "--max-conversations", help="Prompts answered in all (over resumed runs)."
    ),
    out: Optional[Path] = OutOpt,
):
    """Answer training prompts greedily in batches and keep the replies as a datastore (resumable; Ctrl-C saves)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..prompts import read_conversations, refuse_eval_set
    from ..train.store_build import BuildConfig, build_store, check_build_args

    check_build_args(minutes, batch_size, max_new_tokens)
    refuse_eval_set(prompts, read_conversations(prompts))  # before the slow load
    cfg = BuildConfig(minutes, batch_size, max_new_tokens, max_conversations=max_conversations)
    columns = (
        TextColumn("datastore build"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[tokens]} tokens"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task("build", total=None, tokens=0)
        report = build_store(
            model,
            prompts,
            cfg,
            out=out,
            progress=lambda n, total, tokens: bar.update(task, completed=n, total=total, tokens=tokens),
        )
    err.print(
        f"{report.path}: +{report.replies} replies in {report.seconds / 60:.1f} min; "
        f"{report.sequences} sequences, {report.tokens} tokens, {_size(report.path)}",
        soft_wrap=True,
    )


def _tokenizer(model: str):
    from ..llm.load import load_model

    return load_model(model)[1]


def read_corpus(path: Path):
    """The texts of a corpus file: each JSONL record's ``text`` (or ``prompt``/
    ``content``/``completion``) field, or a plain text file as one document."""
    import json

    if not path.is_file():
        raise RedrafterError(f"Corpus file does not exist: {path}", "Check the path.")
    if path.suffix != ".jsonl":
        return [path.read_text()]
    texts = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise RedrafterError(f"{path}:{i} is not JSON.", "Give one JSON object per line.") from None
        text = next(
            (rec[k] for k in ("text", "completion", "content", "prompt") if isinstance(rec, dict) and k in rec), None
        )
        if not isinstance(text, str):
            raise RedrafterError(f"{path}:{i} has no text field.", 'Give each record a "text" string.')
        texts.append(text)
    return texts


@store_app.command()
def add(
    file: Path = typer.Argument(..., help='A text file (one document) or a .jsonl file (a "text" field per line).'),
    model: str = ModelOpt,
    out: Optional[Path] = OutOpt,
):
    """Add a corpus (domain text, code) to the model's datastore, to be drafted from."""
    from ..draft.datastore.index import Datastore, default_path, model_key

    texts = read_corpus(file)
    path = out or default_path(model, "corpus")
    store = Datastore.open(path, model_key(model))
    len(store)  # refuse a bad file before the load
    tok = _tokenizer(model)
    for text in texts:
        store.add(tok.encode(text, add_special_tokens=False))
    store.save(path)
    err.print(
        f"{path}: +{len(texts)} documents; {len(store)} sequences, {store.tokens} tokens, {_size(path)}", soft_wrap=True
    )


def _size(path: Path) -> str:
    return f"{path.stat().st_size / 2**20:.2f} MiB" if path.is_file() else "no file"


@store_app.command()
def info(model: str = ModelOpt):
    """Show the model's stores (sequences, tokens, size on disk) and the last session's hit rate."""
    from ..draft.datastore.index import KINDS, Datastore, default_path, model_key
    from ..draft.datastore.use import read_session, shipped_store_path

    paths = [(kind, default_path(model, kind)) for kind in KINDS]
    if shipped_store_path(model) is not None:
        paths.append(("shipped", shipped_store_path(model)))
    for kind, path in paths:
        store = Datastore.open(path, model_key(model))
        try:
            counts = f"{len(store)} sequences, {store.tokens} tokens"
        except RedrafterError as e:
            counts = f"refused: {e.problem}"
        print(f"{kind:>8}: {counts}, {_size(path)}  ({path})")
    s = read_session(model)
    if s is None:
        print(" session: none recorded (chat and serve record theirs)")
    else:
        print(
            f" session: started {s.started}, {s.replies} replies, {s.tokens} tokens; datastore rows on "
            f"{s.datastore_rows} steps, accepted on {s.datastore_steps} ({s.hit_rate:.0%} hit rate), "
            f"{s.datastore_tokens} tokens ({s.datastore_tokens / max(s.tokens, 1):.0%} of all)"
        )


@store_app.command()
def clear(
    model: str = ModelOpt,
    kind: str = typer.Option("history", "--kind", help="history | built | corpus | all"),
):
    """Empty the model's history store (the replies chat and serve kept, and their prompts), or another kind."""
    from ..draft.datastore.index import KINDS, default_path
    from ..draft.datastore.use import prompts_path, session_path

    kinds = KINDS if kind == "all" else (kind,)
    if not set(kinds) <= set(KINDS):
        raise RedrafterError(f"Unknown --kind {kind!r}.", f"Use one of {', '.join(KINDS)} or all.")
    for k in kinds:
        path = default_path(model, k)
        history = (session_path(model), prompts_path(model)) if k == "history" else ()
        for p in (path, path.with_name(path.name + ".done.json")) + history:
            p.unlink(missing_ok=True)
        print(f"cleared {k}: {path}")
