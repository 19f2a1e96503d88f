"""The chat page at ``/`` of ``mlx-redrafter serve``, driven in a real
headless Chromium (Debian's ``chromium`` through Playwright) against real
servers in subprocesses: the default model with its shipped drafter, and
``--no-draft``. Model output that tries to run HTML comes from a stand-in
stream (the page must be safe whatever a server sends)."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from openai import OpenAI
from ui_servers import GenerateCommand, Server, chromium_path, fake_app, serve_in_thread

MAX_TOKENS = 16
PROMPT = "Write a short poem about the sea."
FOLLOW_UP = "Now make it rhyme."
LONG = "Count from 1 to 500, separated by commas."
REPLY = ".msg.assistant"
COLOURED = ".msg.assistant .src-drafter, .msg.assistant .src-lookup"
# The reference command runs in-process (ui_servers.GenerateCommand): the session's default model, loaded once.
pytestmark = pytest.mark.usefixtures("default_loaded_once")


@pytest.fixture(scope="module")
def generate_cli():
    """``mlx-redrafter generate --temp 0 --no-draft`` (plain decoding) on PROMPT."""
    return GenerateCommand(PROMPT, MAX_TOKENS, "--no-draft")


@pytest.fixture(scope="module")
def server(tmp_path_factory, generate_cli):
    s = Server(["--max-tokens", str(MAX_TOKENS), "--queue-size", "2"], tmp_path_factory.mktemp("ui") / "serve.log")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    s = Server(["--no-draft", "--max-tokens", "6"], tmp_path_factory.mktemp("ui") / "plain.log")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    """A fresh browser context (empty localStorage); page errors fail the test."""
    context = browser.new_context(viewport={"width": 1000, "height": 800})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        yield page
    finally:
        context.close()
    assert not errors, errors


# --------------------------------------------------------------------------- page helpers


def _send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def _wait_reply(page, n: int, state: str = "done", timeout: float = 300_000):
    page.wait_for_selector(f"{REPLY}:nth-of-type({2 * n})[data-state='{state}']", timeout=timeout)


def _setting(page, selector: str, value: str) -> None:
    if not page.eval_on_selector("#settings", "d => d.open"):
        page.click("#settings summary")
    page.fill(selector, value)


def _stored(page) -> dict:
    """The page's state in localStorage: what a reload starts from."""
    return json.loads(page.evaluate("localStorage.getItem('mlx-redrafter.chat.v1')"))


def _messages(page) -> list:
    state = _stored(page)
    return next(c for c in state["chats"] if c["id"] == state["currentId"])["messages"]


def _words(text: str) -> str:
    return " ".join(text.split())


# Records the text of the streaming reply each time it changes, to see it grow.
WATCH = """() => { window.seen = []; new MutationObserver(() => {
  const r = document.querySelector('.msg.assistant[data-state="streaming"] .body');
  if (r && window.seen[window.seen.length - 1] !== r.textContent) window.seen.push(r.textContent);
}).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true}); }"""


# --------------------------------------------------------------------------- the stream's extension


def test_stream_carries_token_sources(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": PROMPT}],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_text = [c for c in chunks if c.choices and c.choices[0].delta.content]
    xs = [c.model_extra["x_redrafter"] for c in with_text]
    sources = [s for x in xs for s in x["sources"]]
    usage = chunks[-1].usage
    assert len(sources) == usage.completion_tokens == MAX_TOKENS and set(sources) <= {"drafter", "lookup", "llm"}
    stats = next(c for c in chunks if c.model_extra.get("redrafter")).model_extra["redrafter"]
    drafted = sum(s != "llm" for s in sources)
    assert drafted / MAX_TOKENS == pytest.approx(stats["from_drafts"], abs=1e-3)
    assert xs[-1]["tokens"] == MAX_TOKENS and xs[-1]["steps"] == stats["steps"]
    assert xs[-1]["prompt_tokens"] == usage.prompt_tokens
    assert xs[-1]["prompt_tokens_reused"] == usage.prompt_tokens_details.cached_tokens


# --------------------------------------------------------------------------- a conversation


def test_two_turns_stream_greedy_replies_coloured_by_source(server, page, generate_cli):
    page.goto(server.url + "/")
    page.evaluate(WATCH)
    _send(page, PROMPT)
    _wait_reply(page, 1)
    stdout, stderr = generate_cli.communicate(timeout=600)
    assert generate_cli.returncode == 0, stderr
    first = _messages(page)[1]
    assert first["content"] == stdout.removesuffix("\n")  # greedy: the command line's reply
    assert _words(page.inner_text(f"{REPLY} .body")) == _words(first["content"])
    assert len([s for s in page.evaluate("window.seen") if s]) >= 2  # it grew while streaming

    # The page's colours are the server's per-token sources.
    body = {"messages": [{"role": "user", "content": PROMPT}], "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    drafted = "".join(
        e["choices"][0]["delta"]["content"]
        for e in events
        if any(s != "llm" for s in e.get("x_redrafter", {}).get("sources", []))
    )
    assert drafted, "the shipped drafter had no draft accepted"
    coloured = page.eval_on_selector_all(COLOURED, "els => els.map(e => e.textContent).join('')")
    assert coloured and _words(coloured) == _words(drafted)
    status = page.inner_text("#status")
    assert re.search(r"[\d.]+ tokens/s · [\d.]+ tokens/step · \d+% from drafts", status)

    # The toggle turns the colours off (the legend stays).
    span = page.locator(COLOURED).first
    assert span.evaluate("e => getComputedStyle(e).backgroundColor") != "rgba(0, 0, 0, 0)"
    page.click("#show-sources")
    assert span.evaluate("e => getComputedStyle(e).backgroundColor") == "rgba(0, 0, 0, 0)"

    # A second turn: the whole conversation goes to the server, most of it from the cache.
    _send(page, FOLLOW_UP)
    _wait_reply(page, 2)
    messages = _messages(page)
    history = [{"role": m["role"], "content": m["content"]} for m in messages[:3]]
    whole = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": history, "temperature": 0}, timeout=300
    ).json()
    assert messages[3]["content"] == whole["choices"][0]["message"]["content"]
    reused = int(re.search(r"(\d+) reused from the cache", page.inner_text("#status")).group(1))
    assert reused > len(PROMPT.split())
    assert page.evaluate("document.activeElement.id") == "input"


def test_stop_mid_reply_empties_the_queue(server, page):
    before = server.health()["queue"]
    page.goto(server.url + "/")
    _setting(page, "#max-tokens", "2000")
    _send(page, LONG)
    page.wait_for_function(
        "() => { const r = document.querySelector('.msg.assistant .body'); return r && r.textContent.length > 10; }",
        timeout=300_000,
    )
    page.click("#stop")
    _wait_reply(page, 1, "stopped", timeout=30_000)
    deadline = time.monotonic() + 60
    while True:
        q = server.health()["queue"]
        if q["cancelled"] == before["cancelled"] + 1 and not q["running"] and q["waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"the server did not stop generating: {q}"
        time.sleep(0.2)
    assert q["served"] == before["served"] + 1
    assert _messages(page)[1]["content"]  # the partial reply stays

    _setting(page, "#max-tokens", "4")
    _send(page, "Say hi.")
    _wait_reply(page, 2)
    assert _messages(page)[3]["content"]


def test_reload_keeps_the_conversation_at_phone_width(server, browser):
    context = browser.new_context(viewport={"width": 375, "height": 700})
    try:
        page = context.new_page()
        page.goto(server.url + "/")
        _setting(page, "#max-tokens", "6")
        _send(page, "Name a colour.")
        _wait_reply(page, 1)
        html, messages = page.inner_html("#log"), _messages(page)
        page.reload()
        page.wait_for_selector(REPLY)
        assert page.inner_html("#log") == html and _messages(page) == messages
        assert page.input_value("#max-tokens") == "6"
        # Nothing is wider than a phone's screen.
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        page.click("#new-chat")
        assert page.locator(".msg").count() == 0
        assert page.evaluate("document.activeElement.id") == "input"
    finally:
        context.close()


# --------------------------------------------------------------------------- plain decoding, errors


def test_no_draft_colours_nothing(plain_server, page):
    page.goto(plain_server.url + "/")
    _send(page, PROMPT)
    _wait_reply(page, 1)
    assert _messages(page)[1]["content"]
    assert page.locator(COLOURED).count() == 0
    assert "1.00 tokens/step · 0% from drafts" in page.inner_text("#status")


def test_context_too_long_is_a_readable_message(plain_server, page):
    page.goto(plain_server.url + "/")
    _setting(page, "#system", "hello " * 9000)
    _send(page, "Hi.")
    page.wait_for_selector("#error:not([hidden])")
    assert "8192" in page.inner_text("#error") and "Start a new chat" in page.inner_text("#error")
    assert page.input_value("#input") == "Hi."  # given back to retry
    assert page.locator(".msg").count() == 0


def test_server_gone_is_a_readable_message(plain_server, page):
    page.goto(plain_server.url + "/")
    plain_server.stop()
    _send(page, "Hello?")
    page.wait_for_selector("#error:not([hidden])")
    assert "cannot be reached" in page.inner_text("#error")
    assert page.input_value("#input") == "Hello?"


# --------------------------------------------------------------------------- the API key


def test_the_page_asks_for_the_key_once_and_keeps_it(tmp_path, page):
    key = "sk-page-test"
    keyed = Server(["--no-draft", "--max-tokens", "4", "--api-key", key], tmp_path / "keyed.log")
    try:
        asked, answers = [], [key]

        def answer(dialog):  # the page's question, answered as a user would
            asked.append(dialog.message)
            reply = answers.pop(0)
            dialog.accept(reply) if reply is not None else dialog.dismiss()

        page.on("dialog", answer)
        page.goto(keyed.url + "/")
        _send(page, "Say hi.")
        _wait_reply(page, 1)
        assert len(asked) == 1 and "needs an API key" in asked[0]
        assert page.evaluate("localStorage.getItem('mlx-redrafter.api-key')") == key
        page.reload()
        page.wait_for_selector(REPLY)
        _send(page, "Again.")
        _wait_reply(page, 2)
        assert len(asked) == 1  # kept in the browser: not asked again

        # A kept key the server refuses is asked for again.
        page.evaluate("localStorage.setItem('mlx-redrafter.api-key', 'stale')")
        answers.append(key)
        _send(page, "Once more.")
        _wait_reply(page, 3)
        assert len(asked) == 2 and "refused the API key" in asked[1]

        # No key given: a readable error, the text given back to retry.
        page.evaluate("localStorage.removeItem('mlx-redrafter.api-key')")
        answers.append(None)
        _send(page, "No key.")
        page.wait_for_selector("#error:not([hidden])")
        assert "API key" in page.inner_text("#error") and page.input_value("#input") == "No key."
        assert len(asked) == 3 and len(_messages(page)) == 6
    finally:
        keyed.stop()


# --------------------------------------------------------------------------- untrusted output

EVIL = (
    "Code:\n\n```html\n<script>window.pwned = 'fenced'</script>\n```\n\n"
    "Inline <script>window.pwned = 'script'</script> and <img src=\"missing.png\" onerror=\"window.pwned = 'img'\">"
    " and <svg onload=\"window.pwned = 'svg'\"></svg> <iframe src=\"javascript:window.pwned = 'iframe'\"></iframe>"
    " [a link](javascript:window.pwned='link') <a href=\"javascript:window.pwned='a'\">b</a>"
)


def test_the_legend_has_a_colour_for_every_draft_source(page):
    """Every source the server names (/metrics' DRAFT_SOURCES) has a swatch in
    the legend, coloured as the reply's tokens from it (EAGLE-3 had none:
    caught on the page before its swatch was added)."""
    from mlx_redrafter.serve.metrics import DRAFT_SOURCES

    pieces = [(f"{source} words ", source) for source in DRAFT_SOURCES] + [("own words", "llm")]
    background = "e => getComputedStyle(e).backgroundColor"
    with serve_in_thread(fake_app(pieces)) as url:
        page.goto(url + "/")
        _send(page, "Say it.")
        _wait_reply(page, 1)
        colours = set()
        for source in DRAFT_SOURCES:
            swatch = page.locator(f"#legend .swatch.src-{source}")
            assert swatch.count() == 1, f"the legend has no swatch for {source}"
            token = page.locator(f"{REPLY} .src-{source}").first
            colour = swatch.evaluate(background)
            assert colour != "rgba(0, 0, 0, 0)" and token.evaluate(background) == colour, source
            colours.add(colour)
        assert len(colours) == len(DRAFT_SOURCES)  # each its own


def test_model_html_never_runs(page):
    # Streamed in 5-character pieces, as tokens come: every partial render is sanitized too.
    pieces = [(EVIL[i : i + 5], ("drafter", "llm", "lookup")[i % 3]) for i in range(0, len(EVIL), 5)]
    with serve_in_thread(fake_app(pieces)) as url:
        page.goto(url + "/")
        _send(page, "Say something dangerous.")
        _wait_reply(page, 1)
        page.wait_for_timeout(500)  # time for a broken image to fire its error
        for _ in range(2):  # as streamed, then as restored from localStorage
            assert page.evaluate("window.pwned") is None
            assert page.locator("#log script, #log iframe, #log [onerror], #log [onload]").count() == 0
            hrefs = page.eval_on_selector_all("#log a", "els => els.map(a => a.getAttribute('href') || '')")
            assert not any(h.startswith("javascript:") for h in hrefs)
            assert "<script>window.pwned = 'fenced'</script>" in page.inner_text("#log pre")
            page.reload()
            _wait_reply(page, 1)
            page.wait_for_timeout(500)

        # The real server's queue-full error is shown as it says.
        _send(page, "busy")
        page.wait_for_selector("#error:not([hidden])")
        assert "The server is busy" in page.inner_text("#error")
