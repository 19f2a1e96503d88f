"""Datastore rows in the step loops (issue 28): exact greedy tokens with the
datastore alone and merged with the drafter and context lookup, through the
pipelined and the synchronous loop, on the tiny architectures and the
default model; ``stream_generate(datastore=...)``. The sampling
distribution with datastore rows: test_datastore_sampling.py."""

from __future__ import annotations

import pytest
from helpers import TINY_CONFIGS, prompts, random_drafter, tiny_model

from mlx_redrafter.draft.datastore.index import Datastore
from mlx_redrafter.draft.datastore.use import Stores, open_datastore
from mlx_redrafter.generate import DraftConfig, generate_tokens, stream_generate

N_TOKENS = 40
LOOPS = {"pipelined": True, "synchronous": False}


def _store_of(replies, every: int = 7) -> Datastore:
    """A store of earlier replies: each one with one token in ``every``
    changed, and its first half unchanged. Its rows are partly right, so
    partial acceptance and rejection both occur."""
    store = Datastore(model_id="test")
    for r in replies:
        store.add([(t + 1) % 97 if i % every == every - 1 else t for i, t in enumerate(r)])
        store.add(r[: len(r) // 2])
    return store


def _taken(stats, source="datastore"):
    return sum(s.accepted for s in stats if s.source == source)


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny(request):
    model = tiny_model(request.param)
    ps = prompts(3)
    refs = [generate_tokens(model, p, max_tokens=N_TOKENS)[0] for p in ps]
    return request.param, model, ps, refs, _store_of(refs)


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("merged", [False, True], ids=["alone", "merged"])
def test_tiny_models_exact_with_the_datastore(tiny, loop, merged):
    kind, model, ps, refs, store = tiny
    drafter = random_drafter(exit_dim=48, num_draft_layers=1) if merged else None
    draft = DraftConfig(drafter, 2, 1, lookup=int(merged), datastore=store, pipelined=LOOPS[loop])
    taken = 0
    for p, ref in zip(ps, refs):
        out, stats = generate_tokens(model, p, draft=draft, max_tokens=N_TOKENS)
        assert out == ref, kind
        assert {s.source for s in stats} <= {"", "drafter", "lookup", "datastore"}
        taken += _taken(stats)
    assert taken > 0, kind  # the store's rows were verified and accepted


def test_an_empty_store_is_plain_steps():
    model = tiny_model("llama")
    p = prompts(1)[0]
    ref, _ = generate_tokens(model, p, max_tokens=12)
    for pipelined in LOOPS.values():
        out, stats = generate_tokens(
            model, p, draft=DraftConfig(datastore=Datastore(), pipelined=pipelined), max_tokens=12
        )
        assert out == ref and all(s.tree_size == 1 for s in stats)


def test_the_store_row_comes_only_when_the_context_has_no_match():
    """The sources as a step asks them (lookup, then the datastore, read then build)."""
    from mlx_redrafter.step.source import At, Setting
    from mlx_redrafter.step.sources.datastore import DatastoreSource
    from mlx_redrafter.step.sources.lookup import LookupSource

    store = Datastore()
    store.add([5, 6, 7, 8, 9])

    def step_rows(history):
        setting = Setting(None, None, lambda h: h, list(history), False, True, False)
        at = At(None, None, list(history))
        out = []
        for source in (LookupSource(1, 3), DatastoreSource(store, 3)):
            rows = source.open(setting).propose(at)
            if rows is not None:
                at.proposed.append(rows)
                out.append((rows.host, rows.label))
        return out

    assert step_rows([1, 2, 3, 1, 2]) == [([[3, 1, 2]], "lookup")]  # the context's own match wins
    assert step_rows([1, 2, 5, 6]) == [([[7, 8, 9]], "datastore")] and store.proposed == 1


# --------------------------------------------------------------------------- default model

CHAT = ["What is the capital of France?", "Write a Python function that reverses a string."]


@pytest.fixture(scope="module")
def default_setup(default_model):
    from mlx_redrafter.hub.load import load_drafter
    from mlx_redrafter.runtime import shipped_drafter_path

    model, tok = default_model
    ps = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True) for c in CHAT]
    refs = [generate_tokens(model, p, max_tokens=N_TOKENS, eos_ids=tok.eos_token_ids)[0] for p in ps]
    store = Datastore(model_id="default")
    for r in refs:  # an earlier session's replies to the same questions, cut short
        store.add(r[: N_TOKENS // 2])
    return model, tok, ps, refs, store, load_drafter(shipped_drafter_path("default"))


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("merged", [False, True], ids=["alone", "merged"])
def test_default_model_exact_with_the_datastore(default_setup, loop, merged):
    model, tok, ps, refs, store, drafter = default_setup
    draft = DraftConfig(drafter if merged else None, 2, 1, lookup=int(merged), datastore=store, pipelined=LOOPS[loop])
    taken = 0
    for p, ref in zip(ps, refs):
        out, stats = generate_tokens(model, p, draft=draft, max_tokens=N_TOKENS, eos_ids=tok.eos_token_ids)
        assert out == ref
        taken += _taken(stats)
    assert taken > 0


def test_stream_generate_takes_a_path_a_store_none_or_false(default_setup, tmp_path):
    model, tok, ps, refs, store, _ = default_setup
    path = store.save(tmp_path / "s.bin")
    ref_text = tok.decode(refs[0])
    for given in (path, str(path), store):
        rs = list(stream_generate(model, tok, ps[0], max_tokens=N_TOKENS, datastore=given, drafter=None))
        assert "".join(r.text for r in rs).strip() == ref_text.strip()
        assert any(r.stats.source == "datastore" for r in rs)
    rs = list(stream_generate(model, tok, ps[0], max_tokens=N_TOKENS, datastore=False, lookup=True, drafter=None))
    assert not any(r.stats.source == "datastore" for r in rs)
    # None: the model's default stores, and only when the call drafts at all.
    assert open_datastore("default", "default", drafting=False) is None
    assert isinstance(open_datastore("default", "default"), Stores) and open_datastore(False, "default") is None
    assert open_datastore(None, "default") is None  # off unless asked
    with pytest.raises(ValueError, match="draft= and datastore="):
        list(stream_generate(model, tok, ps[0], max_tokens=4, datastore=store, draft=DraftConfig(lookup=1)))


def test_a_foreign_store_file_warns_and_drafts_nothing(default_setup, tmp_path, caplog):
    model, tok, ps, refs, store, _ = default_setup
    other = Datastore(model_id="another/model")
    other.add(refs[0])
    path = other.save(tmp_path / "other.bin")
    rs = list(stream_generate(model, tok, ps[0], max_tokens=12, datastore=path, drafter=None))
    assert [r.token for r in rs if r.finish_reason != "stop" or r.token not in tok.eos_token_ids][:12] == refs[0][:12]
    assert not any(r.stats.source == "datastore" for r in rs)
    assert "another/model" in caplog.text
