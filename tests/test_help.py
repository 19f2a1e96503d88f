"""A command's help names what the command serves.

``serve --help`` is derived-checked against the app ``serve`` builds: every
API module whose routes the app mounts must be named (its name and one of its
paths), and every route the app defines itself (``/health``, ``/metrics``, the
chat page) must be listed, so an API added without help text fails here.
"""

from __future__ import annotations

import re

import typer

from mlx_redrafter.cli import app
from mlx_redrafter.llm.prompt_cache import PromptCache
from mlx_redrafter.serve.app import create_app
from mlx_redrafter.serve.engine import Engine, JobQueue

SERVE = "mlx_redrafter.serve."


def command_help(name: str) -> str:
    """What ``mlx-redrafter NAME --help`` shows above the options (typer's help text, unwrapped)."""
    return typer.main.get_command(app).commands[name].help


def served_routes() -> dict:
    """``{module: [paths]}`` of the routes ``serve``'s app answers (FastAPI's own docs pages left out)."""
    # The routes are registered at build time: an engine without a model, never started, is enough.
    engine = object.__new__(Engine)
    engine.cache, engine.queue, engine.listeners = PromptCache(None), JobQueue(lambda job: None, 1), []
    built = create_app(engine, ui=True, security=None, max_body_bytes=1 << 20)  # no model to read a context from
    out = {}
    for route in _flat(built.routes):
        module = getattr(getattr(route, "endpoint", None), "__module__", "")
        if module.startswith(SERVE):
            out.setdefault(module[len(SERVE) :], []).append(route.path)
    return out


def _flat(routes) -> list:
    """The routes, an included router's own ones in its place (newer FastAPI keeps the router whole)."""
    out = []
    for route in routes:
        router = getattr(route, "original_router", None)
        out += _flat(router.routes) if router is not None else [route]
    return out


def named(path: str, text: str) -> bool:
    """Whether ``path`` appears in ``text`` as itself (not inside a longer path)."""
    return re.search(r"(?<![\w/.])" + re.escape(path) + r"(?![\w/])", text) is not None


def test_serve_help_names_every_api_the_app_mounts():
    routes, text = served_routes(), command_help("serve")
    apis = sorted(m for m in routes if m.endswith("_api"))
    assert {"openai_api", "anthropic_api", "responses_api", "ollama_api"} <= set(apis)  # the reader finds them
    for module in apis:
        api = module.removesuffix("_api")
        assert api.lower() in text.lower(), f"serve --help does not name the {api} API ({module})"
        assert any(named(p, text) for p in routes[module]), f"serve --help names none of {routes[module]}"
    own = routes.pop("app")
    assert "/" in own and "/health" in own  # the chat page and the app's own routes
    missing = [p for p in own if not named(p, text)]
    assert not missing, f"serve --help does not list {missing}"
    assert "chat page" in text


def test_the_route_reader_and_the_path_matcher_do_fail():
    assert not named("/v1/responses", "OpenAI's API (/v1/responses/{id})")
    assert not named("/", "see /v1/models")
    assert named("/", "a chat page at /.") and named("/health", "(/health, /metrics)")
    assert "app" in served_routes()  # the app's own routes are read too


def test_generate_help_says_it_drafts():
    """generate drafts by default (the drafter store's drafter for the model, else lookup)."""
    text = command_help("generate")
    assert "without a drafter" not in text and "draft" in text.lower()


def _commands(command=None, path=()):
    """``(words, click command)`` of every command and subcommand of the CLI."""
    command = command or typer.main.get_command(app)
    yield list(path), command
    for name, sub in getattr(command, "commands", {}).items():  # a group (typer's own click classes)
        yield from _commands(sub, (*path, name))


def test_help_into_a_pipe_cuts_nothing(monkeypatch, capsys):
    """``mlx-redrafter CMD --help | less``: stdout is not a terminal, so rich
    drew the tables 80 columns wide and cut what did not fit
    (``multi-token-predic…``, ``--max-prompt-toke…``). Every command's help
    now shows every flag's name and every word whole. Caught: help_width()
    returning None (rich's 80 columns) cut sweep's, serve's, distill's and train's."""
    import os

    from helpers import cli

    def no_terminal(fd=1):
        raise OSError("not a terminal")

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(os, "get_terminal_size", no_terminal)  # stdin, stdout and stderr: none is one
    commands = list(_commands())
    assert {"sweep", "datastore build", "drafters list"} <= {" ".join(w) for w, _ in commands}
    for words, command in commands:
        assert cli([*words, "--help"]) == 0, words
        out = capsys.readouterr().out
        assert "…" not in out, (words, [line for line in out.splitlines() if "…" in line])
        for param in command.params:
            for flag in [*param.opts, *param.secondary_opts]:
                assert flag.startswith("-") is False or re.search(re.escape(flag) + r"(?![\w-])", out), (words, flag)


def test_sweeps_help_into_a_pipe_as_a_script_runs_it():
    """The issue's case itself: no terminal on any stream (the help cut
    `multi-token-predic…`)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    out = subprocess.run(
        [sys.executable, "-m", "mlx_redrafter.cli", "sweep", "--help"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0 and "multi-token-prediction" in out.stdout and "…" not in out.stdout, out.stdout
