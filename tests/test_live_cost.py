"""The live cost model and the governor, on synthetic step times (no clock is read).

A simulated machine answers each step with the time its true cost says (plus
seeded noise); the governor decides from what :class:`LiveCost` learned.
Mutations seen caught (each on a scratch copy): the RLS gain's sign flipped,
forgetting set to 1.0 (the slow-down test keeps drafting), the probe wait never
doubled (the back-off test), ``to_dict`` dropping the sources (the reload
test), ``needs_plain`` always False (the plain-measurement test).
"""

from __future__ import annotations

import numpy as np
import pytest

from mlx_redrafter.step.curve import builtin_curve
from mlx_redrafter.step.governor import MAX_WAIT, PROBE_AFTER, PROBE_STEPS, Governor, Option
from mlx_redrafter.step.live_cost import LiveCost, live_path, load_state, save_state, size_weights

PLAIN = 0.05  # seconds per plain step on the simulated machine


def steep(n):  # a 4-bit model on a CPU: every token costs a plain step
    return float(n)


def flat(n):  # a GPU: verifying a few tokens costs about one
    return 1.0 if n == 1 else 1.04


def _options(cost, gov, accept):
    """Each source set's gain for a W=1 L=1 tree (size 2) that ``accept`` of the time adds a token."""
    out = []
    for sources in gov.options():
        c = cost.curve(sources)
        out.append(Option(sources, (1 + accept) / c(2) if sources else 1 / c(1)))
    return out


def simulate(true_c, draft, accept, steps, seed=0, cost=None, gov=None, slow_after=None):
    """Run ``steps`` governed steps; returns (cost, governor, per-step drafted flags)."""
    rng = np.random.default_rng(seed)
    cost = cost or LiveCost(builtin_curve())
    gov = gov or Governor(["drafter"])
    drafted = []
    for t in range(steps):
        sources, probing = gov.choose(_options(cost, gov, accept), measure_plain=cost.needs_plain())
        size = 2 if sources else 1
        base = true_c(size) + (draft if sources else 0.0)
        if slow_after is not None and t >= slow_after and sources:
            base *= 2.5  # the drafting got much dearer (another job on the cores, a longer context)
        cost.observe(size, PLAIN * base * (1 + 0.05 * rng.standard_normal()), sources)
        gov.ran(sources, size > 1, probing)
        drafted.append(bool(sources) and not probing)
    return cost, gov, drafted


def test_size_weights_interpolate_and_extrapolate():
    assert not size_weights(1).any()
    w = size_weights(5)  # between sizes 4 and 6
    assert w.sum() == pytest.approx(1.0) and (w > 0).sum() == 2
    assert size_weights(20).sum() == pytest.approx(1.0)  # the last slope continued


def test_a_steep_cost_makes_plain_decoding_win_within_a_few_steps():
    # The built-in curve says two tokens cost 1.07 plain steps; this machine says 2.
    cost, gov, drafted = simulate(steep, draft=0.2, accept=0.4, steps=200)
    first_plain = drafted.index(False)
    assert first_plain <= 3
    assert not any(drafted[10:]), "a step drafted on merit after the cost was learned"
    assert gov.tally.plain > 150
    assert cost.ratio(2, ["drafter"]) == pytest.approx(2.2, rel=0.15)


def test_a_flat_cost_makes_drafting_win():
    cost, gov, drafted = simulate(flat, draft=0.1, accept=0.5, steps=200)
    assert sum(drafted[10:]) > 0.9 * len(drafted[10:])
    assert gov.tally.drafted > gov.tally.plain


def test_a_generation_that_stops_paying_stops_drafting():
    # Drafting pays until step 100, then costs 2.5 times as much: the model follows within a few steps.
    _, _, drafted = simulate(flat, draft=0.1, accept=0.5, steps=200, slow_after=100)
    assert sum(drafted[80:100]) >= 18
    assert sum(drafted[100:130]) <= 15
    assert not any(drafted[130:])


def test_a_plain_step_is_measured_when_its_cost_is_no_longer_known():
    # Always drafting, the plain cost and the draft cost cannot be told apart: plain steps pin it.
    cost, gov, drafted = simulate(flat, draft=0.1, accept=0.9, steps=300)
    plain_steps = gov.tally.plain
    assert 3 <= plain_steps <= 30  # a few percent of the steps
    assert cost.ratio(1) == 1.0 and cost.predict(1) == pytest.approx(PLAIN, rel=0.1)


def test_the_probe_schedule_backs_off():
    gov = Governor(["mtp"])
    starts, probing_prev = [], False
    for t in range(4000):
        sources, probing = gov.choose([Option(frozenset(), 1.0), Option(frozenset(["mtp"]), 0.5)])
        if probing and not probing_prev:
            starts.append(t)
        probing_prev = probing
        gov.ran(sources, bool(sources), probing)
    gaps = np.diff(starts).tolist()
    assert starts[0] == PROBE_AFTER
    waits = [g - PROBE_STEPS for g in gaps]
    assert waits[:4] == [2 * PROBE_AFTER, 4 * PROBE_AFTER, 8 * PROBE_AFTER, 16 * PROBE_AFTER]
    assert max(waits) == MAX_WAIT
    assert gov.tally.probes == PROBE_STEPS * len(starts)


def test_a_source_chosen_again_starts_its_wait_over():
    gov = Governor(["mtp"])
    for _ in range(200):  # losing: the wait grows
        sources, probing = gov.choose([Option(frozenset(), 1.0), Option(frozenset(["mtp"]), 0.5)])
        gov.ran(sources, bool(sources), probing)
    assert gov.parked["mtp"].wait > PROBE_AFTER
    sources, probing = gov.choose([Option(frozenset(), 1.0), Option(frozenset(["mtp"]), 1.5)])
    assert sources == {"mtp"} and not probing
    assert gov.parked["mtp"].wait == PROBE_AFTER


def test_the_learned_state_is_saved_and_reloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path))
    cost, gov, _ = simulate(steep, draft=0.2, accept=0.4, steps=100)
    key = ("linux-x86_64-cpu-blis", "tiny", "float32")
    save_state(key, {"cost": cost.to_dict(), "governor": gov.to_dict()})
    assert live_path(key).is_file()
    data = load_state(key)
    assert load_state(("another", "tiny", "float32")) is None
    again = LiveCost.from_dict(data["cost"])
    assert again.ratio(2, ["drafter"]) == pytest.approx(cost.ratio(2, ["drafter"]), rel=1e-6)
    gov2 = Governor(["drafter"])
    gov2.restore(data["governor"])
    assert gov2.parked["drafter"].wait == gov.parked["drafter"].wait
    # The reloaded model starts plain at once (it knows drafting loses here), on a machine twice as slow.
    _, gov3, drafted = simulate(lambda n: 2.0 * steep(n), draft=0.4, accept=0.4, steps=20, cost=again, gov=gov2)
    assert not any(drafted)


def test_a_reloaded_model_of_another_version_is_refused():
    with pytest.raises(ValueError, match="version"):
        LiveCost.from_dict({"version": 0, "theta": [1.0]})
