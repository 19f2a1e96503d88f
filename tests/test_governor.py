"""Never slower than plain decoding: the governor chooses each step's sources
(plain decoding among them) from the steps' measured rates.

Unit tests feed the governor a simulated machine (no clock is read); the
loop tests run the real step loops on tiny models with each step's time
given by a cost table instead of the clock (``Generation.timed`` is wrapped),
so "a steep cost makes plain win" is a fact of the test, not of this machine.
Mutations seen caught (each on a scratch copy): the governor's choice never
applied to the proposers (``drafts.on`` ignored: the steep-cost loop test),
the holes kept or the queued step dropped when plain decoding starts
(``holes.compact(drop_unread=True)``: the cache test),
the probe wait never doubled (the back-off test), a probe compared with the
plan's arm instead of the fastest measured (the five-arm test), the shadow's
``saw`` dropped or counted while its arm runs (the shadow tests), a queued
plain step read through a new op (the read test), ``restore`` ignoring the
best arm (the carry-over tests), a parked draft model's catch-up dropped
(``Chain.extend`` skipped while parked: the exactness test), the best arm
ranked by the lowest rate (the steep and flat tests), a probe's budget
ignored (``_budget`` giving 0: the budget test), a far arm's steps out not
restored (the wait-span test), plain decoding's or a shadowed arm's wait
started over by a new generation (the test of their waits across generations),
the plan's doubt dropped or not scaled by its rate's error (the unsure-plan
test), a probe ended on every step measured without its own steps agreeing
(the test of a generation that stops paying and starts again), the next arm
chosen before the read where nothing proposes early, or a generation's first
drafting step left unmeasured there (the test of the arm chosen knowing the
last step's time).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import OracleDrafter, prompts, run_steps, tiny_model
from loops import check_caches, steps_then_close

from mlx_redrafter.config import DraftConfig
from mlx_redrafter.generate import generate_tokens
from mlx_redrafter.step import keep, loop
from mlx_redrafter.step.governor import (
    EXPLORE,
    MAX_WAIT,
    MIN_SAMPLES,
    PLAIN,
    PROBE_AFTER,
    PROBE_STEPS,
    RESTORED_WAIT,
    Governor,
    arm_name,
    arms_of,
    mode_of,
)

N = 96


# --------------------------------------------------------------------------- a simulated machine


def simulate(gov, rate, steps, seed=0, modes=None):
    """Run ``steps`` governed steps; ``rate(arm, t)``: tokens per second of
    that arm at step ``t``. Returns the arm of each step; ``modes``, a list,
    gets each step's mode (as its stats say it)."""
    rng = np.random.default_rng(seed)
    arms = []
    for t in range(steps):
        arm, probing = gov.choose()
        k = 1 if not arm else int(rng.integers(1, 4))  # a drafting step emits 1-3 tokens
        gov.ran(arm, k, k / rate(arm, t) * (1 + 0.05 * rng.standard_normal()), probing)
        arms.append(arm)
        if modes is not None:
            modes.append(mode_of(arm, probing))
    return arms


def simulate_tokens(gov, arms, steps, seed=0):
    """Like :func:`simulate` with the real noise: ``arms[arm] = (tokens per
    step, seconds per step)``; a drafting step emits a geometric number of
    tokens (at least 1) with that mean, its time hardly moves (2%)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        arm, probing = gov.choose()
        mean, seconds = arms[arm]
        k = int(rng.geometric(1 / mean)) if mean > 1 else 1
        gov.ran(arm, k, seconds * (1 + 0.02 * rng.standard_normal()), probing)
        out.append(arm)
    return out


def steep(arm, t):  # drafting costs more than it brings: 2 tokens per step at 3 plain steps
    return 100.0 if not arm else 70.0


def flat(arm, t):  # a GPU: drafting nearly free
    return 100.0 if not arm else 180.0


def test_a_steep_cost_makes_plain_decoding_win_within_a_few_steps():
    gov = Governor(["drafter"])
    modes = []
    arms = simulate(gov, steep, 300, modes=modes)
    first_plain = next(t for t, a in enumerate(arms) if a == PLAIN and t > PROBE_STEPS)
    assert first_plain < 3 * PROBE_STEPS
    assert gov.best == PLAIN
    late = arms[3 * PROBE_STEPS :]
    assert sum(bool(a) for a in late) <= PROBE_STEPS * 6, "drafted outside the probes"
    assert modes.count("plain") > 250


def test_a_flat_cost_makes_drafting_win():
    gov = Governor(["drafter"])
    modes = []
    arms = simulate(gov, flat, 300, modes=modes)
    assert gov.best == frozenset(["drafter"])
    assert sum(bool(a) for a in arms[20:]) > 0.9 * len(arms[20:])
    assert modes.count("draft") > 5 * modes.count("plain")


def test_the_source_that_pays_drafts_alone():
    """An MTP head whose drafts are rejected beside lookup that copies well (a
    Qwen3.5 shape with its head): lookup alone wins, the head is parked."""
    rates = {frozenset(): 100.0, frozenset(["lookup"]): 200.0, frozenset(["mtp", "lookup"]): 150.0}
    gov = Governor(["mtp", "lookup"], costly=["mtp"])
    assert set(gov.arms) == set(rates)  # lookup is never dropped alone: it costs nothing when it finds nothing
    arms = simulate(gov, lambda arm, t: rates[arm], 400)
    assert gov.best == frozenset(["lookup"])
    assert sum(a == frozenset(["lookup"]) for a in arms[100:]) > 0.9 * 300


def test_lookup_measured_where_it_sat_out_is_chosen_without_waiting_for_a_probe():
    """Plain decoding wins while lookup finds nothing; then the text turns
    into a copy. What lookup would have drafted at the plain steps (step/
    shadow.py) raises its rate at once: it runs long before its next probe."""
    lookup = frozenset(["lookup"])
    gov = Governor(["drafter", "lookup"], costly=["drafter"])
    rates = {PLAIN: (1.0, 1.0), lookup: (1.0, 1.1), frozenset(["drafter", "lookup"]): (1.2, 1.6)}
    simulate_tokens(gov, rates, 160)
    assert gov.best == PLAIN and not gov.probe_left
    wait = gov.parked[lookup].wait - gov.parked[lookup].out
    arms = []
    while len(arms) < 12 and lookup not in arms:  # a copy: lookup's row would be accepted whole
        arm, probing = gov.choose()
        arms.append(arm)
        gov.ran(arm, 1, 1.0, probing)
        gov.saw(lookup, 4)
    assert arms[-1] == lookup and not gov.probe_left, arms  # chosen on its rate, not probed
    assert len(arms) < wait, (arms, wait)
    before = gov.rates[lookup].per_second
    gov.saw(lookup, 1)  # lookup runs now: its own steps measure it, not the shadow
    assert gov.rates[lookup].per_second == before


class _Guesser:
    """A proposer that guesses from the history, as lookup does: right at even steps, wrong at odd ones."""

    shadow = True

    def __init__(self, text, history):
        self.text, self.history = text, history

    def guess(self):
        at = len(self.history)
        return [self.text[at : at + 3] if at % 2 == 0 else [-1, -1, -1]]


def test_the_shadow_checks_each_steps_rows_against_what_came_next():
    from mlx_redrafter.step.shadow import Shadow

    text = list(range(100, 140))
    history = text[:4]
    full, lookup = frozenset(["drafter", "lookup"]), frozenset(["lookup"])
    shadow = Shadow(["drafter", "lookup"], [object(), _Guesser(text, history)], [full, PLAIN, lookup])
    assert shadow.arms == [lookup]  # only the arms made of sources that can guess
    got = []
    for t in range(4, 20):  # plain steps: one token each
        history.append(text[t])
        got += shadow.emitted(history)
    # Each step's guess settles once its row has been matched whole (1 + 3 tokens) or broken:
    # the odd places' at the next token, the even ones' three tokens on (the last two still open).
    assert sorted(k for _, k in got) == [1] * 8 + [4] * 6, got
    assert all(arm == lookup for arm, _ in got)


def test_a_governed_generation_measures_lookup_where_it_sat_out(costs, tiny):
    """The loop hands the governor what lookup would have drafted at the
    steps it sat out: the kept state says how many."""
    model, p, _ = tiny
    costs["fn"] = steep_step
    draft = DraftConfig(OracleDrafter(model, p, N, 3), 2, 3, lookup=1, always_draft=False)
    run_steps(model, p, draft, N)
    (state,) = keep._KEPT.values()
    seen = state["governor"]["arms"]["lookup"]["seen"]
    assert seen[1] > 10, state


def test_a_generation_that_stops_paying_stops_drafting_and_one_that_starts_starts():
    gov = Governor(["lookup"])
    # Drafting pays until step 150 (a copy task), then stops paying, then pays again from 600.
    arms = simulate(gov, lambda arm, t: 100.0 if not arm else (180.0 if t < 150 or t >= 600 else 85.0), 1000)
    assert sum(bool(a) for a in arms[100:150]) >= 40  # plain measured now and then
    assert sum(bool(a) for a in arms[250:600]) <= 40, "kept drafting after it stopped paying"
    assert sum(bool(a) for a in arms[900:]) >= 90, "never drafted again after it paid again"


def close_behind(arm, t):  # drafting at 0.85 of plain: close, probed every doubling wait (or budget's)
    return 100.0 if not arm else 85.0


def drafting_runs(arms):
    """``[(start, length)]`` of each run of drafting steps."""
    runs, t = [], 0
    while t < len(arms):
        if arms[t] and (t == 0 or not arms[t - 1]):
            n = next(k for k in range(t, len(arms) + 1) if k == len(arms) or not arms[k]) - t
            runs.append((t, n))
            t += n
        t += 1
    return runs


def waits_between(runs):
    return [b - a - n for (a, n), (b, _) in zip(runs, runs[1:])]


def test_the_probe_schedule_backs_off():
    gov = Governor(["mtp"])
    runs = drafting_runs(simulate(gov, close_behind, 6000))
    waits = waits_between(runs)
    # The plan's arm first, plain measured (a probe), then the waits double
    # (from at least the first doubled wait: a probe's budget may ask for more).
    assert waits[0] == PROBE_STEPS + PROBE_AFTER, waits
    assert waits[1] >= 2 * PROBE_AFTER, waits
    assert waits[2:4] == [min(2 * waits[1], MAX_WAIT), min(4 * waits[1], MAX_WAIT)], waits
    assert max(waits) == MAX_WAIT and waits[-1] == MAX_WAIT


def test_a_probe_that_costs_more_waits_longer_within_its_budget():
    """An MTP head whose steps cost three plain ones and whose drafts are
    all rejected: each of its steps loses two plain steps' time, so after its
    first three steps (one not measured) it waits until they are at most
    EXPLORE of the time (300 plain steps), not the far arm's fixed 64; a probe
    of it (two steps) waits at least 200. An arm near a tie keeps the doubling waits."""
    mtp = frozenset(["mtp"])
    gov = Governor(["mtp"])
    arms = []
    for _ in range(2000):
        arm, probing = gov.choose()
        gov.ran(arm, 1, 3.0 if arm else 1.0, probing)
        arms.append(arm)
    runs = drafting_runs(arms)
    waits = waits_between(runs)
    assert runs[0] == (0, 3) and all(n == 2 for _, n in runs[1:]), runs
    assert waits[0] >= 3 * 2 / EXPLORE - PROBE_STEPS, runs  # its first steps' loss, then plain measured
    assert all(w >= 2 * 2 / EXPLORE for w in waits[1:]), runs
    assert gov.parked[mtp].wait >= 2 * 2 / EXPLORE


def test_a_governor_seeded_from_another_starts_from_its_choice():
    """A batch's governor for a new number of rows starts from the nearest
    one's measurements (scaled by the rows and the cost), its best arm and
    its waits: plain decoding runs at once, nothing is measured again first.
    Mutation seen caught: the rates copied unscaled."""
    drafter = frozenset(["drafter"])
    gov = Governor(["drafter"])
    simulate(gov, steep, 300)
    new = Governor(["drafter"])
    new.seeded(gov, tokens=2.0, seconds=1.5)
    assert new.best == gov.best == PLAIN
    for arm in gov.arms:
        assert new.rates[arm].per_second == pytest.approx(gov.rates[arm].per_second * 2.0 / 1.5)
        assert new.rates[arm].samples == gov.rates[arm].samples
    assert (new.parked[drafter].wait, new.parked[drafter].out) == (gov.parked[drafter].wait, gov.parked[drafter].out)
    assert new.choose() == (PLAIN, False)
    fresh = Governor(["drafter"])
    fresh.seeded(Governor(["drafter"]))  # one that measured nothing: nothing to start from
    assert fresh.choose() == (drafter, False)


def test_a_far_arms_wait_spans_generations():
    """The steps a far arm waited in one generation count in the next: its probe comes when the wait is up."""
    drafter = frozenset(["drafter"])
    gov = Governor(["drafter"])
    simulate(gov, steep, 150)
    out, wait = gov.parked[drafter].out, gov.parked[drafter].wait
    assert 0 < out < wait
    again = Governor(["drafter"])
    again.restore(gov.to_dict())
    assert (again.parked[drafter].out, again.parked[drafter].wait) == (out, wait)
    arms = simulate(again, steep, wait - out + 1)
    assert not any(arms[:-1]) and arms[-1] == drafter


def test_two_unlucky_steps_do_not_park_an_arm():
    """A probe whose first measured steps emit one token each (the plan's
    drafter at 0.67 of plain by their mean) measures on: drafting steps swing,
    and an arm called far behind would wait four times longer. A draft model
    as slow with every step alike is called far at once."""
    for tokens, far in (([1, 1, 1, 3, 2, 3], False), ([2, 2, 2, 2, 2, 2], True)):
        gov = Governor(["drafter"], starts_plain=True)
        while True:
            arm, probing = gov.choose()
            if arm:
                break
            gov.ran(arm, 1, 1.0, probing)
        lengths = 0
        for k in tokens:
            lengths += 1
            gov.ran(arm, k, 1.5 if k == 1 or not far else 3.0, probing)
            if not gov.probe_left:
                break
            arm, probing = gov.choose()
        assert (lengths < PROBE_STEPS) == far, (tokens, lengths)


def test_a_probe_is_compared_with_the_fastest_arm_measured_not_the_plans():
    """A draft model's plan (five arms): while every arm is measured the
    first time, the plan's own arm is itself far behind. A probe of another
    slow arm ends after one measured step against plain decoding, the
    fastest measured, not after all six against the plan's arm."""
    full, slow = frozenset(["dm", "drafter", "lookup"]), frozenset(["dm", "lookup"])
    steps = {full: (2, 4.0), PLAIN: (1, 1.0), frozenset(["drafter", "lookup"]): (2, 2.0), slow: (1, 2.5)}
    steps[frozenset(["lookup"])] = (1, 1.0)
    gov = Governor(["dm", "drafter", "lookup"], costly=["dm", "drafter"])
    arms = []
    for _ in range(40):
        arm, probing = gov.choose()
        gov.ran(arm, *steps[arm], probing)
        arms.append(arm)
    assert arms[:3] == [full] * 3 and slow in arms
    assert arms.count(slow) == 2, [arm_name(a) for a in arms]  # a first step, then one measured


def test_an_arm_far_behind_is_probed_shorter_and_less_often():
    """A draft model at half plain's speed: each probe ends after two measured
    steps at most, and once its steps make it surely far behind, the waits
    quadruple (from at least a far arm's first wait; its budget may ask more)."""
    gov = Governor(["draft-model"])
    runs = drafting_runs(simulate(gov, lambda arm, t: 100.0 if not arm else 50.0, 3000))
    assert all(n <= 3 for _, n in runs), runs  # a first step, then two measured at most
    waits = waits_between(runs)
    assert waits[1] >= 4 * PROBE_AFTER and waits[2:4] == [min(4 * waits[1], MAX_WAIT), MAX_WAIT], runs


def test_an_arm_chosen_again_starts_its_wait_over():
    gov = Governor(["mtp"])
    simulate(gov, steep, 300)
    assert gov.parked[frozenset(["mtp"])].wait > PROBE_AFTER
    simulate(gov, flat, 600)  # it pays now: found at a probe, then kept
    assert gov.best == frozenset(["mtp"])
    assert gov.parked[frozenset(["mtp"])].wait == PROBE_AFTER


def test_what_was_learned_carries_over():
    drafter = frozenset(["drafter"])
    gov = Governor(["drafter"])
    simulate(gov, steep, 200)
    again = Governor(["drafter"])
    again.restore(gov.to_dict())
    # Far behind (0.7 of plain): it keeps its wait and is not measured again first: plain runs.
    assert again.best == PLAIN and again.parked[drafter].wait == gov.parked[drafter].wait > RESTORED_WAIT
    assert again.rates[drafter].per_second == pytest.approx(gov.rates[drafter].per_second)
    left = again.parked[drafter].wait - again.parked[drafter].out
    arms = simulate(again, steep, 100)
    assert left > 0 and not any(arms[:left]) and arms[left], "a reloaded governor explored again, or waited anew"
    # Close behind (0.9 of plain): the next text may decide otherwise: measured first, probed again soon.
    close = Governor(["drafter"])
    simulate(close, lambda arm, t: 100.0 if not arm else 90.0, 300)
    assert close.best == PLAIN
    again = Governor(["drafter"])
    again.restore(close.to_dict())
    assert again.parked[drafter].wait == RESTORED_WAIT
    assert simulate(again, flat, 3)[0] == drafter
    other = Governor(["drafter", "lookup"])
    other.restore(gov.to_dict())  # another plan's state is not this one's
    assert other.best == frozenset(["drafter", "lookup"])


def test_an_unsure_plan_keeps_its_place_and_a_sure_one_does_not():
    """The arm asked for, measured at 0.90 of plain decoding's rate over 60
    steps. When its steps swing (1 or 3 tokens, as a draft's yield comes in
    hard and easy stretches), its rate is unsure by more than the edges it
    is short of, and it keeps running; when every step is alike (2 tokens),
    the rate is sure, and plain decoding wins."""
    full = frozenset(["drafter"])
    for tokens, kept in (([1, 3], True), ([2, 2], False)):
        gov = Governor(["drafter"])
        for t in range(60):
            gov.rates[PLAIN].add(t, 1, 1.0)
            gov.rates[full].add(t, tokens[t % 2], 2 / 0.9)
        assert gov.rates[full].per_second == pytest.approx(0.9, rel=0.01)
        assert gov.choose() == ((full, False) if kept else (PLAIN, False)), tokens


def test_plain_and_a_shadowed_arm_keep_their_waits_across_generations():
    """A new text can change what a draft yields, not what a plain step
    does, and lookup's yield on it is seen from its first step (the shadow):
    neither is probed again at the next generation's start (as a close
    drafting arm is, above); their waits and the steps they waited carry."""
    full, lookup = frozenset(["drafter", "lookup"]), frozenset(["lookup"])
    steps = {full: (2, 1.8), PLAIN: (1, 1.0), lookup: (1, 1.05)}  # plain and lookup close: 0.90 and 0.86
    gov = Governor(["drafter", "lookup"], costly=["drafter"])
    for _ in range(300):
        arm, probing = gov.choose()
        gov.ran(arm, *steps[arm], probing)
        if arm != lookup:
            gov.saw(lookup, 1)
    assert gov.best == full and all(gov.parked[a].wait > RESTORED_WAIT for a in (PLAIN, lookup))
    again = Governor(["drafter", "lookup"], costly=["drafter"])
    again.restore(gov.to_dict())
    for a in (PLAIN, lookup):
        assert (again.parked[a].wait, again.parked[a].out) == (gov.parked[a].wait, gov.parked[a].out)
    left = min(gov.parked[a].wait - gov.parked[a].out for a in (PLAIN, lookup))
    arms = []
    for _ in range(min(left, 2 * RESTORED_WAIT)):
        arm, probing = again.choose()
        again.ran(arm, *steps[arm], probing)
        arms.append(arm)
    assert arms == [full] * len(arms) and len(arms) > RESTORED_WAIT, [arm_name(a) for a in arms]


# --------------------------------------------------------------------------- the real loops


@pytest.fixture
def costs(monkeypatch, tmp_path):
    """Each step's time from ``costs["fn"](size, arm)`` instead of the clock; the kept state in ``tmp_path``."""
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path))
    monkeypatch.setattr(keep, "_KEPT", {})
    real = loop.Generation.timed
    table = {}

    def timed(self, out, size, arm=None, probing=False):
        out.stats.step_time = table["fn"](size, arm)
        return real(self, out, size, arm, probing)

    monkeypatch.setattr(loop.Generation, "timed", timed)
    return table


def steep_step(size, arm):  # every verified token costs a plain step, a draft forward half of one
    return 0.01 * (size + 0.5 * len(arm or ()))


def flat_step(size, arm):
    return 0.01 * (1.0 if size == 1 else 1.05)


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama")
    p = prompts(1)[0]
    return model, p, generate_tokens(model, p, max_tokens=N)[0]


@pytest.mark.parametrize("pipelined", [True, False], ids=["ahead", "after-read"])
@pytest.mark.parametrize("tree", ["fixed", "auto"])
def test_plain_wins_on_a_steep_cost_and_drafting_on_a_flat_one_with_the_same_tokens(
    costs, tiny, pipelined, tree, monkeypatch, tmp_path
):
    model, p, ref = tiny
    modes = {}
    for name, fn in (("steep", steep_step), ("flat", flat_step)):
        keep._KEPT.clear()  # each machine its own (nothing carried from the other)
        monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / name))
        costs["fn"] = fn
        drafter = OracleDrafter(model, p, N, 3)
        draft = DraftConfig(drafter, 2, 3, pipelined=pipelined, tree=tree, always_draft=False)
        got, stats, _ = run_steps(model, p, draft, N)
        assert got == ref, name
        modes[name] = [s.mode for s in stats[1:]]
        assert all(s.tree_size == 1 and not s.accepted for s in stats if s.mode == "plain"), "a plain step drafted"
    steep_modes, flat_modes = modes["steep"], modes["flat"]
    assert all(m in ("draft", "plain", "probe") for m in steep_modes + flat_modes)
    tail = steep_modes[12:]
    assert tail and tail.count("plain") >= len(tail) - 2 * PROBE_STEPS, steep_modes
    assert "plain" not in flat_modes and flat_modes.count("draft") >= len(flat_modes) - 3 * PROBE_STEPS, flat_modes


def test_a_parked_draft_model_catches_up_exactly(costs, tiny):
    """A draft model parked for stretches (its cache behind) and probed
    (catching up in one call): the output and the target's cache equal plain
    decoding's, and its own cache holds what the target's does."""
    model, p, _ = tiny
    costs["fn"] = steep_step
    draft = DraftConfig(draft_model=model, draft_model_length=3, lookup=1, always_draft=False)
    got, stats, cache = steps_then_close(model, p, draft, 400, loop="sourced", tokens=N)
    assert got == generate_tokens(model, p, max_tokens=len(got))[0]
    modes = [s.mode for s in stats[1:]]
    assert "plain" in modes and "probe" in modes
    assert all(s.tree_size == 1 for s in stats if s.mode == "plain"), "a plain step drafted"
    check_caches(model, p, cache, got, "governed draft model", copies=1)


@pytest.mark.parametrize("drafter", [False, True], ids=["late-sources", "an-early-source"])
def test_the_next_arm_is_chosen_knowing_the_last_steps_time_where_nothing_proposes_early(costs, tiny, drafter):
    """Read, then build: a plan whose sources all propose after the read (a
    draft model, lookup) chooses each step's arm once that step is timed,
    and nothing of its first step runs before it is timed, so its first run
    measures every step and ends after MIN_SAMPLES; plain decoding is probed
    next. With an early source (a drafter on the device, proposed before the
    read) the first step is not measured (its drafts came with the prefill)
    and the next arm is chosen before a step is timed: two steps more.
    Seen to fail: the arm always chosen before the read, and the first step
    not measured."""
    model, p, _ = tiny
    costs["fn"] = steep_step
    draft = DraftConfig(draft_model=model, draft_model_length=3, lookup=1, always_draft=False, pipelined=False)
    if drafter:
        draft = DraftConfig(
            OracleDrafter(model, p, N, 3), 1, 2, draft_model=model, draft_model_length=3, always_draft=False
        )
    got, stats, _ = run_steps(model, p, draft, 24)
    assert got == generate_tokens(model, p, max_tokens=24)[0]
    modes = [s.mode for s in stats[1:]]
    first = modes.index("probe")
    assert modes[:first] == ["draft"] * first and stats[1 + first].tree_size == 1, modes
    assert first == MIN_SAMPLES + 2 * drafter, modes


def test_the_next_generation_starts_where_the_last_one_ended(costs, tiny, tmp_path):
    model, p, _ = tiny
    costs["fn"] = steep_step
    draft = DraftConfig(OracleDrafter(model, p, N, 3), 2, 3, always_draft=False)
    run_steps(model, p, draft, N)
    files = list((tmp_path / "profiles").glob("live-*.json"))
    assert len(files) == 1
    keep._KEPT.clear()  # a new process: from the disk
    _, stats, _ = run_steps(model, p, draft, 24)
    modes = [s.mode for s in stats[1:]]
    # The plan's arm measured again on this text (a probe), then plain: no exploration from scratch.
    assert "draft" not in modes and modes.count("probe") <= PROBE_STEPS and modes[-5:] == ["plain"] * 5, modes


def test_always_draft_drafts_every_step(costs, tiny):
    model, p, ref = tiny
    costs["fn"] = steep_step
    got, stats, _ = run_steps(model, p, DraftConfig(OracleDrafter(model, p, N, 3), 2, 3, always_draft=True), N)
    assert got == ref
    assert all(s.mode == "" and s.tree_size == 7 for s in stats[1:])


def test_arm_names_and_sets():
    assert arm_name(PLAIN) == "plain" and arm_name(frozenset(["lookup", "drafter"])) == "drafter+lookup"
    both = frozenset(["drafter", "mtp", "lookup"])
    arms = arms_of(["drafter", "mtp", "lookup"], costly=["drafter", "mtp"])
    assert arms[:2] == [both, PLAIN]
    assert set(arms[2:]) == {frozenset(["mtp", "lookup"]), frozenset(["drafter", "lookup"]), frozenset(["lookup"])}


# --------------------------------------------------------------------------- what users see


def _responses(modes, plain_rate=50.0, tps=60.0):
    from mlx_redrafter.output import RedrafterResponse
    from mlx_redrafter.step.protocol import StepStats

    out = []
    for i, mode in enumerate(modes, start=1):
        stats = StepStats(step=i, mode=mode, plain_rate=plain_rate)
        out.append(
            RedrafterResponse(
                text="x",
                token=1,
                logprobs=None,
                from_draft=False,
                prompt_tokens=3,
                prompt_tps=1.0,
                generation_tokens=i,
                generation_tps=tps,
                peak_memory=0.1,
                finish_reason=None,
                stats=stats,
            )
        )
    return out


def test_the_summary_says_how_often_it_drafted_and_the_speed_against_plain():
    from mlx_redrafter.output import Tally

    t = Tally()
    for r in _responses(["draft"] * 6 + ["plain"] * 3 + ["probe"]):
        t.add(r)
    text = t.summary()
    assert "drafted 6 of 10 steps, 3 plain (drafting did not pay), 1 measuring; 1.20x plain decoding" in text
    ungoverned = Tally()
    for r in _responses([""] * 4):
        ungoverned.add(r)
    assert ungoverned.governor_summary() == "" and "plain decoding" not in ungoverned.summary()
    from types import SimpleNamespace

    from mlx_redrafter.chat.commands import status_line

    turn = SimpleNamespace(tally=t, interrupted=False, prefilled_tokens=3, reused_tokens=0)
    assert "1.20x plain decoding (measured live) | prefill" in status_line(turn)  # chat's line after each reply


def test_metrics_count_governed_steps():
    from types import SimpleNamespace

    from helpers import engine_metrics

    from mlx_redrafter.output import Tally

    m, engine = engine_metrics()
    assert 'redrafter_governed_steps_total{mode="plain"} 0.0' in m.text().decode()
    t = Tally()
    for r in _responses(["draft", "plain", "plain", "probe"]):
        t.add(r)
    done = SimpleNamespace(prompt_tokens=3, completion_tokens=4, step_tokens=[], drafted_by_source={}, reused_tokens=0)
    engine.listeners[0](SimpleNamespace(**vars(done), tally=t))
    text = m.text().decode()
    assert 'redrafter_governed_steps_total{mode="plain"} 2.0' in text
    assert 'redrafter_governed_steps_total{mode="draft"} 1.0' in text


@pytest.mark.parametrize("loop_name,pipelined", [("pipelined", True), ("synchronous", False)])
def test_the_cache_equals_plain_decodings_after_drafting_then_plain_steps(costs, tiny, loop_name, pipelined):
    """Drafting first, then plain steps once it loses (build ahead: the holes
    squeezed out when plain decoding starts): keys, values and the tokens
    held are plain decoding's."""
    model, p, _ = tiny
    costs["fn"] = steep_step
    draft = DraftConfig(OracleDrafter(model, p, N, 3), 2, 3, pipelined=pipelined, always_draft=False)
    got, stats, cache = steps_then_close(model, p, draft, 400, loop=loop_name, tokens=N)
    assert got == generate_tokens(model, p, max_tokens=len(got))[0]
    modes = [s.mode for s in stats[1:]]
    assert "draft" in modes and modes.count("plain") > len(modes) / 2
    check_caches(model, p, cache, got, f"governed, {loop_name}")


def test_plain_steps_queued_ahead_on_a_hybrid_leave_plain_decodings_cache(costs):
    """Read, then build, with plain decoding chosen: its steps are queued a
    step ahead (as mlx-lm's loop), and the one queued when the loop ends is
    undone: a hybrid's recurrent states and keys are plain decoding's."""
    from hybrids import tiny_hybrid

    model = tiny_hybrid("qwen3_5")
    p = prompts(1)[0]
    costs["fn"] = steep_step
    draft = DraftConfig(OracleDrafter(model, p, N, 3), 2, 3, pipelined=False, always_draft=False)
    for stop_at in (N - 12, N - 9):  # the loop ends after a plain step that queued the next, or mid-run
        keep._KEPT.clear()
        got, stats, cache = steps_then_close(model, p, draft, 400, loop="synchronous", tokens=stop_at)
        assert got == generate_tokens(model, p, max_tokens=len(got))[0]
        assert [s.mode for s in stats[-3:]] == ["plain"] * 3
        check_caches(model, p, cache, got, "governed hybrid, read then build")


def test_a_plain_step_queued_ahead_is_read_without_a_new_op(costs, tiny, monkeypatch):
    """Read, then build, plain decoding chosen: with the next step queued, the
    read of this one is of an array already evaluated (one flat int32 array):
    a new op there (a concatenation of a scalar token) would wait behind the
    queued step, and the device would idle while the host builds the next (a
    tenth of plain decoding's speed on this CPU, bench/RESULTS.md §36)."""
    from mlx_redrafter.step import after_read

    model, p, ref = tiny
    costs["fn"] = steep_step
    reads = []
    real = after_read.host_read

    def spy(*arrays):
        reads.append(len(arrays) == 1 and arrays[0].ndim == 1 and arrays[0].dtype == mx.int32)
        return real(*arrays)

    monkeypatch.setattr(after_read, "host_read", spy)
    draft = DraftConfig(OracleDrafter(model, p, N, 3), 2, 3, pipelined=False, always_draft=False)
    got, stats, _ = run_steps(model, p, draft, N)
    assert got == ref
    modes = [s.mode for s in stats[1:]]
    assert modes.count("plain") > 20
    assert sum(reads) >= modes.count("plain") - 2 * PROBE_STEPS, (reads, modes)
