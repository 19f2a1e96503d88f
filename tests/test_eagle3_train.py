"""Training an EAGLE-3 head (issue 45): training-time test equals the head's
own cached inference, and a head trains end to end on distilled data of a
tiny model, saved in the speculators layout, resumable."""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import save_tiny_folder

from mlx_redrafter.draft.eagle3_io import read_eagle3
from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.train.ttt import ttt_logits

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "eagle3"
WORDS = [f"w{i}" for i in range(5, 90)]


def test_training_time_test_is_the_heads_own_chained_inference():
    """Step k at origin i equals: the head's cache over the taps of positions 0..i,
    then k - 1 chained calls on its own state with the next tokens."""
    head = read_eagle3(FIXTURE / "speculators", dtype="float32")
    mx.random.seed(0)
    S, D = 6, 4
    taps = mx.random.normal((1, S, 192))
    tokens = mx.random.randint(0, 97, (1, S + D - 1))
    steps = ttt_logits(head, taps, tokens, D)
    for i in range(S):
        cache = head.make_cache()
        logits, hidden = head(tokens[:, : i + 1], taps[:, : i + 1], cache, first=True)
        assert mx.allclose(logits[:, -1], steps[0][:, i], atol=1e-5)
        hidden = hidden[:, -1:]
        for k in range(1, D):
            logits, hidden = head(tokens[:, i + k : i + k + 1], hidden, cache, first=False)
            assert mx.allclose(logits[:, -1], steps[k][:, i], atol=1e-5), (i, k)
    assert not mx.allclose(steps[1], steps[2])


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """A tiny model and its distilled data with the head's taps."""
    from mlx_redrafter.llm.load import load_model
    from mlx_redrafter.train.distill import DistillConfig, distill
    from mlx_redrafter.train.eagle3_trainer import distill_layers

    root = tmp_path_factory.mktemp("eagle3-train")
    folder = save_tiny_folder(root / "model")
    rng = random.Random(0)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(80):
            f.write(json.dumps({"id": f"c{i}", "turns": [" ".join(rng.choice(WORDS) for _ in range(8))]}) + "\n")
    model, tok = load_model(str(folder))
    cfg = DistillConfig(batch_size=8, max_new_tokens=16, feature_layers=distill_layers(len(model.model.layers)))
    distill(str(folder), root / "prompts.jsonl", root / "data", cfg, model, tok)
    plain = DistillConfig(batch_size=8, max_new_tokens=8, max_conversations=8)
    distill(str(folder), root / "prompts.jsonl", root / "plain", plain, model, tok)
    return model, tok, root


def test_a_head_trains_on_distilled_data_and_resumes(distilled, tmp_path):
    from mlx_redrafter.train.eagle3_trainer import Eagle3TrainConfig, train_eagle3
    from mlx_redrafter.train.trainer import LOG, checkpoint_state

    model, tok, root = distilled
    cfg = Eagle3TrainConfig(
        max_steps=30,
        eval_every=15,
        checkpoint_every=15,
        batch_size=4,
        window=32,
        eval_fraction=0.1,
        draft_vocab_size=48,
    )
    out = train_eagle3(model, root / "data", tmp_path / "head", cfg, eos_ids=sorted(tok.eos_token_ids))
    log = [json.loads(x) for x in (out / LOG).read_text().splitlines()]
    evals = [r for r in log if "eval_acc" in r]
    assert len(evals) == 2 and len(evals[-1]["eval_acc"]) == cfg.depth
    assert evals[-1]["train_loss"] < evals[0]["train_loss"]  # it learns
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 48
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 1, 1]  # a 2-layer model: [2, L // 2, max(1, L - 3)]
    head = read_eagle3(out, dtype="float32").bind(model)
    assert set(tok.eos_token_ids) <= set(mx.array(head.draft_to_target).tolist())  # EOS is always draftable
    assert checkpoint_state(out)["step"] == 30
    more = train_eagle3(
        model, root / "data", out, Eagle3TrainConfig(max_steps=40), resume=True, extend=True
    )  # the checkpoint's settings, this call's budget
    assert checkpoint_state(more)["step"] == 40 and checkpoint_state(more)["config"]["window"] == 32


def test_data_without_the_heads_taps_is_refused(distilled, tmp_path):
    from mlx_redrafter.train.eagle3_trainer import Eagle3TrainConfig, train_eagle3

    model, _, root = distilled
    with pytest.raises(RedrafterError, match=r"(?s)outputs of layers \[1, 0, 0\].*--feature-layers 1,0,0"):
        train_eagle3(model, root / "plain", tmp_path / "head", Eagle3TrainConfig(max_steps=1))


# --------------------------------------------------------------------------- make-drafter --head


@pytest.fixture(scope="module")
def tiny_prompts(distilled):
    _, _, root = distilled
    return root / "model", root / "prompts.jsonl"


def _recipe(tiny_prompts, out, head, **kw):
    from mlx_redrafter.train.budget import Sizes
    from mlx_redrafter.train.recipe import RecipeConfig

    folder, prompts = tiny_prompts
    sizes = Sizes(controller_prompts=2, controller_tokens=16, verdict_prompts=2, verdict_tokens=16, calibrate_s=0.3)
    return RecipeConfig(
        model=str(folder),
        minutes=1.0,
        out=out,
        prompts=str(prompts),
        max_conversations=30,
        sizes=sizes,
        distill={"batch_size": 8, "max_new_tokens": 12},
        train={"batch_size": 32, "max_steps": 10},
        eagle3={"batch_size": 4, "window": 32, "max_steps": 10, "draft_vocab_size": 48},
        head=head,
        **kw,
    )


def _stop_at(stage):
    def progress(status):
        if status.stage == stage and status.line is None:
            raise KeyboardInterrupt

    return progress


@pytest.mark.parametrize("head", ["eagle3", "auto"])
def test_make_drafter_distils_the_taps_and_trains_the_heads_it_is_asked_for(tiny_prompts, tmp_path, monkeypatch, head):
    from mlx_redrafter.train.recipe import make_drafter
    from mlx_redrafter.train.recipe_state import STATE
    from mlx_redrafter.train.shards import read_corpus

    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "work"
    with pytest.raises(KeyboardInterrupt):  # stopped when the stages after training begin
        make_drafter(_recipe(tiny_prompts, out, head), progress=_stop_at("controller"))
    state = json.loads((out / STATE).read_text())
    assert state["head"] == {"head": head} and "train" in state["done"]
    assert state["rates"]["eagle3_positions_per_s"] > 0
    assert (state["rates"]["train_steps_per_s"] > 0) == (head == "auto")
    corpus = read_corpus(out / "data")
    assert corpus.feature_layers == [1, 0, 0] and corpus.extra["features"].shape[1] == 3 * 64
    config = json.loads((out / "eagle3" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"] and config["draft_vocab_size"] == 48
    assert (out / "drafter" / "model.safetensors").is_file() == (head == "auto")
    # The folder is for this head: another --head is refused before anything runs.
    from mlx_redrafter.errors import RedrafterError

    with pytest.raises(RedrafterError, match="head settings"):
        make_drafter(_recipe(tiny_prompts, out, "redrafter"))


def test_an_unknown_head_is_refused_by_the_command(tiny_prompts, tmp_path, capsys):
    from helpers import cli

    folder, prompts = tiny_prompts
    code = cli(["make-drafter", "--model", str(folder), "--minutes", "1", "--head", "medusa", "--out", str(tmp_path)])
    assert code != 0 and "Unknown --head 'medusa'" in capsys.readouterr().err
