"""The ``serve`` command: one model over OpenAI's HTTP API.

* engine.py: the core, without HTTP: a fair bounded queue of jobs on one
  worker thread, and the KV cache consecutive requests share;
* openai_api.py: the HTTP layer (FastAPI; the ``server`` extra).
"""

from .engine import Engine, GenParams, Job, JobQueue, Piece, QueueFull, Result, token_source

__all__ = ["Engine", "GenParams", "Job", "JobQueue", "Piece", "QueueFull", "Result", "token_source"]
