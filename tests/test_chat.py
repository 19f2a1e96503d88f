"""`mlx-redrafter chat`: cache reuse is exact, interruptions and long
conversations keep the session consistent, slash commands, and the terminal
and piped front ends (driven through a pseudo-terminal and a pipe)."""

import io
import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager

import pytest

from mlx_redrafter import RedrafterError, generate
from mlx_redrafter.chat import ChatSession, ChatSettings
from mlx_redrafter.chat.terminal import _Output
from mlx_redrafter.output import RedrafterResponse
from mlx_redrafter.prompts import build_messages, render_messages
from mlx_redrafter.step.protocol import StepStats

TIMEOUT = 300  # seconds for one expect: the machine is shared and slow


@pytest.fixture(scope="module")
def drafter():
    """The drafter shipped for the default model: its drafts are accepted (a
    random one's never are, and the exactness below would show nothing)."""
    from mlx_redrafter.hub.load import load_drafter

    return load_drafter("default")


@pytest.fixture(scope="module")
def drafter_dir():
    from mlx_redrafter.runtime import shipped_drafter_path

    return shipped_drafter_path("default")


def greedy(model, tok, history, user, max_tokens, system=None):
    """Plain greedy decoding (no drafter, no lookup) on the fully templated conversation, from scratch."""
    full = render_messages(tok, build_messages(system, history, user))
    return generate(model, tok, full, drafter=None, lookup=False, max_tokens=max_tokens)


# --------------------------------------------------------------------------- exactness of cache reuse


@pytest.mark.parametrize(
    "use_drafter,lookup", [(False, 0), (True, 0), (False, 1), (True, 1)], ids=["plain", "redrafter", "lookup", "merged"]
)
def test_turns_reuse_the_cache_and_equal_plain_greedy(default_model, drafter, use_drafter, lookup):
    model, tok = default_model
    settings = ChatSettings(max_tokens=16, beam_width=2, beam_length=3, lookup=lookup)
    s = ChatSession(model, tok, drafter if use_drafter else None, settings)
    # The third turn's reply copies from the conversation: lookup's drafts are accepted there.
    q1, q2 = "What is 2+2?", "Write a poem about the sea."
    q3 = "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog."
    t1 = s.reply(q1)
    t2 = s.reply(q2)
    # Both ways a reply ends leave the cache consistent: EOS (its KV may be
    # in the cache) and max_tokens.
    assert (t1.finish_reason, t2.finish_reason) == ("stop", "length")
    assert t1.reused_tokens == 0
    assert t2.reused_tokens >= t1.reused_tokens + t1.prefilled_tokens  # turn 1 was not recomputed
    assert t2.reply == greedy(model, tok, [(q1, t1.reply)], q2, 16)
    t3 = s.reply(q3)
    assert t3.reused_tokens >= t2.reused_tokens + t2.prefilled_tokens
    history = [(q1, t1.reply), (q2, t2.reply)]
    assert t3.reply == greedy(model, tok, history, q3, 16)
    fresh = ChatSession(model, tok, drafter if use_drafter else None, settings, history=history)
    assert fresh.reply(q3).reply == t3.reply
    drafted = [t.tally.drafted_tokens for t in (t2, t3)]  # the turns compared with plain decoding
    assert (sum(drafted) >= 2) if use_drafter or lookup else drafted == [0, 0]
    assert s.totals.turns == 3 and s.totals.tokens == sum(t.tally.tokens for t in (t1, t2, t3))
    assert s.totals.reused_tokens == t2.reused_tokens + t3.reused_tokens


# W=2 L=3 runs the pipelined loop, W=4 L=3 (12 drafter nodes) the synchronous one.
@pytest.mark.parametrize("width,lookup", [(2, 1), (4, 0)], ids=["pipelined+lookup", "synchronous"])
def test_interrupted_turn_keeps_the_session_consistent(default_model, drafter, width, lookup):
    model, tok = default_model
    settings = ChatSettings(max_tokens=200, beam_width=width, beam_length=3, lookup=lookup)
    s = ChatSession(model, tok, drafter, settings)
    seen = []

    def ctrl_c_after_five(r):
        seen.append(r.text)
        if len(seen) == 5:
            raise KeyboardInterrupt

    q1 = "Write a long story about a dragon."
    t1 = s.reply(q1, on_response=ctrl_c_after_five)
    assert t1.interrupted and t1.finish_reason is None
    assert t1.tally.tokens == 5 and t1.reply == "".join(seen)
    assert s.history == [(q1, t1.reply)]  # what the user saw stays in the conversation
    assert s.totals.interrupted == 1
    # The cache survives Ctrl-C: it holds the prompt and (a prefix of) the reply.
    assert s.cache is not None and len(s.cached) == s.cache[0].offset
    s.settings.max_tokens = 16
    q2 = "Now tell me a joke."
    t2 = s.reply(q2)
    assert not t2.interrupted
    assert t2.reused_tokens >= t1.prefilled_tokens + 4  # the first prompt and the interrupted reply's tokens
    assert t2.reply == greedy(model, tok, [(q1, t1.reply)], q2, 16) and t2.tally.drafted_tokens >= 2
    fresh = ChatSession(
        model,
        tok,
        drafter,
        ChatSettings(max_tokens=16, beam_width=width, beam_length=3, lookup=lookup),
        history=[(q1, t1.reply)],
    )
    assert fresh.reply(q2).reply == t2.reply


def test_system_change_and_reset_trim_the_cache(default_model, drafter):
    """Changing an earlier part of the conversation invalidates the cache
    past the change: only the common prefix may be reused."""
    model, tok = default_model
    s = ChatSession(model, tok, drafter, ChatSettings(max_tokens=12, beam_width=2, beam_length=3))
    q1, q2, q3 = "Name a colour.", "Name an animal.", "Name a fruit."
    a1 = s.reply(q1).reply
    assert s.handle_command("/system You are a pirate.").message == "System message set."
    t2 = s.reply(q2)
    assert 0 < t2.reused_tokens < len(s.cached) // 2  # only the template's opening survives
    assert t2.reply == greedy(model, tok, [(q1, a1)], q2, 12, system="You are a pirate.")
    assert t2.tally.drafted_tokens >= 1  # drafts accepted on this path
    s.handle_command("/reset")
    t3 = s.reply(q3)
    assert t3.reused_tokens > 5  # the system message is still cached
    assert t3.reply == greedy(model, tok, [], q3, 12, system="You are a pirate.")


def test_closing_the_stream_early_is_an_interruption(default_model):
    model, tok = default_model
    s = ChatSession(model, tok, settings=ChatSettings(max_tokens=50))
    stream = s.stream_reply("Count from one to twenty.")
    text = "".join(next(stream).text for _ in range(3))
    stream.close()
    assert s.last_turn.interrupted and s.turns[-1].reply == text
    # The cache is kept, trimmed to what it holds of the prompt and the reply,
    # and the next turn reuses it and still equals plain greedy decoding.
    assert s.cache is not None and len(s.cached) == s.cache[0].offset >= s.last_turn.prefilled_tokens
    # Closing right after the last response is a complete turn, and the cache is kept.
    s.settings.max_tokens = 4
    stream = s.stream_reply("Say hi.")
    for r in stream:
        if r.finish_reason is not None:
            break
    stream.close()
    assert not s.last_turn.interrupted and s.last_turn.finish_reason == "length"
    assert s.cache is not None and len(s.cached) == s.cache[0].offset > 0
    assert s.last_turn.reused_tokens >= s.turns[0].prefilled_tokens  # the closed turn's cache was reused
    assert s.last_turn.reply == greedy(model, tok, [("Count from one to twenty.", text)], "Say hi.", 4)


def test_long_conversation_drops_oldest_turns(default_model):
    model, tok = default_model
    limit, n = 130, 8
    notices = []
    s = ChatSession(model, tok, settings=ChatSettings(max_tokens=n), max_context=limit, notify=notices.append)
    questions = ["What is the capital of France?", "And of Italy?", "And of Spain?", "And of Germany?", "And of Peru?"]
    for q in questions:
        before = s.history
        t = s.reply(q)
        # The templated conversation plus the longest reply fit the context.
        assert t.reused_tokens + t.prefilled_tokens + n <= limit
        if notices:
            break
    assert len(notices) == 1 and "Dropped the" in notices[0] and f"({limit} tokens" in notices[0]
    used = s.history[:-1]  # what the model saw for the last reply
    assert 0 < len(used) < len(before) and used == before[len(before) - len(used) :]  # the oldest went
    assert not s.turns[0].in_context and s.totals.dropped_turns == len(before) - len(used)
    # The reply after dropping is what the model says to the shortened conversation.
    assert t.reply == greedy(model, tok, used, q, n)
    # A message that cannot fit even alone is refused, and nothing is lost.
    before = list(s.history)
    with pytest.raises(RedrafterError, match="context holds 130"):
        s.reply("word " * 200)
    assert s.history == before


# --------------------------------------------------------------------------- commands


@pytest.fixture
def chat(default_model):
    model, tok = default_model
    return ChatSession(
        model,
        tok,
        settings=ChatSettings(max_tokens=8),
        history=[("Hi", "Hello! How can I help?")],
        info={"model": "default"},
    )


def test_help_lists_every_command(chat):
    res = chat.handle_command("/help")
    for name in ("/help", "/reset", "/stats", "/set", "/system", "/save", "/quit"):
        assert name in res.message
    assert not res.error


def test_set_validates_keys_and_values(chat, drafter, default_model):
    res = chat.handle_command("/set temp=0.7 top_p=0.9 max_tokens=32 show_drafts=on")
    assert not res.error and "temp=0.7" in res.message
    assert (
        chat.settings.sampling.temp,
        chat.settings.sampling.top_p,
        chat.settings.max_tokens,
        chat.settings.show_drafts,
    ) == (0.7, 0.9, 32, True)
    for args, msg in [
        ("bogus=1", "'bogus' is not a setting"),
        ("temp=-1", "temp must be a number >= 0"),
        ("temp=hot", "temp must be a number >= 0"),
        ("top_p=1.5", "top_p must be a number from 0 to 1"),
        ("max_tokens=0", "max_tokens must be an integer >= 1"),
        ("temp", "'temp' is not key=value"),
        ("beam_width=3", "no effect: this chat decodes without a drafter"),
    ]:
        res = chat.handle_command(f"/set {args}")
        assert res.error and msg in res.message, args
    # A bad item anywhere leaves every setting as it was.
    chat.handle_command("/set temp=0.1 top_k=-2")
    assert chat.settings.sampling.temp == 0.7 and chat.settings.sampling.top_k == 0
    model, tok = default_model
    drafting = ChatSession(model, tok, drafter)
    res = drafting.handle_command("/set beam_width=3 beam_length=4")
    assert not res.error and (drafting.settings.beam_width, drafting.settings.beam_length) == (3, 4)
    assert drafting.handle_command("/set beam_length=0").error
    assert "beam_width=3" in drafting.handle_command("/set").message


def test_system_reset_quit_and_unknown(chat, default_model):
    _, tok = default_model
    assert chat.handle_command("/system You are terse.").message == "System message set."
    assert chat.system == "You are terse."
    assert "You are terse." in chat.prompt_text("Next?")
    assert "You are terse." in chat.handle_command("/system").message
    chat.handle_command("/system -")
    assert chat.system is None
    assert chat.handle_command("/reset").message == "New conversation."
    assert chat.history == []
    assert chat.handle_command("/quit").quit and chat.handle_command("/exit").quit
    res = chat.handle_command("/frobnicate")
    assert res.error and "Unknown command /frobnicate" in res.message


def test_save_markdown_and_json(chat, tmp_path):
    chat.system = "Be brief."
    res = chat.handle_command(f"/save {tmp_path / 'c.md'}")
    assert not res.error
    md = (tmp_path / "c.md").read_text()
    assert "## User\n\nHi\n" in md and "## Assistant\n\nHello! How can I help?\n" in md and "Be brief." in md
    assert not chat.handle_command(f"/save {tmp_path / 'c.json'}").error
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["model"] == "default" and data["settings"]["max_tokens"] == 8
    assert [(m["role"], m["content"]) for m in data["messages"]] == [
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "Hello! How can I help?"),
    ]
    for args, msg in [
        (f"{tmp_path / 'c.txt'}", "Use a .md"),
        ("", "needs a file name"),
        (f"{tmp_path / 'no' / 'dir' / 'c.md'}", "Cannot write"),
    ]:
        res = chat.handle_command(f"/save {args}".strip())
        assert res.error and msg in res.message


def test_show_drafts_colours_drafted_tokens():
    from rich.console import Console

    out = _Output(interactive=True)
    out.console = Console(file=io.StringIO(), force_terminal=True, color_system="standard", highlight=False)

    def response(text, from_draft, source="drafter"):
        return RedrafterResponse(
            text=text,
            token=0,
            logprobs=None,
            from_draft=from_draft,
            prompt_tokens=1,
            prompt_tps=0.0,
            generation_tokens=1,
            generation_tps=0.0,
            peak_memory=0.0,
            stats=StepStats(accepted=1, source=source if from_draft else ""),
        )

    out.token(response("drafted", True), show_drafts=True)
    out.token(response("copied", True, "lookup"), show_drafts=True)
    out.token(response("own", False), show_drafts=True)
    out.token(response("plain", True), show_drafts=False)
    written = out.console.file.getvalue()
    assert "\x1b[36mdrafted\x1b[0m" in written  # cyan
    assert "\x1b[35mcopied\x1b[0m" in written  # magenta: a lookup draft
    assert "own" in written and "\x1b[36mown" not in written
    assert "\x1b[36mplain" not in written
    out.token(response("headed", True, "eagle3"), show_drafts=True)
    assert "\x1b[94mheaded\x1b[0m" in out.console.file.getvalue()  # bright blue: an EAGLE-3 head's


def test_the_terminal_legend_names_the_sources_that_draft():
    """The greeting's legend: the colour of each source this chat drafts
    with, an EAGLE-3 or MTP head's and a DFlash drafter's included (it named
    drafter, lookup and datastore whatever drafted)."""
    from types import SimpleNamespace

    from mlx_redrafter.chat.terminal import legend
    from mlx_redrafter.config import DraftConfig

    head = DraftConfig(head=SimpleNamespace(source="eagle3"), lookup=1)
    assert legend(head) == "[bright_blue]bright_blue[/] (EAGLE-3 head) and [magenta]magenta[/] (lookup)"
    mtp = DraftConfig(drafter=object(), head=SimpleNamespace(source="mtp"), draft_model=object(), lookup=1)
    assert legend(mtp) == (
        "[cyan]cyan[/] (drafter), [yellow]yellow[/] (MTP head), [bright_green]bright_green[/] (draft model) "
        "and [magenta]magenta[/] (lookup)"
    )
    assert legend(DraftConfig(drafter=object())) == "[cyan]cyan[/] (drafter)"
    assert legend(DraftConfig(head=SimpleNamespace(source="dflash"))) == "[bright_red]bright_red[/] (DFlash drafter)"


# --------------------------------------------------------------------------- the command in a terminal and a pipe


def chat_command(*args):
    return [sys.executable, "-m", "mlx_redrafter.cli", "chat", *args]


@contextmanager
def terminal_chat(*args, **spawn):
    """``chat *args`` on a pseudo-terminal (pexpect; ``spawn``: more of its
    options). Leaving the block sends Ctrl-D: the command must end with 0."""
    import pexpect  # a test dependency (.[test]): missing is an error, not a skip

    cmd = chat_command(*args)
    child = pexpect.spawn(cmd[0], cmd[1:], env=dict(os.environ), encoding="utf-8", timeout=TIMEOUT, **spawn)
    try:
        yield child
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def test_terminal_session(default_model, drafter_dir):
    args = ("--drafter", str(drafter_dir), "-W", "2", "-L", "3", "--max-tokens", "16", "--show-drafts")
    with terminal_chat(*args, dimensions=(40, 240)) as child:
        child.expect_exact(">>> ")
        child.sendline("What is 2+2?")
        child.expect(r"\d+ tokens, [\d.]+ tok/s, [\d.]+ tokens/step, \d+% from drafts")
        child.expect_exact(">>> ")
        child.sendline("And 3+3?")
        child.expect(r"\((\d+) reused from the cache\)")
        assert int(child.match.group(1)) > 0
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect_exact("turns: 2 (0 interrupted")
        child.expect_exact(">>> ")
        child.sendline("/set beam_width=3 beam_length=2 temp=0")
        child.expect_exact("set beam_width=3 beam_length=2 temp=0.0")
        child.sendline("/set bogus=1")
        child.expect_exact("'bogus' is not a setting")
        child.sendline("/reset")
        child.expect_exact("New conversation.")
        child.expect_exact(">>> ")
        # Ctrl-C in the middle of a long reply stops it and keeps the session.
        child.sendline("/set max_tokens=400")
        child.expect_exact(">>> ")
        child.sendline("Write a long story about a dragon who learns to fly.")
        child.expect_exact("learns to fly.\r\n")
        child.expect(r"[A-Za-z]{4,}")  # the first word of the reply (escape codes have fewer letters)
        child.sendcontrol("c")
        child.expect_exact("(interrupted)")
        child.expect(r"interrupted: \d+ tokens")
        child.expect_exact(">>> ")
        child.sendline("/set max_tokens=16")
        child.sendline("Thanks!")
        child.expect(r"\d+ tokens, [\d.]+ tok/s.*\((\d+) reused from the cache\)")  # Ctrl-C kept the cache
        assert int(child.match.group(1)) > 20
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect_exact("turns: 4 (1 interrupted")
        child.expect_exact(">>> ")


def test_terminal_multi_line_messages(default_model, tmp_path):
    """A multi-line message is one turn, typed between two lines of three
    double quotes or pasted whole (a bracketed paste, as terminals send it:
    lines end in CR); /help names the way. Caught: each line was a turn of
    its own, one reply each (read_message returning the first line alone;
    no bracketed paste asked of the terminal)."""
    model, tok = default_model
    status = r"\d+ tokens, [\d.]+ tok/s"
    with terminal_chat("--no-draft", "--max-tokens", "4", "--no-history") as child:
        child.expect_exact('open and close them with """')  # the greeting names the way in
        child.expect_exact(">>> ")
        child.sendline('"""')
        child.expect_exact("... ")
        child.sendline("Name a colour.")
        child.expect_exact("... ")
        child.sendline('Then a fruit."""')
        child.expect(status)
        # A terminal brackets a paste only when the program asks it to (this
        # sequence, readline's, before each prompt); unasked, it sends the lines bare.
        child.expect_exact("\x1b[?2004h>>> ")
        child.send("\x1b[200~Name a city.\rThen a river.\x1b[201~")  # the paste, its lines ending in CR
        child.send("\r")  # Enter sends it
        child.expect(status)
        child.expect_exact(">>> ")
        child.sendline("/help")
        child.expect_exact('"""                   open a message of several lines')
        child.expect_exact(">>> ")
        child.sendline(f"/save {tmp_path / 'c.json'}")
        child.expect_exact("Saved 2 turns")
        child.expect_exact(">>> ")
    messages = json.loads((tmp_path / "c.json").read_text())["messages"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    assert users == ["Name a colour.\nThen a fruit.", "Name a city.\nThen a river."]
    first = messages[1]["content"]
    assert first == greedy(model, tok, [], users[0], 4)


def test_piped_session(default_model):
    model, tok = default_model
    q1, q2 = "What is 2+2?", "And 3+3?\n/stats is not a command here."
    stdin = f'{q1}\n/stats\n\n/set nope=1\n"""\n{q2}\n"""\n'  # the second turn: a block of two lines
    p = subprocess.run(chat_command("--max-tokens", "12"), input=stdin, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\x1b" not in p.stderr  # plain text, no colours
    a1 = greedy(model, tok, [], q1, 12)
    a2 = greedy(model, tok, [(q1, a1)], q2, 12)
    assert p.stdout.startswith(a1 + "\n")
    assert p.stdout.endswith("\n" + a2 + "\n")
    assert "turns: 1 (0 interrupted" in p.stdout
    assert re.search(r"mean tree [\d.]+ tokens verified per step", p.stdout)
    assert "'nope' is not a setting" in p.stderr
    assert len(re.findall(r"tok/s, [\d.]+ tokens/step", p.stderr)) == 2  # one status line per reply
    assert max(int(n) for n in re.findall(r"(\d+)% from drafts", p.stderr)) > 0  # the shipped drafter's, accepted
