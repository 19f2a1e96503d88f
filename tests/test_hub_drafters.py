"""Drafters from the Hugging Face Hub (hub/locate.py) and ``upload``
(hub/publish.py), without a network: a Hub cache is made in a temp folder
(``HF_HUB_CACHE``, offline) as ``hf download`` leaves it, with this
project's layout and the official PyTorch one (written by torch_format.py,
without torch). The upload itself cannot reach the Hub here: ``HfApi``'s
methods are replaced and what they were called with is checked.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    assert_exact_under_drafting,
    bigram_drafter,
    bigram_model,
    cli,
    drafted_share,
    save_bigram_drafter,
    save_tiny_folder,
)
from mlx.utils import tree_flatten
from torch_format import write_zip

from mlx_redrafter import load_drafter
from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.hub import publish
from mlx_redrafter.hub import store as st

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPT = "w1 w2 w3 w1 w2 w3 w1"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model the drafters here predict (their drafts are accepted)."""
    return save_tiny_folder(tmp_path_factory.mktemp("hub-models") / "tiny", bigram=True)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hugging Face cache and a drafter store of this test's own."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / "cache"))
    return cache


def cache_repo(cache, repo: str, folder, commit: str = COMMIT):
    """``folder``'s files as the snapshot of ``repo`` at ``commit`` (the layout `hf download` leaves)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    shutil.copytree(folder, root / "snapshots" / commit)
    return root


def full_meta(identity) -> dict:
    return {
        "format": 1,
        "source": "make-drafter",
        "base_model": identity.to_dict(),
        "data": {"prompts": "sharegpt", "private": False, "conversations": 1234, "positions": 456789, "tokens": 123456},
        "recipe": {
            "command": "mlx-redrafter make-drafter --model tiny --minutes 90",
            "stages": {"distill": {"minutes": 50.1}, "train": {"minutes": 25.0, "steps": 4000}},
            "train": {"exit_dim": 576, "draft_vocab_size": 8192},
        },
        "acceptance": {"held_out": {"positions": 5000, "by_depth": [0.61, 0.38], "tokens_per_step": 1.9}},
        "verdict": {
            "date": "2026-12-01",
            "device": "cpu, Linux x86_64, 2 cores, BLIS",
            "commit": "abc1234",
            "prompts": 8,
            "max_tokens": 96,
            "plain": {"tokens_per_second": 12.0},
            "lookup": {"speedup": 1.02, "tokens_per_step": 1.1},
            "drafter": {"speedup": 1.15, "tokens_per_step": 1.8, "beam_width": 2, "beam_length": 1},
            "identical": True,
            "installed": True,
            "reason": "1.15x against lookup's 1.02x",
        },
    }


def staged_drafter(tmp_path, tiny, **data):
    """A drafter with full META, staged by `upload` (what its repo on the Hub holds)."""
    from mlx_redrafter.llm.load import identity_for_spec

    folder = save_bigram_drafter(tmp_path / "made")
    identity = identity_for_spec(str(tiny))
    meta = full_meta(identity)
    meta["data"].update(data)
    (folder / st.META).write_text(json.dumps(meta))
    return folder, identity


# --------------------------------------------------------------------------- fetching


def test_an_mlx_drafter_from_the_hub_is_kept_in_the_store_and_drafts(hub, tiny, tmp_path, capsys):
    made, identity = staged_drafter(tmp_path, tiny)
    cache_repo(hub, "someone/tiny-drafter", publish.stage(made, "someone/tiny-drafter", tmp_path / "up"))
    d = load_drafter("someone/tiny-drafter")
    path = d.source_path
    assert path == st.store_root() / identity.family / "someone--tiny-drafter"
    meta = st.read_meta(path)
    assert meta["source"] == "hub:someone/tiny-drafter" and meta["hub"] == {
        "repo": "someone/tiny-drafter",
        "revision": COMMIT,
    }
    assert meta["base_model"]["fingerprint"] == identity.fingerprint
    stamp = (path / st.META).stat().st_mtime_ns
    assert load_drafter("someone/tiny-drafter").source_path == path and (path / st.META).stat().st_mtime_ns == stamp
    # Fetched for a model it names: the tools find it for that model without a flag.
    assert st.find(identity).path == path
    gen = ["generate", "--model", str(tiny), "--prompt", PROMPT, "-n", "12", "--raw"]
    assert cli(gen + ["--no-draft"]) == 0
    plain = capsys.readouterr().out
    assert cli(gen + ["--drafter", "someone/tiny-drafter"]) == 0
    got = capsys.readouterr()
    assert got.out == plain and "(hub:someone/tiny-drafter)" in "".join(got.err.split())
    assert drafted_share(got.err) > 0  # the same output, with the fetched drafter's drafts accepted


def torch_repo(tmp_path, layout: str):
    """A drafter in the official PyTorch code's layout, and its weights."""
    drafter = bigram_drafter(bigram_model())
    tensors = {k: np.array(v) for k, v in tree_flatten(drafter.parameters())}
    folder = tmp_path / f"torch-{layout}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**drafter.config.to_dict(), "torch_dtype": "float32"}))
    if layout == "bin":
        write_zip(folder / "pytorch_model.bin", tensors)
    else:  # torch-named safetensors shards, listed by an index
        name = "model-00001-of-00001.safetensors"
        mx.save_safetensors(str(folder / name), {k: mx.array(v) for k, v in tensors.items()}, {"format": "pt"})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: name for k in tensors}}))
    return folder, tensors


@pytest.mark.parametrize("layout", ["bin", "shards"])
def test_a_pytorch_drafter_from_the_hub_is_converted_once(hub, tiny, tmp_path, capsys, layout):
    from mlx_redrafter.llm.load import load_model

    folder, tensors = torch_repo(tmp_path, layout)
    cache_repo(hub, "apple/redrafter-tiny", folder)
    d = load_drafter("apple/redrafter-tiny", dtype="float32")
    assert "Converting the PyTorch drafter apple/redrafter-tiny" in capsys.readouterr().err
    for k, v in tree_flatten(d.parameters()):
        np.testing.assert_array_equal(np.array(v), tensors[k])
    meta = st.read_meta(d.source_path)
    assert (
        meta["source"] == "converted from hub:apple/redrafter-tiny" and d.source_path.parent.name == st.UNKNOWN_FAMILY
    )
    assert load_drafter("apple/redrafter-tiny").source_path == d.source_path
    assert "Converting" not in capsys.readouterr().err  # once
    model, tok = load_model(str(tiny))
    assert st.find(st.model_identity(model)) is None  # its base model is not known: used only when named
    # Lookup off: on this repeating prompt its rows would take the credit for what the drafter also drafted.
    assert_exact_under_drafting(
        model, tok, PROMPT, max_tokens=12, drafter=d, lookup=False, min_accepted=2, source="drafter"
    )


def test_not_cached_offline_is_one_clear_error(hub, tiny, capsys):
    with pytest.raises(RedrafterError, match="not in the Hugging Face cache") as e:
        load_drafter("nobody/nothing")
    assert "hf download nobody/nothing" in e.value.fix
    assert cli(["generate", "--model", str(tiny), "--drafter", "nobody/nothing", "--prompt", "w1"]) == 1
    err = capsys.readouterr().err
    assert "hf download nobody/nothing" in err and "Traceback" not in err


def test_a_model_repo_is_not_fetched_as_a_drafter(hub, tiny):
    cache_repo(hub, "someone/a-model", tiny)
    with pytest.raises(RedrafterError, match="not a ReDrafter drafter") as e:
        load_drafter("someone/a-model")
    assert "make-drafter --model someone/a-model" in e.value.fix


def test_the_store_keeps_a_fetched_drafter_when_the_cache_is_gone(hub, tiny, tmp_path, capsys):
    made, _ = staged_drafter(tmp_path, tiny)
    root = cache_repo(hub, "someone/tiny-drafter", made)
    path = load_drafter("someone/tiny-drafter").source_path
    shutil.rmtree(root)
    assert load_drafter("someone/tiny-drafter").source_path == path
    assert "using the copy of someone/tiny-drafter in the store" in capsys.readouterr().err


# --------------------------------------------------------------------------- the model card and upload


def test_the_model_card_says_what_the_drafter_knows(tiny, tmp_path):
    _, identity = staged_drafter(tmp_path, tiny)
    meta = full_meta(st.ModelIdentity(**{**identity.to_dict(), "id": "org/Model-1B"}))
    card = publish.model_card(meta, "me/model-1b-redrafter")
    front, body = card.split("\n---\n", 1)
    assert front.startswith("---\n")
    assert "library_name: mlx-redrafter" in front and "base_model: org/Model-1B" in front and "- redrafter" in front
    for text in (
        identity.fingerprint,
        identity.family,
        "hidden size 64, vocabulary 97",  # the base model
        "prompts: sharegpt",
        "conversations: 1,234",
        "training positions: 456,789",  # the data
        "mlx-redrafter make-drafter --model tiny --minutes 90",
        "distill: minutes 50.1",
        "draft_vocab_size=8192",
        "positions: 5,000",
        "1: 0.61, 2: 0.38",
        "tokens per step: 1.90",  # held-out acceptance
        "cpu, Linux x86_64, 2 cores, BLIS",
        "| drafter (W=2 L=1) |  | 1.15x | 1.8 |",
        "| plain | 12.0 |",
        "Output identical to plain decoding: yes",
        "mlx-redrafter chat --model org/Model-1B --drafter me/model-1b-redrafter",
    ):
        assert text in body, text
    # A local base model is named in the text, not as a Hub base_model.
    assert "base_model" not in publish.model_card({"base_model": {"id": "tiny"}}, "me/x").split("\n---\n")[0]
    assert "Not recorded" in publish.model_card({}, "me/x")


@pytest.fixture
def hf_api(monkeypatch):
    """HfApi's two calls, recorded instead of sent (the Hub cannot be reached from here)."""
    from huggingface_hub import HfApi

    calls = []

    def create_repo(self, **kw):
        calls.append(("create_repo", kw))

    def upload_folder(self, **kw):
        from pathlib import Path

        folder = Path(kw["folder_path"])
        calls.append(
            (
                "upload_folder",
                {**kw, "files": sorted(p.name for p in folder.iterdir()), "card": (folder / "README.md").read_text()},
            )
        )

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return calls


def test_upload_creates_the_repo_and_uploads_the_folder_with_its_card(hf_api, tiny, tmp_path, capsys):
    made, identity = staged_drafter(tmp_path, tiny)
    (made / "train_log.jsonl").write_text("{}\n")  # names local folders: not uploaded
    assert cli(["upload", str(made), "--repo", "me/tiny-redrafter", "--private"]) == 0
    (name, create), (name2, up) = hf_api
    assert name == "create_repo" and create == {
        "repo_id": "me/tiny-redrafter",
        "repo_type": "model",
        "private": True,
        "exist_ok": True,
    }
    assert name2 == "upload_folder" and up["repo_id"] == "me/tiny-redrafter" and up["repo_type"] == "model"
    assert up["files"] == ["README.md", "config.json", "model.safetensors", st.META]
    assert identity.fingerprint in up["card"] and "library_name: mlx-redrafter" in up["card"]
    assert "https://huggingface.co/me/tiny-redrafter" in capsys.readouterr().err


def test_upload_refuses_private_data_unless_asked(hf_api, tiny, tmp_path, capsys):
    made, _ = staged_drafter(tmp_path, tiny, prompts="history", private=True)
    for extra in ([], ["--dry-run", "--out", str(tmp_path / "dry")]):
        assert cli(["upload", str(made), "--repo", "me/mine", *extra]) == 1
        err = capsys.readouterr().err
        assert "your own conversations" in err and "--include-private-data" in err
    assert hf_api == [] and not (tmp_path / "dry").exists()
    assert cli(["upload", str(made), "--repo", "me/mine", "--include-private-data"]) == 0
    assert [c[0] for c in hf_api] == ["create_repo", "upload_folder"]
    assert "the user's own conversations" in hf_api[1][1]["card"]


def test_upload_dry_run_writes_the_folder_and_prints_the_card(hf_api, tiny, tmp_path, capsys):
    made, identity = staged_drafter(tmp_path, tiny)
    out = tmp_path / "dry"
    assert cli(["upload", str(made), "--repo", "me/tiny-redrafter", "--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == (out / "README.md").read_text().strip() and identity.fingerprint in printed.out
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors", st.META]
    assert "nothing uploaded" in printed.err and hf_api == []
    assert cli(["upload", str(made), "--repo", "not-a-repo", "--dry-run"]) == 1
