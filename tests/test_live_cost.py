"""The live cost model, on synthetic step times (no clock is read).

A simulated machine answers each step with the time its true cost says (plus
seeded noise); :class:`LiveCost` learns it. Mutations seen caught (each on a
scratch copy): the RLS gain's sign flipped, forgetting set to 1.0 (the
slow-down test), ``to_dict`` dropping the sources (the reload test),
``needs_plain`` always False (the plain-measurement test).
"""

from __future__ import annotations

import numpy as np
import pytest

from mlx_redrafter.step.curve import builtin_curve
from mlx_redrafter.step.live_cost import LiveCost, live_path, load_state, save_state, size_weights

PLAIN = 0.05  # seconds per plain step on the simulated machine


def steep(n):  # a 4-bit model on a CPU: every token costs a plain step
    return float(n)


def flat(n):  # a GPU: verifying a few tokens costs about one
    return 1.0 if n == 1 else 1.04


def simulate(true_c, draft, steps, seed=0, cost=None, slow_after=None, draft_every=2):
    """Feed ``steps`` steps (every ``draft_every``-th one plain, the others a
    size-2 tree drafted by "drafter") to a :class:`LiveCost`; returns it."""
    rng = np.random.default_rng(seed)
    cost = cost or LiveCost(builtin_curve())
    for t in range(steps):
        sources = ["drafter"] if t % draft_every else []
        size = 2 if sources else 1
        base = true_c(size) + (draft if sources else 0.0)
        if slow_after is not None and t >= slow_after and sources:
            base *= 2.5  # the drafting got much dearer (another job on the cores, a longer context)
        cost.observe(size, PLAIN * base * (1 + 0.05 * rng.standard_normal()), sources)
    return cost


def test_size_weights_interpolate_and_extrapolate():
    assert not size_weights(1).any()
    w = size_weights(5)  # between sizes 4 and 6
    assert w.sum() == pytest.approx(1.0) and (w > 0).sum() == 2
    assert size_weights(20).sum() == pytest.approx(1.0)  # the last slope continued


def test_a_steep_cost_is_learned_within_a_few_steps():
    # The built-in curve says two tokens cost 1.07 plain steps; this machine says 2.
    cost = simulate(steep, draft=0.2, steps=12)
    assert cost.ratio(2, ["drafter"]) == pytest.approx(2.2, rel=0.15)


def test_a_flat_cost_is_learned():
    cost = simulate(flat, draft=0.1, steps=40)
    assert cost.curve()(2) == pytest.approx(1.04, rel=0.1)
    assert cost.ratio(2, ["drafter"]) == pytest.approx(1.14, rel=0.1)


def test_a_machine_that_slows_down_is_followed():
    cost = simulate(flat, draft=0.1, steps=200, slow_after=100)
    assert cost.ratio(2, ["drafter"]) == pytest.approx(2.5 * 1.14, rel=0.15)


def test_a_plain_step_is_asked_for_when_its_cost_is_no_longer_known():
    # Always drafting, the plain cost and the draft cost cannot be told apart.
    cost = simulate(flat, draft=0.1, steps=300)  # every other step plain: known
    assert not cost.needs_plain()
    always = LiveCost(builtin_curve())
    for _ in range(60):
        always.observe(2, PLAIN * 1.14, ["drafter"])
    assert always.needs_plain()


def test_the_learned_state_is_saved_and_reloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path))
    cost = simulate(steep, draft=0.2, steps=100)
    key = ("linux-x86_64-cpu-blis", "tiny", "float32")
    save_state(key, {"cost": cost.to_dict()})
    assert live_path(key).is_file()
    data = load_state(key)
    assert load_state(("another", "tiny", "float32")) is None
    again = LiveCost.from_dict(data["cost"])
    assert again.ratio(2, ["drafter"]) == pytest.approx(cost.ratio(2, ["drafter"]), rel=1e-6)
    # On a machine twice as slow the reloaded costs keep their ratios after its first step sets the scale.
    again.observe(1, 2 * PLAIN)
    assert again.ratio(2, ["drafter"]) == pytest.approx(cost.ratio(2, ["drafter"]), rel=0.1)


def test_a_reloaded_model_of_another_version_is_refused():
    with pytest.raises(ValueError, match="version"):
        LiveCost.from_dict({"version": 0, "theta": [1.0]})
