"""``mlx-redrafter serve``: one server (the default model and its shipped
drafter) in a subprocess on a free port, driven with the official ``openai``
client and with raw HTTP for bad input."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI
from ui_servers import GenerateCommand

from mlx_redrafter.serve import GenParams, Job, JobQueue, QueueFull, Result

MAX_TOKENS = 8  # the server's default reply length: keeps every request short
QUEUE = 4
MAX_BATCH = 4  # requests decoded at once (--max-batch)
PROMPT = "Write a short poem about the sea."
LONG = "Count from 1 to 500, separated by commas."  # a reply far longer than any test waits for
# The reference command runs in-process (ui_servers.GenerateCommand): the session's default model, loaded once.
pytestmark = pytest.mark.usefixtures("default_loaded_once")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def generate_cli():
    """``mlx-redrafter generate --temp 0 --no-draft`` (plain decoding) on PROMPT."""
    return GenerateCommand(PROMPT, MAX_TOKENS, "--no-draft")


@pytest.fixture(scope="module")
def server(tmp_path_factory, generate_cli):
    """The server's base URL; the process is always stopped."""
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "mlx_redrafter.cli",
        "serve",
        "--port",
        str(port),
        "--max-tokens",
        str(MAX_TOKENS),
        "--queue-size",
        str(QUEUE),
        "--max-batch",
        str(MAX_BATCH),
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}):\n{log.read_text()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.5)
        yield url
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server + "/v1", api_key="not-needed", max_retries=0, timeout=300)


def _chat(client, content, **kw):
    messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
    return client.chat.completions.create(model="default", messages=messages, temperature=0, **kw)


def _health(server) -> dict:
    return httpx.get(server + "/health", timeout=10).json()


def _wait_idle(server, served_at_least: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = _health(server)
        q = h["queue"]
        if q["served"] >= served_at_least and not q["running"] and q["waiting"] == 0:
            return h
        assert time.monotonic() < deadline, f"the server did not go idle: {h}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(client):
    """The reply to PROMPT at temperature 0 (non-streamed)."""
    return _chat(client, PROMPT)


# --------------------------------------------------------------------------- endpoints


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["default"]
    h = _health(server)
    assert h["status"] == "ok" and h["model"] == "default"
    assert h["drafter"] is not None  # the shipped drafter is used
    assert h["queue"]["bound"] == QUEUE and h["queue"]["max_batch"] == MAX_BATCH
    m = h["memory"]  # MLX's: the model's weights at least are alive
    assert 0 < m["active_mb"] <= m["peak_mb"] and m["cache_mb"] >= 0
    # No --prompt-cache-bytes: no bound, said as null (it once said 9223372036854775808).
    assert h["prompt_cache"]["bound_bytes"] is None


def test_metrics_name_the_chat_pages_files_by_their_route(server):
    """The page's files count under the mount's route, not as unknown paths."""

    def count(route: str, status: str) -> float:
        text = httpx.get(server + "/metrics", timeout=10).text
        want = f'redrafter_requests_total{{route="{route}",status="{status}"}} '
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(want))

    before = (count("/ui/{path}", "200"), count("/", "200"), count("unmatched", "404"))
    for path in ("/", "/ui/app.js", "/ui/style.css", "/nowhere"):
        httpx.get(server + path, timeout=10)
    assert count("/ui/{path}", "200") == before[0] + 2
    assert count("/", "200") == before[1] + 1
    assert count("unmatched", "404") == before[2] + 1  # an unknown path still is one


def test_chat_equals_generate_and_stream_equals_whole(client, reference, generate_cli):
    r = reference
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + MAX_TOKENS
    stats = r.model_extra["redrafter"]
    # Drafted, with drafts accepted (2 of 8 tokens here): the plain command line's reply below is the same.
    assert stats["drafting"] and 0 < stats["from_drafts"] <= 1 and stats["tokens_per_step"] > 1
    by_source = stats["from_drafts_by_source"]
    assert set(by_source) <= {"drafter", "lookup", "datastore"}
    assert sum(by_source.values()) == pytest.approx(stats["from_drafts"], abs=2e-3)

    # The streamed reply is the same text, with usage in the last chunk.
    chunks = list(_chat(client, PROMPT, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens

    # ... and it equals the command line's plain decoding of the same message.
    stdout, stderr = generate_cli.communicate(timeout=600)
    assert generate_cli.returncode == 0, stderr
    assert stdout == text + "\n"


def test_completions_and_stop(client, reference):
    r = client.completions.create(model="default", prompt="The capital of France is", temperature=0, max_tokens=4)
    assert r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4
    streamed = client.completions.create(
        model="default", prompt="The capital of France is", temperature=0, max_tokens=4, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text

    # A stop string ends the reply before it, with finish_reason "stop".
    text = reference.choices[0].message.content
    word = text.split()[1]
    stopped = _chat(client, PROMPT, stop=[word, "@@@"])
    assert stopped.choices[0].message.content == text[: text.index(word)]
    assert stopped.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(client):
    a, b = (
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": PROMPT}],
            temperature=0.9,
            top_p=0.95,
            seed=7,
            max_tokens=4,
        )
        for _ in range(2)
    )
    assert a.choices[0].message.content == b.choices[0].message.content


# --------------------------------------------------------------------------- the prompt cache


def test_second_turn_reuses_the_cache(client):
    first = [{"role": "user", "content": "Name a colour."}]
    r1 = _chat(client, first)
    convo = first + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Name another one."},
    ]
    r2 = _chat(client, convo)
    stats = r2.model_extra["redrafter"]
    # The whole first turn (its prompt and its reply) came from the cache.
    assert stats["prompt_tokens_reused"] >= r1.usage.prompt_tokens + 1
    assert r2.usage.prompt_tokens_details.cached_tokens == stats["prompt_tokens_reused"]
    assert stats["prompt_tokens_prefilled"] == r2.usage.prompt_tokens - stats["prompt_tokens_reused"]

    # After an unrelated request the conversation is still cached (the
    # prompt cache keeps several sequences): the same request reuses its whole
    # prompt but the last token, and the reply is the same.
    _chat(client, "Say hello.", max_tokens=2)
    again = _chat(client, convo)
    assert again.model_extra["redrafter"]["prompt_tokens_reused"] == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == r2.choices[0].message.content


# --------------------------------------------------------------------------- many clients


def _batch_steps(server) -> float:
    """How many steps so far decoded more than one request (``/metrics``)."""
    text = httpx.get(server + "/metrics", timeout=10).text
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("redrafter_batch")
    }
    return values["redrafter_batch_size_count"] - values['redrafter_batch_size_bucket{le="1.0"}']


def _alone(client, prompts, max_tokens, drafted=None):
    """Each prompt's greedy reply sent alone (drafted with the shipped
    drafter); ``drafted``: a list that gets each reply's share from drafts."""
    replies = [_chat(client, p, max_tokens=max_tokens) for p in prompts]
    if drafted is not None:
        drafted += [r.model_extra["redrafter"]["from_drafts"] for r in replies]
    return [r.choices[0].message.content for r in replies]


def test_four_concurrent_clients_equal_each_alone(server, client):
    prompts = ["Name a fruit.", "Name a city.", "What is 2 + 2?", "Say hi."]
    drafted = []
    alone = _alone(client, prompts, 12, drafted)
    # Alone: drafts accepted (the live choice may run a 12-token reply plain);
    # batched below: plain decoding, the same text.
    assert any(d > 0 for d in drafted)
    batched = _batch_steps(server)
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: _chat(client, p, max_tokens=12), prompts))
    assert [r.choices[0].message.content for r in together] == alone
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in together)
    # They were decoded together: steps of several rows, and tokens decoded in the batch.
    assert _batch_steps(server) > batched
    assert sum(r.model_extra["redrafter"]["tokens_batched"] for r in together) > 0
    assert _wait_idle(server, 0)["queue"]["active"] == 0


def _streamed(client, prompt, max_tokens, on_chunk=None, **kw):
    """A streamed greedy reply's text; ``on_chunk(i)`` after each chunk (False: hang up)."""
    text = ""
    stream = _chat(client, prompt, max_tokens=max_tokens, stream=True, **kw)
    for i, chunk in enumerate(stream):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if on_chunk is not None and on_chunk(i) is False:
            stream.close()
            return None
    return text


def test_joining_and_hanging_up_mid_batch_leave_the_others_unchanged(server, client):
    prompts = ["Write a short poem about the sea.", "Explain what a prime number is.", "Name three rivers."]
    drafted = []
    alone = _alone(client, prompts, 24, drafted)
    assert all(d > 0 for d in drafted)  # drafts accepted alone
    cancelled = _health(server)["queue"]["cancelled"]
    joined, pool = threading.Event(), ThreadPoolExecutor(4)

    def join_after(i):  # the third request starts while the first two decode
        if i == 3 and not joined.is_set():
            joined.set()
            late.append(pool.submit(_streamed, client, prompts[2], 24))

    late = []
    try:
        first = pool.submit(_streamed, client, prompts[0], 24, join_after)
        second = pool.submit(_streamed, client, prompts[1], 24)
        leaver = pool.submit(_streamed, client, "Count from 1 to 500.", 200, lambda i: i < 3)
        texts = [first.result(300), second.result(300)]
        assert leaver.result(300) is None
        assert joined.wait(60)
        texts.append(late[0].result(300))
    finally:
        pool.shutdown()
    assert texts == alone
    h = _wait_idle(server, 0)
    assert h["queue"]["cancelled"] == cancelled + 1 and h["queue"]["active"] == 0


SEEDED = dict(temperature=0.9, top_p=0.9, seed=11, max_tokens=12)


@pytest.fixture(scope="module")
def seeded_cli():
    """The command line's plain seeded sampling of PROMPT: what a seeded row
    decoded in a batch gives (its key starts at its seed). The later --temp wins."""
    flags = ["--no-draft", "--temp", "0.9", "--top-p", "0.9", "--seed", "11"]
    return GenerateCommand(PROMPT, SEEDED["max_tokens"], *flags)


def test_mixed_sampling_and_a_grammar_in_one_batch(server, client, seeded_cli):
    """Greedy, structured, seeded and top-k rows in one batch (beside a long
    reply that decodes all along, so that none of them starts alone): each
    gives what it gives alone, or plain decoding's samples for its seed, and
    top_k=1 at a high temperature is greedy."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    ask = "Name a city in France, as JSON."
    drafted = []
    greedy_alone, hi_alone = _alone(client, ["Name a fruit.", "Say hi."], 12, drafted)
    assert any(d > 0 for d in drafted)  # drafts accepted alone, plain decoding in the batch
    structured_alone = _chat(client, ask, max_tokens=24, response_format=fmt).choices[0].message.content
    batched = _batch_steps(server)
    calls = [
        lambda: _chat(client, "Name a fruit.", max_tokens=12),
        lambda: _chat(client, ask, max_tokens=24, response_format=fmt),
        lambda: client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": PROMPT}], **SEEDED
        ),
        lambda: client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Say hi."}],
            temperature=1.5,
            extra_body={"top_k": 1},
            max_tokens=12,
        ),
    ]
    anchor = _open_request(server, _long(True))
    try:
        deadline = time.monotonic() + 120
        while not _health(server)["queue"]["running"]:
            assert time.monotonic() < deadline, "the long reply did not start"
            time.sleep(0.1)
        with ThreadPoolExecutor(4) as pool:
            greedy, structured, seeded, top_k = [f.result(300) for f in [pool.submit(c) for c in calls]]
    finally:
        anchor.close()
    _wait_idle(server, 0)  # the long reply's hang-up is counted before the next test reads the counts
    assert greedy.choices[0].message.content == greedy_alone
    assert structured.choices[0].message.content == structured_alone
    assert json.loads(structured_alone)["city"]
    assert top_k.choices[0].message.content == hi_alone  # top_k=1 kept in the batch: the argmax
    assert all(r.model_extra["redrafter"]["tokens_batched"] > 0 for r in (greedy, structured, seeded, top_k))
    stdout, stderr = seeded_cli.communicate(timeout=600)
    assert seeded_cli.returncode == 0, stderr
    assert seeded.choices[0].message.content + "\n" == stdout  # the seed's samples, as plain decoding draws them
    assert _batch_steps(server) > batched


def _open_request(server, body: dict) -> socket.socket:
    """Send a request and leave it unread (closing the socket disconnects)."""
    host, port = server.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def _long(stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2000, "stream": stream}


def test_disconnect_stops_generation(server, client, reference):
    served = _health(server)["queue"]["served"]
    cancelled = _health(server)["queue"]["cancelled"]
    with httpx.stream("POST", server + "/v1/chat/completions", json=_long(True), timeout=300) as r:
        lines = r.iter_lines()
        first = [next(lines) for _ in range(4)]  # the role chunk and a token, with blank lines
        assert any("content" in line for line in first)
    # Closed mid-stream: the 2000-token reply stops within a step or so.
    h = _wait_idle(server, served + 1)
    assert h["queue"]["cancelled"] == cancelled + 1
    assert _chat(client, PROMPT).choices[0].message.content == reference.choices[0].message.content


def test_full_queue_answers_503_with_retry_after(server, client, reference):
    """MAX_BATCH decoding and QUEUE waiting: the next request (OpenAI's or
    Ollama's) is a 503 with Retry-After; once the clients leave, requests
    are served again and the queue is back at 0."""
    before = _health(server)["queue"]
    socks = [_open_request(server, _long(True))]
    try:
        deadline = time.monotonic() + 60
        while not _health(server)["queue"]["running"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        socks += [_open_request(server, _long(i % 2 == 0)) for i in range(MAX_BATCH + QUEUE - 1)]
        while True:  # all in: decoding (batched where that pays) or waiting
            q = _health(server)["queue"]
            if q["active"] + q["waiting"] == MAX_BATCH + QUEUE:
                break
            assert time.monotonic() < deadline, q
            time.sleep(0.1)
        r = httpx.post(server + "/v1/chat/completions", json=_long(False), timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        assert int(r.headers["Retry-After"]) >= 1
        r = httpx.post(
            server + "/api/chat", json={"model": "default", "messages": [{"role": "user", "content": LONG}]}, timeout=60
        )
        assert r.status_code == 503 and "busy" in r.json()["error"] and int(r.headers["Retry-After"]) >= 1
    finally:
        for s in socks:
            s.close()
    # Every client left: the decoding replies stop and the waiting ones are skipped.
    h = _wait_idle(server, before["served"] + MAX_BATCH + QUEUE)
    assert h["queue"]["shed"] == before["shed"] + 2 and h["queue"]["active"] == 0
    assert _chat(client, PROMPT).choices[0].message.content == reference.choices[0].message.content
    assert _health(server)["queue"]["waiting"] == 0
    assert "redrafter_requests_shed_total" in httpx.get(server + "/metrics", timeout=10).text


# --------------------------------------------------------------------------- bad input

MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("malformed JSON", b'{"messages": [', 400, None),
    ("missing messages", {"max_tokens": 4}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("messages not a list", {"messages": "hi"}, 400, "messages"),
    ("max_tokens a string", {"messages": MSG, "max_tokens": "5"}, 400, "max_tokens"),
    ("negative max_tokens", {"messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    ("temperature too high", {"messages": MSG, "temperature": 2.5}, 400, "temperature"),
    ("negative temperature", {"messages": MSG, "temperature": -0.1}, 400, "temperature"),
    ("top_p above 1", {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    ("stream not a bool", {"messages": MSG, "stream": "yes"}, 400, "stream"),
    ("unknown model", {"messages": MSG, "model": "gpt-4o"}, 404, "model"),
    ("prompt longer than the context", {"messages": [{"role": "user", "content": "hello " * 9000}]}, 400, "messages"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_error_object(server, name, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        server + "/v1/chat/completions", content=content, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if name.startswith("prompt longer"):
        assert "8192" in error["message"] and "tokens" in error["message"]
    assert _health(server)["status"] == "ok"


def test_bad_completions_and_routes(server):
    r = httpx.post(server + "/v1/completions", json={"prompt": ["a", "b"]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(server + "/v1/completions", json={"max_tokens": 3}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.get(server + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and "error" in r.json()


def test_serve_flags_fail_before_loading(capsys):
    from mlx_redrafter.cli import main

    assert main(["serve", "--queue-size", "0"]) == 1
    assert "--queue-size" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "Traceback" not in err


# --------------------------------------------------------------------------- the queue itself (no model)


def test_queue_is_fair_and_bounded():
    order, started, release = [], threading.Event(), threading.Event()

    def handler(job):
        started.set()
        release.wait(30)
        order.append(job.ids[0])
        return Result()

    q = JobQueue(handler, size=3)
    done = []
    jobs = [Job([i], GenParams(1), lambda kind, value: done.append(kind)) for i in range(5)]
    q.start()
    try:
        q.submit(jobs[0])
        assert started.wait(30)  # job 0 runs: 3 may wait behind it
        for j in jobs[1:4]:
            q.submit(j)
        with pytest.raises(QueueFull):
            q.submit(jobs[4])
        assert q.status()["waiting"] == 3 and q.status()["running"]
        jobs[2].cancel()  # its client left while it waited: skipped
        release.set()
        deadline = time.monotonic() + 30
        while q.status()["served"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        release.set()
        q.stop()
    assert order == [0, 1, 3]
    assert q.status()["served"] == 4 and q.status()["cancelled"] == 1
    assert done == ["done"]  # the skipped job was told


def test_stopping_the_queue_cancels_its_jobs():
    started = threading.Event()

    def handler(job):
        started.set()
        job.cancelled.wait(30)  # a generation that stops at its next step once cancelled
        return Result(cancelled=job.cancelled.is_set())

    q = JobQueue(handler, size=2)
    jobs = [Job([i], GenParams(1), lambda kind, value: None) for i in range(2)]
    q.start()
    for j in jobs:
        q.submit(j)
    assert started.wait(30)
    q.stop()
    assert all(j.cancelled.is_set() for j in jobs)
    assert q.status()["cancelled"] == 2
