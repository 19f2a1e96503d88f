"""One exception type for problems a user can fix."""

from __future__ import annotations

from typing import Optional


class RedrafterError(ValueError):
    """A problem with the user's input, stated with the way to fix it.

    A ``ValueError``, so that library callers can catch bad arguments the
    usual way.
    The CLI prints ``str(error)`` without a traceback and exits non-zero.
    """

    def __init__(self, problem: str, fix: Optional[str] = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if not fix else f"{problem}\nFix: {fix}")
