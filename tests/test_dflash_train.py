"""Training a DFlash drafter (issue 56): the training forward (random anchor
blocks, bidirectional inside a block, causal across blocks) is the
drafter's own inference, a drafter trains on distilled data and resumes,
and ``make-drafter --head dflash`` runs end to end: its verdict measures the
drafter drafting, and ``generate --drafter`` accepts its drafts."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import cli
from test_dflash_parity import FIXTURE, _target
from test_eagle3_train import distilled  # noqa: F401 (a fixture: a tiny model and its data with the taps)

from mlx_redrafter.hub.load import load_drafter
from mlx_redrafter.train.dflash_blocks import train_hidden
from mlx_redrafter.train.dflash_trainer import DFlashTrainConfig, train_dflash


def test_the_training_forward_is_the_drafters_own_inference():
    """Each block of a training window (its anchor anywhere, others beside it)
    gets the states the drafter gives at inference: the context of the
    positions before the anchor cached, then the block."""
    ref = mx.load(str(FIXTURE / "reference.safetensors"))
    drafter = load_drafter(FIXTURE / "drafter", dtype="float32").bind(_target(ref))
    mx.random.seed(3)
    s, k = 9, 5
    taps = mx.random.normal((2, s, 96))
    anchors = mx.array([[1, 4, 8], [6, 2, 3]], mx.int32)
    blocks = mx.random.randint(0, 48, (2, 3, k)).astype(mx.int32)
    got = train_hidden(drafter, taps, blocks, anchors).reshape(2, 3, k, -1)
    for b in range(2):
        for n in range(3):
            a = int(anchors[b, n])
            cache = drafter.make_cache()
            drafter.context(taps[b : b + 1, :a], cache)
            want = drafter.hidden(blocks[b : b + 1, n], cache)[0]
            assert mx.allclose(got[b, n], want, atol=1e-4, rtol=1e-4), (b, n)


def test_a_drafter_trains_on_distilled_data_and_resumes(distilled, tmp_path):  # noqa: F811
    model, _, root = distilled
    cfg = DFlashTrainConfig(max_steps=4, eval_every=2, batch_size=2, window=32, anchors=4, block_size=4)
    out = train_dflash(model, root / "data", tmp_path / "d", cfg)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] == [1, 0, 0]  # the distilled taps, in their order
    assert config["num_hidden_layers"] == 1  # a 2-layer model gets the smallest drafter
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "eval_acc" in r] == [2, 4] and len(log[-1]["eval_acc"]) == 3
    drafter = load_drafter(out, dtype="float32")
    counts = np.bincount(read_tokens(root), minlength=97)
    assert counts[drafter.config.mask_token_id] == counts.min()  # the data's rarest token (every one occurs)
    more = DFlashTrainConfig(**{**cfg.__dict__, "max_steps": 6})
    train_dflash(model, root / "data", tmp_path / "d", more, resume=True, extend=True)
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 6


def read_tokens(root):
    from mlx_redrafter.train.shards import read_corpus

    return read_corpus(root / "data").tokens


def test_data_without_the_taps_is_refused(distilled, tmp_path):  # noqa: F811
    from mlx_redrafter.errors import RedrafterError

    model, _, root = distilled
    with pytest.raises(RedrafterError, match="--feature-layers 1,0,0"):
        train_dflash(model, root / "plain", tmp_path / "d", DFlashTrainConfig(max_steps=1))


def test_make_drafter_head_dflash_trains_a_drafter_that_drafts(tmp_path, monkeypatch, capsys):
    """``make-drafter --head dflash`` on the bigram model: its verdict measures
    the drafter drafting (exact, more than one token per step), it is saved in
    z-lab's layout, and ``generate --drafter`` pointed at it drafts exactly,
    its drafts accepted."""
    import random

    from helpers import drafted_share, save_tiny_folder

    from mlx_redrafter.train.budget import Sizes
    from mlx_redrafter.train.recipe import RecipeConfig, make_drafter

    folder = save_tiny_folder(tmp_path / "model", bigram=True, num_hidden_layers=4)
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / "cache"))
    rng, words = random.Random(0), [f"w{i}" for i in range(5, 90)]
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"id": f"c{i}", "turns": [" ".join(rng.choice(words) for _ in range(8))]}) + "\n")
    sizes = Sizes(controller_prompts=2, controller_tokens=16, verdict_prompts=3, verdict_tokens=24, calibrate_s=0.3)
    dflash = dict(batch_size=4, window=32, anchors=8, block_size=4, max_steps=150, lr=3e-3, warmup_steps=5)
    cfg = RecipeConfig(
        model=str(folder),
        minutes=30.0,  # the budget never ends training first: max_steps does (deterministic on a busy machine)
        out=tmp_path / "work",
        prompts=str(tmp_path / "prompts.jsonl"),
        max_conversations=60,
        sizes=sizes,
        distill={"batch_size": 8, "max_new_tokens": 24},
        dflash=dflash,
        head="dflash",
    )
    report = make_drafter(cfg)
    measured = report.verdict["dflash"]
    assert measured["identical_outputs"] == 3 and measured["tokens_per_step"] > 1.2, measured
    assert (measured["beam_width"], measured["beam_length"]) == (1, 3)  # its trained block as one chain
    assert measured["tree"] == "auto"  # a block is long: the cost curve decides how much of it to verify
    head = tmp_path / "work" / "dflash"
    from mlx_redrafter.train.trainer import checkpoint_state

    assert checkpoint_state(head)["step"] == 150  # every step it was given, whatever the machine's speed
    assert json.loads((head / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    base = ["generate", "--temp", "0", "--raw", "-n", "30", "--model", str(folder), "-p", "w5 w9 w11 w3 w20"]
    assert cli(base + ["--no-draft"]) == 0
    plain = capsys.readouterr().out
    assert cli(base + ["--drafter", str(head), "--no-lookup", "--tree", "fixed"]) == 0  # every drafted node
    out = capsys.readouterr()
    assert out.out == plain
    assert drafted_share(out.err) > 0.05
