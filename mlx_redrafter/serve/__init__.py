"""The ``serve`` command: one model over OpenAI's, Ollama's and Anthropic's HTTP APIs.

* engine.py: the core, without HTTP: a fair bounded queue of jobs on one
  worker thread, and the KV cache consecutive requests share;
* scheduler.py, batch.py, rows.py, jobs.py: who decodes and who waits
  (``--max-batch``, ``--queue-size``, 503 with Retry-After), concurrent
  requests decoded together (mlx-lm's BatchGenerator) where that pays and a
  lone one drafted, one request's row, a job's parameters and result;
* app.py: the HTTP app (FastAPI; the ``server`` extra): every API's routes,
  ``/health``, ``/metrics``, the chat page (ui/, static files) at ``/``, and
  each API's error shape by path;
* streaming.py: what every route shares: queueing a job, the worker's
  events on the event loop, streamed replies, the neutral ``Failure``;
* limits.py: how large a request's body may be (a 413 before it is parsed);
* openai_api.py, openai_reply.py: OpenAI's API;
* ollama_api.py, ollama_reply.py: Ollama's native API on the same engine;
* anthropic_api.py, anthropic_reply.py: Anthropic's Messages API (Claude Code);
* responses_api.py, responses_reply.py: OpenAI's Responses API, stateless (Codex CLI);
* tools.py, tool_calls.py: tool calling: tools into the prompt; calls out of
  the reply, in each API's shape.
"""

from .engine import Engine, GenParams, Job, JobQueue, Piece, QueueFull, Result, token_source

__all__ = ["Engine", "GenParams", "Job", "JobQueue", "Piece", "QueueFull", "Result", "token_source"]
