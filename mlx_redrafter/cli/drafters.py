"""``mlx-redrafter drafters list|path|rm`` (the drafter store, hub/store.py)
and ``mlx-redrafter upload`` (publishing one on the Hub, hub/publish.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..errors import RedrafterError
from .options import app, err

drafters_app = typer.Typer(no_args_is_help=True, help="The drafter store: the drafters the tools pick for each model.")
app.add_typer(drafters_app, name="drafters")


def _row(e, used=None) -> list:
    base = e.meta.get("base_model") or {}
    speed = f"{e.speedup:.2f}x" if isinstance(e.speedup, (int, float)) else "-"
    state = f"does not fit: {e.problem}" if e.problem else ("used" if used is not None and e.path == used else "")
    return [e.model_id, str(base.get("fingerprint", "-"))[:8], e.source, speed, str(e.path), state]


@drafters_app.command("list")
def list_cmd(
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="Only the drafters of this model's family, and which one the tools use for it."
    ),
):
    """Show the stored drafters (and the package's): model, fingerprint, source, measured speed-up, folder."""
    from ..hub import store

    used, rows = None, None
    if model is not None:
        from ..llm.load import identity_for_spec

        identity = identity_for_spec(model)
        found = store.find(identity)
        used = found.path if found else None
        rows = store.candidates(identity)
    rows = store.entries() if rows is None else rows
    table = [["model", "fingerprint", "source", "speed-up", "path", ""]] + [_row(e, used) for e in rows]
    mtp = _mtp_row(model) if model is not None else None
    table += [mtp] if mtp else []
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:  # plain columns: whole paths, whatever the terminal's width
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if not rows and not mtp:
        import shlex

        make = f"mlx-redrafter make-drafter --model {shlex.quote(model) if model else 'MODEL'} --hours 1"
        err.print(
            f"No drafters in {escape(str(store.store_root()))}"
            + (f" for {escape(model)}" if model else "")
            + f". `{escape(make)}` makes one.",
            soft_wrap=True,
        )


def _mtp_row(model: str) -> Optional[list]:
    """The row of the MTP head the model's checkpoint ships (the tools draft
    with it by default, beside any drafter), or None."""
    from ..draft.mtp_load import find_mtp
    from ..llm.load import resolve_model_path

    found = find_mtp(resolve_model_path(model))
    if found is None:
        return None
    layers = f"{found.layers} layer{'s' if found.layers > 1 else ''}"
    return [model, "-", f"native MTP head ({found.family}, {layers})", "-", str(found.path), "used (--mtp none: off)"]


@drafters_app.command("path")
def path_cmd(model: str = typer.Argument(..., help="'default', an mlx-lm folder, a Hub id or a .gguf file.")):
    """Print the folder of the drafter the tools use for MODEL."""
    from ..hub import store
    from ..llm.load import identity_for_spec

    identity = identity_for_spec(model)
    found = store.find(identity)
    if found is None:
        refused = [f"{e.path}: {e.problem}" for e in store.candidates(identity) if e.problem]
        raise RedrafterError(
            f"The drafter store holds no drafter that fits {model}"
            + (f" (refused: {'; '.join(refused)})" if refused else "")
            + ".",
            f"Make one with `mlx-redrafter make-drafter --model {model}`.",
        )
    print(found.path)
    note = found.note(identity)
    if note:
        err.print(f"[yellow]Note: {note}[/yellow]", soft_wrap=True)


@drafters_app.command("rm")
def rm_cmd(
    name: str = typer.Argument(
        ..., help="A drafter's folder name (`drafters list`), or a model id: every drafter made for it."
    ),
):
    """Remove stored drafters (asks nothing; says what it removed)."""
    from ..hub import store

    for path in store.remove(name):
        print(f"removed {path}")


@app.command()
def upload(
    drafter: str = typer.Argument(
        ..., help="A drafter folder, a name from `drafters list`, or a model id (its stored drafter)."
    ),
    repo: str = typer.Option(..., "--repo", help="The Hub repo to publish to (org/name)."),
    include_private_data: bool = typer.Option(
        False, "--include-private-data", help="Publish a drafter trained on your own conversations (--prompts history)."
    ),
    private: bool = typer.Option(False, "--private", help="Create the repo private."),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Write the folder that would be uploaded (see --out) and print its model card; upload nothing.",
    ),
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", help="Where --dry-run writes the folder (default: ./upload-ORG--NAME)."
    ),
):
    """Publish a drafter on the Hugging Face Hub with a model card written from what it knows (base model, data, recipe, acceptance, verdict)."""  # noqa: E501 (one line: typer shows newlines)
    from ..hub.locate import is_hub_id, locate
    from ..hub.publish import publish
    from ..hub.store import slug

    if not is_hub_id(repo):
        raise RedrafterError(f"--repo {repo!r} is not a Hub repo id.", "Use --repo ORG/NAME.")
    folder = locate(drafter).path
    if dry_run:
        staged = Path(
            publish(
                folder, repo, include_private_data=include_private_data, dry_run=out or Path(f"upload-{slug(repo)}")
            )
        )
        print((staged / "README.md").read_text())
        err.print(f"wrote {staged} (nothing uploaded: --dry-run)", soft_wrap=True)
        return
    address = publish(folder, repo, private=private, include_private_data=include_private_data)
    err.print(f"uploaded {folder} to {address}", soft_wrap=True)
