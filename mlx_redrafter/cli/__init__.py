"""The ``mlx-redrafter`` command line: :func:`main`, and the commands.

The shared flags and the typer ``app`` are in :mod:`.options`; each command
module registers its commands on that ``app`` when imported below, so no
command module imports this package (the import graph has no circle).
"""

from __future__ import annotations

from typing import List, Optional

from rich.markup import escape

from ..errors import RedrafterError
from . import convert, datastore, drafters, make, run, sweep, training  # noqa: F401 (the commands register on app)
from .options import app, err


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
