"""One check of a draft on every path (issue 53): the library
(``generate``), and the ``generate``, ``chat`` and ``serve`` commands refuse
the same combinations, each with the same words, before anything drafts;
and what ``serve``'s start-up line announces is what it does.

Each refused combination runs through each entry point: the library with
loaded objects, the commands in this process (``chat`` with a piped turn,
``serve`` with uvicorn replaced by a stand-in that records a start, so a
combination it accepted would show as a start instead of hanging the test).

Seen to catch: ``serve --adaptive --draft-model M`` answering with the
controller never called (``open_runtime`` without ``DraftConfig.check``:
bench/mutations.py H6); ``mtp_depth=0``, ``num_draft_tokens=0`` and
``num_draft_tokens=`` without a draft model silently replaced or ignored by
the library; a controller with no drafter to decide for, ignored.
"""

from __future__ import annotations

import io
import re
import sys

import pytest
from helpers import cli, save_bigram_drafter, save_tiny_folder
from test_sources_cli import mimo_folder  # noqa: F401  (a fixture: a MiMo folder that ships an MTP head)
from ui_servers import free_port

from mlx_redrafter.errors import RedrafterError

PROMPT = "w5 w9 w11"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Folders (a bigram llama, its drafter with a depth controller beside it,
    an EAGLE-3 head for it) and the same things loaded, for the library."""
    from eagle3_heads import save_pass_through_head

    from mlx_redrafter.draft.controller import Controller, ControllerConfig, load_controller, save_controller
    from mlx_redrafter.hub.load import load_drafter
    from mlx_redrafter.llm.load import load_model

    root = tmp_path_factory.mktemp("one-check")
    folder = save_tiny_folder(root / "model", bigram=True)
    drafter = save_bigram_drafter(root / "drafter")
    save_controller(Controller(ControllerConfig(beam_width=2, beam_length=3)), drafter)
    model, tok = load_model(str(folder))
    eagle = save_pass_through_head(root / "eagle3", model, "speculators", 72, [1, 1, 2])
    paths = {"model": folder, "drafter": drafter, "eagle3": eagle}
    loaded = {
        "model": model,
        "tokenizer": tok,
        "drafter": load_drafter(drafter),
        "controller": load_controller(drafter),
        "eagle3": load_drafter(eagle, dtype="float32"),
    }
    return paths, loaded


# (name, model ("llama" or "mimo"), the commands' flags, the library's keywords, the words all say)
COMBINATIONS = [
    (
        "adaptive beside a draft model",
        "llama",
        lambda p: ["--drafter", p["drafter"], "--adaptive", "--draft-model", p["model"]],
        lambda o: dict(drafter=o["drafter"], controller=o["controller"], draft_model=o["model"]),
        r"The adaptive-depth controller decides the draft depth of one drafter",
    ),
    (
        "adaptive without a drafter",
        "llama",
        lambda p: ["--drafter", "none", "--lookup", "--adaptive"],
        lambda o: dict(drafter=None, lookup=1, controller=o["controller"]),
        r"adaptive.* needs a drafter",
    ),
    (
        "an MTP depth beside an EAGLE-3 drafter",
        "llama",
        lambda p: ["--drafter", p["eagle3"], "--mtp-depth", "3"],
        lambda o: dict(drafter=o["eagle3"], mtp_depth=3),
        r"sets an MTP head's depth, but the drafter is an EAGLE-3 head",
    ),
    (
        "beams of width 0",
        "llama",
        lambda p: ["--drafter", p["drafter"], "--beam-width", "0"],
        lambda o: dict(drafter=o["drafter"], beam_width=0),
        r"[Bb]eam.width.* must be at least 1",
    ),
    (
        "a draft model drafting 0 tokens",
        "llama",
        lambda p: ["--draft-model", p["model"], "--num-draft-tokens", "0"],
        lambda o: dict(draft_model=o["model"], num_draft_tokens=0),
        r"at least 1 \(got .*0\)",
    ),
    (
        "draft tokens without a draft model",
        "llama",
        lambda p: ["--num-draft-tokens", "2"],
        lambda o: dict(num_draft_tokens=2),
        r"num.draft.tokens=? needs -*draft.model",
    ),
    (
        "an MTP depth without an MTP head",
        "llama",
        lambda p: ["--mtp-depth", "2"],
        lambda o: dict(mtp_depth=2),
        r"mtp.depth=? was given but the model ships no MTP head",
    ),
    (
        "no MTP head and an MTP depth",
        "llama",
        lambda p: ["--mtp", "none", "--mtp-depth", "2"],
        lambda o: dict(mtp=None, mtp_depth=2),
        r"mtp.* and .*mtp.depth=? contradict each other",
    ),
    (
        "an MTP head drafting 0 tokens",
        "mimo",
        lambda p: ["--mtp-depth", "0"],
        lambda o: dict(mtp_depth=0),
        r"at least 1 \(got .*0\)",
    ),
    (
        "an unknown tree",
        "llama",
        lambda p: ["--tree", "bogus"],
        lambda o: dict(tree="bogus"),
        r"Unknown tree 'bogus'",
    ),
]
ENTRY_POINTS = ["library", "generate", "chat", "serve"]


@pytest.fixture(scope="module")
def mimo(mimo_folder):  # noqa: F811 (the fixture imported above)
    """test_sources_cli's MiMo folder (it ships an MTP head), and the model loaded."""
    from mlx_redrafter.llm.load import load_model

    model, tok = load_model(str(mimo_folder))
    return {"model": mimo_folder}, {"model": model, "tokenizer": tok}


def _command(entry: str, folder, flags, monkeypatch, capsys):
    """``(exit code, what it printed on stderr, whether serve started)`` of a command on ``folder``."""
    started = []
    if entry == "chat":
        monkeypatch.setattr(sys, "stdin", io.StringIO(f"{PROMPT}\n"))
        args = ["chat", "--max-tokens", "4"]
    elif entry == "serve":
        import uvicorn

        monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.append(app))
        args = ["serve", "--port", str(free_port()), "--max-tokens", "4"]
    else:
        args = ["generate", "-p", PROMPT, "-n", "4"]
    code = cli([*args, "--model", str(folder), *map(str, flags)])
    return code, " ".join(capsys.readouterr().err.split()), bool(started)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize(
    "name, kind, flags, keywords, words", COMBINATIONS, ids=[c[0].replace(" ", "-") for c in COMBINATIONS]
)
def test_a_refused_draft_is_refused_on_every_path_with_the_same_words(
    world, mimo, monkeypatch, capsys, entry, name, kind, flags, keywords, words
):
    from mlx_redrafter.generate import generate

    paths, loaded = world if kind == "llama" else mimo
    if entry == "library":
        with pytest.raises(RedrafterError) as e:
            generate(loaded["model"], loaded["tokenizer"], PROMPT, max_tokens=4, **keywords({**world[1], **loaded}))
        said = " ".join(str(e.value).split())
    else:
        code, said, started = _command(entry, paths["model"], flags({**world[0], **paths}), monkeypatch, capsys)
        assert not started, f"serve started with {name}"
        assert code == 1, f"{entry} ran with {name} (exit {code}): {said}"
    assert re.search(words, said), f"{entry} refused {name} in other words: {said}"


def test_serve_does_what_its_start_up_line_announces(world, monkeypatch, capsys):
    """``serve --adaptive``: the line says "adaptive depth" and the controller
    decides each step of a request; ``--draft-model`` (the model itself): the
    line names it and the request's reply counts its accepted drafts."""
    import uvicorn
    from starlette.testclient import TestClient

    from mlx_redrafter.draft.controller import Controller

    paths, _ = world
    replies, decisions = [], []
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16}

    def answer_one(app, **kw):
        with TestClient(app, base_url="http://127.0.0.1") as http:
            replies.append(http.post("/v1/chat/completions", json=body).json())

    real_logit = Controller.logit
    monkeypatch.setattr(uvicorn, "run", answer_one)
    monkeypatch.setattr(Controller, "logit", lambda self, h: decisions.append(1) or real_logit(self, h))
    port = ["--port", str(free_port())]
    model = ["--model", str(paths["model"])]
    assert cli(["serve", *model, *port, "--drafter", str(paths["drafter"]), "--adaptive", "-L", "3"]) == 0
    said = " ".join(capsys.readouterr().err.split())
    assert "adaptive depth" in said and decisions, said
    assert replies[-1]["redrafter"]["from_drafts_by_source"].get("drafter", 0) > 0
    decisions.clear()
    assert cli(["serve", *model, *port, "--draft-model", str(paths["model"]), "--no-lookup"]) == 0
    said = " ".join(capsys.readouterr().err.split())
    assert f"draft model: {paths['model']}" in said and "draft-model guess" in said, said
    assert replies[-1]["redrafter"]["from_drafts_by_source"].get("draft-model", 0) > 0
    assert not decisions  # no controller was asked for, none decides
