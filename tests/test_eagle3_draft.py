"""EAGLE-3 heads draft (issue 45): a head loaded by ``load_drafter``, found
by ``--drafter`` or trained by ``make-drafter --head eagle3`` becomes the
draft's layer head (DraftConfig.head): the sourced loop feeds it the target's
three taps, keeps its KV cache in step with the accepted tokens, and joins
its beams to lookup's rows in one tree. Exact with its drafts accepted, in
both published layouts, its reduced vocabulary mapped back through d2t; the
model's own distribution under sampling.

Mutations seen caught here (bench/mutations.py): C3 (d2t without its offsets)."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import pytest
from eagle3_heads import save_pass_through_head
from helpers import assert_exact_under_drafting, bigram_drafter, cli, drafted_share, save_tiny_folder, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from test_sampling import chi2_passes, exact_first_tokens

from mlx_redrafter.config import DraftConfig, SamplingConfig, library_draft
from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.generate import generate_tokens
from mlx_redrafter.hub.load import load_drafter
from mlx_redrafter.llm.load import load_model
from mlx_redrafter.llm.parts import model_parts
from mlx_redrafter.step.loop import columns

PROMPT = "w5 w9 w11 w3 w20"
DRAFT_VOCAB = 72  # of 97: every token the bigram model predicts from one token, and some more


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 4-layer bigram model folder (with its tokenizer) and a head right by
    construction for it in each published layout: the speculators one names
    its taps, the EAGLE repository's names none (EAGLE-3's defaults)."""
    root = tmp_path_factory.mktemp("eagle3-draft")
    folder = save_tiny_folder(root / "model", bigram=True, num_hidden_layers=4)
    model, tok = load_model(str(folder))
    heads = {
        "speculators": save_pass_through_head(root / "spec", model, "speculators", DRAFT_VOCAB, [1, 2, 4]),
        "eagle": save_pass_through_head(root / "eagle", model, "eagle", DRAFT_VOCAB),
    }
    return folder, model, tok, heads


@pytest.mark.parametrize(
    "layout, width, length", [("speculators", 1, 3), ("speculators", 2, 2), ("eagle", 1, 2), ("eagle", 2, 3)]
)
def test_each_published_layout_loads_and_drafts_exactly(tiny, layout, width, length):
    _, model, tok, heads = tiny
    head = load_drafter(heads[layout], dtype="float32")
    assert head.reduced and int(mx.max(head.draft_to_target - mx.arange(DRAFT_VOCAB))) > 0  # d2t is no identity
    got = assert_exact_under_drafting(
        model,
        tok,
        PROMPT,
        drafter=head,
        beam_width=width,
        beam_length=length,
        lookup=False,
        max_tokens=40,
        min_accepted=5,
        source="eagle3",
    )
    assert head.taps == {"speculators": (0, 1, 3), "eagle": (1, 1, 0)}[layout]  # bound to the model it drafted for
    assert max(r.stats.tree_size for r in got) == 1 + width * length  # the head's beams alone, as asked


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_heads_cache_is_a_clean_pass_over_the_accepted_text(tiny, adaptive):
    """Drafts accepted in part and rejected: the head's cache ends holding what a
    teacher-forced pass over the accepted text gives, one entry behind the model's
    (also when a depth controller stops the head's chain early: its dropped call
    is trimmed off too)."""
    _, model, _, heads = tiny
    head = load_drafter(heads["speculators"], dtype="float32")
    cache, prompt = make_prompt_cache(model), [5, 9, 11, 3, 20]
    draft = library_draft(model, head, 1, 4 if adaptive else 3, 0)
    if adaptive:  # keeps 2 of 4 depths, deciding after each call: the third is made, dropped and trimmed off
        draft.controller = _keeping(4, 2)
    tokens, stats = generate_tokens(model, prompt, draft=draft, prompt_cache=cache)
    accepted = [s.accepted for s in stats[1:]]
    assert 0 in accepted and any(0 < a for a in accepted)  # rejected drafts, and accepted ones
    if not adaptive:
        assert any(0 < a < 3 for a in accepted)  # some rejected after accepted ones
    assert {s.source for s in stats if s.accepted} == {"eagle3"}
    model_cache, head_cache = cache[0], cache[-1]
    assert len(cache) == len(model.model.layers) + 1 and head_cache.offset == model_cache.offset - 1
    text = prompt + generate_tokens(model, prompt, max_tokens=80)[0]  # accepted drafts may pass max_tokens
    assert text[5 : 5 + len(tokens)] == tokens
    ids = mx.array(text[: model_cache.offset], mx.int32)[None]
    layers = list(dict.fromkeys(head.taps))
    wide = model_parts(model, layers)[1](ids)
    taps = mx.take(wide, columns(layers, head.taps, model.args.hidden_size, last=False), axis=-1)
    clean = head.make_cache()
    head(ids[:, 1:], taps[:, :-1], clean, first=True)
    want, got = clean[0].keys[..., : clean[0].offset, :], head_cache.keys[..., : head_cache.offset, :]
    assert got.shape == want.shape and mx.allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tree", ["fixed", "auto"])
def test_its_beams_join_lookup_in_one_tree(tiny, tree):
    _, model, tok, heads = tiny
    head = load_drafter(heads["eagle"], dtype="float32")
    got = assert_exact_under_drafting(
        model,
        tok,
        PROMPT,
        drafter=head,
        beam_length=2,
        lookup=2,
        tree=tree,
        max_tokens=40,
        min_accepted=3,
        source="eagle3",
    )
    if tree == "fixed":  # g0, the head's beam, then lookup's rows: one tree
        assert max(r.stats.tree_size for r in got) > 1 + 2


def test_a_head_from_the_store_drafts_by_default(tiny, tmp_path, monkeypatch):
    """``drafter="auto"`` (the default): the store's drafter, an EAGLE-3 head, drafts."""
    from mlx_redrafter.hub.store import install
    from mlx_redrafter.llm.identity import model_identity

    folder, model, tok, heads = tiny
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / "cache"))
    install(heads["speculators"], model_identity(model, str(folder)), {"head": "eagle3"})
    assert_exact_under_drafting(model, tok, PROMPT, lookup=False, max_tokens=30, min_accepted=3, source="eagle3")


def test_an_mtp_head_beside_an_eagle3_drafter_is_refused(tiny):
    from test_sources import pass_through_head, repeating_target

    from mlx_redrafter.generate import generate

    _, model, tok, heads = tiny
    head = load_drafter(heads["speculators"], dtype="float32")
    mtp = pass_through_head(repeating_target())
    with pytest.raises(RedrafterError, match="one layer head"):
        generate(model, tok, PROMPT, drafter=head, mtp=mtp, max_tokens=4)
    with pytest.raises(RedrafterError, match="beam_length"):
        generate(model, tok, PROMPT, drafter=head, mtp_depth=3, max_tokens=4)


# --------------------------------------------------------------------------- adaptive depth (RADAR)


def _controller(length: int, bias: float = 0.0, seed: int = 0, before_call: bool = False):
    """A depth controller for one beam of ``length``: random, its continue
    logit shifted by ``bias`` (+10: always deeper, -10: never)."""
    from mlx_redrafter.draft.controller import Controller, ControllerConfig

    mx.random.seed(seed)
    c = Controller(ControllerConfig(beam_width=1, beam_length=length, before_call=before_call))
    c.mlp[1].bias = c.mlp[1].bias + bias
    mx.eval(c.parameters())
    return c


def _keeping(length: int, keep: int, before_call: bool = False):
    """A depth controller that keeps exactly ``keep`` of ``length`` depths, whatever
    the confidences: its LSTM ignores its input, so its state grows with the
    depth (``h_t = tanh(0.46 t)``), and its continue logit is ``bias - mean(h_t)``,
    with the bias between the ``keep``-th and the next depth's ``h`` (in either
    order the decision on depth ``d + 1`` reads the state after ``d + 1`` inputs)."""
    import math

    c = _controller(length, before_call=before_call)
    h = c.config.hidden
    c.lstm.Wx = mx.zeros_like(c.lstm.Wx)
    c.lstm.Wh = mx.zeros_like(c.lstm.Wh)
    c.lstm.bias = mx.concatenate([mx.full((h,), 10.0), mx.full((h,), 10.0), mx.full((h,), 0.5), mx.full((h,), 10.0)])
    c.mlp[0].weight, c.mlp[0].bias = mx.eye(h), mx.zeros((h,))
    rise = [math.tanh(math.tanh(0.5) * t) for t in range(1, length + 2)]
    c.mlp[1].weight = mx.full((1, h), -1.0 / h)
    c.mlp[1].bias = mx.array([(rise[keep - 1] + rise[keep]) / 2])
    mx.eval(c.parameters())
    return c


@pytest.mark.parametrize("before_call", [False, True])
def test_the_gate_keeps_the_depth_the_controller_picks_from_all_depths(before_call):
    """One depth at a time (a layer head's calls), driven as the head's beam
    search drives it, the same rule as the controller over the whole stack of
    confidences (before each call: the depths drafted so far): stop at the
    first decision below the threshold."""
    from mlx_redrafter.draft.controller import DepthGate, before_call_inputs

    ctrl, picked = _controller(5, before_call=before_call), []
    for seed in range(40):
        mx.random.seed(seed)
        conf = mx.sort(mx.random.uniform(shape=(5, ctrl.top_k)), axis=-1)[:, ::-1]
        inputs = before_call_inputs(conf) if before_call else conf
        # A threshold between this stack's logits: stops at every depth happen.
        logits = sorted(ctrl.continue_logits(inputs)[1:].tolist())
        ctrl.config.threshold = float(mx.sigmoid(mx.array(logits[seed % 4] + 1e-4)))
        gate, kept = DepthGate(ctrl), 0
        while kept < 5 and (kept == 0 or gate.deeper(kept)) and gate.drafted(kept, conf[kept]):
            kept += 1
        assert kept == ctrl.depth(inputs).item()
        assert gate.reads == min(kept, 4)  # one host read per depth past the first, none past a stop
        picked.append(kept)
    assert len(set(picked)) >= 3


@pytest.mark.parametrize("before_call", [True, False])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_adaptive_depth_decides_the_heads_draft_calls_and_stays_exact(tiny, depth, before_call):
    """``controller=`` beside an EAGLE-3 head: the controller decides each step's
    draft calls; the output is plain greedy decoding's, with drafts accepted.
    Before each call (a head's controller as make-drafter trains it) no call
    is wasted; after each (the recurrent drafter's order) a dropped depth's
    call was made."""
    _, model, tok, heads = tiny
    head = load_drafter(heads["speculators"], dtype="float32")
    calls = []
    real = type(head).__call__

    def counted(self, tokens, features, cache=None, first=True, **kw):
        calls.append(first)
        return real(self, tokens, features, cache, first, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(head), "__call__", counted)
        got = assert_exact_under_drafting(
            model,
            tok,
            PROMPT,
            drafter=head,
            beam_width=1,
            beam_length=3,
            controller=_keeping(3, depth, before_call),
            lookup=False,
            max_tokens=40,
            min_accepted=5,
            source="eagle3",
        )
    steps = {r.stats.step: r.stats for r in got if r.stats.step > 0}.values()
    assert {s.depth for s in steps} == {depth}  # only the controller's depth is verified
    chained = calls.count(False)  # depth 1 comes from the commit call; each later depth is one chained call
    wasted = 0 if before_call or depth == 3 else 1  # after each call: the dropped depth's call was made
    assert chained == len(steps) * (depth - 1 + wasted)


def test_the_controller_beside_two_drafters_is_refused(tiny):
    from test_sources import pass_through_head, repeating_target

    from mlx_redrafter.generate import generate

    _, model, tok, _ = tiny
    mtp = pass_through_head(repeating_target())
    with pytest.raises(RedrafterError, match="one drafter"):
        generate(model, tok, PROMPT, drafter=bigram_drafter(model), mtp=mtp, controller=_controller(3), max_tokens=4)


# --------------------------------------------------------------------------- sampling

V = 5
N_RUNS = 400


def test_sampling_with_an_eagle3_head_follows_the_model():
    """Temperature 1: the first three tokens follow the model's own distribution
    (chi-square), the head's reduced vocabulary drafting through d2t."""
    import tempfile

    target = tiny_model("llama", vocab_size=V, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    for layer in target.model.layers:  # the next token follows mostly from the last one
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * 0.02
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * 0.02

    with tempfile.TemporaryDirectory() as tmp:
        head = load_drafter(save_pass_through_head(tmp, target, "speculators", V - 1, [1, 1, 2]), dtype="float32")
    assert head.reduced
    draft = DraftConfig(head=head, head_width=2, head_length=2)
    prompt = [1, 3, 0, 2]
    expected = exact_first_tokens(target, prompt, SamplingConfig(temp=1.0))
    mx.random.seed(7)
    observed, drafted = Counter(), 0
    for _ in range(N_RUNS):
        tokens, stats = generate_tokens(target, prompt, draft=draft, max_tokens=3, temp=1.0)
        observed[tuple(tokens)] += 1
        drafted += sum(s.accepted for s in stats)
    assert drafted > N_RUNS // 2  # drafts were accepted in many runs
    assert chi2_passes(observed, expected, N_RUNS)


# --------------------------------------------------------------------------- the command line


def _generate(capsys, *args):
    code = cli(["generate", "--temp", "0", "--raw", "-n", "30", *args])
    out = capsys.readouterr()
    return code, out.out, " ".join(out.err.split())


@pytest.mark.parametrize("layout", ["speculators", "eagle"])
def test_generate_drafter_points_at_a_head_folder(tiny, capsys, layout):
    folder, _, _, heads = tiny
    code, plain, _ = _generate(capsys, "--model", str(folder), "--no-draft", "-p", PROMPT)
    assert code == 0
    args = ["--model", str(folder), "--drafter", str(heads[layout]), "--no-lookup", "-p", PROMPT]
    code, out, err = _generate(capsys, *args)
    assert code == 0 and out == plain
    assert "1 EAGLE-3 guess of 2 tokens per step" in err and f"drafter {heads[layout]}" in err
    assert drafted_share(err) > 0
    code, _, err = _generate(capsys, *args, "--mtp-depth", "3")
    assert code != 0 and "--beam-width/--beam-length" in err


def _eagle3_share(err: str) -> float:
    import re

    shares = re.findall(r"(\d+)% eagle3", err)
    assert shares, f"no '% eagle3' in:\n{err}"
    return int(shares[-1]) / 100


def test_a_head_make_drafter_trained_drafts_through_drafter(tiny, tmp_path, monkeypatch, capsys):
    """``make-drafter --head eagle3`` on the bigram model: its verdict measures
    the head drafting (exact, tokens/step above 1), and ``generate --drafter``
    pointed at the folder it wrote drafts with it, exactly, its drafts accepted."""
    import json
    import random

    from mlx_redrafter.train.budget import Sizes
    from mlx_redrafter.train.recipe import RecipeConfig, make_drafter

    folder = tiny[0]
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / "cache"))
    rng, words = random.Random(0), [f"w{i}" for i in range(5, 90)]
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"id": f"c{i}", "turns": [" ".join(rng.choice(words) for _ in range(8))]}) + "\n")
    sizes = Sizes(controller_prompts=2, controller_tokens=16, verdict_prompts=3, verdict_tokens=24, calibrate_s=0.3)
    eagle3 = dict(batch_size=8, window=32, max_steps=100, draft_vocab_size=48, lr=3e-3, warmup_steps=5, depth=3)
    cfg = RecipeConfig(
        model=str(folder),
        minutes=1.0,
        out=tmp_path / "work",
        prompts=str(tmp_path / "prompts.jsonl"),
        max_conversations=60,
        sizes=sizes,
        distill={"batch_size": 8, "max_new_tokens": 24},
        eagle3=eagle3,
        head="eagle3",
    )
    report = make_drafter(cfg)
    measured = report.verdict["eagle3"]
    assert measured["identical_outputs"] == 3 and measured["tokens_per_step"] > 1.2
    assert (measured["beam_width"], measured["beam_length"]) == (1, 2)  # a layer head's built-in shape
    head = tmp_path / "work" / "eagle3"
    assert json.loads((head / "config.json").read_text())["speculators_model_type"] == "eagle3"
    code, plain, _ = _generate(capsys, "--model", str(folder), "--no-draft", "-p", PROMPT)
    code, out, err = _generate(capsys, "--model", str(folder), "--drafter", str(head), "--no-lookup", "-p", PROMPT)
    assert code == 0 and out == plain
    assert _eagle3_share(err) > 0.1
    # The depth controller make-drafter trained beside the head decides its calls (--adaptive) ...
    adaptive = ["--model", str(folder), "--drafter", str(head), "--no-lookup", "--adaptive", "-p", PROMPT]
    code, out, err = _generate(capsys, *adaptive, "-L", "3")
    assert code == 0 and out == plain, (out, plain, err)
    assert "adaptive depth" in err
    assert _eagle3_share(err) > 0.1
    # ... and train-controller retrains it for the head on this device.
    before = (head / "controller.safetensors").stat().st_mtime_ns
    code = cli(["train-controller", "--model", str(folder), "--drafter", str(head), "--num-prompts", "2", "-n", "16",
                "-L", "3", "--epochs", "3"])  # fmt: skip
    err = " ".join(capsys.readouterr().err.split())
    assert code == 0 and "steps recorded" in err and (head / "controller.safetensors").stat().st_mtime_ns > before
    assert json.loads((head / "controller.json").read_text())["beam_length"] == 3


def test_sweep_shapes_an_eagle3_heads_beams_and_generate_uses_its_profile(tiny, tmp_path, monkeypatch, capsys):
    import json

    folder, _, _, heads = tiny
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "p.jsonl").write_text('{"id": "a", "turns": ["w5 w9 w11"]}\n{"id": "b", "turns": ["w40 w7"]}\n')
    head, out = heads["speculators"], tmp_path / "sweep"
    args = ["sweep", "--model", str(folder), "--drafter", str(head), "--widths", "1,2", "--lengths", "2"]
    args += ["--prompts", str(tmp_path / "p.jsonl"), "--num-prompts", "2", "--max-tokens", "12", "--out", str(out)]
    assert cli([*args, "--save-profile"]) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    alone = [c for c in results["cells"] if c["lookup"] == 0 and c["tree"] == "fixed"]
    assert all(c["identical_outputs"] == 2 for c in results["cells"])
    assert {c["width"]: c["tree_size"] for c in alone} == {1: 3, 2: 5}  # g0 and the head's W x 2 drafts
    assert all(c["tokens_per_step"] > 1 for c in alone)  # its drafts accepted
    best = results["best"]
    code, _, err = _generate(capsys, "--model", str(folder), "--drafter", str(head), "-p", PROMPT)
    guesses = f"{best['width']} EAGLE-3 guess{'es' if best['width'] > 1 else ''} of {best['length']} tokens"
    assert code == 0 and guesses in err and "tuned profile" in err


def test_a_chat_drafts_with_an_eagle3_head_in_the_settings_shape(tiny):
    """ChatSession with an EAGLE-3 drafter: every turn equals plain greedy
    decoding with the head's drafts accepted, its beams shaped by the settings
    (``/set beam_width=`` reaches the head)."""
    from mlx_redrafter.chat import ChatSession, ChatSettings
    from mlx_redrafter.generate import generate
    from mlx_redrafter.prompts import build_messages, render_messages

    _, model, tok, heads = tiny
    head = load_drafter(heads["eagle"], dtype="float32")
    s = ChatSession(model, tok, head, ChatSettings(max_tokens=24, beam_width=1, beam_length=2, lookup=0))
    t1 = s.reply("w5 w9 w11")
    s.settings.beam_width = 2
    assert s.draft().head_width == 2 and s.draft().head_length == 2 and s.draft().drafter is None
    t2 = s.reply("w40 w7 w3")
    history = []
    for turn, user in ((t1, "w5 w9 w11"), (t2, "w40 w7 w3")):
        full = render_messages(tok, build_messages(None, history, user))
        assert turn.reply == generate(model, tok, full, drafter=None, lookup=False, max_tokens=24)
        history.append((user, turn.reply))
    assert t1.tally.source_tokens.get("eagle3", 0) >= 2 and t2.tally.source_tokens.get("eagle3", 0) >= 2
    assert t2.tally.tree_tokens > t1.tally.tree_tokens * t2.tally.steps / t1.tally.steps  # wider trees: W = 2
