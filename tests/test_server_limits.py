"""Oversized requests cannot stall or bloat ``serve`` (issue 47,
mlx_redrafter/serve/limits.py): a body over ``--max-body-bytes`` is a 413 in
each API's shape before it is parsed, a chunked one is cut off as it streams
in, the key is checked before any body is read; a prompt the context
provably cannot hold is refused before it is tokenized, and tokenizing runs
off the event loop, so ``/health`` and other clients are answered meanwhile.

Through real HTTP: ``mlx-redrafter serve`` in a subprocess on 127.0.0.1 (the
default model, plain decoding; the official ``openai``, ``anthropic`` and
``ollama`` clients, raw sockets where a client cannot send the request),
and, where a test must hold the tokenizer at a known point, the real app on
uvicorn in this process.

Mutations seen caught here (bench/mutations.py): H4 (the default bound x10),
C6 (a configured bound x10)."""

from __future__ import annotations

import json
import re
import socket
import threading

import anthropic
import httpx
import ollama
import openai
import pytest
from fastapi.testclient import TestClient
from helpers import cli
from starlette.responses import PlainTextResponse
from ui_servers import Server, serve_in_thread

from mlx_redrafter.llm.text import byte_cover, encode_prompt, token_floor
from mlx_redrafter.serve import Engine
from mlx_redrafter.serve import limits as limits_module
from mlx_redrafter.serve.app import create_app
from mlx_redrafter.serve.limits import BodyLimit, default_body_bytes

KEY = "sk-limits-test"
BOUND = 200_000  # --max-body-bytes of the subprocess server
OVER = "word " * (BOUND // 4)  # a message whose body is over the bound (250 KB)
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``serve --api-key KEY --max-body-bytes 200000``, with its chat page."""
    args = ["--no-draft", "--max-tokens", "4", "--api-key", KEY, "--max-body-bytes", str(BOUND)]
    s = Server(args, tmp_path_factory.mktemp("limits") / "serve.log")
    yield s
    s.stop()


def _says_the_bound(message: str) -> None:
    assert f"at most {BOUND} bytes" in message and "--max-body-bytes" in message, message


# --------------------------------------------------------------------------- the body bound, per API


def test_openai_clients_get_a_413(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    calls = [
        lambda: client.chat.completions.create(model="default", messages=[{"role": "user", "content": OVER}]),
        lambda: client.completions.create(model="default", prompt=OVER),
        lambda: client.responses.create(model="default", input=OVER),
    ]
    for call in calls:
        with pytest.raises(openai.APIStatusError) as e:
            call()
        assert e.value.status_code == 413
        assert e.value.body["code"] == "request_too_large" and e.value.body["type"] == "invalid_request_error"
        _says_the_bound(e.value.body["message"])


def test_anthropic_clients_get_a_413(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": OVER}]
    for call in (
        lambda: client.messages.create(model="default", max_tokens=4, messages=messages),
        lambda: client.messages.count_tokens(model="default", messages=messages),
    ):
        with pytest.raises(anthropic.APIStatusError) as e:
            call()
        assert e.value.status_code == 413
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "request_too_large"
        _says_the_bound(e.value.body["error"]["message"])


def test_ollama_clients_get_a_413(server):
    client = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})
    for call in (
        lambda: client.chat("default", messages=[{"role": "user", "content": OVER}], stream=False),
        lambda: client.generate("default", prompt=OVER, stream=False),
    ):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 413
        _says_the_bound(e.value.error)


def test_the_chat_pages_routes_are_bounded_too(server):
    """The page and its files need no key, but a body still gets the bound."""
    for path in ("/", "/ui/app.js"):
        r = httpx.request("GET", server.url + path, content=b"x" * (BOUND + 1), timeout=60)
        assert r.status_code == 413 and r.headers["connection"] == "close"
        _says_the_bound(r.json()["error"]["message"])
    assert httpx.get(server.url + "/", timeout=60).status_code == 200


# --------------------------------------------------------------------------- raw HTTP: what is read


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=120)
    return sock


def _head(path: str, *lines: str) -> bytes:
    return "\r\n".join([f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *lines, "", ""]).encode()


def _answer(sock: socket.socket) -> tuple:
    """``(status, headers, body)`` of the answer, read until the server closes
    (a reset ends it too: a server that leaves a body unread may close with one)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def test_a_declared_length_over_the_bound_is_refused_before_the_body_is_sent(server):
    """The headers alone are sent: the 413 comes without the server waiting for a byte of the body."""
    with _connect(server) as sock:
        sock.sendall(_head("/v1/chat/completions", f"Authorization: Bearer {KEY}", "Content-Length: 1000000000"))
        status, headers, body = _answer(sock)
    assert status == 413 and headers["connection"] == "close"
    assert "has 1000000000 bytes" in json.loads(body)["error"]["message"]


def test_a_chunked_body_is_cut_off_as_it_streams_in(server):
    """Chunks up to the one that passes the bound, and no last chunk: the
    server answers 413 while the body has not ended, then closes the connection."""
    chunk = b"x" * 16384
    with _connect(server) as sock:
        sock.sendall(_head("/api/chat", f"Authorization: Bearer {KEY}", "Transfer-Encoding: chunked"))
        for _ in range(BOUND // len(chunk) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, headers, body = _answer(sock)  # the body never ended: only the server's refusal ends this
    assert status == 413 and headers["connection"] == "close"
    message = json.loads(body)["error"]  # Ollama's shape
    assert f"passed {BOUND} bytes" in message and "--max-body-bytes" in message


def test_a_chunked_body_within_the_bound_is_answered(server):
    body = json.dumps({"messages": HI, "max_tokens": 2}).encode()
    with _connect(server) as sock:
        sock.sendall(
            _head(
                "/v1/chat/completions",
                f"Authorization: Bearer {KEY}",
                "Content-Type: application/json",
                "Transfer-Encoding: chunked",
                "Connection: close",
            )
        )
        for i in range(0, len(body), 10):
            piece = body[i : i + 10]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        sock.sendall(b"0\r\n\r\n")
        status, _, answer = _answer(sock)
    assert status == 200, answer
    assert json.loads(answer)["object"] == "chat.completion"


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_an_unauthenticated_large_body_is_refused_without_being_read(server, key):
    """No key (or a wrong one) and a gigabyte declared, none of it sent: a
    401, not a 413, and no wait for the body: the key is checked first."""
    auth = [f"Authorization: Bearer {key}"] if key else []
    with _connect(server) as sock:
        sock.sendall(_head("/v1/messages", *auth, "Content-Length: 1000000000", "Connection: close"))
        status, _, body = _answer(sock)
    assert status == 401
    assert json.loads(body)["error"]["type"] == "authentication_error"
    with _connect(server) as sock:  # chunked: refused before the first chunk
        sock.sendall(_head("/v1/chat/completions", *auth, "Transfer-Encoding: chunked", "Connection: close"))
        status, _, _ = _answer(sock)
    assert status == 401


# --------------------------------------------------------------------------- tokenizing: off the loop, stopped early


@pytest.fixture(scope="module")
def runtime():
    from mlx_redrafter.runtime import load_runtime

    return load_runtime("default", None, no_draft=True)


class HeldTokenizer:
    """The runtime's tokenizer, with its ``encode`` held on a long text until
    ``release`` (``entered`` says one is held) and the lengths of the texts
    it encoded recorded."""

    def __init__(self, tokenizer, long: int = 100_000):
        self.hf, self.long = tokenizer._tokenizer, long
        self.original = self.hf.encode
        self.entered, self.release = threading.Event(), threading.Event()
        self.lengths = []

    def encode(self, text, *args, **kwargs):
        self.lengths.append(len(text))
        if len(text) > self.long:
            self.entered.set()
            assert self.release.wait(300), "the test never released the tokenizer"
        return self.original(text, *args, **kwargs)


@pytest.fixture
def held(runtime, monkeypatch):
    tok = HeldTokenizer(runtime.tokenizer)
    monkeypatch.setattr(tok.hf, "encode", tok.encode)
    yield tok
    tok.release.set()


@pytest.fixture(scope="module")
def local_app(runtime):
    """The real app (no key, the default body bound) on uvicorn in this process, on 127.0.0.1."""
    with serve_in_thread(create_app(Engine(runtime, max_tokens=4))) as url:
        yield url


def test_health_and_a_small_chat_answer_while_a_long_prompt_is_tokenized(local_app, held):
    """A long prompt (under the body bound and the early refusal) is held
    inside the tokenizer; meanwhile /health and a small chat request are
    answered. On the event loop, the tokenizer would hold both back until
    released, which this test does only after they are answered."""
    long = "word " * 120_000  # 600 KB: fits 1 MB, too short for the early bound: tokenized
    out = {}

    def send_long():
        body = {"messages": [{"role": "user", "content": long}], "max_tokens": 2}
        out["long"] = httpx.post(local_app + "/v1/chat/completions", json=body, timeout=300)

    sender = threading.Thread(target=send_long)
    sender.start()
    try:
        assert held.entered.wait(300), "the long prompt never reached the tokenizer"
        assert httpx.get(local_app + "/health", timeout=60).json()["status"] == "ok"
        small = httpx.post(local_app + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=300)
        assert small.status_code == 200 and small.json()["choices"][0]["message"]["content"]
        assert not held.release.is_set() and "long" not in out  # both answered while the long one was held
    finally:
        held.release.set()
        sender.join(300)
    assert out["long"].status_code == 400
    assert out["long"].json()["error"]["code"] == "context_length_exceeded"
    assert "has 120031 tokens" in out["long"].json()["error"]["message"]  # tokenized whole: the exact count


# A prompt longer than the context can hold even at the tokenizer's longest
# tokens (81 bytes each for the default model's 8192-token context: 663,552).
FAR_OVER = "word " * 140_000  # 700 KB, under the 1 MB default body bound
ROUTES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": FAR_OVER}]}, "messages"),
    ("/v1/completions", {"prompt": FAR_OVER}, "prompt"),
    ("/v1/responses", {"input": FAR_OVER}, "input"),
    ("/v1/messages", {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": FAR_OVER}]}, None),
    ("/api/chat", {"messages": [{"role": "user", "content": FAR_OVER}], "stream": False}, None),
    ("/api/generate", {"prompt": FAR_OVER, "stream": False}, None),
]


@pytest.mark.parametrize("path, body, param", ROUTES, ids=[r[0] for r in ROUTES])
def test_a_prompt_far_over_the_context_is_refused_before_tokenizing(local_app, held, path, body, param):
    r = httpx.post(local_app + path, json=body, timeout=300)
    assert r.status_code == 400, r.text
    assert max(held.lengths, default=0) < 100_000, "the long prompt was tokenized"
    error = r.json()
    message = error["error"] if path.startswith("/api/") else error["error"]["message"]
    if path == "/v1/messages":  # Anthropic's words, which Claude Code parses to compact its history (issue 48)
        words = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", message)
        assert words and int(words[1]) > int(words[2]) and int(words[2]) < 8192, message  # at least N: a floor
    else:
        assert "The prompt has at least" in message and "the model's context is 8192 tokens" in message
    if param:  # OpenAI's shape (the Responses API's too)
        assert error["error"]["code"] == "context_length_exceeded" and error["error"]["param"] == param
    elif path == "/v1/messages":
        assert error["error"]["type"] == "invalid_request_error"


def test_count_tokens_counts_a_prompt_over_the_context(local_app):
    """Counting is what a client decides on: it has no early refusal (the body bound limits its work)."""
    body = {"model": "default", "messages": [{"role": "user", "content": FAR_OVER}]}
    r = httpx.post(local_app + "/v1/messages/count_tokens", json=body, timeout=300)
    assert r.status_code == 200 and r.json()["input_tokens"] > 140_000


def test_memory_is_given_back_after_a_large_body():
    """The C heap is trimmed after a body of TRIM_BYTES or more (its parse,
    template and tokens freed into malloc's arenas), not after a small one.
    The middleware gets its own trim: other tests' servers trim as they finish."""
    trims = []

    async def echo(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        await PlainTextResponse(str(len(body)))(scope, receive, send)

    app = BodyLimit(echo, max_bytes=1 << 20, refuse=lambda path, failure: None, trim=lambda: trims.append(1))
    http = TestClient(app, base_url="http://127.0.0.1:8080")  # no lifespan: echo answers http only
    assert http.post("/", content=b"hi").text == "2"
    assert trims == []
    big = b"x" * limits_module.TRIM_BYTES
    assert http.post("/", content=big).text == str(len(big))  # handed on whole
    assert trims == [1]
    limits_module.give_back_memory()  # the real one runs (a no-op where malloc is not glibc's)


# --------------------------------------------------------------------------- the bound and the flag


def documented_bound(context: int) -> int:
    """The default bound ``serve --help`` promises for a model of ``context``
    tokens, read from the help text (not from limits.py: the test holds the
    code to its documentation)."""
    from mlx_lm.utils import _parse_size

    from mlx_redrafter.cli.run import MaxBodyBytesOpt

    found = re.search(r"default: (\d+) bytes per token of the model's context, at least (\w+)\)", MaxBodyBytesOpt.help)
    assert found, MaxBodyBytesOpt.help
    return max(int(found[1]) * context, _parse_size(found[2]))


@pytest.mark.parametrize("context", [512, 32768], ids=["floor", "per-token"])
def test_the_default_bound_is_the_documented_one_to_the_byte(tmp_path, context):
    """No --max-body-bytes: a body of exactly the documented bound is read (a
    400 for its junk, not a 413), one byte more is a 413 naming that bound;
    through real HTTP, the context as /v1/models reports it (a small one: the
    floor binds; a large one: the bytes per token do).

    Seen to catch: the default bound ten times larger (limits.py
    ``BYTES_PER_TOKEN`` x10, bench/mutations.py H4)."""
    from helpers import save_tiny_folder

    from mlx_redrafter.runtime import load_runtime

    folder = save_tiny_folder(tmp_path / "model", max_position_embeddings=context)
    with serve_in_thread(create_app(Engine(load_runtime(str(folder), None, no_draft=True)))) as url:
        reported = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["context_length"]
        assert reported == context
        bound = documented_bound(reported)
        for size, status in ((bound, 400), (bound + 1, 413)):
            r = httpx.post(url + "/v1/chat/completions", content=b"x" * size, timeout=120,
                           headers={"Content-Type": "application/json"})  # fmt: skip
            assert (r.status_code == 413) == (status == 413), (size, r.status_code, r.text[:200])
        assert f"at most {bound} bytes" in r.json()["error"]["message"]
    assert default_body_bytes(None) == default_body_bytes(131072)  # an unknown context: a 128k-token one's


def test_the_flag_is_checked_and_documented(runtime, capsys):
    assert cli(["serve", "--max-body-bytes", "lots"]) == 1
    assert "--max-body-bytes 'lots' is not a size" in capsys.readouterr().err
    schema = TestClient(create_app(Engine(runtime)), base_url="http://127.0.0.1:8080").get("/openapi.json").json()
    assert "413" in schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "413" not in schema["paths"]["/v1/models"]["get"]["responses"]


# --------------------------------------------------------------------------- the tokenizer's floor


TEXTS = [
    "#" * 8000,
    " " * 10000,
    "\n" + " " * 80,
    "hello world " * 1000,
    "日本語のテキスト" * 500,
    "😀" * 1000,
    "<|im_start|>" * 100,
    ("#" * 80 + "\n") * 50,
    "\x04" * 1000 + "a",  # a byte the default vocabulary lacks: dropped, not a token
    "\U00040000" * 100,
]


def test_the_token_floor_never_exceeds_the_count(runtime, tmp_path):
    from helpers import byte_tokenizer, save_tiny_folder
    from mlx_lm.tokenizer_utils import load

    tok = runtime.tokenizer
    longest, dropped = byte_cover(tok)
    assert longest == 81 and "\x04" in dropped
    for text in TEXTS:
        assert token_floor(tok, text) <= len(encode_prompt(tok, text)), text[:20]
    assert token_floor(tok, "word " * 200_000) > 8192  # not vacuous: it refuses 1 MB of words
    byte_level = byte_tokenizer(tmp_path / "bytes", special_tokens=["<tool>"])
    for text in TEXTS:
        assert 0 < token_floor(byte_level, text) <= len(encode_prompt(byte_level, text)), text[:20]
    words = load(save_tiny_folder(tmp_path / "words"))  # a pre-tokenizer that drops whitespace: nothing provable
    assert byte_cover(words) is None and token_floor(words, "w1 " * 1000) == 0
