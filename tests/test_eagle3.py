"""EAGLE-3 heads (issue 45): both published layouts load, their logits match
mlx-vlm's EAGLE-3 drafter on the same checkpoints (tests/fixtures/eagle3, see
its GENERATED_BY.md), the reduced vocabulary maps back through d2t, and what
we save is the speculators layout.

Mutations seen caught here (bench/mutations.py): C5 (the embedding and state norms swapped)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import tiny_model

from mlx_redrafter.draft.eagle3 import Eagle3Head, default_layer_ids
from mlx_redrafter.draft.eagle3_io import config_from_dict, fit_problem, read_eagle3, save_eagle3
from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.hub.load import load_drafter

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "eagle3"


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(FIXTURE / "reference.npz"))


@pytest.fixture(scope="module")
def target(ref):
    """A 4-layer tiny Llama whose embedding is the fixture's target embedding."""
    model = tiny_model("llama", num_hidden_layers=4)
    model.model.embed_tokens.weight = mx.array(ref["target_embedding"])
    return model


def run_chain(head: Eagle3Head, ref: dict):
    """The fixture's calls: the prompt's taps, then one chained token at a time on the head's own state."""
    cache = head.make_cache()
    first, hidden = head(mx.array(ref["tokens"]), mx.array(ref["taps"]), cache, first=True)
    chain = []
    for t in ref["chain"].tolist():
        logits, hidden = head(mx.array([[t]]), hidden[:, -1:], cache, first=False)
        chain.append(logits)
    return np.array(first), np.array(mx.concatenate(chain, axis=1))


@pytest.mark.parametrize("layout", ["speculators", "eagle"])
def test_each_published_layout_matches_mlx_vlm_on_the_same_checkpoint(layout, ref, target):
    head = load_drafter(FIXTURE / layout, dtype="float32")
    assert ("embed_tokens" in head) == (layout == "speculators")  # the EAGLE repository's has none
    head.bind(target)
    # The speculators head names hidden_states 1, 2, 3: the outputs of layers 0, 1, 2. The EAGLE repository's
    # names none: [2, L // 2, L - 3] = [2, 2, 1] for 4 layers.
    assert head.taps == {"speculators": (0, 1, 2), "eagle": (1, 1, 0)}[layout]
    first, chain = run_chain(head, ref)
    np.testing.assert_allclose(first, ref[f"{layout}_logits_first"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(chain, ref[f"{layout}_logits_chain"], rtol=1e-4, atol=1e-4)
    # The reduced vocabulary: draft ids map to the same target ids as mlx-vlm's d2t.
    ids = head.draft_to_target[mx.argmax(mx.array(chain), axis=-1)]
    assert np.array(ids).tolist() == ref[f"{layout}_target_ids_chain"].tolist()
    assert int(mx.max(head.draft_to_target)) > head.config.draft_vocab_size  # d2t is not the identity


def test_the_layouts_read_their_published_config_fields():
    spec = config_from_dict(json.loads((FIXTURE / "speculators" / "config.json").read_text()))
    eagle = config_from_dict(json.loads((FIXTURE / "eagle" / "config.json").read_text()))
    assert spec.norm_before_residual and not eagle.norm_before_residual
    assert spec.layer_ids == [1, 2, 3] and eagle.layer_ids is None
    assert (spec.draft_vocab_size, spec.vocab_size, spec.num_key_value_heads) == (40, 97, 2)
    assert (eagle.draft_vocab_size, eagle.vocab_size, eagle.head_dim) == (40, 97, 16)
    # vLLM reads a speculators head without the field as norm_before_residual=true.
    d = json.loads((FIXTURE / "speculators" / "config.json").read_text())
    del d["norm_before_residual"]
    assert config_from_dict(d).norm_before_residual


def test_a_head_without_layer_ids_taps_eagle3s_default_layers(target):
    head = load_drafter(FIXTURE / "eagle", dtype="float32")
    assert default_layer_ids(32) == [2, 16, 29]
    assert head.config.taps_for(8) == (1, 3, 4)
    assert head.bind(target).taps == (1, 1, 0)  # [2, 2, 1] for 4 layers
    assert fit_problem(head.config, 64, 97, 4) is None
    assert "3 layers" not in (fit_problem(head.config, 64, 97, 2) or "")
    assert "hidden states" in fit_problem(head.config, 64, 97, 2)


def test_saved_in_the_speculators_layout_and_read_back_the_same(tmp_path, ref, target):
    head = load_drafter(FIXTURE / "eagle", dtype="float32").bind(target)
    out = save_eagle3(head, tmp_path / "saved", extra_config={"training": {"steps": 1}})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1 and cfg["norm_before_residual"] is False
    assert cfg["training"] == {"steps": 1}
    tensors = mx.load(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors  # the target's embedding: vLLM and mlx-vlm read the target's too
    assert "layers.0.self_attn.q_proj.weight" in tensors and not any(k.startswith("midlayer") for k in tensors)
    assert tensors["d2t"].dtype == mx.int64 and tensors["t2d"].dtype == mx.bool_
    assert int(tensors["t2d"].sum()) == 40
    again = read_eagle3(out, dtype="float32").bind(target)
    first, chain = run_chain(again, ref)
    np.testing.assert_allclose(chain, ref["eagle_logits_chain"], rtol=1e-4, atol=1e-4)


def test_a_pickled_head_is_read_through_load_drafter_only(tmp_path):
    """draft/ reads safetensors; the pickle reader (hub/, the converters) is what load_drafter adds."""
    with pytest.raises(RedrafterError, match="load_drafter"):
        read_eagle3(FIXTURE / "eagle")


def test_a_head_without_an_embedding_says_to_bind_it(ref):
    head = load_drafter(FIXTURE / "eagle", dtype="float32")
    with pytest.raises(RedrafterError, match="bind"):
        head(mx.array(ref["tokens"]), mx.array(ref["taps"]))


def _copy(tmp_path, layout="speculators") -> Path:
    return Path(shutil.copytree(FIXTURE / layout, tmp_path / layout))


def test_damaged_heads_are_refused_with_the_problem_named(tmp_path):
    folder = _copy(tmp_path)
    weights = mx.load(str(folder / "model.safetensors"))
    bad = {k: v for k, v in weights.items() if k != "norm.weight"}
    mx.save_safetensors(str(folder / "model.safetensors"), bad)
    with pytest.raises(RedrafterError, match="missing keys: norm.weight"):
        read_eagle3(folder)
    bad = {**weights, "fc.weight": mx.zeros((64, 100))}
    mx.save_safetensors(str(folder / "model.safetensors"), bad)
    with pytest.raises(RedrafterError, match=r"fc.weight .* shape \(64, 100\)"):
        read_eagle3(folder)
    t2d = np.array(weights["t2d"])
    t2d[np.argmax(~t2d)] = True  # one target id too many
    mx.save_safetensors(str(folder / "model.safetensors"), {**weights, "t2d": mx.array(t2d)})
    with pytest.raises(RedrafterError, match="t2d map that does not match"):
        read_eagle3(folder)


def test_unsupported_configs_are_refused(tmp_path):
    folder = _copy(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["transformer_layer_config"]["num_hidden_layers"] = 2
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RedrafterError, match="2 decoder layers"):
        read_eagle3(folder)
    cfg["transformer_layer_config"].update(num_hidden_layers=1, hidden_act="gelu")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RedrafterError, match="gelu"):
        read_eagle3(folder)


# --------------------------------------------------------------------------- the store, the Hub, load_drafter


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hugging Face cache (as `hf download` leaves it) and a drafter store of this test's own."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / "cache"))
    return cache


def cache_repo(cache: Path, repo: str, folder: Path, commit: str = "0123456789abcdef0123456789abcdef01234567"):
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    shutil.copytree(folder, root / "snapshots" / commit)


def test_a_hub_head_in_the_eagle_layout_is_converted_once_into_the_speculators_layout(hub, ref, target):
    from mlx_redrafter import load_drafter
    from mlx_redrafter.draft.redrafter import check_fits

    cache_repo(hub, "someone/EAGLE3-tiny", FIXTURE / "eagle")
    messages = []
    from mlx_redrafter.hub.locate import locate

    found = locate("someone/EAGLE3-tiny", say=messages.append)
    assert "converted" in found.source and any("Converting the EAGLE-3 head" in m for m in messages)
    cfg = json.loads((found.path / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["torch_dtype"] == "float32"
    assert locate("someone/EAGLE3-tiny", say=messages.append).path == found.path  # once: the store's copy after
    head = load_drafter("someone/EAGLE3-tiny", dtype="float32")
    assert isinstance(head, Eagle3Head)
    check_fits(head, target)  # binds it: the target's embedding, its taps
    _, chain = run_chain(head, ref)
    np.testing.assert_allclose(chain, ref["eagle_logits_chain"], rtol=1e-4, atol=1e-4)


def test_a_stored_head_is_found_for_its_model_and_bound_to_it(hub, target):
    from mlx_redrafter.hub import store
    from mlx_redrafter.llm.identity import model_identity

    identity = model_identity(target)
    path = store.install(FIXTURE / "speculators", identity, {"source": "test"})
    head, found = store.drafter_for(target)
    assert found.path == path and found.exact and isinstance(head, Eagle3Head)
    assert head.taps == (0, 1, 2)
    other = tiny_model("llama", num_hidden_layers=2)  # a model whose layers the head's taps do not fit
    with pytest.raises(RedrafterError, match="hidden states"):
        store.install(FIXTURE / "speculators", model_identity(other), {"source": "test"})


def test_last_gives_the_last_positions_logits_alone(ref):
    head = read_eagle3(FIXTURE / "speculators", dtype="float32")
    logits, hidden = head(mx.array(ref["tokens"]), mx.array(ref["taps"]), head.make_cache(), last=True)
    assert logits.shape == (1, 1, 40) and hidden.shape == (1, 7, 64)
    np.testing.assert_allclose(np.array(logits[0, 0]), ref["speculators_logits_first"][0, -1], rtol=1e-4, atol=1e-4)
