"""Fuzzing ``mlx-redrafter serve`` with schemathesis against its own OpenAPI
schema (``/openapi.json``): a bounded number of generated requests per
route, on every API, none of which may get a 5xx, and every answer's status
and media type must be the ones the schema documents (schemathesis'
``status_code_conformance`` and ``content_type_conformance``: clients
generated from the schema are right); afterwards the server still answers a
normal request. The server runs in a subprocess on 127.0.0.1 and a free port,
and is always stopped."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance
from ui_servers import Server

EXAMPLES = 8  # per route: ~10 routes, about 30 s on a loaded 2-core machine
# Reply lengths the generated requests may ask for: long replies only cost time.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "num_predict")
CONFORMANCE = [status_code_conformance, content_type_conformance]


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


def test_no_generated_request_gets_a_5xx_or_an_undocumented_answer(server):
    raw = httpx.get(server.url + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(_bounded(raw))
    operations = [r.ok() for r in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/api/chat",
        "/api/generate",
        "/api/show",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
    } <= paths
    failures, undocumented = [], []
    for op in operations:

        @given(case=op.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case):
            response = case.call(base_url=server.url, timeout=120)
            if response.status_code >= 500:
                failures.append((op.method, op.path, case.body, response.status_code, response.text[:300]))
            try:
                case.validate_response(response, checks=CONFORMANCE)
            except FailureGroup as e:
                undocumented.append(
                    (
                        op.method,
                        op.path,
                        response.status_code,
                        response.headers.get("content-type"),
                        [f.title for f in e.exceptions],
                    )
                )

        fuzz()
    assert not failures, failures
    assert not undocumented, undocumented
    health = server.health()
    assert health["queue"]["waiting"] == 0
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=120,
        json={"messages": [{"role": "user", "content": "Hi"}], "temperature": 0},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    r = httpx.post(
        server.url + "/api/chat",
        timeout=120,
        json={"model": "default", "messages": [{"role": "user", "content": "Hi"}], "stream": False},
    )
    assert r.status_code == 200 and r.json()["done"]
