"""Self-distillation and drafter training, end to end on a tiny random model."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from helpers import TINY_CONFIGS, tiny_model
from mlx_redrafter import RedrafterError
from mlx_redrafter.drafter import load_drafter
from mlx_redrafter.generate import DraftConfig, generate_tokens
from mlx_redrafter.prompts import FINGERPRINTS, build_fingerprints, refuse_eval_set
from mlx_redrafter.train.distill import DistillConfig, distill
from mlx_redrafter.train.shards import Manifest, read_corpus
from mlx_redrafter.train.trainer import TrainConfig, train

from conftest import SHARED

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
    for k, cid in enumerate(corpus.ids):
        toks = corpus.tokens[corpus.offsets[k] : corpus.offsets[k + 1]].tolist()
        prompt = tok.apply_chat_template([{"role": "user", "content": convs[cid]["turns"][0]}], add_generation_prompt=True)
        ref, _ = generate_tokens(model, prompt, max_tokens=10, eos_ids=tok.eos_token_ids)
        assert toks[: len(ref)] == ref
        # hidden[i] is the state that produced tokens[i]: the last prompt position first.
        from mlx_redrafter.models import model_parts

        _, backbone, _ = model_parts(model)
        h = backbone(mx.array([prompt + toks[:-1]]))[0, len(prompt) - 1 :]
        got = corpus.hidden[corpus.offsets[k] : corpus.offsets[k + 1]].astype(np.float32)
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
        run_distill(tiny_llm, SHARED / "data" / "mt_bench" / "question.jsonl", tmp_path / "x")
    # Renamed: recognized by content.
    disguised = tmp_path / "my_prompts.jsonl"
    lines = open(SHARED / "data" / "gsm8k" / "test.jsonl").readlines()[:5]
    disguised.write_text("".join(lines))
    with pytest.raises(RedrafterError, match="gsm8k"):
        run_distill(tiny_llm, disguised, tmp_path / "x")
    for name in ("spec_bench/question.jsonl", "alpaca_eval/outputs.json", "humaneval/HumanEval.jsonl.gz"):
        with pytest.raises(RedrafterError):
            refuse_eval_set(SHARED / "data" / name)


def test_cli_distill_refuses_evaluation_sets(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mlx_redrafter.cli", "distill", "--prompts", str(SHARED / "data" / "mt_bench" / "question.jsonl"), "--out", str(tmp_path / "x")],
        capture_output=True, text=True, env=dict(os.environ), timeout=120,
    )
    assert r.returncode == 1 and "evaluation set" in r.stderr and "Traceback" not in r.stderr


def test_shipped_fingerprints_match_the_evaluation_sets():
    assert json.loads(FINGERPRINTS.read_text()) == build_fingerprints(SHARED / "data")


def small_train_config(**kw):
    base = dict(exit_dim=32, num_draft_layers=1, draft_vocab_size=256, depth=3, batch_size=32, lr=3e-3,
                warmup_steps=5, max_steps=60, eval_every=20, checkpoint_every=20, eval_fraction=0.25)
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
