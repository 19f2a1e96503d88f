"""The ``mlx-redrafter`` command line: :func:`main`, and the commands.

The shared flags and the typer ``app`` are in :mod:`.options`; each command
module registers its commands on that ``app`` when imported below, so no
command module imports this package (the import graph has no circle).
"""

from __future__ import annotations

import os
from typing import List, Optional

import typer.rich_utils
from rich.markup import escape

from ..errors import RedrafterError
from . import convert, datastore, drafters, make, run, sweep, training  # noqa: F401 (the commands register on app)
from .options import app, err

# --help's width into a pipe or a file, where no terminal says one: wide enough that
# no command's table cuts a word (at rich's 80 columns it drew `multi-token-predic…`).
PIPE_WIDTH = 120
TYPER_WIDTH = typer.rich_utils.MAX_WIDTH  # typer's own ($TERMINAL_WIDTH, else the terminal's)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point: user errors print one message, no traceback, exit 1."""
    typer.rich_utils.MAX_WIDTH = help_width()
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


def help_width() -> Optional[int]:
    """The width ``--help`` is drawn at: the user's ($TERMINAL_WIDTH,
    $COLUMNS), else a terminal's (rich asks stdin, stdout and stderr: ``|
    less`` gets the terminal's width), else, with no terminal at all (a
    script, an agent, CI), PIPE_WIDTH."""
    if TYPER_WIDTH is not None or os.environ.get("COLUMNS") or _a_terminal():
        return TYPER_WIDTH  # None: rich reads $COLUMNS, else the terminal
    return PIPE_WIDTH


def _a_terminal() -> bool:
    for fd in (0, 1, 2):
        try:
            if os.get_terminal_size(fd).columns > 0:
                return True
        except (OSError, ValueError):  # not a terminal
            pass
    return False
