"""The ``chat`` command: a conversation with a model in the terminal.

* settings.py: what ``/set`` and the command's flags change (:class:`ChatSettings`);
* conversation.py: history, KV cache reuse and totals (:class:`ChatSession`,
  which works without a terminal);
* commands.py: slash commands and transcripts;
* terminal.py: the read-reply loop (:func:`run_chat`).
"""

from .conversation import ChatSession, Turn
from .settings import ChatSettings
from .terminal import run_chat

__all__ = ["ChatSession", "ChatSettings", "Turn", "run_chat"]
