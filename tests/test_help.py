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
