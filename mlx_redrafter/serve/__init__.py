"""The ``serve`` command: one model over OpenAI's and Ollama's HTTP APIs.

* engine.py: the core, without HTTP: a fair bounded queue of jobs on one
  worker thread, and the KV cache consecutive requests share;
* openai_api.py: the HTTP layer (FastAPI; the ``server`` extra), with the
  chat page (ui/, static files) at ``/``;
* ollama_api.py, ollama_reply.py: Ollama's native API on the same engine;
* tools.py: tool calling (tools into the prompt, calls out of the reply).
"""

from .engine import Engine, GenParams, Job, JobQueue, Piece, QueueFull, Result, token_source

__all__ = ["Engine", "GenParams", "Job", "JobQueue", "Piece", "QueueFull", "Result", "token_source"]
