"""Self-distillation and drafter training, end to end on a tiny random model."""

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import EVAL_SETS
from helpers import TINY_CONFIGS, OracleDrafter, assert_tokens_exact, tiny_model

import mlx_redrafter
from mlx_redrafter import RedrafterError
from mlx_redrafter.generate import DraftConfig, generate_tokens
from mlx_redrafter.hub.load import load_drafter
from mlx_redrafter.prompts import FINGERPRINTS, PROMPT_SETS, build_fingerprints, refuse_eval_set
from mlx_redrafter.train.distill import DistillConfig, distill
from mlx_redrafter.train.shards import Manifest, read_corpus
from mlx_redrafter.train.trainer import TrainConfig, train

# The five evaluation sets: three ship with the package, two with the tests.
EVAL_FILES = {
    **PROMPT_SETS,
    "gsm8k": EVAL_SETS / "gsm8k" / "test.jsonl.gz",
    "humaneval": EVAL_SETS / "humaneval" / "HumanEval.jsonl.gz",
}

TOPICS = ["the sea", "a red fox", "bread baking", "prime numbers", "the moon", "old trains", "jazz", "rain", "chess"]


@pytest.fixture(scope="module")
def tiny_llm(default_model):
    """A tiny random llama that speaks SmolLM2's vocabulary (so it has a
    tokenizer with a chat template)."""
    _, tok = default_model
    TINY_CONFIGS["llama_smolvocab"] = dict(TINY_CONFIGS["llama"], vocab_size=49152)
    try:
        model = tiny_model("llama_smolvocab", scale=2.0)
    finally:
        del TINY_CONFIGS["llama_smolvocab"]
    return model, tok


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "train_prompts.jsonl"
    with open(path, "w") as f:
        for i, t in enumerate(TOPICS):
            turns = [f"Tell me something about {t}.", f"And why does {t} matter?"]
            f.write(json.dumps({"id": f"c{i}", "turns": turns}) + "\n")
    return path


def run_distill(tiny_llm, prompts, out, **kw):
    model, tok = tiny_llm
    cfg = DistillConfig(**{"batch_size": 3, "max_new_tokens": 10, "shard_sequences": 2, **kw})
    return distill("tiny", prompts, out, cfg, model=model, tokenizer=tok)


def test_distilled_replies_are_the_model_s_greedy_replies(tiny_llm, prompt_file, tmp_path):
    model, tok = tiny_llm
    m = run_distill(tiny_llm, prompt_file, tmp_path / "data", max_conversations=4)
    assert m.sequences == 4 and len(m.done) == 4 and len(m.shards) == 2
    corpus = read_corpus(tmp_path / "data")
    convs = {json.loads(line)["id"]: json.loads(line) for line in open(prompt_file)}
    from mlx_redrafter.llm.parts import model_parts

    _, backbone, _ = model_parts(model)
    for k, cid in enumerate(corpus.ids):
        a, b = corpus.offsets[k], corpus.offsets[k + 1]
        reply = corpus.reply[a:b]
        toks = corpus.tokens[a:b][reply].tolist()
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": convs[cid]["turns"][0]}], add_generation_prompt=True
        )
        ref, _ = generate_tokens(model, prompt, max_tokens=10, eos_ids=tok.eos_token_ids)
        assert toks[: len(ref)] == ref
        # The prompt's positions come first (prompt[1:], each predicted by
        # the position before it), then the reply's.
        assert corpus.tokens[a:b][~reply].tolist() == prompt[1:] and not reply[: len(prompt) - 1].any()
        # hidden[i] is the state that produced tokens[i].
        h = backbone(mx.array([prompt + toks[:-1]]))[0]
        got = corpus.hidden[a:b].astype(np.float32)
        np.testing.assert_allclose(got, np.array(h), atol=2e-2 * float(mx.abs(h).max()))


def test_looping_replies_end_early(tiny_llm):
    from mlx_redrafter.train.distill import LOOP_NGRAM, Distiller, _Row

    model, tok = tiny_llm
    d = Distiller(model, tok, DistillConfig(max_new_tokens=500, stop_loops=4))
    row = _Row({"id": "x"}, 0, [], 3)
    h = np.zeros(4, np.float16)
    for t in [11, 12, 13, 14, 15, 16, 17, 18]:  # fresh text
        row.add(t, h)
        assert not d._finished(row)
    loop = [11, 12, 13, 14, 15, 16, 17, 18] * 3
    ended = None
    for i, t in enumerate(loop):
        row.add(t, h)
        if d._finished(row):
            ended = i
            break
    # The first LOOP_NGRAM - 1 repeated tokens only rebuild an old n-gram;
    # then 4 tokens in a row close seen n-grams.
    assert ended == LOOP_NGRAM - 1 + 4 - 1
    d.cfg.stop_loops = 0
    assert not d._finished(row)


def test_multi_turn_conversations(tiny_llm, prompt_file, tmp_path):
    m = run_distill(tiny_llm, prompt_file, tmp_path / "data", max_conversations=3, turns=2)
    assert m.sequences == 6 and len(m.done) == 3
    seqs = []
    for shard in m.shards:
        _, meta = mx.load(str(tmp_path / "data" / shard), return_metadata=True)
        seqs += zip(json.loads(meta["ids"]), json.loads(meta["turns"]), json.loads(meta["prompt_len"]))
    by_conv = {}
    for cid, turn, plen in seqs:
        by_conv.setdefault(cid, {})[turn] = plen
    assert len(by_conv) == 3 and all(set(t) == {0, 1} for t in by_conv.values())
    # The second turn's prompt holds the first turn and the model's own reply.
    assert all(t[1] > t[0] + 10 for t in by_conv.values())


def test_interrupted_distill_resumes_without_losing_or_redoing(tiny_llm, prompt_file, tmp_path, monkeypatch):
    from mlx_redrafter.train import distill as dmod

    calls = {"n": 0}
    real_step = dmod.Distiller.step

    def flaky_step(self):
        calls["n"] += 1
        if calls["n"] == 25:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(dmod.Distiller, "step", flaky_step)
    with pytest.raises(KeyboardInterrupt):
        run_distill(tiny_llm, prompt_file, tmp_path / "data")
    first = Manifest.load(tmp_path / "data")
    assert 0 < first.sequences < len(TOPICS)  # finished replies were written
    monkeypatch.setattr(dmod.Distiller, "step", real_step)
    done = run_distill(tiny_llm, prompt_file, tmp_path / "data")
    assert sorted(done.done) == sorted(f"c{i}" for i in range(len(TOPICS)))
    assert done.sequences == len(TOPICS)  # nothing lost, nothing duplicated
    assert len(set(read_corpus(tmp_path / "data").ids)) == len(TOPICS)


def test_distill_refuses_evaluation_sets(tiny_llm, tmp_path):
    with pytest.raises(RedrafterError, match="evaluation set"):
        run_distill(tiny_llm, EVAL_FILES["mt_bench"], tmp_path / "x")
    # Renamed: recognized by content.
    disguised = tmp_path / "my_prompts.jsonl"
    with gzip.open(EVAL_FILES["gsm8k"], "rt", encoding="utf-8") as f:
        disguised.write_text("".join(f.readlines()[:5]))
    with pytest.raises(RedrafterError, match="gsm8k"):
        run_distill(tiny_llm, disguised, tmp_path / "x")
    for name in ("spec_bench", "alpaca_eval", "humaneval"):
        with pytest.raises(RedrafterError, match="evaluation set"):
            refuse_eval_set(EVAL_FILES[name])
        # By content too, under a name that says nothing.
        plain = tmp_path / f"prompts{EVAL_FILES[name].suffix}"
        shutil.copy(EVAL_FILES[name], plain)
        with pytest.raises(RedrafterError, match=name):
            refuse_eval_set(plain)


def test_shipped_training_prompts_are_not_evaluation_sets():
    from mlx_redrafter.prompts import SHAREGPT, default_training_prompts, read_conversations

    path = default_training_prompts()
    assert path == SHAREGPT and path.is_relative_to(Path(mlx_redrafter.__file__).parent)
    convs = read_conversations(path)
    assert len(convs) > 8000 and all(c["turns"] for c in convs)
    refuse_eval_set(path, convs)  # raises if any evaluation prompt slipped in


def test_cli_distill_refuses_evaluation_sets(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_redrafter.cli",
            "distill",
            "--prompts",
            str(EVAL_FILES["mt_bench"]),
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )
    assert r.returncode == 1 and "evaluation set" in r.stderr and "Traceback" not in r.stderr


def test_shipped_fingerprints_match_the_evaluation_sets():
    assert json.loads(FINGERPRINTS.read_text()) == build_fingerprints(EVAL_FILES)


def small_train_config(**kw):
    base = dict(
        exit_dim=32,
        num_draft_layers=1,
        draft_vocab_size=256,
        depth=3,
        batch_size=32,
        lr=3e-3,
        warmup_steps=5,
        max_steps=60,
        eval_every=20,
        checkpoint_every=20,
        eval_fraction=0.25,
    )
    return TrainConfig(**{**base, **kw})


@pytest.fixture
def data_dir(tiny_llm, prompt_file, tmp_path):
    run_distill(tiny_llm, prompt_file, tmp_path / "data", max_new_tokens=24)
    return tmp_path / "data"


def read_log(folder):
    return [json.loads(line) for line in open(folder / "train_log.jsonl")]


def test_train_lowers_the_loss_and_writes_a_usable_drafter(tiny_llm, data_dir, tmp_path):
    model, tok = tiny_llm
    out = train(model, data_dir, tmp_path / "drafter", small_train_config(), eos_ids=[2])
    log = read_log(out)
    evals = [r for r in log if "train_loss" in r]
    assert evals[-1]["train_loss"] < evals[0]["train_loss"]
    assert len(evals[-1]["eval_acc"]) == 3 and "eval_accepted_w1" in evals[-1]
    start = log[0]
    assert start["event"] == "start" and 0 < start["draft_vocab_coverage"] <= 1
    d = load_drafter(out)
    assert d.config.draft_vocab_size == 256 and 2 in np.array(d.draft_vocab).tolist()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ref, _ = generate_tokens(model, prompt, max_tokens=20)
    out_tokens, _ = generate_tokens(model, prompt, draft=DraftConfig(d, 2, 3), max_tokens=20)
    assert out_tokens == ref


def test_train_resumes_after_an_interrupt(tiny_llm, data_dir, tmp_path):
    model, _ = tiny_llm
    out = tmp_path / "drafter"

    def stop_at_30(step, total, loss):
        if step == 30:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(model, data_dir, out, small_train_config(), progress=stop_at_30)
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 30  # Ctrl-C saved a checkpoint
    assert (out / "model.safetensors").exists()
    steps = []
    train(model, data_dir, out, small_train_config(), resume=True, progress=lambda s, n, loss: steps.append(s))
    assert steps[0] == 31 and steps[-1] == 60
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 60
    assert [r["step"] for r in read_log(out) if "train_loss" in r] == [20, 40, 60]


def test_train_errors(tiny_llm, tmp_path):
    model, _ = tiny_llm
    with pytest.raises(RedrafterError, match="No distillation data"):
        train(model, tmp_path, tmp_path / "d", small_train_config())


def test_head_starts_from_the_llm_output_rows(tiny_llm, data_dir, tmp_path):
    from mlx_redrafter.train.trainer import llm_output_rows

    model, _ = tiny_llm
    out = train(model, data_dir, tmp_path / "d", small_train_config(exit_dim=64, max_steps=1, lr=1e-6))
    d = load_drafter(out, dtype="float32")
    want = llm_output_rows(model, d.draft_vocab)
    np.testing.assert_allclose(np.array(d.lm_head[-1].weight), np.array(want), atol=1e-2 * float(mx.abs(want).max()))


# --------------------------------------------------------------------------- soft targets, features, accumulation


def test_soft_target_kl_has_the_known_answer():
    from mlx_redrafter.train.examples import soft_targets
    from mlx_redrafter.train.loss import kl_to_soft

    # q = (1/2, 1/4, 1/4); p = (1/2, 1/2, 0) given on ids 0 and 1:
    # KL(p || q) = 1/2 log(1/2 / 1/2) + 1/2 log(1/2 / 1/4) = log(2) / 2.
    logits = mx.log(mx.array([[0.5, 0.25, 0.25]]))
    kl = kl_to_soft(logits + 3.0, mx.array([[0, 1]]), mx.array([[0.5, 0.5]]))  # shift-invariant in the logits
    assert abs(kl.item() - np.log(2) / 2) < 1e-6
    # The LLM's top-k over the full vocabulary -> the draft vocabulary: ids
    # outside it drop out and the rest are renormalized.
    vmap = np.array([-1, 0, 1, -1, 2])  # full id -> draft index
    idx, p = soft_targets(np.array([[1, 3, 4]]), np.log(np.array([[0.2, 0.5, 0.3]])), vmap)
    assert idx[0, 0] == 0 and idx[0, 2] == 2
    np.testing.assert_allclose(p, [[0.4, 0.0, 0.6]], atol=1e-6)
    # No id inside: no soft target at all.
    _, p = soft_targets(np.array([[0, 3]]), np.array([[1.0, 2.0]]), vmap)
    assert (p == 0).all()


def test_distill_keeps_top_k_logits_and_layer_features(tiny_llm, prompt_file, tmp_path):
    from mlx_redrafter.llm.parts import capture_layers, model_parts

    model, tok = tiny_llm
    run_distill(tiny_llm, prompt_file, tmp_path / "data", max_conversations=2, top_k=5, feature_layers=[0])
    c = read_corpus(tmp_path / "data")
    assert c.soft_targets and c.feature_layers == [0]
    assert c.extra["topk_ids"].shape == (len(c.tokens), 5) and c.extra["features"].shape == c.hidden.shape
    # A reply's token is the argmax of its own top-k.
    best = c.extra["topk_ids"][np.arange(len(c.tokens)), c.extra["topk_logits"].argmax(1)]
    assert (best[c.reply] == c.tokens[c.reply]).all() and (~c.reply).any()
    # The features are layer 0's outputs at the positions that produced each
    # token, the prompt's included; the top-k logits are the head's largest.
    convs = {json.loads(line)["id"]: json.loads(line) for line in open(prompt_file)}
    _, backbone, head = model_parts(model)
    a, b = c.offsets[0], c.offsets[1]
    reply = c.tokens[a:b][c.reply[a:b]].tolist()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": convs[c.ids[0]]["turns"][0]}], add_generation_prompt=True
    )
    with capture_layers(model, [0]) as taps:
        h = backbone(mx.array([prompt + reply[:-1]]))
    want = np.array(taps[0][0])
    np.testing.assert_allclose(c.extra["features"][a:b].astype(np.float32), want, atol=2e-2 * np.abs(want).max())
    logits = np.array(head(h[0]))
    got = c.extra["topk_logits"][a:b]
    np.testing.assert_allclose(np.sort(got, 1), np.sort(logits, 1)[:, -5:], atol=1e-3 * np.abs(logits).max())
    # The model is left as it was: no wrapped layers after the run.
    assert all(type(layer).__name__ != "_Tap" for layer in model.model.layers)


def test_distill_runs_accumulate_in_the_manifest(tiny_llm, prompt_file, tmp_path):
    first = run_distill(tiny_llm, prompt_file, tmp_path / "data", max_conversations=3)
    second = run_distill(tiny_llm, prompt_file, tmp_path / "data", max_conversations=7)
    assert [r["sequences"] for r in second.runs] == [3, 4]
    assert second.sequences == 7 and second.tokens == sum(r["tokens"] for r in second.runs)
    assert set(first.done) < set(second.done) and len(set(second.done)) == 7
    assert len(set(read_corpus(tmp_path / "data").ids)) == 7  # nothing redone
    # A run that would write shards of another format is refused.
    with pytest.raises(RedrafterError, match="top_k"):
        run_distill(tiny_llm, prompt_file, tmp_path / "data", max_conversations=9, top_k=4)
    assert Manifest.load(tmp_path / "data").sequences == 7


def test_hostile_prompt_files_give_clear_errors_or_are_skipped(tiny_llm, tmp_path):
    from mlx_redrafter.prompts import read_conversations

    def write(name, text):
        path = tmp_path / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path

    # Records that hold no usable prompt are skipped; the rest are read.
    mixed = write(
        "mixed.jsonl",
        "\n".join(
            [
                json.dumps({"id": "a", "prompt": "Tell me about owls."}),
                "5",
                "null",
                "[1, 2]",
                '"   "',
                json.dumps({"turns": [{"role": "user"}]}),
                json.dumps({"turns": ["ok", 7]}),
                json.dumps({"text": "x" * 20000, "id": "long"}),
                json.dumps({"nothing": "here"}),
            ]
        )
        + "\n",
    )
    convs = read_conversations(mixed)
    assert [c["id"] for c in convs] == ["a", "long"]
    # A prompt too long for --max-prompt-tokens is skipped by distill, and the rest answered.
    m = run_distill(tiny_llm, mixed, tmp_path / "data", max_prompt_tokens=100)
    assert m.sequences == 1 and sorted(m.done) == ["a", "long"]
    for name, text, match in [
        ("bad.jsonl", json.dumps({"prompt": "fine"}) + "\n{not json\n", "line 2"),
        ("binary.jsonl", b'{"prompt": "hi"}\n\xff\xfe\x00\n', "decode"),
        ("empty.jsonl", "\n\n", "No prompts"),
        (
            "dupes.jsonl",
            json.dumps({"id": 1, "prompt": "a"}) + "\n" + json.dumps({"id": 1, "prompt": "b"}) + "\n",
            "more than once",
        ),
        ("junk.gz", b"not gzip at all", "Cannot read"),
    ]:
        with pytest.raises(RedrafterError, match=match):
            read_conversations(write(name, text))
    with pytest.raises(RedrafterError, match="does not exist"):
        read_conversations(tmp_path / "missing.jsonl")


def test_soft_targets_and_fused_features_train_an_exact_drafter(tiny_llm, prompt_file, tmp_path):
    model, tok = tiny_llm
    run_distill(tiny_llm, prompt_file, tmp_path / "data", max_new_tokens=24, top_k=8, feature_layers=[0])
    runs = {}
    for name, kw in {"hard": dict(soft_weight=0.0), "soft": dict(), "fused": dict(fuse_features=True)}.items():
        out = train(model, tmp_path / "data", tmp_path / name, small_train_config(max_steps=40, **kw), eos_ids=[2])
        log = read_log(out)
        runs[name] = log
        assert log[0]["soft_targets"] == (name != "hard")
        evals = [r for r in log if "train_loss" in r]
        assert evals[-1]["train_loss"] < evals[0]["train_loss"]
    # The soft loss adds a non-negative KL term to the same first batch.
    assert [r for r in runs["soft"] if "train_loss" in r][0]["train_loss"] > [
        r for r in runs["hard"] if "train_loss" in r
    ][0]["train_loss"]
    d = load_drafter(tmp_path / "fused")
    assert d.config.feature_layers == [0] and d.context_size == 2 * model.args.hidden_size
    assert "feature_layers" not in load_drafter(tmp_path / "soft").config.to_dict()  # unfused: the official layout
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ref, _ = generate_tokens(model, prompt, max_tokens=20)
    # The trained fused drafter's beam search (40 steps on a random model: its
    # drafts are rarely right) beside the oracle's right beam: drafts accepted.
    beside = OracleDrafter(model, prompt, 20, 3, inner=d)
    for cfg in (
        DraftConfig(beside, 2, 3),
        DraftConfig(beside, 1, 3),
        DraftConfig(beside, 2, 3, pipelined=False),
        DraftConfig(beside, 2, 2, lookup=1),
    ):
        assert_tokens_exact(model, prompt, cfg, plain=ref, max_tokens=20, min_accepted=4)


def test_fuse_features_needs_features_in_the_data(tiny_llm, data_dir, tmp_path):
    model, _ = tiny_llm
    with pytest.raises(RedrafterError, match="feature-layers"):
        train(model, data_dir, tmp_path / "d", small_train_config(fuse_features=True))


def test_data_fraction_trains_on_nested_shares(tiny_llm, data_dir):
    from mlx_redrafter.train.examples import split_examples

    c = read_corpus(data_dir)
    full, held = split_examples(c, 0.25)
    quarter, held_q = split_examples(c, 0.25, share=0.5)
    assert set(quarter.positions) < set(full.positions) and (held.positions == held_q.positions).all()


def test_prompt_positions_train_on_the_llm_s_predictions(tiny_llm, data_dir):
    from mlx_redrafter.train.examples import llm_labels, split_examples

    c = read_corpus(data_dir)
    assert (~c.reply).any()
    train_all, held = split_examples(c, 0.25)
    train_replies, _ = split_examples(c, 0.25, prompts=False)
    assert c.reply[held.positions].all() and c.reply[train_replies.positions].all()  # held out: replies only
    assert not c.reply[train_all.positions].all() and set(train_replies.positions) < set(train_all.positions)
    labels = llm_labels(c)
    top1 = c.extra["topk_ids"][np.arange(len(c.tokens)), c.extra["topk_logits"].argmax(1)]
    assert (labels == top1).all()  # the text in replies, the LLM's own guess in prompts
    assert (labels[~c.reply] != c.tokens[~c.reply]).any()
