"""Who may drive ``mlx-redrafter serve`` (mlx_redrafter/serve/security.py):
the Host allowlist (DNS rebinding), browser origins (CORS), the API key in
each API's error shape, the warnings at start; a client's error as one log
line; and ``/openapi.json`` documenting what each route answers.

The app is the real one on the default model (its shipped drafter off: the
replies only have to come), in process: uvicorn on a thread on 127.0.0.1 and
a free port where real clients (the official ``openai`` and ``ollama``) or
raw HTTP headers matter, Starlette's TestClient for the rest. The chat page
asking for the key is in tests/test_ui.py."""

from __future__ import annotations

import json
import logging
import socket
from contextlib import contextmanager

import anthropic
import httpx
import jsonschema_rs
import ollama
import openai
import pytest
from fastapi.testclient import TestClient
from ui_servers import serve_in_thread

from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.serve import Engine
from mlx_redrafter.serve.app import create_app
from mlx_redrafter.serve.security import SecurityConfig

KEY = "sk-local-test-key"
HI = [{"role": "user", "content": "Hi"}]
ORIGIN = "http://localhost:3000"  # a local web app the user allows
NO_ENV: dict = {}  # resolve() reads the key and origins from here, not from the test's environment
# One route of each kind, with the shape its errors have.
ROUTES = [
    ("GET", "/v1/models", "openai"),
    ("POST", "/v1/chat/completions", "openai"),
    ("POST", "/v1/completions", "openai"),
    ("GET", "/metrics", "openai"),
    ("GET", "/api/tags", "ollama"),
    ("POST", "/api/chat", "ollama"),
    ("POST", "/api/generate", "ollama"),
    ("POST", "/v1/messages", "anthropic"),
    ("POST", "/v1/messages/count_tokens", "anthropic"),
    ("POST", "/v1/responses", "openai"),
]
BODIES = {
    "/v1/chat/completions": {"messages": HI, "max_tokens": 2},
    "/v1/completions": {"prompt": "1,", "max_tokens": 2},
    "/api/chat": {"messages": HI, "stream": False},
    "/api/generate": {"prompt": "1,", "stream": False},
    "/v1/messages": {"model": "default", "max_tokens": 2, "messages": HI},
    "/v1/messages/count_tokens": {"model": "default", "messages": HI},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
}


@pytest.fixture(scope="module")
def runtime():
    from mlx_redrafter.runtime import load_runtime

    return load_runtime("default", None, no_draft=True)


def _app(runtime, **flags):
    security = SecurityConfig.resolve(flags.pop("bind", "127.0.0.1"), environ=flags.pop("environ", NO_ENV), **flags)
    return create_app(Engine(runtime, max_tokens=2), security=security)


@contextmanager
def _client(runtime, host="127.0.0.1:8080", **flags):
    """TestClient on the guarded app, reaching it as ``host``."""
    with TestClient(_app(runtime, **flags), base_url=f"http://{host}") as http:
        yield http


@pytest.fixture(scope="module")
def open_server(runtime):
    """The defaults of ``serve``: no key, no other host or origin."""
    with serve_in_thread(_app(runtime)) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_server(runtime):
    with serve_in_thread(_app(runtime, api_key=KEY, allow_origins=[ORIGIN])) as url:
        yield url


def _message(shape: str, body: dict) -> str:
    """The message of an error in ``shape``, checking the shape on the way."""
    if shape == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str)
        return body["error"]
    if shape == "anthropic":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]["message"]


def _request(url, method, path, **kw):
    return httpx.request(method, url + path, json=BODIES.get(path), timeout=120, **kw)


# --------------------------------------------------------------------------- Host names


def test_an_app_made_without_a_config_trusts_loopback_names_only(runtime):
    """create_app's default is the safe one: a rebinding Host is refused even
    when its maker passed no SecurityConfig."""
    app = create_app(Engine(runtime, max_tokens=2))
    with TestClient(app, base_url="http://attacker.example") as http:
        assert http.get("/api/tags").status_code == 403
    with TestClient(app, base_url="http://127.0.0.1:8080") as http:
        assert http.get("/api/tags").status_code == 200


@pytest.mark.parametrize("method, path, shape", ROUTES)
def test_a_rebinding_host_gets_a_403_naming_the_flag(open_server, method, path, shape):
    r = _request(open_server, method, path, headers={"Host": "attacker.example"})
    assert r.status_code == 403
    message = _message(shape, r.json())
    assert "attacker.example" in message and "--allow-host attacker.example" in message


def test_loopback_names_and_allowed_hosts_pass(open_server, runtime):
    port = open_server.rsplit(":", 1)[1]
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(open_server + "/api/tags", headers={"Host": host}).status_code == 200, host
    for host in ("127.0.0.1.attacker.example", "localhost.attacker.example", "192.168.1.5", ""):
        assert httpx.get(open_server + "/api/tags", headers={"Host": host}).status_code == 403, host
    with _client(runtime, "my-mac.local:8080", allow_hosts=["my-mac.local", "*.lan"]) as http:
        assert http.get("/v1/models").status_code == 200
        assert http.get("/v1/models", headers={"Host": "box.lan"}).status_code == 200
        assert http.get("/v1/models", headers={"Host": "attacker.example"}).status_code == 403
    with _client(runtime, "anything.example", allow_hosts=["*"]) as http:
        assert http.get("/v1/models").status_code == 200


def test_a_server_on_all_interfaces_answers_its_addresses_and_name(runtime):
    name = socket.gethostname()
    with _client(runtime, "192.168.1.5:8080", bind="0.0.0.0", api_key=KEY) as http:
        for host in ("192.168.1.5:8080", "[fe80::1]:8080", "10.0.0.2", name, "localhost"):
            assert http.get("/health", headers={"Host": host}).status_code == 200, host
        assert http.get("/health", headers={"Host": "attacker.example"}).status_code == 403


# --------------------------------------------------------------------------- browser origins


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1"])
def test_a_foreign_origin_gets_a_403(open_server, origin):
    for method, path, shape in (
        ("POST", "/v1/chat/completions", "openai"),
        ("POST", "/api/chat", "ollama"),
        ("GET", "/api/tags", "ollama"),
    ):
        r = _request(open_server, method, path, headers={"Origin": origin})
        assert r.status_code == 403, (path, r.text)
        assert f"--allow-origin {origin}" in _message(shape, r.json())
        assert "access-control-allow-origin" not in r.headers
    preflight = httpx.options(
        open_server + "/v1/chat/completions",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 403


def test_the_default_app_lets_no_foreign_origin_in(runtime):
    """create_app's default config (no SecurityConfig given) is serve's with no
    flags: no origin beside the server's own; a web page elsewhere is refused."""
    from mlx_redrafter.serve.app import LOCAL_ONLY

    assert LOCAL_ONLY.origins == () and LOCAL_ONLY == SecurityConfig.resolve(environ=NO_ENV)
    app = create_app(Engine(runtime, max_tokens=2))  # no security= given
    with TestClient(app, base_url="http://127.0.0.1:8080") as http:
        for origin in ("http://evil.example", "http://localhost:3000", "null"):
            r = http.get("/v1/models", headers={"Origin": origin})
            assert r.status_code == 403 and f"--allow-origin {origin}" in r.json()["error"]["message"], origin
            assert "access-control-allow-origin" not in r.headers
        assert http.get("/v1/models", headers={"Origin": "http://127.0.0.1:8080"}).status_code == 200  # its own page
        assert http.get("/v1/models").status_code == 200  # no Origin: curl, the SDKs


@pytest.mark.parametrize("header", [{"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}])
def test_a_valid_key_does_not_get_a_foreign_origin_past_the_origin_check(keyed_server, header):
    """The key is checked after the origin: a page elsewhere that has the key
    (or a user's browser that sends it) is still refused, before the model runs."""
    for method, path, shape in (("POST", "/v1/chat/completions", "openai"), ("POST", "/api/chat", "ollama")):
        r = _request(keyed_server, method, path, headers={"Origin": "http://evil.example", **header})
        assert r.status_code == 403, (path, r.text)
        assert "--allow-origin http://evil.example" in _message(shape, r.json())
        assert "access-control-allow-origin" not in r.headers
    allowed = _request(keyed_server, "POST", "/v1/chat/completions", headers={"Origin": ORIGIN, **header})
    assert allowed.status_code == 200  # the same key from the allowed origin: served


def test_the_servers_own_origin_passes(open_server):
    r = _request(open_server, "POST", "/v1/chat/completions", headers={"Origin": open_server})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    port = open_server.rsplit(":", 1)[1]
    r = _request(
        open_server, "GET", "/api/tags", headers={"Origin": f"http://localhost:{port}", "Host": f"localhost:{port}"}
    )
    assert r.status_code == 200


def test_an_allowed_origin_gets_cors_and_preflights(keyed_server):
    preflight = httpx.options(
        keyed_server + "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200  # before the key: a preflight carries none
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    private = httpx.options(
        keyed_server + "/api/chat",
        headers={  # Chrome's Private Network Access
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Private-Network": "true",
        },
    )
    assert private.status_code == 200 and private.headers["access-control-allow-private-network"] == "true"
    r = _request(
        keyed_server, "POST", "/v1/chat/completions", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = _request(keyed_server, "POST", "/v1/chat/completions", headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN  # the page can read why


def test_origins_from_the_environment_and_patterns(runtime):
    env = {"MLX_REDRAFTER_ORIGINS": "chrome-extension://*, http://localhost:5173"}
    with _client(runtime, environ=env) as http:
        for origin, status in (
            ("chrome-extension://abcdef", 200),
            ("http://localhost:5173", 200),
            ("http://localhost:5174", 403),
            ("https://evil.example", 403),
        ):
            assert http.get("/v1/models", headers={"Origin": origin}).status_code == status, origin
    with _client(runtime, allow_origins=["*"]) as http:
        r = http.get("/v1/models", headers={"Origin": "https://anywhere.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


# --------------------------------------------------------------------------- bodies sent as forms (curl -d)

# What clients send for a JSON body: `curl -d` (a form's type), text/plain, no type at all.
LOOSE_TYPES = ["application/x-www-form-urlencoded", "text/plain", None]


@pytest.mark.parametrize("content_type", LOOSE_TYPES, ids=["form", "text", "none"])
def test_a_json_body_is_read_whatever_its_content_type(open_server, content_type):
    """As Ollama's server does: every route that takes a body reads it as
    JSON. Caught: without the JsonBody middleware (app.py), every request
    here but the untyped one was a 400 "Input should be a valid dictionary"."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    for path, body in BODIES.items():
        r = httpx.post(open_server + path, content=json.dumps(body).encode(), headers=headers, timeout=120)
        assert r.status_code == 200, (path, r.text)
        assert r.headers["content-type"].startswith("application/json"), path
    r = httpx.post(open_server + "/api/chat", content=b"messages=hi", headers=headers, timeout=120)  # a real form
    assert r.status_code == 400 and r.json()["error"].startswith("The body is not valid JSON: "), r.text


def test_curl_dash_d_is_answered(open_server):
    """`curl -d` itself, as Ollama's documentation writes it."""
    import shutil
    import subprocess

    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl on this machine (the test above sends its headers)")
    body = json.dumps({"model": "default", "prompt": "1,", "stream": False, "options": {"num_predict": 2}})
    out = subprocess.run([curl, "-s", "-d", body, open_server + "/api/generate"], capture_output=True, timeout=120)
    reply = json.loads(out.stdout)
    assert reply["done"] is True and isinstance(reply["response"], str), reply
    body = json.dumps({"messages": HI, "max_tokens": 2})
    out = subprocess.run(
        [curl, "-s", "-d", body, open_server + "/v1/chat/completions"], capture_output=True, timeout=120
    )
    assert json.loads(out.stdout)["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_foreign_pages_simple_request_is_still_refused(open_server, content_type):
    """A web page may post a form or text/plain to any address without a
    CORS preflight (a "simple request"), but its browser sends its Origin:
    reading such bodies as JSON must not let a foreign page drive the model
    (CSRF). Caught: OriginGuard passing every request through."""
    before = httpx.get(open_server + "/metrics").text
    for path, body in BODIES.items():
        for origin in ("http://evil.example", "null"):
            r = httpx.post(
                open_server + path,
                content=json.dumps(body).encode(),
                headers={"Content-Type": content_type, "Origin": origin, "Sec-Fetch-Site": "cross-site"},
            )
            assert r.status_code == 403, (path, r.text)
            assert "access-control-allow-origin" not in r.headers
    after = httpx.get(open_server + "/metrics").text
    assert _generated(after) == _generated(before)  # the model never ran for them


def _generated(metrics: str) -> float:
    """The tokens the server generated, from its /metrics."""
    for line in metrics.splitlines():
        if line.startswith("redrafter_generated_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("no redrafter_generated_tokens_total in /metrics")


# --------------------------------------------------------------------------- the API key


def test_official_clients_work_with_the_defaults(open_server):
    client = openai.OpenAI(base_url=open_server + "/v1", api_key="ignored", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=2, temperature=0)
    assert r.choices[0].message.content is not None
    reply = ollama.Client(host=open_server).chat(model="default", messages=HI, options={"num_predict": 2})
    assert reply.message.content is not None
    message = anthropic.Anthropic(base_url=open_server, api_key="ignored", max_retries=0, timeout=120).messages.create(
        model="default", max_tokens=2, messages=HI
    )
    assert message.type == "message" and message.stop_reason in ("max_tokens", "end_turn")
    assert httpx.get(open_server + "/", timeout=30).status_code == 200  # the chat page


def test_official_clients_work_with_the_key(keyed_server):
    client = openai.OpenAI(base_url=keyed_server + "/v1", api_key=KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=2, temperature=0)
    assert r.choices[0].message.content is not None
    assert [m.id for m in client.models.list()] == ["default"]
    keyed = ollama.Client(host=keyed_server, headers={"Authorization": f"Bearer {KEY}"})
    assert keyed.chat(model="default", messages=HI, options={"num_predict": 2}).message.content is not None
    assert keyed.list().models
    r = httpx.get(keyed_server + "/api/tags", headers={"x-api-key": KEY})  # Anthropic's header, anywhere
    assert r.status_code == 200
    claude = anthropic.Anthropic(base_url=keyed_server, api_key=KEY, max_retries=0, timeout=120)  # sends x-api-key
    message = claude.messages.create(model="default", max_tokens=2, messages=HI)
    assert message.type == "message" and message.content is not None
    with claude.messages.stream(model="default", max_tokens=2, messages=HI) as stream:
        assert stream.get_final_message().usage.output_tokens >= 1
    assert claude.messages.count_tokens(model="default", messages=HI).input_tokens > 0
    r = client.responses.create(model="default", input="Hi", max_output_tokens=2)
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"


def test_official_clients_with_a_wrong_key_get_a_401(keyed_server):
    client = openai.OpenAI(base_url=keyed_server + "/v1", api_key="wrong", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError) as e:
        client.chat.completions.create(model="default", messages=HI, max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert "wrong API key" in e.value.message
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=keyed_server, headers=headers).chat(model="default", messages=HI)
        assert e.value.status_code == 401 and "--api-key" in e.value.error
    claude = anthropic.Anthropic(base_url=keyed_server, api_key="wrong", max_retries=0, timeout=120)
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude.messages.create(model="default", max_tokens=2, messages=HI)
    assert e.value.status_code == 401
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client.responses.create(model="default", input="Hi", max_output_tokens=2)


@pytest.mark.parametrize("method, path, shape", ROUTES)
@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": f"Bearer {KEY}x"}, {"x-api-key": "nope"}, {"Authorization": KEY}],
    ids=["none", "bearer", "x-api-key", "no-scheme"],
)
def test_a_missing_or_wrong_key_is_a_401_in_each_apis_shape(keyed_server, method, path, shape, headers):
    r = _request(keyed_server, method, path, headers=headers)
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    message = _message(shape, r.json())
    assert "API key" in message and "Authorization: Bearer KEY" in message and KEY not in message
    if shape == "openai":
        assert r.json()["error"]["code"] == "invalid_api_key"
    if shape == "anthropic":
        assert r.json()["error"]["type"] == "authentication_error"


def test_the_page_and_health_need_no_key(keyed_server):
    for path in ("/", "/ui/app.js", "/ui/api.js", "/health"):
        assert httpx.get(keyed_server + path).status_code == 200, path
    assert httpx.get(keyed_server + "/openapi.json").status_code == 401
    assert httpx.get(keyed_server + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


# --------------------------------------------------------------------------- the flags


def test_flags_are_checked_and_warned_about():
    assert SecurityConfig.resolve("127.0.0.1", environ=NO_ENV).warnings() == []
    assert SecurityConfig.resolve("0.0.0.0", api_key=KEY, environ=NO_ENV).warnings() == []
    [warning] = SecurityConfig.resolve("0.0.0.0", environ=NO_ENV).warnings()
    assert "without --api-key" in warning and "MLX_REDRAFTER_API_KEY" in warning
    assert SecurityConfig.resolve("0.0.0.0", environ={"MLX_REDRAFTER_API_KEY": KEY}).api_key == KEY
    both = SecurityConfig.resolve("127.0.0.1", allow_hosts=["*"], allow_origins=["*"], environ=NO_ENV).warnings()
    assert len(both) == 2 and "DNS rebinding" in both[0] and "every web page" in both[1]
    assert SecurityConfig.resolve(allow_origins=["HTTP://LocalHost:3000/"], environ=NO_ENV).origins == (ORIGIN,)
    for flags, message in (
        (dict(api_key=" "), "--api-key is empty"),
        (dict(allow_origins=["localhost:3000"]), "is not an origin"),
        (dict(allow_origins=["http://localhost:3000/chat"]), "is not an origin"),
        (dict(allow_hosts=["a*b"]), "is not a host name"),
        (dict(allow_hosts=["*example.com"]), "is not a host name"),
    ):
        with pytest.raises(RedrafterError, match=message):
            SecurityConfig.resolve("127.0.0.1", environ=NO_ENV, **flags)


def test_serve_resolves_the_flags_before_the_load_and_warns(monkeypatch, capsys):
    """The command line's flags reach the app (uvicorn and the port check are
    stood in for: a test never listens on 0.0.0.0)."""
    import uvicorn
    from helpers import cli

    from mlx_redrafter.cli import run

    def serve(*args) -> int:
        return cli(["serve", *args])

    import mlx_redrafter.doctor as doctor

    served = {}
    monkeypatch.setattr(
        doctor, "slow_blas_warning", lambda: None
    )  # its warning is not this test's (no BLIS: tests pass too)
    monkeypatch.setattr(run, "_check_port", lambda host, port: None)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app, **kw))
    monkeypatch.delenv("MLX_REDRAFTER_API_KEY", raising=False)
    assert serve("--host", "0.0.0.0", "--allow-origin", "localhost:3000") == 1
    assert "--allow-origin 'localhost:3000' is not an origin" in capsys.readouterr().err and not served
    assert serve("--no-draft", "--host", "0.0.0.0", "--allow-host", "box.lan", "-n", "2") == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "Warning: serving on 0.0.0.0 without --api-key" in err
    assert served["host"] == "0.0.0.0"
    with TestClient(served["app"], base_url="http://box.lan:8080") as http:
        assert http.get("/api/tags").status_code == 200
        assert http.get("/api/tags", headers={"Host": "attacker.example"}).status_code == 403
    served.clear()
    monkeypatch.setenv("MLX_REDRAFTER_API_KEY", KEY)
    assert serve("--no-draft", "--host", "0.0.0.0", "-n", "2") == 0
    assert "Warning" not in capsys.readouterr().err
    with TestClient(served["app"], base_url="http://127.0.0.1:8080") as http:
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


# --------------------------------------------------------------------------- client errors in the log


def test_a_clients_error_is_one_log_line(runtime, caplog):
    with _client(runtime, api_key=KEY) as http:
        auth = {"Authorization": f"Bearer {KEY}"}
        cases = [
            ("/api/chat", dict(content=b"\xff\xfe{", headers={**auth, "content-type": "application/json"})),
            ("/v1/chat/completions", dict(content=b"{not json", headers={**auth, "content-type": "application/json"})),
            ("/api/generate", dict(json={"prompt": "x", "options": {"temperature": "hot"}}, headers=auth)),
            ("/v1/chat/completions", dict(json={"messages": HI})),  # no key
            ("/nowhere", dict(json={}, headers=auth)),
        ]
        for path, kw in cases:
            caplog.clear()
            with caplog.at_level(logging.INFO):
                r = http.post(path, **kw)
            assert 400 <= r.status_code < 500, (path, r.status_code)
            records = [rec for rec in caplog.records if rec.name.startswith("mlx_redrafter")]
            assert len(records) == 1, (path, [rec.getMessage() for rec in records])
            [rec] = records
            assert rec.exc_info is None and "\n" not in rec.getMessage()
            assert rec.getMessage().startswith(f"{r.status_code} {path}: ")
        assert not [rec for rec in caplog.records if rec.exc_info]
        for body in (b"\xff\xfe{", b'{"model": "caf\xe9"}'):
            r = http.post("/api/chat", content=body, headers={**auth, "content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"].startswith("The body is not UTF-8 JSON: "), r.text


def test_the_servers_own_failure_keeps_its_traceback(caplog):
    """What every API does with a job that raised on the worker
    (streaming.generation_failure): the server's error logs its traceback,
    a request the engine refused (a RedrafterError) is the client's."""
    from mlx_redrafter.serve.streaming import generation_failure

    try:
        raise RuntimeError("the model fell over")
    except RuntimeError as e:
        crash = e
    with caplog.at_level(logging.INFO):
        assert generation_failure(crash).status == 500
        [rec] = caplog.records
        assert rec.getMessage() == "Generation failed" and rec.exc_info[1] is crash and rec.exc_info[2] is not None
        caplog.clear()
        assert generation_failure(RedrafterError("too long")).status == 400
        assert not caplog.records


# --------------------------------------------------------------------------- /openapi.json


def test_openapi_documents_what_each_route_answers(runtime):
    with _client(runtime, api_key=KEY) as http:
        auth = {"Authorization": f"Bearer {KEY}"}
        paths = http.get("/openapi.json", headers=auth).json()["paths"]
        assert "422" not in json.dumps(paths)
        assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
        assert "text/event-stream" in paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
        assert "application/x-ndjson" in paths["/api/chat"]["post"]["responses"]["200"]["content"]
        assert "401" not in paths["/health"]["get"]["responses"]
        for method, path, _ in ROUTES:
            responses = paths[path][method.lower()]["responses"]
            assert {"401", "403", "500"} <= set(responses), path
            if method == "POST":  # every POST names a model; all but counting tokens queue a generation
                assert {"400", "404"} <= set(responses) and ("503" in responses) != path.endswith("count_tokens"), path
            # The documented error schema is what the route really answers.
            for status, headers in (("401", {}), ("403", {**auth, "Host": "attacker.example"})):
                schema = responses[status]["content"]["application/json"]["schema"]
                r = http.request(method, path, json=BODIES.get(path), headers=headers)
                assert r.status_code == int(status)
                jsonschema_rs.validate(schema, r.json())
            if method == "POST":
                r = http.request(method, path, content=b"[", headers={**auth, "content-type": "application/json"})
                assert r.status_code == 400
                jsonschema_rs.validate(responses["400"]["content"]["application/json"]["schema"], r.json())
