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
        dflash={"batch_size": 2, "window": 32, "anchors": 4, "block_size": 4, "max_steps": 10},
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
    assert (state["rates"]["dflash_positions_per_s"] > 0) == (head == "auto")  # --head auto trains DFlash too
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


# --------------------------------------------------------------------------- a head that is right often


def repeating_target(leak: float = 0.02):
    """A tiny 4-layer Llama whose layers add only ``leak`` times their outputs:
    its next token depends (mostly) on the current one, so a head can learn it."""
    from helpers import tiny_model

    model = tiny_model("llama", num_hidden_layers=4)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * leak
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * leak
    mx.eval(model.parameters())
    return model


def greedy_corpus(model, folder: Path, n: int = 40, seed: int = 0) -> Path:
    """Distilled data written in code: greedy replies to random prompts, with the head's taps."""
    import numpy as np

    from mlx_redrafter.generate import generate_tokens
    from mlx_redrafter.llm.parts import model_parts
    from mlx_redrafter.train.eagle3_trainer import distill_layers
    from mlx_redrafter.train.shards import Manifest, Sequence, write_shard

    layers = distill_layers(len(model.model.layers))
    _, backbone, _ = model_parts(model, layers)
    rng, seqs, h = np.random.default_rng(seed), [], model.args.hidden_size
    for k in range(n):
        prompt = rng.integers(0, 97, 5).tolist()
        full = prompt + generate_tokens(model, prompt, max_tokens=40)[0]
        wide = backbone(mx.array(full)[None])[0][:-1]  # position j produced full[j + 1]
        feats = {"features": np.array(wide[:, :-h].astype(mx.float16))}
        seqs.append(Sequence(f"c{k}", 0, 5, full[1:], np.array(wide[:, -h:].astype(mx.float16)), feats, 4))
    folder.mkdir(parents=True, exist_ok=True)
    config = {"feature_layers": layers, "top_k": 0, "prompt_positions": True}
    Manifest("tiny", "code", config, [write_shard(folder, 0, seqs)], sequences=n).save(folder)
    return folder


@pytest.fixture(scope="module")
def cycling(tmp_path_factory):
    """The repeating target and an EAGLE-3 head trained on its greedy replies."""
    from mlx_redrafter.train.eagle3_trainer import Eagle3TrainConfig, train_eagle3

    root = tmp_path_factory.mktemp("cycling")
    target = repeating_target()
    cfg = Eagle3TrainConfig(
        max_steps=60,
        eval_every=30,
        window=32,
        batch_size=8,
        eval_fraction=0.2,
        draft_vocab_size=None,
        lr=3e-3,
        warmup_steps=10,
    )
    out = train_eagle3(target, greedy_corpus(target, root / "data"), root / "head", cfg)
    return target, read_eagle3(out, dtype="float32").bind(target)


def test_the_controller_for_a_head_prices_each_depth_as_draft_calls(cycling, tmp_path, monkeypatch):
    import numpy as np

    import mlx_redrafter.train.head_controller as hc
    from mlx_redrafter.draft.controller import load_controller
    from mlx_redrafter.train.controller import step_cost
    from mlx_redrafter.train.head_controller import fit_head_controller, head_latency, record_head_episodes

    target, head = cycling
    prompts = [[5, 9, 11, 3, 7], [1, 2, 3, 4, 5], [40, 41, 42, 43, 44]]
    episodes = record_head_episodes(target, head, prompts, length=3, max_tokens=24)
    assert episodes.confidences.shape[1:] == (3, 10) and episodes.accepted.max() >= 2  # drafts are accepted
    assert (episodes.tree_sizes == [2, 3, 4]).all()  # one beam: depth d verifies d + 1 tokens
    latency = head_latency(target, head, 3, repeats=2)
    assert latency["draft_1"] < latency["draft_2"] < latency["draft_3"]  # each depth is one more call
    cost = step_cost(latency, episodes.tree_sizes[:1].astype(float))
    assert np.all(np.diff(cost[0]) > np.diff([latency[f"verify_{n}"] for n in (2, 3, 4)]))
    trained = []
    real = hc.train_and_save
    monkeypatch.setattr(hc, "train_and_save", lambda eps, *a: trained.append(eps) or real(eps, *a))
    fit = fit_head_controller(target, head, tmp_path, prompts, 3, 24, epochs=5)
    assert fit.steps == len(episodes.accepted)
    # It decides before each call: trained on the depths drafted before each decision (run time's DepthGate).
    seen = trained[0].confidences
    assert (seen[:, 0] == 0).all() and np.array_equal(seen[:, 1:], episodes.confidences[:, :-1])
    ctrl = load_controller(tmp_path)
    assert ctrl.config.beam_width == 1 and ctrl.config.beam_length == 3 and "draft_3" in ctrl.config.latency
    assert ctrl.config.before_call


class FakePasses:
    """The verdict's passes, injected (the rule decided by given numbers): each setting's tokens/s."""

    def __init__(self, **rates):
        self.rates = {"plain": 100.0, "plain again": 100.0, "lookup": 101.0, **rates}
        self.calls = []

    def __call__(self, name, draft, prompts, max_tokens):
        self.calls.append(name)
        return {"tokens_per_s": self.rates[name], "tokens_per_step": 1.5, "tokens": [[1, 2, 3] for _ in prompts]}


@pytest.mark.parametrize(
    "head, rates, chosen",
    [
        ("eagle3", {"eagle3": 120.0}, "eagle3"),
        ("auto", {"drafter": 125.0, "eagle3": 115.0, "dflash": 105.0}, "drafter"),
        ("auto", {"drafter": 110.0, "eagle3": 130.0, "dflash": 120.0}, "eagle3"),
    ],
)
def test_make_drafter_head_runs_every_stage_and_installs_the_faster_head(
    tiny_prompts, tmp_path, monkeypatch, head, rates, chosen
):
    from mlx_redrafter.hub.store import META, find
    from mlx_redrafter.llm.identity import model_identity
    from mlx_redrafter.llm.load import load_model
    from mlx_redrafter.train.recipe import make_drafter

    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / "cache"))
    out, passes = tmp_path / "work", FakePasses(**rates)
    report = make_drafter(_recipe(tiny_prompts, out, head), measure=passes)
    assert passes.calls == ["plain", "lookup", *rates, "plain again"]
    v = report.verdict
    assert v["chosen"] == chosen and v["installed"] and report.installed is not None
    folder = out / {"drafter": "drafter", "eagle3": "eagle3"}[chosen]
    assert report.drafter == folder
    meta = json.loads((folder / META).read_text())
    assert meta["head"] == {"drafter": "redrafter", "eagle3": "eagle3"}[chosen]
    kinds = {"eagle3": ["eagle3"], "auto": ["redrafter", "eagle3"]}[head]
    state = json.loads((out / "make-drafter.json").read_text())
    assert sorted(state["controllers"]) == sorted(kinds)
    for kind in kinds:  # a depth controller beside each head
        assert (out / {"redrafter": "drafter", "eagle3": "eagle3"}[kind] / "controller.safetensors").is_file()
    if chosen == "eagle3":
        assert meta["recipe"]["train"]["layer_ids"] == [2, 1, 1] and meta["recipe"]["controller"]["prompts"] > 0
        model, _ = load_model(str(tiny_prompts[0]))
        found = find(model_identity(model, str(tiny_prompts[0])))
        assert found.path == report.installed
        assert json.loads((found.path / "config.json").read_text())["speculators_model_type"] == "eagle3"


def test_a_run_without_held_out_data_keeps_its_last_head(distilled, tmp_path):
    from mlx_redrafter.train.eagle3_trainer import Eagle3TrainConfig, train_eagle3

    model, _, root = distilled
    cfg = Eagle3TrainConfig(max_steps=4, eval_every=2, batch_size=2, window=16, eval_fraction=0.0, draft_vocab_size=48)
    out = train_eagle3(model, root / "data", tmp_path / "head", cfg)
    assert json.loads((out / "config.json").read_text())["training"]["steps"] == 4
