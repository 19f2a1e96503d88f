"""The real agents against the real server (issue 48): Claude Code and Codex
CLI, installed from npm (bench/agents.py: once, into a cache folder), each
run non-interactively for two turns against ``mlx-redrafter serve``, exactly
as docs/server.md tells a user to run them.

The model is tests/helpers.py's agent model: a one-layer tiny llama with a
byte-level BPE trained on the agents' recorded requests and a ChatML
template, so its prompts are as long as with a real model (12-15k tokens)
and a prefill costs next to nothing (bench/agents.py runs the same turns on
the Gemma 3 270M GGUF for bench/RESULTS.md). Its replies are random tokens
that never end a turn, so the server caps every reply
(``--max-tokens-cap``) and reports the cut as the turn's end
(``--cap-ends-turn``: both clients take a reply cut short for an error and
retry it). What is checked is the protocol, not the words: Claude Code's
JSON result has ``is_error: false``, Codex exits 0 with a final message,
every request either client sent got a 2xx, and the second turn prefilled
only what is new (the system prompt and tools came from the prompt cache).

Without Node.js and npm the test is skipped, unless
``MLX_REDRAFTER_REQUIRE_AGENTS`` is set (``.ci/run`` sets it, and installs
the clients first): then it fails, so CI never skips it silently.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
from helpers import agent_model_folder

REPO = Path(__file__).resolve().parents[1]
CAP = 8  # tokens a reply may have


def _bench():
    spec = importlib.util.spec_from_file_location("bench_agents", REPO / "bench" / "agents.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


agents = _bench()


def _missing(why: str):
    if os.environ.get("MLX_REDRAFTER_REQUIRE_AGENTS"):
        pytest.fail(f"{why} (MLX_REDRAFTER_REQUIRE_AGENTS is set: CI must run this test)")
    pytest.skip(why)


@pytest.fixture(scope="session")
def clients():
    """Both clients, installed with npm into the cache folder once."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        _missing(agents.NO_NODE)
    return agents.install_clients()


@pytest.fixture(scope="module")
def server(tmp_path_factory, clients):
    """``serve`` on the agent model: its URL, the model's short name, its log."""
    root = tmp_path_factory.mktemp("agents-serve")
    folder = agent_model_folder(root, "llama", max_position_embeddings=32768)
    log = root / "serve.log"
    with agents.serving(["--model", str(folder), "--max-tokens-cap", str(CAP), "--cap-ends-turn"], log) as url:
        yield url, folder.name, log


def _turns(run, clients, server, tmp_path):
    """Two turns of one client; each turn's :class:`Run` and what it cost the server."""
    url, model, log = server
    for d in ("work", "home"):
        (tmp_path / d).mkdir()
    out = []
    for turn, prompt in enumerate(agents.PROMPTS):
        before = agents.metrics(url)
        r = run(clients, url, model, prompt, tmp_path / "work", tmp_path / "home", resume=turn > 0)
        out.append((r, agents.turn_tokens(before, agents.metrics(url))))
        assert r.returncode == 0, f"{r.output[-3000:]}\n--- serve's log:\n{log.read_text()[-3000:]}"
    return out


def _check_server_side(turns, route: str):
    (_, first), (_, second) = turns
    for cost in (first, second):
        assert cost["requests"], "the client sent nothing"
        assert all(k.split()[1].startswith("2") for k in cost["requests"]), cost["requests"]  # every request: a 2xx
        assert any(k.startswith(route) for k in cost["requests"]), cost["requests"]
    assert first["prefilled"] > 5_000  # the agent's system prompt and tools, prefilled once
    # then reused: all of the first turn's prompt but its last token (the one a step decodes from)
    assert second["reused"] >= first["prefilled"] - 1 and second["prefilled"] < 500


def test_claude_code_two_turns(clients, server, tmp_path):
    turns = _turns(agents.claude, clients, server, tmp_path)
    for r, _ in turns:
        assert r.result["is_error"] is False and r.result["api_error_status"] is None, r.output[-3000:]
        assert r.result["type"] == "result"
    _check_server_side(turns, "/v1/messages")


def test_codex_two_turns(clients, server, tmp_path):
    turns = _turns(agents.codex, clients, server, tmp_path)
    for r, _ in turns:
        assert r.answer.strip(), r.output[-3000:]  # its final message
    _check_server_side(turns, "/v1/responses")
