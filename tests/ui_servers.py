"""Servers for the tests that need one (the chat page, Ollama, tools, structured
output, fuzz): ``mlx-redrafter serve`` in a
subprocess, and a stand-in OpenAI-compatible stream that says whatever a
test wants (the page must be safe for any server's output). Each is on
127.0.0.1 and a free port, and always stopped."""

from __future__ import annotations

import io
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import List, Optional, Tuple

import httpx
import pytest
from starlette.requests import Request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(url: str, proc, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}):\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"the server did not start:\n{log.read_text() if log else ''}")
        time.sleep(0.5)


class GenerateCommand:
    """``mlx-redrafter generate --temp 0 -n MAX_TOKENS -p PROMPT FLAGS``, run
    in-process the first time its output is read, like a finished process:
    ``communicate()`` gives ``(stdout, stderr)``, then ``returncode`` is set.
    ``--no-draft``: plain decoding, which the server's drafted replies equal.
    In-process, a module that uses ``default_loaded_once`` (conftest.py) does
    not load the default model again (a subprocess spent seconds on it)."""

    def __init__(self, prompt: str, max_tokens: int, *flags: str):
        self.args = ["generate", "--temp", "0", "-n", str(max_tokens), "-p", prompt, *flags]
        self.returncode: Optional[int] = None
        self._output: Optional[Tuple[str, str]] = None

    def communicate(self, timeout: Optional[float] = None) -> Tuple[str, str]:
        from helpers import cli

        if self._output is None:
            out, err = io.StringIO(), io.StringIO()
            with redirect_stdout(out), redirect_stderr(err):
                self.returncode = cli(self.args)
            self._output = out.getvalue(), err.getvalue()
        return self._output


class Server:
    """``mlx-redrafter serve ARGS`` on a free port: ``url``, ``stop()``."""

    def __init__(self, args: List[str], log: Path, port: Optional[int] = None, **popen):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "mlx_redrafter.cli", "serve", "--port", str(self.port), *args]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **popen)
        try:
            wait_healthy(self.url, self.proc, log)
        except BaseException:
            self.stop()
            raise

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self) -> None:
        stop_process(self.proc)


# --------------------------------------------------------------------------- a stand-in stream


def fake_app(pieces: List[Tuple[str, str]]):
    """The chat page (the real ``mount_ui``) over a chat route that streams
    ``pieces`` (``(text, source)``) as OpenAI chunks with ``x_redrafter``.
    A last user message ``busy`` gets the real server's queue-full error."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from mlx_redrafter.serve.app import mount_ui
    from mlx_redrafter.serve.openai_api import error_response
    from mlx_redrafter.serve.streaming import BUSY, Failure

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": "stand-in", "drafter": None}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):  # Request at module level: FastAPI resolves the annotation there
        body = await request.json()
        if body["messages"][-1]["content"] == "busy":
            return error_response(
                Failure(
                    503, "The server is busy: 4 requests are waiting for the model (the bound is 4). Retry later.", BUSY
                )
            )
        return StreamingResponse(_chunks(pieces), media_type="text/event-stream")

    mount_ui(app)
    return app


async def _chunks(pieces):
    head = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "stand-in"}
    yield _data({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    for i, (text, source) in enumerate(pieces, 1):
        x = {
            "sources": [source],
            "tokens": i,
            "steps": i,
            "tokens_per_second": 1.0,
            "prompt_tokens": 3,
            "prompt_tokens_reused": 0,
        }
        yield _data({**head, "choices": [{"index": 0, "delta": {"content": text}}], "x_redrafter": x})
    yield _data({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    yield "data: [DONE]\n\n"


def _data(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@contextmanager
def serve_in_thread(app):
    """Run an ASGI ``app`` with uvicorn on a thread; yields its URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, None, None, timeout=60)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def chromium_path() -> str:
    """Debian's chromium (never a browser downloaded by ``playwright install``)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail(
            "The chat page's browser tests need Chromium: apt-get install -y chromium (and pip install playwright)."
        )
    return path
