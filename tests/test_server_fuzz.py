"""Fuzzing ``mlx-redrafter serve`` with schemathesis against its own OpenAPI
schema (FastAPI's ``/openapi.json``): a bounded number of generated requests
per route, on both APIs, none of which may get a 5xx; afterwards the server
still answers a normal request. The server runs in a subprocess on
127.0.0.1 and a free port, and is always stopped."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from ui_servers import Server

EXAMPLES = 8  # per route: ~10 routes, about 30 s on a loaded 2-core machine
# Reply lengths the generated requests may ask for: long replies only cost time.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "num_predict")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(["--max-tokens", "4", "--queue-size", "4", "--no-ui"], tmp_path_factory.mktemp("fuzz") / "serve.log")
    try:
        yield s
    finally:
        s.stop()


def _bounded(node):
    """The schema with every reply length capped at 4 tokens (from 1)."""
    if isinstance(node, dict):
        out = {k: _bounded(v) for k, v in node.items()}
        for name in LENGTH_FIELDS:
            prop = out.get("properties", {}).get(name)
            if prop is not None:
                out["properties"][name] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 4}, {"type": "null"}]}
        return out
    if isinstance(node, list):
        return [_bounded(v) for v in node]
    return node


def test_no_generated_request_gets_a_5xx(server):
    raw = httpx.get(server.url + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(_bounded(raw))
    operations = [r.ok() for r in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate", "/api/show"} <= paths
    failures = []
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call(base_url=server.url, timeout=120)
            if response.status_code >= 500:
                failures.append((op.method, op.path, case.body, response.status_code, response.text[:300]))

        fuzz()
    assert not failures, failures
    health = server.health()
    assert health["queue"]["waiting"] == 0
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "Hi"}], "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    r = httpx.post(server.url + "/api/chat", timeout=120,
                   json={"model": "default", "messages": [{"role": "user", "content": "Hi"}], "stream": False})
    assert r.status_code == 200 and r.json()["done"]
