"""The commands and the library find and name the stateful sources: a model
folder that ships an MTP head drafts with it by default, `--draft-model`,
`drafters list`, the refusals, serve's stats and metrics."""

from __future__ import annotations

import json
import re
import shutil

import mlx.core as mx
import pytest
from helpers import cli, save_tiny_folder, squeeze
from mlx.utils import tree_flatten
from test_sources import pass_through_head, repeating_target

from mlx_redrafter.config import DraftConfig
from mlx_redrafter.errors import RedrafterError


@pytest.fixture(scope="module")
def mimo_folder(tmp_path_factory):
    """A tiny MiMo checkpoint folder whose safetensors keep the MTP layer
    (``model.mtp_layers.0.*``, the layout MiMo ships), with the word-level
    tokenizer of the helpers' tiny llama (same vocabulary)."""
    from test_sources import MIMO

    folder = save_tiny_folder(tmp_path_factory.mktemp("mimo") / "m")
    target = repeating_target(0.02)
    head = pass_through_head(target)
    weights = dict(tree_flatten(target.parameters()))
    names = {
        "pre_fc_norm_embedding": "token_layernorm",
        "pre_fc_norm_hidden": "hidden_layernorm",
        "fc": "input_proj",
        "norm": "final_layernorm",
    }
    for k, v in tree_flatten(head.parameters()):
        top, rest = k.split(".", 1)
        key = rest[2:] if top == "layers" else f"{names[top]}.{rest}"  # layers.0.x -> x
        weights[f"model.mtp_layers.0.{key}"] = v
    for f in [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json")]:
        f.unlink()
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(MIMO))
    return folder


def _share(words: str, source: str) -> float:
    """The share of tokens a command printed for ``source`` (``"... from drafts (0% drafter, 40% mtp, ...)"``)."""
    found = re.findall(rf"(\d+)% {re.escape(source)}\b", words)
    assert found, f"no share for {source} in: {words}"
    return int(found[-1]) / 100


def _generate(capsys, *args):
    code = cli(["generate", "--temp", "0", "--raw", "-n", "24", *args])
    out = capsys.readouterr()
    return code, out.out, squeeze(out.err), " ".join(out.err.split())


def test_a_model_that_ships_an_mtp_head_drafts_with_it(mimo_folder, capsys):
    code, plain, _, _ = _generate(capsys, "--model", str(mimo_folder), "--no-draft", "-p", "w5 w9 w11")
    assert code == 0
    code, out, err, words = _generate(capsys, "--model", str(mimo_folder), "-p", "w5 w9 w11")
    assert code == 0 and out == plain and _share(words, "mtp") >= 0.2  # 33% measured
    assert "1 MTP guess of 2 tokens + 1 copy from the context per step" in words
    assert "MTP head: mimo MTP head, 1 layer (checkpoint" in words
    code, out, _, words = _generate(capsys, "--model", str(mimo_folder), "--mtp", "none", "-p", "w5 w9 w11")
    assert code == 0 and out == plain and "MTP" not in words
    code, out, _, words = _generate(capsys, "--model", str(mimo_folder), "--mtp-depth", "3", "-p", "w5 w9 w11")
    assert code == 0 and out == plain and "1 MTP guess of 3 tokens" in words and _share(words, "mtp") >= 0.2


def test_a_draft_model_joins_from_the_command_line(mimo_folder, tmp_path, capsys):
    """The draft model is the target's leak-free copy (same tokenizer and
    embeddings): right most of the time, so its drafts are accepted."""
    sibling = save_tiny_folder(tmp_path / "sibling")  # the tokenizer; its weights are replaced
    for f in sibling.glob("*.safetensors*"):
        f.unlink()
    weights = dict(tree_flatten(repeating_target(0.0).parameters()))
    mx.save_safetensors(str(sibling / "model.safetensors"), weights, {"format": "mlx"})
    shutil.copy(mimo_folder / "config.json", sibling / "config.json")
    code, plain, _, _ = _generate(capsys, "--model", str(mimo_folder), "--no-draft", "-p", "w5 w9")
    args = ["--model", str(mimo_folder), "--mtp", "none", "--draft-model", str(sibling), "--num-draft-tokens", "2"]
    code, out, _, words = _generate(capsys, *args, "-p", "w5 w9")
    assert code == 0 and out == plain and _share(words, "draft-model") >= 0.1  # 21% measured
    assert "1 draft-model guess of 2 tokens" in words and f"draft model: {sibling}" in words


@pytest.mark.parametrize(
    "args, message",
    [
        (["--no-draft", "--draft-model", "x"], "--no-draft and --draft-model contradict each other"),
        (["--mtp", "none", "--mtp-depth", "2"], "--mtp none and --mtp-depth contradict each other"),
        (["--num-draft-tokens", "2"], "--num-draft-tokens needs --draft-model"),
        (["--mtp-depth", "0"], "--mtp-depth must be at least 1"),
    ],
)
def test_contradicting_source_flags_fail_before_the_load(capsys, args, message):
    code, _, err, _ = _generate(capsys, "--model", "/nowhere", "-p", "w1", *args)
    assert code == 1 and squeeze(message) in err


def test_a_draft_model_with_another_tokenizer_is_refused(mimo_folder, tmp_path):
    from mlx_redrafter.draft.draft_model import load_draft_model
    from mlx_redrafter.llm.load import load_model

    model, tokenizer = load_model(str(mimo_folder))
    other = save_tiny_folder(tmp_path / "other")
    vocab = json.loads((other / "tokenizer.json").read_text())
    words = vocab["model"]["vocab"]
    words["w1"], words["w2"] = words["w2"], words["w1"]  # one swap: another tokenizer
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    with pytest.raises(RedrafterError, match=r"maps 'w[12]' to [56] but the model's maps it to [56]"):
        load_draft_model(str(other), model, tokenizer)


def test_drafters_list_shows_the_models_mtp_head(mimo_folder, capsys):
    assert cli(["drafters", "list", "--model", str(mimo_folder)]) == 0
    out = capsys.readouterr().out
    assert "native MTP head (mimo, 1 layer)" in out and str(mimo_folder) in out


def test_the_library_uses_the_models_own_head_by_default(mimo_folder):
    """No ``mtp=``: the head the checkpoint ships drafts, and is accepted; the
    plain baseline (``mtp=None``, no drafter, no lookup) drafts nothing."""
    from helpers import assert_exact_under_drafting

    from mlx_redrafter import load_model, stream_generate

    model, tokenizer = load_model(str(mimo_folder))
    assert_exact_under_drafting(
        model, tokenizer, "w5 w9 w11", min_accepted=4, source="mtp", max_tokens=16, drafter=None
    )
    with pytest.raises(RedrafterError, match="Both draft= and mtp= were given"):
        list(stream_generate(model, tokenizer, "w5", draft=DraftConfig(), mtp=str(mimo_folder)))


def test_serve_drafts_a_lone_request_with_the_head_and_counts_it(mimo_folder):
    """A request alone drafts with the model's MTP head: its stats and
    ``/metrics`` count the tokens by source, ``/health`` names the head, and
    the reply equals the one without drafting."""
    from starlette.testclient import TestClient

    from mlx_redrafter.runtime import load_runtime
    from mlx_redrafter.serve import Engine
    from mlx_redrafter.serve.app import create_app

    body = {"model": str(mimo_folder), "messages": [{"role": "user", "content": "w5 w9 w11"}], "max_tokens": 16}
    replies = []
    for flags in ({}, {"no_draft": True}):
        rt = load_runtime(str(mimo_folder), **flags)
        with TestClient(create_app(Engine(rt, max_tokens=16)), base_url="http://127.0.0.1") as http:
            reply = http.post("/v1/chat/completions", json=body).json()
            replies.append(reply["choices"][0]["message"]["content"])
            if not flags:
                assert any(s.startswith("MTP head: mimo") for s in http.get("/health").json()["sources"])
                assert reply["redrafter"]["from_drafts_by_source"].get("mtp", 0) > 0
                metrics = http.get("/metrics").text
                line = next(
                    x
                    for x in metrics.splitlines()
                    if x.startswith('redrafter_draft_tokens_accepted_total{source="mtp"}')
                )
                assert float(line.split()[-1]) > 0
    assert replies[0] == replies[1]


def test_the_sweep_shapes_the_mtp_heads_beams_and_its_profile_is_used(mimo_folder, tmp_path, capsys):
    """``sweep --grid mtp``: the grid's lengths are the head's depths (each
    cell exact); a profile saved for the head sets the depth the tools use."""
    from mlx_redrafter.profiles import save_profile
    from mlx_redrafter.tuning import sweep as sw

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "a", "turns": ["w5 w9 w11"]}) + "\n")
    out = tmp_path / "sweep"
    args = ["sweep", "--model", str(mimo_folder), "--grid", "mtp", "--widths", "1", "--lengths", "1,3"]
    args += ["--prompts", str(prompts), "--num-prompts", "1", "-n", "12", "--tree", "fixed", "--no-lookup"]
    assert cli(args + ["--out", str(out)]) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["grid"] == "mtp"
    assert sorted(sw.cell_key(c) for c in results["cells"]) == [(1, 1, 0, "fixed"), (1, 3, 0, "fixed")]
    assert all(c["identical_outputs"] == 1 and c["tokens_per_step"] > 1 for c in results["cells"])
    capsys.readouterr()
    save_profile(str(mimo_folder), mimo_folder, 1, 3, lookup=0, tree="fixed", grid="mtp", speedup=1.2)
    code, _, _, words = _generate(capsys, "--model", str(mimo_folder), "-p", "w5 w9")
    assert code == 0 and "1 MTP guess of 3 tokens" in words
    code = cli(["sweep", "--model", str(mimo_folder), "--grid", "draft-model", "--out", str(tmp_path / "o")])
    assert code == 1 and "--grid draft-model needs --draft-model" in " ".join(capsys.readouterr().err.split())
