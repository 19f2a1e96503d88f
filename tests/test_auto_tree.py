"""tree="auto" through the step loops: the same tokens as plain decoding on
every tiny architecture and the default model (drafter, lookup, both; both
loops), tree sizes from the buckets, a steep curve falls back to g0 alone,
calibration learns from what the loop reads, sampling keeps the model's
distribution, and still one read per step."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    TINY_CONFIGS,
    OracleDrafter,
    accepted_in_steps,
    assert_tokens_exact,
    generate_tokens,
    prompts,
    random_drafter,
    run_steps,
    tiny_model,
)
from test_sampling import PROMPT, V_SMALL, chi2_passes, exact_first_tokens, small_model  # noqa: F401

from mlx_redrafter.config import DraftConfig, SamplingConfig
from mlx_redrafter.step.auto import AutoTree, can_pay
from mlx_redrafter.step.curve import CostCurve, builtin_curve
from mlx_redrafter.step.plan import make_plan
from mlx_redrafter.step.select import BUCKETS
from mlx_redrafter.step.sources import request_sources
from mlx_redrafter.step.sources.lookup import PRIOR as LOOKUP

N = 32
FLAT = CostCurve(tuple([1.0] * 16))  # extra tokens are free: verify every candidate (up to a bucket)
STEEP = CostCurve(tuple(float(n) for n in range(1, 17)))  # every token costs a plain step: nothing pays
SHALLOW = CostCurve(tuple(1.0 + 0.12 * (n - 1) for n in range(1, 17)))  # some nodes pay, not all


def run(model, p, draft, n=N, history=()):
    """The first ``n`` tokens of the step loop and its stats."""
    return run_steps(model, p, draft, n, history=history)[:2]


def accepted(got, stats, source=None) -> int:
    return accepted_in_steps(stats, len(got), source)


def auto(drafter, w, l, lookup, curve, pipelined=True, **kw):
    return DraftConfig(drafter, w, l, lookup=lookup, tree="auto", curve=curve, pipelined=pipelined, **kw)


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny(request):
    model = tiny_model(request.param)
    p = prompts(1)[0]
    return request.param, model, p, generate_tokens(model, p, max_tokens=N)[0]


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "synchronous"])
@pytest.mark.parametrize("shape,lookup", [((2, 3), 0), ((3, 1), 1), ((0, 0), 1)], ids=["drafter", "both", "lookup"])
@pytest.mark.parametrize("curve", [FLAT, SHALLOW, builtin_curve()], ids=["flat", "shallow", "builtin"])
def test_auto_trees_are_exact_on_tiny_models(tiny, pipelined, shape, lookup, curve):
    """The oracle's drafts and lookup copies from a context holding this very reply: both right."""
    kind, model, p, ref = tiny
    drafter = OracleDrafter(model, p, N, shape[1]) if shape[0] else None
    w, l = shape if shape[0] else (2, 1)
    got, stats = run(model, p, auto(drafter, w, l, lookup, curve, pipelined), history=p + ref if lookup else ())
    assert got == ref, kind
    assert accepted(got, stats) >= 4, kind  # drafts were accepted on every curve
    assert all(s.host_syncs == s.step + 1 for s in stats)  # one read per step
    caps = 1 + (w * l if drafter else 0) + lookup * 4
    assert all(s.tree_size <= caps for s in stats)


def test_auto_with_a_real_drafters_beams_is_exact(tiny):
    """A real drafter's beam search beside the oracle's right beam, and lookup rows."""
    kind, model, p, ref = tiny
    drafter = OracleDrafter(model, p, N, 2, inner=random_drafter(exit_dim=48, num_draft_layers=1))
    for pipelined in (True, False):
        got, stats = run(model, p, auto(drafter, 2, 2, 1, SHALLOW, pipelined))
        # A prefix the rows share is verified once, in its first row's place; the
        # longest row accepted takes the step (a lookup row on a reply that repeats).
        assert got == ref and accepted(got, stats) >= 4 and accepted(got, stats, "drafter") >= 1, kind


@pytest.mark.parametrize("lookup", [0, 1], ids=["drafter", "both"])
def test_the_controller_and_auto_together_are_exact(lookup):
    """The controller (RADAR) decides how deep the drafter's rows go, the
    selection which of their nodes are verified: exact, and a controller that
    always stops at depth 1 caps the drafter's part of even a flat curve's tree."""
    from mlx_redrafter.draft.controller import Controller, ControllerConfig

    model, p = tiny_model("llama"), prompts(1)[0]
    ref = generate_tokens(model, p, max_tokens=N)[0]
    drafter = OracleDrafter(model, p, N, 3)
    ctrl = Controller(ControllerConfig(beam_width=2, beam_length=3))
    mx.eval(ctrl.parameters())
    for threshold in (0.5, 1 - 1e-6):  # 1 - 1e-6: never one level deeper
        ctrl.config.threshold = threshold
        got, stats = run(model, p, auto(drafter, 2, 3, lookup, FLAT, controller=ctrl))
        assert got == ref and accepted(got, stats) >= 4
        assert all(s.tree_size <= 1 + 2 * 3 + 4 * lookup for s in stats)
    if not lookup:
        assert max(s.tree_size for s in stats) <= 1 + 2 * 1  # depth 1 for both beams
        assert max(s.tree_size for s in run(model, p, auto(drafter, 2, 3, 0, FLAT))[1]) > 3  # without it: deeper


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "synchronous"])
def test_a_long_context_prices_trees_dearer(pipelined):
    """A curve flat after a short context and steep after a long one: a short
    prompt verifies drafts, a long one g0 alone (its trees attend to more
    cached tokens), and both stay exact."""
    model = tiny_model("llama")
    curve = CostCurve(FLAT.costs, context=16, long_costs=STEEP.costs, long_context=48)
    sizes = {}
    for n in (8, 120):
        p = (prompts(1)[0] * 20)[:n]
        ref = generate_tokens(model, p, max_tokens=24)[0]
        got, stats = run(model, p, auto(OracleDrafter(model, p, 24, 2), 2, 2, 1, curve, pipelined), 24)
        assert got == ref
        sizes[n] = max(s.tree_size for s in stats), accepted(got, stats)
    assert sizes[8][0] > 1 and sizes[8][1] >= 4  # short: drafts verified and accepted
    assert sizes[120] == (1, 0)  # long: g0 alone


def test_pipelined_sizes_come_from_the_buckets():
    model = tiny_model("llama")
    p = prompts(1)[0]
    oracle = OracleDrafter(model, p, N, 3)
    for curve in (FLAT, SHALLOW, builtin_curve()):
        _, stats = run(model, p, auto(oracle, 3, 3, 1, curve))
        assert {s.tree_size for s in stats[1:]} <= set(BUCKETS)
    _, flat = run(model, p, auto(oracle, 3, 3, 1, FLAT))
    assert max(s.tree_size for s in flat[1:]) == 12  # 13 candidates: the largest bucket they fill


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_steep_curve_verifies_g0_alone(pipelined):
    model = tiny_model("qwen3")
    p = prompts(1)[0]
    ref = generate_tokens(model, p, max_tokens=N)[0]
    got, stats = run(model, p, auto(OracleDrafter(model, p, N, 2), 2, 2, 1, STEEP, pipelined))
    assert got == ref
    assert all(s.tree_size == 1 and s.accepted == 0 for s in stats)


@pytest.mark.parametrize("pipelined", [True, False], ids=["ahead", "after-read"])
def test_calibration_learns_from_the_read(monkeypatch, pipelined):
    """Both schedules choose on the device and learn from the codes in the step's read."""
    from mlx_redrafter.step import auto as auto_mod

    seen = []
    original = auto_mod.AutoTree.observe

    def spy(self, structure, codes, path):
        seen.append((list(codes), list(path)))
        return original(self, structure, codes, path)

    monkeypatch.setattr(auto_mod.AutoTree, "observe", spy)
    model = tiny_model("llama")
    p = prompts(1)[0]
    got, stats = run(model, p, auto(OracleDrafter(model, p, N, 2), 2, 2, 0, FLAT, pipelined))
    assert got == generate_tokens(model, p, max_tokens=N)[0] and accepted(got, stats) >= 4
    assert len(seen) >= len(stats) - 2  # every verified tree is learned from (the last one may be unread)
    # 4 candidates, so bucket 4 (g0 + 3 nodes); the oracle drafts real tokens, never padding.
    assert all(len(codes) == 3 and min(codes) >= 0 for codes, _ in seen)
    assert sum(len(path) > 1 for _, path in seen) > 0


# --------------------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def default():
    from mlx_redrafter.hub.load import load_drafter
    from mlx_redrafter.llm.load import load_model
    from mlx_redrafter.runtime import shipped_drafter_path

    model, tok = load_model("default")
    drafter = load_drafter(shipped_drafter_path("default"))
    p = tok.apply_chat_template(
        [{"role": "user", "content": "List three facts about the moon, then repeat them."}], add_generation_prompt=True
    )
    return model, drafter, p, generate_tokens(model, p, max_tokens=32)[0]


@pytest.mark.parametrize("which,pipelined", [("drafter", True), ("lookup", True), ("both", True), ("both", False)])
def test_default_model_auto_is_exact(default, pipelined, which):
    model, drafter, p, ref = default
    d = None if which == "lookup" else drafter
    draft = auto(d, 2, 2, 0 if which == "drafter" else 1, SHALLOW, pipelined)
    source = None if which == "both" else which  # "List ... then repeat them": lookup copies too
    assert_tokens_exact(model, p, draft, plain=ref, max_tokens=32, min_accepted=2, source=source)


# --------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("pipelined,runs", [(True, 600), (False, 300)], ids=["pipelined", "synchronous"])
def test_auto_sampling_matches_the_model(small_model, pipelined, runs):  # noqa: F811
    """W=3 L=2 beams share prefixes: the selection keeps each prefix once, and
    the walk over the chosen subtree still emits the model's distribution
    (the first two tokens: the second comes from a walk over a selected tree)."""
    cfg = SamplingConfig(temp=1.0)
    drafter = random_drafter(hidden=32, vocab=V_SMALL, exit_dim=32, num_draft_layers=1)
    draft = auto(drafter, 3, 2, 1, SHALLOW, pipelined, lookup_length=2)
    prompt = PROMPT * 3
    expected = exact_first_tokens(small_model, prompt, cfg, k=2)
    mx.random.seed(7)
    observed, sizes, drafted = Counter(), Counter(), 0
    for _ in range(runs):
        tokens, stats = generate_tokens(small_model, prompt, draft=draft, max_tokens=2, temp=cfg.temp)
        observed[tuple(tokens)] += 1
        sizes.update(s.tree_size for s in stats[1:])
        drafted += accepted(tokens, stats)
    assert max(sizes) > 2 and min(sizes) < 1 + 3 * 2 + 2  # real subsets: more than one node, fewer than all 8
    assert drafted > runs // 10  # the second token came from an accepted draft in many runs
    assert chi2_passes(observed, expected, runs)


def test_the_controller_prices_verification_with_the_curve():
    from mlx_redrafter.train.controller import curve_latency, step_cost

    latency = {"plain": 10.0, "verify_1": 10.0, "verify_2": 30.0, "verify_4": 31.0, "draft": 1.0, "controller": 0.5}
    priced = curve_latency(latency, SHALLOW)
    assert priced["verify_2"] == pytest.approx(11.2) and priced["verify_4"] == pytest.approx(13.6)
    assert priced["draft"] == 1.0 and priced["plain"] == 10.0
    assert step_cost(priced, np.array([2.0])) == pytest.approx(11.2 + 1.5)


# --------------------------------------------------------------------------- when nothing can pay


Q4_LIKE = CostCurve(tuple(1.0 + 0.97 * (n - 1) for n in range(1, 17)))  # a 4-bit model on this CPU


@pytest.mark.parametrize(
    "curve,pays",
    [
        (FLAT, True),
        (SHALLOW, True),
        (builtin_curve(), True),
        (STEEP, False),
        (Q4_LIKE, False),
        (builtin_curve("q4g64-float32"), False),
    ],
    ids=["flat", "shallow", "builtin", "steep", "q4-like", "builtin-q4"],
)
def test_can_pay_known_answers(curve, pays):
    model = tiny_model("llama")
    drafter = random_drafter(exit_dim=48, num_draft_layers=1)
    for draft in (auto(drafter, 2, 1, 1, curve), auto(None, 2, 1, 1, curve), auto(drafter, 4, 3, 0, curve)):
        assert can_pay(request_sources(draft), curve) == pays
        plan = make_plan(model, draft)
        assert plan.drafting == pays and (pays or "pay" in plan.reason)
    assert make_plan(model, DraftConfig(drafter, 2, 1, lookup=1, curve=STEEP)).drafting  # a fixed tree always drafts


@pytest.mark.parametrize("pipelined", [True, False])
def test_auto_runs_plain_decoding_when_nothing_pays(monkeypatch, pipelined):
    """tree="auto" on a curve where no draft can pay runs mlx-lm's plain decoding:
    the same tokens, and the step loops are never entered."""
    import mlx_redrafter.step.dispatch as dispatch

    model = tiny_model("llama")
    p = prompts(1)[0]
    ref = generate_tokens(model, p, max_tokens=N)[0]

    def refuse(*a, **k):
        raise AssertionError("the ReDrafter loop ran although nothing pays")

    monkeypatch.setattr(dispatch, "ahead_steps", refuse)
    monkeypatch.setattr(dispatch, "after_read_steps", refuse)
    draft = auto(OracleDrafter(model, p, N, 2), 2, 2, 1, STEEP, pipelined)
    out, stats = generate_tokens(model, p, draft=draft, max_tokens=N)
    assert out == ref
    assert all(s.tree_size == 1 for s in stats)


def test_the_default_tree_follows_the_model_variant(tmp_path, monkeypatch):
    """Quantized models default to tree="auto" (with the built-in quantized
    curve, where nothing pays), float ones to "fixed" (bench/RESULTS.md)."""
    import mlx.nn as nn

    from mlx_redrafter.keywords import with_curve
    from mlx_redrafter.step.curve import curve_for, default_tree

    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path))
    model = tiny_model("llama")
    assert default_tree(model) == "fixed"
    nn.quantize(model, group_size=32, bits=4)
    assert default_tree(model) == "auto"
    curve = curve_for(model)
    assert curve.builtin and curve.variant.startswith("q4g32") and curve(2) > 1.5
    draft = with_curve(model, DraftConfig(lookup=1, tree=default_tree(model)))
    assert not make_plan(model, draft).drafting


def test_a_strong_host_match_sizes_the_bucket_for_its_row():
    """The pipelined loop passes the host's lookup match length: a weak match
    verifies g0 alone, a strong one its row (SHALLOW curve)."""
    at = AutoTree(SHALLOW, [LOOKUP])
    structure, _ = at.shape([4], ["lookup"])
    assert at.bucket(structure, [1.0] * 4) == 1
    assert at.bucket(structure, [6.0] * 4) == 4
    assert at.bucket(structure, [float("nan")] * 4) == at.bucket(structure)  # unknown: the rank rates


# --------------------------------------------------------------------------- rows left out are learned from


def test_a_row_left_out_is_learned_from_the_greedy_tokens():
    """Greedy, a draft token is accepted exactly when it equals the model's
    own: a host row that was not verified still teaches its cells."""
    at = AutoTree(FLAT, [LOOKUP])
    k = at.cal.channel("lookup")
    before = at.cal.trials.copy(), at.cal.hits.copy()
    # Proposed after the read history: it must first repeat what the step in flight emitted ([5]).
    at.observe_unverified([[5, 6, 7, 8, 9], [4, 6, 7, 8, 9]], [2, 3], "lookup", before=[5], emitted=[6, 7, 1])
    trials, hits = at.cal.trials - before[0], at.cal.hits - before[1]
    b = 1  # matched 2 tokens: the lookup's second score bucket
    assert [trials[k, d, b] for d in range(3)] == [1, 1, 1]
    assert [hits[k, d, b] for d in range(3)] == [1, 1, 0]  # 6 and 7 right, 8 wrong (the model said 1)
    assert trials.sum() == 3  # the row that does not line up with [5] is not a trial; nothing past `emitted` is


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "synchronous"])
def test_the_loops_learn_from_lookup_rows_they_leave_out(monkeypatch, pipelined):
    """A curve on which a weak lookup match never pays at the prior: the
    rows are left out (g0 alone), and the loop still learns from them."""
    from mlx_redrafter.step import auto as auto_mod

    seen = []
    original = auto_mod.AutoTree.observe_unverified

    def spy(self, *args, **kwargs):
        seen.append(args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(auto_mod.AutoTree, "observe_unverified", spy)
    model = tiny_model("llama")
    p = prompts(1)[0]
    ref = generate_tokens(model, p, max_tokens=N)[0]
    steep_start = CostCurve(tuple([1.0, 1.55] + [1.55 + 0.6 * n for n in range(1, 15)]))
    # The lookup context holds this very reply: every proposed row is right.
    got = run_steps(model, p, auto(None, 2, 1, 1, steep_start, pipelined), N, history=p + ref)[0]
    assert got == ref
    assert seen and all(source == "lookup" for _, _, source, _, _ in seen)
