"""``make-drafter`` (issue 36 item 1) end to end on a tiny model saved with a
tokenizer: every stage, Ctrl-C in each stage and the rerun that continues,
a larger budget that adds data and training, the install rule (the
verdict's passes injected, so that the rule is decided by given numbers;
the real measurement runs once, on a model its drafter can learn, with
the install rule on a clock of steps), ``--prompts history`` from a real
chat, the held-out split, a base model's raw prompts, and the command line."""

from __future__ import annotations

import io
import json
import random
import sys
from pathlib import Path

import pytest
from helpers import cli, save_tiny_folder

from mlx_redrafter.train.budget import Sizes
from mlx_redrafter.train.recipe import RecipeConfig, make_drafter
from mlx_redrafter.train.recipe_state import STATE
from mlx_redrafter.train.shards import Manifest, read_corpus

TINY = Sizes(controller_prompts=2, controller_tokens=16, verdict_prompts=2, verdict_tokens=16, calibrate_s=0.3)
WORDS = [f"w{i}" for i in range(5, 90)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model folder (with a chat template) and 300 prompts of its words.
    The model is a bigram model (helpers.bigram_model), which a drafter learns
    in the few steps a test trains: the verdict sees its drafts accepted."""
    root = tmp_path_factory.mktemp("make")
    folder = save_tiny_folder(root / "model", bigram=True)
    rng = random.Random(0)
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(300):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
            f.write(json.dumps({"id": f"c{i}", "turns": [text]}) + "\n")
    return folder, prompts


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test its own cache: the drafter store, curves and work folders."""
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def recipe(tiny, out, minutes=1.0, max_steps=20, **kw) -> RecipeConfig:
    folder, prompts = tiny
    base = dict(
        model=str(folder),
        minutes=minutes,
        out=out,
        prompts=str(prompts),
        max_conversations=40,
        sizes=TINY,
        distill={"batch_size": 8, "max_new_tokens": 12},
        train={"batch_size": 32, "max_steps": max_steps},
        command=f"mlx-redrafter make-drafter --model {folder} --minutes {minutes}",
    )
    return RecipeConfig(**{**base, **kw})


class Passes:
    """The verdict's passes, injected: each setting's tokens/s (plain at 100),
    every output the same, and a count of the passes measured."""

    def __init__(self, drafter=130.0, lookup=105.0, existing=110.0, same=True, stop_at=None):
        self.rates = {"plain": 100.0, "plain again": 100.0, "lookup": lookup, "drafter": drafter, "existing": existing}
        self.same, self.stop_at, self.calls = same, stop_at, []

    def __call__(self, name, draft, prompts, max_tokens):
        if self.stop_at is not None and len(self.calls) == self.stop_at:
            raise KeyboardInterrupt
        self.calls.append(name)
        tokens = [[1, 2, 3] if self.same or name.startswith("plain") else [1, 2, 4] for _ in prompts]
        return {
            "tokens_per_s": self.rates[name],
            "tokens_per_step": 1.0 if name.startswith("plain") else 1.5,
            "tokens": tokens,
        }


class StepClock:
    """The verdict's real passes (real decoding and outputs; the real clock's
    tokens/s kept in ``clock``), each setting's tokens/s then replaced by 100 x
    its tokens/step: a clock on which every step costs the same, so that the
    install rule follows the acceptance measured, not the machine's load."""

    def __init__(self, folder):
        from mlx_redrafter.llm.load import load_model
        from mlx_redrafter.tuning.verdict import real_measure

        model, tokenizer = load_model(str(folder))
        self.real, self.clock = real_measure(model, tokenizer.eos_token_ids), {}

    def __call__(self, name, draft, prompts, max_tokens):
        rec = self.real(name, draft, prompts, max_tokens)
        self.clock[name] = rec["tokens_per_s"]
        return {**rec, "tokens_per_s": 100.0 * rec["tokens_per_step"]}


def state(out: Path) -> dict:
    return json.loads((out / STATE).read_text())


def checkpoint_step(out: Path) -> int:
    return json.loads((out / "drafter" / "checkpoint" / "state.json").read_text())["step"]


def stop_in(stage: str, after: int = 1):
    """A progress callback that presses Ctrl-C at the ``after``-th status of ``stage``."""
    seen = {"n": 0}

    def progress(status):
        if status.stage == stage and status.line is None:
            seen["n"] += 1
            if seen["n"] >= after:
                raise KeyboardInterrupt

    return progress


# --------------------------------------------------------------------------- end to end, real measurement


def test_make_drafter_end_to_end_measures_on_held_out_prompts(tiny, tmp_path):
    from mlx_redrafter.hub.store import META, find
    from mlx_redrafter.llm.identity import model_identity
    from mlx_redrafter.llm.load import load_model
    from mlx_redrafter.train.examples import is_eval_conversation, split_examples

    out = tmp_path / "work"
    lines, clock = [], StepClock(tiny[0])
    report = make_drafter(recipe(tiny, out), progress=lambda s: s.line and lines.append(s.line), measure=clock)
    s = state(out)
    assert set(s["done"]) >= {"distill", "train", "controller", "calibrate", "verdict"}
    rates = s["rates"]
    assert rates["step_s"] > 0 and rates["positions_per_s"] > 0 and rates["train_steps_per_s"] > 0
    assert any(line.startswith("distilled") for line in lines) and any("controller" in line for line in lines)
    assert (out / "drafter" / "controller.safetensors").is_file()
    v = report.verdict
    assert set(clock.clock) == {"plain", "lookup", "drafter", "plain again"} and min(clock.clock.values()) > 0
    # Identical outputs, with the new drafter's drafts accepted (plain decoding makes 1 token a step).
    assert v["identical"] and v["drafter"]["identical_outputs"] == v["prompts"] == TINY.verdict_prompts
    assert v["drafter"]["tokens_per_step"] >= 1.2 and v["device"].startswith("cpu")
    # The install rule, on the steps measured: faster than plain and lookup alone, installed and found.
    assert v["drafter"]["speedup"] > max(1.0, v["lookup"]["speedup"]) and v["installed"]
    model, _ = load_model(str(tiny[0]))
    found = find(model_identity(model, str(tiny[0])))
    assert report.installed is not None and found is not None and found.path == report.installed
    # The held-out prompts the verdict ran on were never trained on.
    frac = s["held_out"]
    assert all(is_eval_conversation(c, frac) for c in v["prompt_ids"])
    corpus = read_corpus(out / "data")
    train_ex, _ = split_examples(corpus, frac)
    trained = {corpus.ids[i] for i in (corpus.offsets[1:] > train_ex.positions[:, None]).argmax(1)}
    assert trained and not trained & set(v["prompt_ids"])
    # What the model card needs.
    meta = json.loads((out / "drafter" / META).read_text())
    assert meta["base_model"]["hidden_size"] == 64 and meta["base_model"]["fingerprint"]
    assert meta["data"]["prompts"] == "file:prompts.jsonl" and not meta["data"]["private"]
    assert meta["data"]["conversations"] == 40 and meta["data"]["positions"] == corpus.offsets[-1]
    assert (
        meta["recipe"]["command"].startswith("mlx-redrafter make-drafter")
        and meta["recipe"]["stages"]["distill"]["minutes"] >= 0
    )
    assert meta["recipe"]["train"]["exit_dim"] == 64 and len(meta["acceptance"]["held_out"]["by_depth"]) == 5
    assert meta["verdict"]["installed"]
    # The same command again: done, nothing redone.
    again = make_drafter(recipe(tiny, out))
    assert again.already_done and state(out)["seconds"]["verdict"] == s["seconds"]["verdict"]
    assert len(Manifest.load(out / "data").runs) == 1 and checkpoint_step(out) == 20


# --------------------------------------------------------------------------- Ctrl-C in every stage


def test_an_interrupt_in_each_stage_keeps_what_is_done_and_the_rerun_continues(tiny, tmp_path, monkeypatch, cache):
    import mlx_redrafter.hub.store as store
    import mlx_redrafter.tuning.calibrate as calibrate

    out = tmp_path / "work"
    cfg = recipe(tiny, out)
    with pytest.raises(KeyboardInterrupt):  # distillation
        make_drafter(cfg, progress=stop_in("distill", after=20), measure=Passes())  # past the first batch
    first = Manifest.load(out / "data")
    assert 0 < first.sequences < 40 and "distill" not in state(out)["done"]

    with pytest.raises(KeyboardInterrupt):  # training, at its 5th step
        make_drafter(cfg, progress=stop_in("train", after=5), measure=Passes())
    m = Manifest.load(out / "data")
    assert set(first.done) < set(m.done) and len(m.done) == 40 and len(set(read_corpus(out / "data").ids)) == 40
    assert len(m.runs) == 2 and checkpoint_step(out) == 5

    steps = []
    with pytest.raises(KeyboardInterrupt):  # the controller
        make_drafter(
            cfg,
            progress=lambda st: steps.append(st.info) if st.stage == "train" and st.info else stop_in("controller")(st),
            measure=Passes(),
        )
    assert steps[0].startswith("step 6,") and checkpoint_step(out) == 20  # resumed, not restarted
    assert len(Manifest.load(out / "data").runs) == 2

    def no_curve(*a, **k):
        raise KeyboardInterrupt

    # monkeypatch.context(), not monkeypatch.undo(): undo() would also drop the
    # autouse fixture's MLX_REDRAFTER_CACHE, and the install below would land
    # in the session's store, where later tests of the same model find it.
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):  # calibration
        m.setattr(calibrate, "measure_curve", no_curve)
        make_drafter(cfg, measure=Passes())
    assert "controller" in state(out)["done"] and "calibrate" not in state(out)["done"]

    passes = Passes(stop_at=2)
    with pytest.raises(KeyboardInterrupt):  # the verdict, after two passes
        make_drafter(cfg, measure=passes)
    assert passes.calls == ["plain", "lookup"] and set(state(out)["verdict_passes"]["passes"]) == {"plain", "lookup"}

    def no_install(*a, **k):
        raise KeyboardInterrupt

    passes = Passes()
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):  # the install
        m.setattr(store, "install", no_install)
        make_drafter(cfg, measure=passes)
    assert passes.calls == ["drafter", "plain again"]  # the finished passes are not measured again

    passes = Passes()
    report = make_drafter(cfg, measure=passes)
    assert passes.calls == [] and report.installed is not None and (report.installed / "model.safetensors").is_file()
    assert report.installed.is_relative_to(cache)  # this test's own store
    s = state(out)
    assert len(Manifest.load(out / "data").runs) == 2 and checkpoint_step(out) == 20 and len(s["runs"]) == 7
    assert json.loads((report.installed / "redrafter.json").read_text())["verdict"]["reason"].startswith("1.30x")
    again = make_drafter(cfg, measure=passes)  # done: announced and installed again, nothing measured
    assert again.already_done and again.installed == report.installed and passes.calls == []


# --------------------------------------------------------------------------- a larger budget


def test_a_larger_budget_adds_data_and_trains_on(tiny, tmp_path):
    out = tmp_path / "work"
    # A budget too small for the set-up: distillation stops at its first
    # finished replies, training takes one step.
    small = make_drafter(recipe(tiny, out, minutes=0.01, max_conversations=None), measure=Passes(drafter=90.0))
    first, step = Manifest.load(out / "data"), checkpoint_step(out)
    assert 0 < len(first.done) < 300 and small.installed is None
    assert "needs" in small.verdict and small.verdict["reason"].startswith("0.90x")
    passes = Passes()
    larger = make_drafter(recipe(tiny, out, minutes=1.0, max_conversations=120), measure=passes)
    m = Manifest.load(out / "data")
    assert set(first.done) < set(m.done) and len(m.done) == 120 and len(m.runs) == 2
    assert checkpoint_step(out) == 20 > step  # trained on from the checkpoint
    log = [json.loads(line) for line in open(out / "drafter" / "train_log.jsonl")]
    assert [r["event"] for r in log if r.get("event") == "start"] == ["start"]  # never started over
    assert passes.calls == ["plain", "lookup", "drafter", "plain again"]  # the new drafter measured again
    assert larger.installed is not None and not larger.already_done


def test_a_rerun_says_the_prompts_are_used_up_and_the_drafter_it_kept(tiny, tmp_path, monkeypatch, capsys):
    """The first run distils every prompt of a small file and says so; a
    rerun with more budget distils nothing new (it says why, and what adds
    data), its training scores worse (held-out scores forced low) so the
    folder keeps the drafter it had, and the report says that drafter and
    its verdict stand. Caught: "distilled 0 positions" and the old verdict
    printed as if new, with no word of either (used_up() returning "",
    train_head not marking the head kept)."""
    from mlx_redrafter.cli.make import _print_report
    from mlx_redrafter.train import trainer

    folder, _ = tiny
    small = tmp_path / "small.jsonl"
    small.write_text(
        "".join(json.dumps({"id": f"s{i}", "turns": [f"w{5 + i} w{6 + i} w{7 + i}"]}) + "\n" for i in range(40))
    )
    out, lines = tmp_path / "work", []

    def said(status):
        if status.line:
            lines.append(status.line)

    cfg = recipe((folder, small), out, minutes=1.0, max_conversations=None)
    first = make_drafter(cfg, progress=said, measure=Passes())
    assert len(Manifest.load(out / "data").done) == 40 and first.installed is not None
    used_up = "every one of the 40 conversations of --prompts"
    assert any(line.startswith("distilled ") and used_up in line for line in lines), lines
    lines.clear()
    monkeypatch.setattr(trainer, "evaluate", lambda *a, **k: {"eval_acc": [0.0], "eval_accepted_w1": 0.0})
    cfg = recipe((folder, small), out, minutes=2.0, max_conversations=None, train={"batch_size": 32, "max_steps": 40})
    passes = Passes()
    again = make_drafter(cfg, progress=said, measure=passes)
    [distilled] = [line for line in lines if line.startswith("distilled ")]
    assert distilled.startswith("distilled 0 positions") and used_up in distilled and "--prompts FILE" in distilled
    [trained] = [line for line in lines if line.startswith("trained ")]
    assert "no step of this run scored better" in trained and "so that one is kept" in trained, trained
    assert again.kept == ("redrafter",) and not again.verdict_measured and passes.calls == []
    assert again.verdict == first.verdict and again.installed == first.installed
    capsys.readouterr()
    _print_report(again, cfg)
    err = capsys.readouterr().err
    assert "scored no better on the held-out conversations than the drafter it continued" in err
    assert f"kept, unchanged (its verdict of {first.verdict['date']} stands" in err and "Installed" in err


def test_a_draining_distillation_finishes_the_replies_under_way_and_starts_no_more(tiny, tmp_path):
    from mlx_redrafter.llm.load import load_model
    from mlx_redrafter.train.distill import DistillConfig, distill

    model, tok = load_model(str(tiny[0]))
    cfg = DistillConfig(batch_size=8, max_new_tokens=12, max_conversations=100)
    m = distill("tiny", tiny[1], tmp_path / "data", cfg, model=model, tokenizer=tok, drain=lambda replies: replies > 0)
    assert m.sequences == 8 and len(m.done) == 8  # the first batch, every reply of it kept


# --------------------------------------------------------------------------- the install rule


def test_the_install_rule():
    from mlx_redrafter.tuning.verdict import decide, run_verdict, summarize

    def verdict(**kw):
        p = Passes(**kw)
        settings = {"lookup": None, "drafter": None, **({"existing": None} if "existing" in kw else {})}
        return decide(summarize(run_verdict(settings, [[1], [2]], 8, p)))

    assert verdict(drafter=130.0, lookup=105.0) == (True, "1.30x against lookup alone's 1.05x")
    ok, why = verdict(drafter=104.0, lookup=105.0)
    assert not ok and why == "1.04x is not faster than lookup alone (1.05x)"
    ok, why = verdict(drafter=98.0, lookup=90.0)
    assert not ok and "plain decoding" in why
    ok, why = verdict(drafter=120.0, lookup=105.0, existing=125.0)
    assert not ok and "the drafter in use (1.25x)" in why
    ok, why = verdict(drafter=130.0, lookup=105.0, same=False)
    assert not ok and "identical" in why


def test_a_refused_drafter_says_what_its_learning_curve_needs(tiny, tmp_path):
    from mlx_redrafter.hub.store import find
    from mlx_redrafter.llm.identity import model_identity
    from mlx_redrafter.llm.load import load_model

    out = tmp_path / "work"
    report = make_drafter(
        recipe(tiny, out, train={"batch_size": 32, "max_steps": 40, "eval_every": 5, "warmup_steps": 4}),
        measure=Passes(drafter=102.0, lookup=104.0),
    )
    assert report.installed is None and report.verdict["reason"] == "1.02x is not faster than lookup alone (1.04x)"
    need = report.verdict["needs"]
    assert "learning curve" in need["message"] and "ln(positions)" in need["message"]
    assert not (out / "drafter" / "redrafter.json").read_text().count('"installed": true')
    model, _ = load_model(str(tiny[0]))
    assert find(model_identity(model, str(tiny[0]))) is None


def test_learning_curve_fit_has_the_known_answer():
    import math

    from mlx_redrafter.train.learning import data_needed, fit_log

    points = [(p, 0.1 + 0.05 * math.log(p)) for p in (1000, 2000, 4000, 8000, 16000)]
    a, b = fit_log(points)
    assert abs(a - 0.1) < 1e-9 and abs(b - 0.05) < 1e-9
    # tokens/step 1.4 at accuracy 0.4 (beta = 1), speed-up 1.0 (a step costs 1.4 plain steps):
    # 1.2x needs 1.68 tokens/step, accuracy 0.68, at exp((0.68 - 0.1) / 0.05) positions seen.
    need = data_needed(points, 0.4, 1.4, 1.0, 1.2, 20000, 0.01)
    want = math.exp((0.68 - 0.1) / 0.05)
    assert abs(need.accuracy - 0.68) < 1e-9 and abs(need.positions - 20000 * want / 16000) < 1e-3
    assert abs(need.more_minutes - (need.positions - 20000) * 0.01 / 60) < 1e-6
    assert "too few" in data_needed(points[:2], 0.4, 1.4, 1.0, 1.2, 20000, 0.01).message
    assert "too few" in data_needed(points, 0.4, 1.4, 1.0, 1.2, 20000, 0.01, warmup=5000).message  # the warm-up's
    flat = [(p, 0.3) for p, _ in points]
    assert "learning curve is flat" in data_needed(flat, 0.3, 1.3, 1.0, 1.2, 20000, 0.01).message
    # A falling curve is called so, its sign written once (it read "flat", "= 2.182 + -0.0981 ln(positions)").
    falling = [(p, 0.9 - 0.05 * math.log(p)) for p, _ in points]
    said = data_needed(falling, 0.3, 1.3, 1.0, 1.2, 20000, 0.01).message
    assert said.startswith("its learning curve falls (") and "0.900 - 0.0500 ln(positions)" in said, said
    assert "+ -" not in said and "-0.035 per doubling" in said and "0.485 at 4,000 positions" in said, said
    unaccepted = data_needed(points, 0.4, 1.0, 1.0, 1.2, 20000, 0.01).message
    assert "not accepted in the verdict (1.00 tokens/step)" in unaccepted and "flat" not in unaccepted


def test_the_budget_split_and_the_head():
    from mlx_redrafter.train.budget import Rates, fit_sizes, more_distill_s
    from mlx_redrafter.train.recipe import head_settings
    from mlx_redrafter.train.trainer import PRESETS

    # 1 step/s of 100 positions (no held-out): 0.01 s of training per position; 100 positions/s
    # distilled: x + 0.01 * 100 * x = 600 s -> 300 s of distilling, 300 of training.
    rates = Rates(0.05, 100.0, 1.0)
    assert abs(more_distill_s(600, 0, 0, rates, 100, 0.0) - 300) < 1e-9
    # Data already there calls for its training first.
    assert abs(more_distill_s(600, 10_000, 0, rates, 100, 0.0) - 250) < 1e-9
    assert more_distill_s(600, 100_000, 0, rates, 100, 0.0) == 0.0 and more_distill_s(-5, 0, 0, rates, 100, 0.0) == 0
    assert fit_sizes(90 * 60, 0.08) == Sizes() and fit_sizes(60, 0.08).verdict_prompts < Sizes().verdict_prompts
    shipped = {k: PRESETS["default"][k] for k in ("exit_dim", "num_draft_layers", "draft_vocab_size", "skip_repeats")}
    assert head_settings(576, 49152) == shipped  # the default model's: the shipped preset
    assert head_settings(640, 262144)["draft_vocab_size"] == 8192 and head_settings(64, 97)["draft_vocab_size"] is None


# --------------------------------------------------------------------------- prompts: history, base models


def test_prompts_history_distils_what_chat_kept_and_is_private(tiny, tmp_path, monkeypatch):
    from mlx_redrafter.draft.datastore.use import history_prompts, prompts_path

    folder = str(tiny[0])
    assert cli(["make-drafter", "--model", folder, "--minutes", "1", "--prompts", "history"]) == 1  # none yet
    lines = [" ".join(random.Random(i).choice(WORDS) for _ in range(4)) + "\n/reset\n" for i in range(48)]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(lines)))
    assert cli(["chat", "--model", folder, "--max-tokens", "6", "--drafter", "none"]) == 0
    kept = history_prompts(folder)
    assert len(kept) == 48
    out = tmp_path / "work"
    report = make_drafter(recipe(tiny, out, prompts="history", max_conversations=None), measure=Passes())
    assert report.meta["data"]["prompts"] == "history" and report.meta["data"]["private"] is True
    corpus = read_corpus(out / "data")
    # The exact ids chat fed the model: the distilled prompt positions are each prompt from its second token.
    starts = {tuple(corpus.tokens[a:b][~corpus.reply[a:b]]) for a, b in zip(corpus.offsets[:-1], corpus.offsets[1:])}
    assert starts and starts <= {tuple(p[1:]) for p in kept}
    assert cli(["datastore", "clear", "--model", folder]) == 0
    assert not prompts_path(folder).exists()


def test_a_base_model_without_a_chat_template_is_prompted_with_raw_text(tiny, tmp_path):
    import shutil

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_redrafter.llm.text import encode_prompt
    from mlx_redrafter.prompts import read_conversations

    base = shutil.copytree(tiny[0], tmp_path / "base")
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    tok = load_tokenizer(base)
    assert not tok.has_chat_template
    out = tmp_path / "work"
    report = make_drafter(recipe(tiny, out, model=str(base), max_conversations=6), measure=Passes())
    assert report.meta["recipe"]["distill"]["raw"] is True
    texts = {c["id"]: c["turns"][0] for c in read_conversations(tiny[1])}
    corpus = read_corpus(out / "data")
    for k, cid in enumerate(corpus.ids):
        a, b = corpus.offsets[k], corpus.offsets[k + 1]
        assert corpus.tokens[a:b][~corpus.reply[a:b]].tolist() == encode_prompt(tok, texts[cid])[1:]


# --------------------------------------------------------------------------- the command


def test_cli_make_drafter(tiny, tmp_path, capsys):
    folder, prompts = tiny
    assert cli(["make-drafter", "--model", str(folder), "--minutes", "1", "--hours", "1"]) == 1
    assert "--minutes N or --hours H" in capsys.readouterr().err
    out = tmp_path / "work"
    argv = [
        "make-drafter",
        "--model",
        str(folder),
        "--minutes",
        "0.05",
        "--prompts",
        str(prompts),
        "--max-conversations",
        "16",
        "--out",
        str(out),
    ]
    assert cli(argv) == 0
    text = capsys.readouterr().err
    assert "verdict on" in text and "plain decoding" in text and ("Installed" in text or "Not installed" in text)
    assert state(out)["runs"][0]["command"] == " ".join(
        ["mlx-redrafter"]
        + argv[:3]
        + ["--minutes", "0.05", "--out", str(out), "--prompts", str(prompts), "--max-conversations", "16"]
    )
    assert cli(argv) == 0 and "Already done" in capsys.readouterr().err
    assert cli(["make-drafter", "--model", str(folder), "--minutes", "1", "--out", str(out)]) == 1  # other prompts
    assert "holds a make-drafter run" in capsys.readouterr().err


def test_the_stages_run_in_the_order_the_state_file_names_them(tmp_path):
    """make_drafter calls RecipeRun.stages() in order; the state file keys them by recipe_state.STAGES."""
    from mlx_redrafter.train.recipe import RecipeConfig, RecipeRun
    from mlx_redrafter.train.recipe_state import STAGES, State

    run = RecipeRun(RecipeConfig(model="m", minutes=1.0), State.open(tmp_path, "m", "sharegpt"), tmp_path, print)
    assert tuple(stage.__name__ for stage in run.stages()) == STAGES
    assert run.model is None and run.held_ids is None  # declared, set by load() and the stages
