"""The datastore's sources and commands (issue 28): chat and serve append
each reply to the model's history (``--no-history`` leaves it untouched),
``datastore build|add|info|clear``, and a build that resumes and keeps what
it built when interrupted."""

from __future__ import annotations

import io
import json
import sys

import pytest
from helpers import cli

from mlx_redrafter.draft.datastore.index import Datastore, default_path, model_key
from mlx_redrafter.draft.datastore.use import read_session

SHAREGPT = "mlx_redrafter/data/sharegpt_train_prompts.jsonl.gz"
# chat, serve and datastore add load the default model in-process: the session's, loaded once.
pytestmark = pytest.mark.usefixtures("default_loaded_once")


def history():
    return Datastore.open(default_path("default", "history"), model_key("default"))


@pytest.fixture
def cleared():
    assert cli(["datastore", "clear", "--kind", "all"]) == 0
    yield
    cli(["datastore", "clear", "--kind", "all"])


def _chat(monkeypatch, *flags):
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2+2?\nAnd 3+3?\n"))
    assert cli(["chat", "--max-tokens", "8", *flags]) == 0


def test_chat_appends_each_reply_and_no_history_leaves_it(default_model, cleared, monkeypatch, capsys):
    model, tok = default_model
    _chat(monkeypatch)
    said = capsys.readouterr()
    replies = said.out.strip().split("\n")
    folder = default_path("default", "history").parent
    # Said at start, with where and the flag (a transcript on disk must not be a surprise).
    assert f"History: each prompt and reply is appended to {folder}/" in said.err
    assert "--no-history turns it off" in said.err and "datastore clear" in said.err
    store = history()
    assert len(store) == 2
    assert [tok.decode(s).strip() for s in store.sequences()] == [r.strip() for r in replies]
    s = read_session("default")
    assert s.replies == 2 and s.tokens == store.tokens
    before = default_path("default", "history").read_bytes()
    _chat(monkeypatch, "--no-history")
    assert default_path("default", "history").read_bytes() == before
    assert "History:" not in capsys.readouterr().err
    assert cli(["datastore", "info"]) == 0
    out = capsys.readouterr().out
    assert "history: 2 sequences" in out and "session:" in out


@pytest.mark.parametrize("record", [True, False], ids=["history", "no_history"])
def test_serve_appends_each_reply(default_model, cleared, record):
    from openai import OpenAI
    from starlette.testclient import TestClient

    from mlx_redrafter.runtime import load_runtime
    from mlx_redrafter.serve import Engine
    from mlx_redrafter.serve.app import create_app

    rt = load_runtime("default", history=record)
    with TestClient(create_app(Engine(rt, max_tokens=8)), base_url="http://127.0.0.1") as http:
        client = OpenAI(base_url="http://127.0.0.1/v1", api_key="-", http_client=http, max_retries=0)
        texts = [
            client.chat.completions.create(model="default", temperature=0, messages=[{"role": "user", "content": q}])
            .choices[0]
            .message.content
            for q in ("Hi!", "Name a colour.")
        ]
        stats = http.post("/v1/completions", json={"prompt": "1, 2, 3,", "max_tokens": 8}).json()
    path = default_path("default", "history")
    if not record:
        assert not path.exists()
        return
    store = history()
    assert len(store) == 3
    assert [model_tok(default_model).decode(s).strip() for s in store.sequences()[:2]] == [t.strip() for t in texts]
    assert stats["choices"][0]["text"]


@pytest.mark.parametrize("flags", [[], ["--no-history"]], ids=["history", "no_history"])
def test_serve_says_what_it_keeps_and_no_history_keeps_nothing(default_model, cleared, monkeypatch, capsys, flags):
    """``mlx-redrafter serve`` as started (uvicorn and the port check stood
    in for): the history line at start, the reply appended; with
    --no-history neither."""
    import uvicorn
    from starlette.testclient import TestClient

    import mlx_redrafter.doctor as doctor
    from mlx_redrafter.cli import run

    served = {}
    monkeypatch.setattr(doctor, "slow_blas_warning", lambda: None)
    monkeypatch.setattr(run, "_check_port", lambda host, port: None)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app))
    assert cli(["serve", "-n", "4", *flags]) == 0
    err = capsys.readouterr().err
    with TestClient(served["app"], base_url="http://127.0.0.1:8080") as http:
        assert http.post("/api/generate", json={"prompt": "Hi", "stream": False}).status_code == 200
    path = default_path("default", "history")
    if flags:
        assert "History:" not in err and not path.exists()
    else:
        assert f"History: each prompt and reply is appended to {path.parent}/" in err and "--no-history" in err
        assert len(history()) == 1


def model_tok(default_model):
    return default_model[1]


def test_add_info_and_clear(cleared, tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("def mean(values):\n    return sum(values) / len(values)\n")
    lines = tmp_path / "docs.jsonl"
    lines.write_text(json.dumps({"text": "first document"}) + "\n" + json.dumps({"text": "second one"}) + "\n")
    assert cli(["datastore", "add", str(text)]) == 0
    assert cli(["datastore", "add", str(lines)]) == 0
    corpus = Datastore.open(default_path("default", "corpus"), model_key("default"))
    assert len(corpus) == 3
    capsys.readouterr()
    assert cli(["datastore", "info"]) == 0
    assert f"corpus: 3 sequences, {corpus.tokens} tokens" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "no text"}\n')
    assert cli(["datastore", "add", str(bad)]) == 1
    assert "has no text field" in capsys.readouterr().err
    assert cli(["datastore", "clear", "--kind", "corpus"]) == 0
    assert not default_path("default", "corpus").exists()
    assert cli(["datastore", "clear", "--kind", "nope"]) == 1


def test_build_refuses_evaluation_sets(capsys):
    assert cli(["datastore", "build", "--prompts", "mlx_redrafter/data/mt_bench.jsonl"]) == 1
    assert "evaluation set" in capsys.readouterr().err


def test_build_resumes_and_keeps_what_it_built_on_ctrl_c(default_model, tmp_path):
    from mlx_redrafter.train.store_build import BuildConfig, build_store

    model, tok = default_model
    out = tmp_path / "built.bin"
    cfg = BuildConfig(batch_size=2, max_new_tokens=6, max_conversations=2, save_every=1)
    report = build_store("default", SHAREGPT, cfg, out=out, model=model, tokenizer=tok)
    assert report.replies == 2 and len(Datastore.open(out, model_key("default"))) == 2

    def interrupt(replies, total, tokens):
        if replies == 1:
            raise KeyboardInterrupt

    cfg.max_conversations = 5
    with pytest.raises(KeyboardInterrupt):
        build_store("default", SHAREGPT, cfg, out=out, model=model, tokenizer=tok, progress=interrupt)
    assert len(Datastore.open(out, model_key("default"))) == 3  # the reply before Ctrl-C was saved
    report = build_store("default", SHAREGPT, cfg, out=out, model=model, tokenizer=tok)
    assert report.sequences == 5  # resumed after the prompts already answered
    first = Datastore.open(out, model_key("default")).sequences()[0]
    assert first and all(t not in tok.eos_token_ids for t in first)  # replies without the EOS


def test_chat_colours_datastore_drafts_and_the_tally_splits_them():
    from rich.console import Console

    from mlx_redrafter.chat.terminal import DATASTORE_STYLE, _Output
    from mlx_redrafter.output import RedrafterResponse, Tally
    from mlx_redrafter.step.protocol import StepStats

    out = _Output(interactive=True)
    out.console = Console(file=io.StringIO(), force_terminal=True, color_system="standard", highlight=False)
    tally = Tally()
    for n, (text, source, step) in enumerate(
        [("a", "", 0), ("stored", "datastore", 1), ("b", "", 1), ("copied", "lookup", 2), ("c", "", 2)], 1
    ):
        r = RedrafterResponse(
            text=text,
            token=n,
            logprobs=None,
            from_draft=bool(source),
            prompt_tokens=1,
            prompt_tps=0.0,
            generation_tokens=n,
            generation_tps=0.0,
            peak_memory=0.0,
            stats=StepStats(step=step, accepted=int(bool(source)), source=source),
        )
        out.token(r, show_drafts=True)
        tally.add(r)
    assert DATASTORE_STYLE == "green" and "\x1b[32mstored\x1b[0m" in out.console.file.getvalue()
    assert "\x1b[35mcopied\x1b[0m" in out.console.file.getvalue()
    assert tally.by_source == {"drafter": 0, "lookup": 1, "datastore": 1} and tally.datastore_steps == 1
    assert "20% datastore" in tally.draft_summary()
