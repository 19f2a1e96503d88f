"""Cost-aware draft trees: the selection rule, its calibration, bucket shapes,
parent-closure of the device selection, and the verify-cost curve's storage."""

import itertools
import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_redrafter.step import curve as vc
from mlx_redrafter.step import select as ts
from mlx_redrafter.step.accept import accept_greedy
from mlx_redrafter.step.sources.datastore import PRIOR as DATASTORE
from mlx_redrafter.step.sources.lookup import PRIOR as LOOKUP
from mlx_redrafter.step.sources.redrafter import PRIOR as DRAFTER
from mlx_redrafter.step.tree import layout
from mlx_redrafter.tuning import calibrate

# The channels of these tests: each source's prior, in this order (channel 0 the drafter's, 1 lookup's).
PRIORS = [DRAFTER, LOOKUP, DATASTORE]
EDGES = ts.Calibration(PRIORS).edges


def calibration(**kw):
    return ts.Calibration(PRIORS, **kw)


def rows(lengths, names):
    return ts.row_structure(lengths, [[p.name for p in PRIORS].index(n) for n in names])


def curve(costs):
    return vc.CostCurve(tuple(float(c) for c in costs))


FLAT = curve([1.0] * 16)
STEEP = curve(range(1, 17))  # every token costs a plain step: nothing can pay

# W=2 L=2 drafter beams and a 4-token lookup row, in layout order.
LENGTHS, SOURCES = (2, 2, 4), ("drafter", "drafter", "lookup")


def structure():
    return rows(LENGTHS, SOURCES)


def brute_force(p, s, c):
    """The best parent-closed subset by enumeration."""
    best, best_set = ts.expected_gain(0.0, 1, c), ()
    for r in range(1, s.size + 1):
        for subset in itertools.combinations(range(s.size), r):
            chosen = set(subset)
            if all(s.parent[i] < 0 or s.parent[i] in chosen for i in subset):
                value = ts.expected_gain(sum(p[i] for i in subset), r + 1, c)
                if value > best + 1e-12:
                    best, best_set = value, subset
    return best, set(best_set)


# --------------------------------------------------------------------------- the selection rule


def test_flat_curve_verifies_every_candidate():
    s = structure()
    p = ts.path_p(np, s.parent, np.full(s.size, 0.3), 4)
    chosen, value = ts.best_subset(p, s, FLAT)
    assert sorted(chosen) == list(range(s.size))
    assert value == pytest.approx(1 + p.sum())


def test_steep_curve_verifies_g0_alone():
    s = structure()
    p = ts.path_p(np, s.parent, np.full(s.size, 0.9), 4)
    assert ts.best_subset(p, s, STEEP) == ([], 1.0)
    assert ts.pick_bucket(p, s, STEEP) == 1


def test_dominant_lookup_match_verifies_its_row():
    """A lookup row the text keeps accepting, beside weak drafter beams, on
    the steep measured CPU curve: the whole row and nothing else."""
    s = structure()
    cal = calibration()
    row = [4, 5, 6, 7]  # the lookup row's packed indices in a tree of all 8 candidates
    obs = ts.Observed(
        [0, 0, 0, 0, 1, 1, 1, 1], [1, 2, 1, 2, 1, 2, 3, 4], [0, 0, 0, 0, 4, 4, 4, 4], [0, 1, 0, 3, 0, 5, 6, 7]
    )
    for _ in range(200):
        cal.observe(obs, [0, 5, 6, 7, 8])
    score = np.array([np.log(0.05)] * 4 + [5.0] * 4, np.float32)
    p, _ = ts.node_p(np, s, score, np.ones(s.size, bool), cal.table(), EDGES)
    chosen, _ = ts.best_subset(p, s, vc.builtin_curve())
    assert sorted(chosen) == row
    # The same with a weak match (2 tokens, the prior): no full row.
    p_weak, _ = ts.node_p(
        np, s, np.array([np.log(0.05)] * 4 + [2.0] * 4, np.float32), np.ones(s.size, bool), calibration().table(), EDGES
    )
    assert len(ts.best_subset(p_weak, s, vc.builtin_curve())[0]) < 4


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_greedy_is_exact_on_random_trees_and_curves(data):
    n = data.draw(st.integers(1, 7))
    parent = np.array([-1] + [data.draw(st.integers(-1, i - 1)) for i in range(1, n)], np.int32)
    depth = np.ones(n, np.int32)
    for i in range(n):
        depth[i] = 1 if parent[i] < 0 else depth[parent[i]] + 1
    s = ts.Structure(parent, np.zeros(n, np.int32), depth)
    q = np.array(data.draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n)))
    p = ts.path_p(np, parent, q, int(depth.max()))
    costs = np.cumsum([1.0] + data.draw(st.lists(st.floats(0.0, 1.5), min_size=15, max_size=15)))
    c = curve(costs)
    chosen, value = ts.best_subset(p, s, c)
    best, _ = brute_force(p, s, c)
    assert value == pytest.approx(best)
    assert all(parent[i] < 0 or parent[i] in chosen[:k] for k, i in enumerate(chosen))


def test_non_convex_curve_is_evaluated_at_every_size():
    """c(8) < c(7) (as measured here): a first-stop greedy would stop early."""
    s = rows([7], ["lookup"])
    p = np.array([0.5, 0.3, 0.2, 0.15, 0.1, 0.1, 0.1])
    bumpy = curve([1.0, 1.4, 1.9, 2.4, 2.6, 2.7, 2.8, 1.5] + [3.0] * 8)
    chosen, value = ts.best_subset(p, s, bumpy)
    assert len(chosen) == 7 and value == pytest.approx((1 + p.sum()) / 1.5)


# --------------------------------------------------------------------------- calibration


def test_calibration_moves_toward_what_it_observes():
    s = rows([1, 1], ["drafter", "drafter"])
    score = np.array([np.log(0.6), np.log(0.2)], np.float32)  # buckets 3 and 1
    cal = calibration()
    before = ts.node_p(np, s, score, np.ones(2, bool), cal.table(), EDGES)[0]
    obs = ts.Observed([0, 0], [1, 1], [3, 1], [0, 0], [0, 1])
    for _ in range(50):
        cal.observe(obs, [0, 1])  # the first node is accepted, its sibling is not
    after = ts.node_p(np, s, score, np.ones(2, bool), cal.table(), EDGES)[0]
    assert after[0] > before[0] and after[1] < before[1]
    assert cal.marginal(0, 1, rank=0) > DRAFTER.slots[0, 0]
    assert cal.marginal(0, 1, rank=1) < DRAFTER.slots[0, 1]
    for _ in range(500):
        cal.observe(obs, [0])  # now nothing is accepted
    assert cal.table()[0, 0, 3] < before[0]


def test_calibration_counts_only_nodes_whose_parent_was_accepted():
    cal = calibration()
    obs = ts.Observed([1, 1], [1, 2], [2, 2], [0, 1])
    cal.observe(obs, [0])  # node 1 rejected: node 2 (its child) tells nothing
    assert cal.trials[1, 0, 2] == 1 and cal.trials[1, 1, 2] == 0
    cal.observe(obs, [0, 1, 2])
    assert cal.hits[1, 0, 2] == 1 and cal.hits[1, 1, 2] == 1 and cal.trials[1, 1, 2] == 1
    cal.observe(ts.Observed([1], [1], [-1], [0]), [0])  # padding is never observed
    assert cal.trials.sum() == 3


def test_calibration_forgets_past_its_weight():
    cal = calibration(max_weight=100)
    obs = ts.Observed([0], [1], [2], [0])
    for _ in range(300):
        cal.observe(obs, [0, 1])
    assert cal.trials[0, 0, 2] == pytest.approx(100)
    for _ in range(100):
        cal.observe(obs, [0])
    assert cal.table()[0, 0, 2] < 0.5


def test_lookup_acceptance_rises_with_match_length():
    q = LOOKUP.q
    assert (np.diff(q, axis=1) > 0).all()
    lengths = ts.bucket_of(np, EDGES, np.ones(5, np.int32), np.array([1, 2, 3, 4, 9], np.float32))
    assert lengths.tolist() == [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------- buckets and the device


def test_pick_bucket_returns_a_bucket_the_candidates_fill():
    s = structure()
    for c in (FLAT, STEEP, vc.builtin_curve()):
        for q in (0.05, 0.4, 0.95):
            b = ts.pick_bucket(ts.path_p(np, s.parent, np.full(s.size, q), 4), s, c)
            assert b in ts.BUCKETS and b - 1 <= s.size
    assert ts.pick_bucket(np.full(s.size, 0.5), s, FLAT) == 8  # the largest that fits 8 candidates
    assert ts.pick_bucket(calibration().estimate(s), s, STEEP) == 1


@pytest.mark.parametrize("bucket", ts.BUCKETS[:6])
def test_device_selection_shapes(bucket):
    s = structure()
    k = bucket - 1
    score = mx.array([-0.5, -1.0, -2.0, -0.1, 3, 3, 3, 3], mx.float32)
    sel = ts.select_device(s, score, mx.ones((s.size,), mx.bool_), calibration().device_table(), EDGES, k)
    assert sel.nodes.shape == (k,) and sel.codes.shape == (k,) and sel.position.shape == (s.size,)
    assert sel.depth.shape == (bucket,) and sel.parent.shape == (bucket,) and sel.mask.shape == (bucket, bucket)
    tree = sel.tree(mx.arange(s.size, dtype=mx.int32) + 10, mx.array(1))
    assert tree.size == bucket


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_device_selection_is_parent_closed_and_matches_the_host(data):
    """Top-k by p (ties to the shallower) on random trees, scores, validity
    and k: the chosen set is parent-closed, ordered parents first, its mask
    is the ancestor relation, and it has the host's best sum of p for k."""
    n = data.draw(st.integers(1, 12))
    parent = np.array([-1] + [data.draw(st.integers(-1, i - 1)) for i in range(1, n)], np.int32)
    depth = np.ones(n, np.int32)
    for i in range(n):
        depth[i] = 1 if parent[i] < 0 else depth[parent[i]] + 1
    source = np.array(data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), np.int32)
    s = ts.Structure(parent, source, depth)
    # Few distinct scores, so that ties in p are common.
    score = np.array(
        data.draw(st.lists(st.sampled_from([-3.0, -0.7, 0.0, 2.0, 3.0]), min_size=n, max_size=n)), np.float32
    )
    valid = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    k = data.draw(st.integers(0, n))
    table = calibration().table()
    sel = ts.select_device(s, mx.array(score), mx.array(valid), mx.array(table), EDGES, k)
    nodes = np.array(sel.nodes).tolist()
    assert len(set(nodes)) == k
    for j, i in enumerate(nodes):
        assert parent[i] < 0 or parent[i] in nodes[:j]
    anc = s.ancestors()
    ext = [0] + [i + 1 for i in nodes]
    np.testing.assert_array_equal(np.array(sel.mask), anc[np.ix_(ext, ext)])
    packed_parent = [0] + [nodes.index(parent[i]) + 1 if parent[i] >= 0 else 0 for i in nodes]
    assert np.array(sel.parent).tolist() == packed_parent
    p, _ = ts.node_p(np, s, score, valid, table, EDGES)
    order = ts.greedy_order(p, parent, depth)
    assert np.float32(p[nodes].sum()) == pytest.approx(p[order[:k]].sum(), rel=1e-5)


def test_selection_feeds_acceptance_and_the_calibration():
    """Select 3 of W=1 L=1 + a 4-token lookup row, verify with logits that
    accept the lookup row's first two tokens, and read it back as the loop would."""
    lengths = (1, 4)
    s = rows(lengths, ("drafter", "lookup"))
    lay = layout(lengths)
    beams = mx.array([[20, -1, -1, -1], [30, 31, 32, 33]], mx.int32)
    tokens = mx.array([20, 30, 31, 32, 33], mx.int32)
    score = mx.array([np.log(0.05), 3, 3, 3, 3], mx.float32)
    sel = ts.select_device(s, score, mx.ones((5,), mx.bool_), calibration().device_table(), EDGES, 3)
    assert np.array(sel.nodes).tolist() == [1, 2, 3]  # the lookup row's first three tokens
    sel_beams, node_index = sel.rows(beams, lay.node_index)
    tree = sel.tree(tokens, mx.array(7))
    assert np.array(tree.tokens).tolist() == [7, 30, 31, 32]
    vocab = 40
    want = [30, 31, 5, 5]  # the argmax after g0, node 1, node 2, node 3
    logits = mx.array(np.eye(vocab, dtype=np.float32)[want])
    acc = accept_greedy(sel_beams, node_index, logits)
    assert int(acc.n) == 2 and int(acc.next_token) == 5
    obs = ts.decode_codes(np.array(sel.codes).tolist(), s)
    assert obs.source == [1, 1, 1] and obs.depth == [1, 2, 3] and obs.parent == [0, 1, 2]
    cal = calibration()
    cal.observe(obs, np.array(acc.path).tolist()[: int(acc.n) + 1])
    assert cal.hits[1, 0, 2] == 1 and cal.hits[1, 1, 2] == 1 and cal.trials[1, 2, 2] == 1 and cal.hits[1, 2, 2] == 0


def test_a_prefix_rows_share_is_verified_once_and_what_hangs_below_it_stays():
    """Two block rows ``[a, b, c]`` and ``[a, b, d]`` (a block's or a beam
    search's top paths share prefixes): the second row's copies of ``a`` and
    ``b`` are not verified, its ``d`` is, below the first row's ``b``, and
    attends to the first row's ``a`` and ``b``. Acceptance through the
    second row reads the first copies' logits and is recorded with ``d``'s
    real parent. Mutations: the parent or the mask not moved to the first
    copy, or the copies ranked as before (both verified)."""
    from mlx_redrafter.step.tree import prefix_tree

    lengths = (3, 3)
    s = rows(lengths, ("drafter", "drafter"))
    lay = layout(lengths)
    beams = mx.array([[20, 21, 22], [20, 21, 23]], mx.int32)
    first = prefix_tree(beams)
    canon = (lay.node_index[first, mx.arange(3)[None, :]] - 1)[lay.node_row, lay.node_pos]
    assert np.array(canon).tolist() == [0, 1, 2, 0, 1, 5]
    score = mx.full((6,), 3.0)
    sel = ts.select_device(s, score, mx.ones((6,), mx.bool_), calibration().device_table(), EDGES, 4, canon=canon)
    assert sorted(np.array(sel.nodes).tolist()) == [0, 1, 2, 5]  # a, b, c and d: each prefix once
    tokens = beams.reshape(-1)
    tree = sel.tree(tokens, mx.array(7))
    order = np.array(tree.tokens).tolist()
    assert sorted(order) == [7, 20, 21, 22, 23]
    at = {t: i for i, t in enumerate(order)}
    assert np.array(sel.parent).tolist()[at[23]] == at[21]  # d hangs below the first row's b
    mask = np.array(sel.mask)
    assert mask[at[23]].tolist() == [i in (0, at[20], at[21], at[23]) for i in range(5)]
    sel_beams, node_index = sel.rows(beams, lay.node_index)
    assert np.array(node_index).tolist() == [[at[20], at[21], at[22]], [at[20], at[21], at[23]]]
    want = {0: 20, at[20]: 21, at[21]: 23, at[22]: 5, at[23]: 6}  # the model takes the second row whole
    logits = mx.array(np.eye(30, dtype=np.float32)[[want[i] for i in range(5)]])
    acc = accept_greedy(sel_beams, node_index, logits)
    assert int(acc.n) == 3 and int(acc.beam) == 1 and int(acc.next_token) == 6
    obs = ts.decode_codes(np.array(sel.codes).tolist(), s)
    assert obs.parent[at[23] - 1] == at[21]  # learned as a trial below b, which was accepted
    cal = calibration()
    cal.observe(obs, np.array(acc.path).tolist()[: int(acc.n) + 1])
    assert cal.trials[0, 2].sum() == 2 and cal.hits[0, 2].sum() == 1  # c and d tried at depth 3, d accepted


def test_device_p_matches_the_host():
    s = structure()
    score = np.array([-0.2, -1.5, -0.4, -3.0, 3, 3, 3, 3], np.float32)
    valid = np.array([True] * 7 + [False])
    table = calibration().table()
    p_host, b_host = ts.node_p(np, s, score, valid, table, EDGES)
    p_dev, b_dev = ts.node_p(mx, s, mx.array(score), mx.array(valid), mx.array(table), EDGES)
    np.testing.assert_allclose(np.array(p_dev), p_host, rtol=1e-6)
    assert np.array(b_dev).tolist() == b_host.tolist() and b_host[-1] == -1 and p_host[-1] == 0


# --------------------------------------------------------------------------- the cost curve


def test_builtin_curve_is_flagged_and_keeps_the_measured_sizes():
    c = vc.builtin_curve()
    assert c.builtin and c.max_size == 16 and c(1) == 1.0
    for n, v in vc.BUILTIN_MEASURED.items():
        assert c(n) == pytest.approx(v)
    assert c(8) < c(7)  # measured, not fitted
    assert "built-in" in vc.format_curve(c)


def test_measured_curve_round_trip_and_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path))
    model = tiny_model("llama")
    assert vc.curve_for(model).builtin  # nothing measured yet
    # A budget no run reaches (the rounds bound the work): every size is timed, whatever the clock says.
    c = calibrate.measure_curve(model, max_size=5, budget_s=600.0, context=16, max_rounds=3, long_context=48, batch_s=0)
    assert len(c.costs) == 5 and c.costs[0] == 1.0 and all(x > 0 for x in c.costs)
    assert not c.builtin and c.rounds == 3 and c.base_ms > 0 and c.measured == (1, 2, 3, 4, 5)
    # The bucket sizes again after the long context (the others interpolated).
    assert (c.context, c.long_context) == (16, 48) and len(c.long_costs) == 5 and c.long_costs[0] == 1.0
    assert "after 48 tokens" in vc.format_curve(c)
    assert (c.device, c.model, c.variant) == vc.curve_key(model)
    assert c.variant == "float32"
    path = vc.save_curve(c, model)
    assert path.parent == tmp_path / "profiles" and json.loads(path.read_text())["version"] == vc.CURVE_VERSION
    loaded = vc.curve_for(model)
    assert loaded == c and not loaded.builtin
    assert "measured" in vc.format_curve(loaded)
    other = tiny_model("qwen3")  # another model: its own key, no curve yet
    assert vc.curve_path(other) != path and vc.curve_for(other).builtin
    path.write_text(json.dumps({**c.to_dict(), "version": 0}))
    assert vc.curve_for(model).builtin  # an old format is not trusted


def test_a_sliding_window_model_calibrates(tmp_path, monkeypatch):
    """Gemma 3's sliding layers keep a RotatingKVCache, whose buffer a timed
    call replaces: the calibration puts it back after each call, before the
    window wraps (context 16, window 24) and after (long context 40)."""
    from helpers import TINY_CONFIGS

    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path))
    monkeypatch.setitem(TINY_CONFIGS, "gemma_window", dict(TINY_CONFIGS["gemma3_text"], sliding_window=24))
    c = calibrate.measure_curve(  # a budget no run reaches: the rounds bound the work
        tiny_model("gemma_window"), max_size=5, budget_s=600.0, context=16, max_rounds=2, long_context=40, batch_s=0
    )
    assert c.rounds == 2 and c.measured == (1, 2, 3, 4, 5) and c.long_context == 40 and len(c.long_costs) == 5


def test_a_device_too_slow_for_the_budget_gets_a_curve_where_drafting_never_pays(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path))
    c = calibrate.measure_curve(tiny_model("llama"), max_size=4, budget_s=0.0)
    assert c.costs == (1.0, 2.0, 3.0, 4.0) and c.measured == (1,) and c.rounds == 0
    assert c.long_context == 0 and c.long_costs == ()  # a model of 512 tokens: no long context to measure


def test_the_curve_follows_the_context():
    short, long = (1.0, 1.1, 1.2, 1.3), (1.0, 1.5, 2.0, 2.5)
    c = vc.CostCurve(short, context=100, long_costs=long, long_context=300)
    assert c.at(50) is c and c.at(100) is c  # at or below the short context: as measured
    assert c.at(300).costs == pytest.approx(long) and c.at(300).long_costs == ()
    assert c.at(200).costs == pytest.approx((1.0, 1.3, 1.6, 1.9)) and c.at(200).context == 200
    stretched = c.at(100 + 200 * 10)  # far past the long context: at most MAX_CONTEXT_STRETCH gaps
    assert stretched.costs == pytest.approx([a + vc.MAX_CONTEXT_STRETCH * (b - a) for a, b in zip(short, long)])
    assert vc.CostCurve(short).at(5000).costs == short  # no long curve: one curve for every context
    assert vc.CostCurve.from_dict(c.to_dict()) == c  # stored and read back with its long curve
    old = {k: v for k, v in c.to_dict().items() if k not in ("long_costs", "long_context", "context")}
    assert vc.CostCurve.from_dict(old).at(5000).costs == short  # a curve stored before: context-free


def test_sizes_not_timed_are_interpolated():
    assert calibrate._fill([1, 2, 3, 4, 5, 6], {1: 1.0, 2: 1.2, 4: 1.8}) == pytest.approx(
        (1.0, 1.2, 1.5, 1.8, 2.1, 2.4)
    )
    assert calibrate._sample_order(list(range(1, 17)))[:8] == list(ts.BUCKETS)
    text = vc.format_curve(vc.CostCurve((1.0, 1.2, 1.5), measured=(1, 2)))
    assert "3:~1.50" in text and "2:1.20" in text


def test_quantized_model_gets_its_own_curve_key():
    import mlx.nn as nn

    model = tiny_model("llama")
    plain = vc.curve_key(model)
    nn.quantize(model, group_size=32, bits=4)
    quant = vc.curve_key(model)
    assert quant[2] == "q4g32-float32" and quant != plain
