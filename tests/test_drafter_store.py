"""The drafter store (hub/store.py) and the tools that read it, on tiny
models saved in temp folders: the model's identity, install / find / list /
rm, the store's drafter picked up by ``generate``, ``chat``, ``serve`` and
``stream_generate`` (greedy output equal to plain decoding, with its drafts
accepted: the tiny model is a bigram model its drafter predicts), a drafter that
does not fit refused with the reason, another copy's drafter used with a
note, and lookup drafting with the one line naming make-drafter when the
store has nothing.

Every test that installs sets its own ``MLX_REDRAFTER_CACHE`` (``store``
fixture), so nothing leaks into the other tests of the worker.
"""

from __future__ import annotations

import io
import json
import sys

import pytest
from helpers import (
    HIDDEN,
    VOCAB,
    assert_exact_under_drafting,
    bigram_drafter,
    bigram_model,
    cli,
    drafted_share,
    plain_responses,
    save_bigram_drafter,
    save_random_drafter,
    save_tiny_folder,
    squeeze,
    tiny_model,
)

from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.hub import store as st

PROMPT = "w1 w2 w3 w1 w2 w3 w1"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two copies of one tiny model (same family, other weights) and a drafter
    that fits both and predicts the first (its drafts are accepted there)."""
    root = tmp_path_factory.mktemp("store-models")
    tiny, other = save_tiny_folder(root / "tiny", bigram=True), save_tiny_folder(root / "other", seed=5, bigram=True)
    return tiny, other, save_bigram_drafter(root / "d")


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A store of this test's own."""
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "drafters"


def installed(folder, drafter, **meta):
    from mlx_redrafter.llm.load import identity_for_spec

    identity = identity_for_spec(str(folder))
    return st.install(drafter, identity, {"source": "make-drafter", **meta}), identity


# --------------------------------------------------------------------------- identity


def test_identity_is_the_files_and_costs_nothing_twice(folders, monkeypatch):
    from mlx_redrafter.llm import identity as ident
    from mlx_redrafter.llm.load import identity_for_spec, load_model

    tiny, other, _ = folders
    # Read from the files: no pass over the weights (the weights' fingerprint is never computed).
    monkeypatch.setattr(ident, "weights_fingerprint", lambda m: pytest.fail("the weights were fingerprinted"))
    model, _ = load_model(str(tiny))
    a = st.model_identity(model)
    assert st.model_identity(model) is a  # cached on the model
    assert "redrafter_identity" not in dict(model.parameters())  # not a parameter of the model
    assert (a.id, a.hidden_size, a.vocab_size, a.num_layers) == ("tiny", HIDDEN, VOCAB, 2)
    # The dtype policy does not change it, and the files alone give the same (nothing loaded).
    assert load_model(str(tiny), dtype="float16")[0].redrafter_identity == a == identity_for_spec(str(tiny))
    # Another copy: another fingerprint, the same family.
    b = identity_for_spec(str(other))
    assert b.family == a.family and b.fingerprint != a.fingerprint
    # A quantized copy of the same model is of the same family too.
    import mlx.nn as nn

    q = tiny_model("llama")
    nn.quantize(q, group_size=32, bits=4)
    monkeypatch.undo()
    assert st.model_identity(q).family == a.family


def test_the_shipped_drafter_records_the_default_models_family():
    from mlx_redrafter.llm.load import identity_for_spec

    meta = st.read_meta(st.shipped_root() / "smollm2-135m-instruct")
    identity = identity_for_spec("default")
    assert meta["base_model"]["family"] == identity.family and meta["base_model"]["id"] == identity.id


# --------------------------------------------------------------------------- install, find, list, rm


def test_install_find_list_and_rm(folders, store, capsys):
    tiny, other, drafter = folders
    path, identity = installed(tiny, drafter, verdict={"drafter": {"speedup": 1.25}})
    assert path.parent.parent == store and path.parent.name == identity.family
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", st.META]
    meta = st.read_meta(path)
    assert meta["format"] == 1 and meta["source"] == "make-drafter" and meta["base_model"] == identity.to_dict()
    found = st.find(identity)
    assert found.path == path and found.exact and found.note(identity) is None
    assert st.read_meta(drafter) == {}  # a folder without META

    assert cli(["drafters", "list"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if str(path) in line)
    assert "tiny" in row and identity.short in row and "make-drafter" in row and "1.25x" in row
    assert "shipped with the package" in out  # the package's drafters are listed too
    assert cli(["drafters", "path", str(tiny)]) == 0
    assert capsys.readouterr().out.strip() == str(path)

    assert cli(["drafters", "rm", path.name]) == 0
    assert capsys.readouterr().out.strip() == f"removed {path}"
    assert not path.exists() and st.find(identity) is None
    assert cli(["drafters", "rm", path.name]) == 1
    assert "No drafter" in capsys.readouterr().err
    assert cli(["drafters", "rm", "smollm2-135m-instruct"]) == 1
    assert "ships with the package" in capsys.readouterr().err
    # By model id: every drafter made for it.
    installed(tiny, drafter)
    installed(other, drafter)
    assert len(st.remove("tiny")) == 1 and st.find(identity).path.name.startswith("other-")


def test_the_store_is_preferred_to_the_package_and_the_exact_copy_first(folders, store):
    from mlx_redrafter.llm.load import identity_for_spec

    tiny, other, drafter = folders
    default = identity_for_spec("default")
    assert st.find(default).shipped and st.find(default).exact
    small = save_random_drafter(
        store.parent / "d576", hidden=576, vocab=49152, exit_dim=32, num_draft_layers=1, draft_vocab_size=16, rnn=False
    )
    mine = st.install(small, default, {"source": "make-drafter"})
    assert st.find(default).path == mine and not st.find(default).shipped
    # Of two copies' drafters, the one of this copy, whatever was installed last.
    a, ia = installed(tiny, drafter)
    installed(other, drafter)
    assert st.find(ia).path == a


def test_a_drafter_that_does_not_fit_is_refused_with_the_reason(folders, store, capsys):
    tiny, _, drafter = folders
    wrong = save_random_drafter(store.parent / "wrong", vocab=VOCAB + 3)
    from mlx_redrafter.llm.load import identity_for_spec

    identity = identity_for_spec(str(tiny))
    with pytest.raises(RedrafterError, match="vocab_size is 100 but the model's embedding has 97 rows"):
        st.install(wrong, identity, {"source": "make-drafter"})
    # One that got there anyway (its config edited after the install) is skipped, and says why.
    path, _ = installed(tiny, drafter)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    assert st.find(identity) is None
    assert cli(["drafters", "list", "--model", str(tiny)]) == 0
    assert "does not fit: The drafter's hidden_size is 32 but the model's is 64." in capsys.readouterr().out
    assert cli(["drafters", "path", str(tiny)]) == 1
    assert "hidden_size is 32" in capsys.readouterr().err


def test_an_empty_store_names_the_command_for_the_model_given(folders, store, capsys):
    """`drafters list --model PATH` with nothing for it: the command to make
    one, with that model in it (it said `--model M`, a literal M)."""
    tiny, _, _ = folders
    assert cli(["drafters", "list", "--model", str(tiny)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"`mlx-redrafter make-drafter --model {tiny} --hours 1` makes one." in err and "--model M`" not in err, err


def test_a_folder_that_is_no_drafter_is_named_for_what_it_is(folders, store, capsys):
    """`--drafter` given a model folder, or a model's split MTP folder: said
    as what it is, with the flag it belongs to (they said `Drafter
    config.json lacks vocab_size, hidden_size` or that the weights did not
    match). Caught: load_drafter without refuse_non_drafter."""
    from pathlib import Path

    tiny, other, _ = folders
    mtp = Path(__file__).parent / "fixtures" / "mtp_qwen3_5"
    cases = [
        (other, f"Error: {other} is a model (llama), not a drafter.", f"Fix: Load it with --model {other}."),
        (mtp / "checkpoint", "is a model (qwen3_5), not a drafter.", f"(or --mtp {mtp / 'checkpoint'})"),
        (mtp / "split", "is a split MTP folder (qwen3_5_mtp", f"Fix: Give it as the MTP head: --mtp {mtp / 'split'}"),
    ]
    for folder, problem, fix in cases:
        assert cli(["generate", "--model", str(tiny), "-p", PROMPT, "-n", "2", "--drafter", str(folder)]) == 1
        err = capsys.readouterr().err
        assert problem in err and fix in err and "lacks" not in err and "do not match" not in err, err
    from mlx_redrafter import load_drafter

    with pytest.raises(RedrafterError, match="split MTP folder") as e:
        load_drafter(str(mtp / "split"))
    assert "mtp= from Python" in e.value.fix
    assert load_drafter(str(Path(__file__).parent / "fixtures" / "eagle3" / "eagle")) is not None  # a head, not a model


# --------------------------------------------------------------------------- the tools read it


def test_generate_uses_the_stored_drafter_and_says_where_it_came_from(folders, store, capsys):
    tiny, _, drafter = folders
    path, _ = installed(tiny, drafter)
    gen = ["generate", "--model", str(tiny), "--prompt", PROMPT, "-n", "12", "--raw"]
    assert cli(gen + ["--no-draft"]) == 0
    plain = capsys.readouterr().out
    assert cli(gen) == 0
    drafted = capsys.readouterr()
    assert drafted.out == plain and drafted_share(drafted.err) > 0  # the same, with drafts accepted
    assert squeeze(f"drafter {path} (from the store: make-drafter)") in squeeze(drafted.err)
    from mlx_redrafter.runtime import resolve_drafter_path

    assert resolve_drafter_path(str(tiny), None) == path  # what `sweep` measures without --drafter


def test_another_copys_drafter_is_used_with_a_note(folders, store):
    from rich.console import Console

    from mlx_redrafter.runtime import load_runtime

    tiny, other, drafter = folders
    path, _ = installed(tiny, drafter)
    rt = load_runtime(str(other))
    assert rt.drafter_path == path and rt.drafter is not None
    console = Console(record=True, width=400)
    rt.announce(console)
    notes = [line for line in console.export_text().splitlines() if line.startswith("Note:")]
    assert len(notes) == 1 and "trained for tiny" in notes[0] and "another copy of this model (other" in notes[0]


def test_chat_uses_the_stored_drafter(folders, store, monkeypatch, capsys):
    tiny, _, drafter = folders
    path, _ = installed(tiny, drafter)
    replies = {}
    for flags in ([], ["--no-draft"]):
        monkeypatch.setattr(sys, "stdin", io.StringIO("w5 w6 w7 w5 w6\nw9 w8\n"))
        assert cli(["chat", "--model", str(tiny), "-n", "8", "--no-history", *flags]) == 0
        captured = capsys.readouterr()
        replies[bool(flags)] = captured.out
        assert (str(path) in squeeze(captured.err)) == (not flags)
        assert (drafted_share(captured.out + captured.err) > 0) == (not flags)  # drafts accepted, or none
    assert replies[False] == replies[True] and replies[False].strip()


def test_serve_uses_the_stored_drafter(folders, store):
    from starlette.testclient import TestClient  # the server extra: `make test` installs it

    from mlx_redrafter.runtime import load_runtime
    from mlx_redrafter.serve import Engine
    from mlx_redrafter.serve.app import create_app

    tiny, _, drafter = folders
    path, _ = installed(tiny, drafter)
    texts = {}
    for no_draft in (False, True):
        rt = load_runtime(str(tiny), no_draft=no_draft)  # what `mlx-redrafter serve --model` loads
        with TestClient(create_app(Engine(rt, max_tokens=10)), base_url="http://127.0.0.1") as http:
            health = http.get("/health").json()
            texts[no_draft] = http.post(
                "/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0}
            ).json()
        assert health["drafter"] == (None if no_draft else str(path))
    assert texts[False]["choices"][0]["text"] == texts[True]["choices"][0]["text"]
    assert texts[False]["redrafter"]["from_drafts_by_source"]["drafter"] > 0  # its drafts were accepted
    assert texts[True]["redrafter"]["from_drafts"] == 0


def test_stream_generate_uses_the_stored_drafter_by_default(folders, store):
    from mlx_redrafter import stream_generate
    from mlx_redrafter.llm.load import load_model

    tiny, _, drafter = folders
    model, tok = load_model(str(tiny))
    assert st.drafter_for(model) == (None, None)
    path, _ = installed(tiny, drafter)
    # drafter="auto": the store's, whose drafts are accepted; the output is plain decoding's.
    # Lookup off: on this repeating prompt its rows would take the credit for what the drafter also drafted.
    rs = assert_exact_under_drafting(model, tok, PROMPT, max_tokens=12, lookup=False, min_accepted=2, source="drafter")
    assert all(r.stats.tree_size > 1 for r in rs[1:])  # every step verified drafts
    loaded, found = st.drafter_for(model)
    assert found.path == path and st.drafter_for(model)[0] is loaded  # cached on the model
    # None explicit: plain decoding; a drafter given: that one.
    assert all(r.stats.tree_size == 1 for r in stream_generate(model, tok, PROMPT, max_tokens=6, drafter=None))
    given = bigram_drafter(bigram_model())
    assert_exact_under_drafting(
        model, tok, PROMPT, max_tokens=12, drafter=given, lookup=False, min_accepted=2, source="drafter"
    )
    with pytest.raises(RedrafterError, match="is not a drafter"):
        list(stream_generate(model, tok, PROMPT, max_tokens=2, drafter="some/folder"))
    # Removed: the next call sees it (the family folder changed).
    st.remove(path.name)
    assert all(r.stats.tree_size == 1 for r in stream_generate(model, tok, PROMPT, max_tokens=4))


def test_drafter_none_and_lookup_false_draft_nothing(folders, store):
    """The baseline every exactness test compares with: with a drafter in the
    store and a prompt lookup copies from, ``drafter=None, lookup=False`` is
    plain decoding (no drafted token, no tree), where the defaults draft."""
    from mlx_redrafter import stream_generate
    from mlx_redrafter.llm.load import load_model

    tiny, _, drafter = folders
    installed(tiny, drafter)
    model, tok = load_model(str(tiny))
    drafted = list(stream_generate(model, tok, PROMPT, max_tokens=16))
    assert {r.stats.source for r in drafted if r.from_draft} == {"drafter", "lookup"}  # what the defaults do
    plain = list(stream_generate(model, tok, PROMPT, max_tokens=16, drafter=None, lookup=False))
    assert not any(r.from_draft for r in plain) and {(r.stats.accepted, r.stats.tree_size) for r in plain} == {(0, 1)}
    assert [r.token for r in plain_responses(model, tok, PROMPT, max_tokens=16)] == [r.token for r in plain]


def test_load_drafter_by_model_id_and_store_name(folders, store):
    from mlx_redrafter import load_drafter

    tiny, _, drafter = folders
    path, _ = installed(tiny, drafter)
    assert load_drafter("tiny").source_path == path
    assert load_drafter(path.name).source_path == path
    assert load_drafter("default").source_path == st.shipped_root() / "smollm2-135m-instruct"
    with pytest.raises(RedrafterError, match="Drafter path does not exist: no-such-drafter"):
        load_drafter("no-such-drafter")


def test_no_drafter_drafts_by_lookup_where_it_pays_and_names_make_drafter(folders, store, capsys, monkeypatch):
    from mlx_redrafter.runtime import load_runtime
    from mlx_redrafter.step import auto

    tiny, _, _ = folders
    gen = ["generate", "--model", str(tiny), "--prompt", PROMPT, "-n", "12", "--raw"]
    assert cli(gen + ["--no-draft"]) == 0
    plain = capsys.readouterr().out
    assert load_runtime(str(tiny), "none", lookup=True).plan().drafting  # the float built-in curve: lookup pays
    assert cli(gen) == 0
    got = capsys.readouterr()
    assert got.out == plain and drafted_share(got.err) > 0  # copies from the context accepted
    assert "drafting:1copyfromthecontextperstep(nodrafter)" in squeeze(got.err)
    lines = [line for line in got.err.splitlines() if "make-drafter" in line]
    assert len(lines) == 1 and f"`mlx-redrafter make-drafter --model {tiny}`" in lines[0]
    # Where lookup does not pay on the curve: plain decoding, the same one line.
    monkeypatch.setattr(auto, "can_pay", lambda sources, curve=None: False)
    rt = load_runtime(str(tiny))
    assert rt.lookup == 0 and not rt.plan().drafting and "do not pay" in rt.plain_reason and "make-drafter" in rt.hint
    # The flags still win, and --drafter none says nothing about make-drafter.
    assert load_runtime(str(tiny), lookup=True).lookup == 1
    assert cli(gen + ["--no-lookup"]) == 0
    assert "plaindecoding(nodrafter" in squeeze(capsys.readouterr().err)
    assert cli(gen + ["--drafter", "none"]) == 0
    assert "make-drafter" not in capsys.readouterr().err
