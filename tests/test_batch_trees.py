"""Batched draft trees (issue 57): every row of a batch drafts, all rows'
trees are verified in one forward, and each row gets exactly what it gets
alone.

What is asserted, precisely: at temperature 0 each row's tokens equal plain
greedy decoding of that row alone (mlx-lm's ``generate_step`` through
``generate_tokens``), token for token, on tiny float32 models with peaked
logits (tests/helpers.py): attention models and hybrids (gated delta net,
Mamba2 run stepwise and padded, short convolution). Drafts are accepted in
every row, the accepted lengths differ between rows in a step, rows join
and leave mid-generation, a row under a grammar decodes beside free rows,
and a sampled row's first tokens follow the model's exact distribution
(chi-square, as tests/test_sampling.py). Logits are not asserted equal:
batched matmuls may round differently (they did not on these models).
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import pytest
from helpers import TINY_CONFIGS, OracleDrafter, random_drafter, tiny_model
from hybrids import tiny_hybrid
from mlx_lm.models.cache import make_prompt_cache
from test_grammar import CHARS, SCHEMAS, reference
from test_sampling import V_SMALL, chi2_passes, exact_first_tokens

from mlx_redrafter.config import DraftConfig, SamplingConfig
from mlx_redrafter.generate import generate_tokens
from mlx_redrafter.step import accept as accept_mod
from mlx_redrafter.step.batch_budget import BatchCost, SourceRates, choose_width, ranked_nodes
from mlx_redrafter.step.batched import BatchRow, BatchSteps, RowPlan
from mlx_redrafter.step.curve import CostCurve
from mlx_redrafter.step.grammar import compile_grammar

FLAT = CostCurve(tuple(1.0 + 0.01 * n for n in range(16)))  # a device where wide batches cost little: drafts pay
STEEP = CostCurve(tuple(float(n) for n in range(1, 17)))  # n tokens cost n steps: no draft pays
PROMPTS = [[1, 2, 3, 4, 5, 6], [10, 11, 12, 10, 11, 12, 10, 11], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36]]
N = 16


def run_batch(bs, prompts, n, join_at=None, plans=None, on_step=None):
    """Decode ``prompts`` together with ``bs``: the first two from the start,
    the others joining at step ``join_at`` (None: all from the start); a row
    leaves once it has ``n`` tokens (a list: each row's own). Returns each
    row's tokens and the accepted drafts of every row in every step."""
    plans = plans or [RowPlan(SamplingConfig()) for _ in prompts]
    ns = list(n) if isinstance(n, (list, tuple)) else [n] * len(prompts)
    outs, handles, accepted = [[] for _ in prompts], [None] * len(prompts), []
    first = len(prompts) if join_at is None else 2

    def join(indices):
        for i in indices:
            handles[i], step = bs.add(make_prompt_cache(bs.model), prompts[i], plans[i])
            outs[i] += step.tokens

    join(range(first))
    step = 0
    while len(bs) or None in handles:
        if step == join_at:
            join(range(first, len(prompts)))
        if not len(bs):
            continue
        results = bs.step()
        step += 1
        accepted.append({handles.index(row): st.stats.accepted for row, st in zip(bs.rows, results)})
        for row, st in zip(list(bs.rows), results):
            i = handles.index(row)
            outs[i] += st.tokens
            if on_step is not None:
                on_step(st)
            if len(outs[i]) >= ns[i]:
                bs.remove(row)
    return [o[:k] for o, k in zip(outs, ns)], accepted


def plain(model, prompts, n):
    return [list(generate_tokens(model, p, max_tokens=n)[0]) for p in prompts]


def staggered_oracle(model, prompts, inner=None):
    """An OracleDrafter for ``prompts`` whose replies differ in length, so
    that its irregular corruption of each beam's last draft falls on other
    steps in each row: rows accept different numbers in a step."""
    replies = [plain(model, [p], N + 5 + 2 * i)[0] for i, p in enumerate(prompts)]
    return OracleDrafter(model, prompts, N, 3, inner=inner, replies=replies)


def check_drafts(accepted, rows):
    """Drafts were accepted in every row, and rows accepted different numbers in one step."""
    for i in range(rows):
        assert sum(a.get(i, 0) for a in accepted) >= 2, (i, accepted)
    assert sum(len(set(a.values())) > 1 for a in accepted) >= 3, accepted  # ragged, in several steps


MODELS = {
    "llama": lambda: tiny_model("llama"),
    "qwen3": lambda: tiny_model("qwen3"),
    "phi3": lambda: tiny_model("phi3"),
    "qwen3_5": lambda: tiny_hybrid("qwen3_5"),  # gated delta net, padded
    "nemotron_h": lambda: tiny_hybrid("nemotron_h"),  # Mamba2, stepwise
    "lfm2": lambda: tiny_hybrid("lfm2"),  # short convolution
}


@pytest.mark.parametrize("kind", list(MODELS))
def test_rows_verified_together_equal_each_alone(kind):
    """Drafter beams (one of them right, the others a real drafter's) and
    lookup rows in every row; two rows join at the third step; each row
    leaves at its own length."""
    model = MODELS[kind]()
    oracle = staggered_oracle(model, PROMPTS, inner=random_drafter())
    bs = BatchSteps(model, DraftConfig(oracle, 2, 3, lookup=1, lookup_length=3), curve=FLAT, live=False)
    got, accepted = run_batch(bs, PROMPTS, N, join_at=2)
    assert got == plain(model, PROMPTS, N)
    check_drafts(accepted, len(PROMPTS))
    assert len(bs) == 0 and bs.cache == []


def test_lookup_rows_alone_and_a_row_that_moves_in_mid_reply():
    """Lookup only (repeating prompts: copies are right); a row that decoded
    elsewhere joins with its cache and its next token, and goes on exactly."""
    model = tiny_model("qwen3")  # its replies to these prompts repeat themselves: lookup copies are right
    prompts = [[32, 68, 90, 77, 18, 39, 12], [93, 41, 90, 8], [66, 33, 7, 70, 1, 11]]
    ref = plain(model, prompts, N)
    bs = BatchSteps(model, DraftConfig(None, lookup=2, lookup_length=4), curve=FLAT, live=False)
    got, accepted = run_batch(bs, prompts[:2], N)
    assert got == ref[:2]
    assert sum(sum(a.values()) for a in accepted) > 0  # lookup copies were accepted
    # The third sequence decodes 5 tokens alone, then joins two fresh rows mid-reply.
    cache = make_prompt_cache(model)
    known = prompts[2] + ref[2][:5]
    mx.eval(model(mx.array(known[:-1])[None], cache=cache))
    row, none = bs.add(cache, [], RowPlan(SamplingConfig()), history=known[:-1], g0=known[-1])
    assert none is None
    others = [bs.add(make_prompt_cache(model), p, RowPlan(SamplingConfig()))[0] for p in prompts[:2]]
    outs = {r: [] for r in [row, *others]}
    while len(outs[row]) < N - 5:
        for r, st in zip(bs.rows, bs.step()):
            outs[r] += st.tokens
    assert ref[2][:5] + outs[row][: N - 5] == ref[2]
    assert [outs[o][: N - 6] for o in others] == [r[1 : N - 5] for r in ref[:2]]


def test_datastore_rows_in_every_row():
    """A datastore of earlier replies (row i's with one token in 4 + i
    changed: partly right, wrong on other steps in each row) drafts for every row."""
    from mlx_redrafter.draft.datastore.index import Datastore

    model = tiny_model("llama")
    ref = plain(model, PROMPTS, N)
    store = Datastore(model_id="test")
    for i, r in enumerate(ref):
        store.add([(t + 1) % 97 if j % (4 + i) == 3 + i else t for j, t in enumerate(r)])
    bs = BatchSteps(model, DraftConfig(None, datastore=store), curve=FLAT, live=False)
    sources = Counter()
    got, accepted = run_batch(bs, PROMPTS, N, on_step=lambda st: sources.update({st.stats.source: st.stats.accepted}))
    assert got == ref
    check_drafts(accepted, len(PROMPTS))
    assert set(sources) <= {"", "datastore"} and sources["datastore"] > 0


def test_nothing_pays_the_batch_decodes_plainly_and_exactly():
    model = tiny_model("llama")
    oracle = OracleDrafter(model, PROMPTS, N, 3)
    bs = BatchSteps(model, DraftConfig(oracle, 2, 3, lookup=1), curve=STEEP, live=False)
    got, accepted = run_batch(bs, PROMPTS, N)
    assert got == plain(model, PROMPTS, N)
    assert bs.last_width == 1 and all(n == 0 for a in accepted for n in a.values())


def batch_steep(rows, width, arm):  # every verified token costs a plain step, each source's draft half of one
    return 0.01 * rows * (width + 0.5 * len(arm or ()))


def batch_flat(rows, width, arm):  # a wide batch costs little more than a plain one
    return 0.01 * rows * (1.0 if width == 1 else 1.05)


def timed_by(monkeypatch, fn, kept=None):
    """Governed batches (no ``always_draft``) whose steps take ``fn(rows, width, arm)`` seconds, not the clock's,
    starting from the requests alone's states ``kept`` (step/keep.py: by key; none from earlier tests or runs)."""
    from mlx_redrafter.step import keep

    monkeypatch.setenv("MLX_REDRAFTER_ALWAYS_DRAFT", "0")
    monkeypatch.setattr(keep, "_KEPT", dict(kept or {}))
    monkeypatch.setattr(keep, "load_state", lambda key: None)
    real = BatchSteps.timed
    monkeypatch.setattr(
        BatchSteps,
        "timed",
        lambda self, out, w, ran, s: real(self, out, w, ran, fn(len(out), w, ran and ran[0])),
    )


@pytest.mark.parametrize("name", ["steep", "flat"])
def test_the_batch_drafts_only_where_it_pays_with_the_same_tokens(name, monkeypatch):
    """Governed (no ``always_draft``, a live batch): on a device where every
    verified token and every draft forward costs (steep), the batch settles
    on plain decoding, with no source asked; where a wide batch costs little
    (flat), on drafting. Each step's time comes from a cost table, not the
    clock; the rows' tokens are plain decoding's either way.
    Mutation: ``BatchSteps._next_arm`` leaving ``drafts.on`` alone (every
    source asked in every arm): the steep batch keeps drafting."""
    timed_by(monkeypatch, {"steep": batch_steep, "flat": batch_flat}[name])
    model, n = tiny_model("llama"), 96
    prompts = PROMPTS[:2]
    oracle = OracleDrafter(model, prompts, n, 3)
    bs = BatchSteps(model, DraftConfig(oracle, 2, 3, lookup=1), curve=FLAT)
    assert bs.governed
    modes, widths = [], []

    def on_step(st):
        modes.append(st.stats.mode)
        widths.append(bs.last_width)

    got, _ = run_batch(bs, prompts, n, on_step=on_step)
    assert got == plain(model, prompts, n)
    late = modes[len(modes) // 2 :]
    if name == "steep":  # plain steps verify g0 alone in every row, after the first few
        assert late.count("plain") > 0.7 * len(late), modes
        assert widths[-1] == 1
        assert bs.queued_steps > len(late) // 4  # plain steps were launched before the last one was read
    else:  # drafting, but for the probes of plain decoding and lookup alone (waits of 16, 32, ... steps)
        assert late.count("draft") > 0.5 * len(late) and modes[-1] == "draft", modes
        assert max(widths[len(widths) // 2 :]) > 1
    assert "probe" in modes  # the arms left out were measured


def test_a_new_number_of_rows_starts_from_what_the_batch_learned(monkeypatch):
    """Governed on the steep cost table: two rows settle on plain decoding,
    then two more join. The four-row batch starts on plain decoding (its
    governor seeded from the two-row one's), not on a run of drafting
    steps measured from scratch (probes aside); the tokens are plain decoding's.
    Mutation seen caught: ``_new_governor`` not seeding (the four-row batch
    drafts its first steps)."""
    timed_by(monkeypatch, batch_steep)
    model, n = tiny_model("llama"), 64
    oracle = OracleDrafter(model, PROMPTS, n, 3)
    bs = BatchSteps(model, DraftConfig(oracle, 2, 3, lookup=1), curve=FLAT)
    steps, step = [], bs.step

    def logged():
        out = step()
        steps.append((len(out), out[0].stats.mode))
        return out

    bs.step = logged
    got, _ = run_batch(bs, PROMPTS, n, join_at=30)
    assert got == plain(model, PROMPTS, n)
    two = [m for r, m in steps[:30] if r == 2]
    four = [m for r, m in steps if r == 4]
    assert two[-5:] == ["plain"] * 5, two
    # plain at once (a probe may follow: the waits carry over too), never the plan's arm measured anew
    assert len(four) > 10 and four[0] == "plain" and "draft" not in four, four


def kept_alone(model, drafting: float) -> dict:
    """A request alone's kept state (step/keep.py) on ``model`` with the
    drafter and lookup: 12 steps of every arm, plain decoding at a token a
    second, the drafting arms at ``drafting`` times that."""
    from mlx_redrafter.step.governor import PLAIN, Governor
    from mlx_redrafter.step.keep import live_key

    alone = Governor(["drafter", "lookup"], costly=["drafter"])
    for _ in range(12):
        for arm in alone.arms:
            alone.step += 1
            alone.prev = alone.chosen = arm
            alone.ran(arm, 1, 1.0 if arm == PLAIN else 1.0 / drafting)
    return {live_key(model, ["drafter", "lookup"]): {"governor": alone.to_dict()}}


@pytest.mark.parametrize("drafting", [1 / 3, 1.2], ids=["far-behind", "paid-alone"])
def test_a_batch_starts_from_what_requests_alone_learned(monkeypatch, drafting):
    """Requests alone on this model and sources found drafting far behind
    plain decoding (a third of its rate), or ahead of it (1.2x), in a kept
    state (step/keep.py); in the batch every verified token costs a plain
    step (no draft pays). The batch's first governor starts from the arms
    far behind alone only: far behind, the drafting arms are not measured
    again (no step verifies a draft before their kept waits are out); ahead,
    the batch measures them itself and settles on plain decoding (what paid
    alone does not say what pays in a batch). The tokens are plain
    decoding's. Mutations seen caught: step/batch_governors.py not reading
    the kept state (far-behind: the batch drafts its first steps), and
    carrying the arms close to the best too (paid-alone: it keeps drafting)."""
    model, n = tiny_model("llama"), 40
    timed_by(monkeypatch, batch_steep, kept_alone(model, drafting))
    oracle = OracleDrafter(model, PROMPTS[:2], n, 3)
    bs = BatchSteps(model, DraftConfig(oracle, 2, 3, lookup=1), curve=FLAT)
    modes, step = [], bs.step

    def logged():
        out = step()
        modes.append((out[0].stats.mode, bs.last_width))
        return out

    bs.step = logged
    got, _ = run_batch(bs, PROMPTS[:2], n)
    assert got == plain(model, PROMPTS[:2], n)
    # The first step verifies the trees proposed as the rows joined; then plain is measured and runs
    # (the far arms' next probes come once their kept waits are out: 16 steps).
    start = modes[1:16]
    if drafting < 1:
        assert all(width == 1 for _, width in start) and start[-1][0] == "plain", str(modes)
    else:
        assert any(width > 1 for _, width in start) and [m for m, _ in modes[-5:]] == ["plain"] * 5, str(modes)


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_rows_join_and_leave_while_a_plain_step_is_queued(kind, monkeypatch):
    """Governed on the steep cost table: once the batch decodes plainly, each
    step is launched before the one before it is read. Two rows join late and
    every row leaves at its own length, each time with a step queued: the
    queued step is undone (its token forgotten by every row's cache, its
    draws' keys given back) and each row's tokens are still plain
    decoding's. A hybrid's plain steps are not queued (its recurrent states
    would not forget the queued token); its rows are still aligned once and
    then written in place. Mutations: ``_unqueue`` doing nothing (the rows'
    caches keep the queued token), or not giving the keys back;
    ``align_rows`` leaving ragged rows where they are."""
    timed_by(monkeypatch, batch_steep)
    model = MODELS[kind]()
    ns = [70, 84, 58, 76]
    oracle = OracleDrafter(model, PROMPTS, max(ns), 3)
    bs = BatchSteps(model, DraftConfig(oracle, 2, 3, lookup=1), curve=FLAT)
    undone = []
    unqueue = bs._unqueue

    def spy():
        if bs.ahead is not None:
            before = list(bs.ragged.lengths)
            unqueue()
            undone.append([a - b for a, b in zip(before, bs.ragged.lengths)])
        else:
            unqueue()

    bs._unqueue = spy
    got, _ = run_batch(bs, PROMPTS, ns, join_at=36)
    assert got == [plain(model, [p], k)[0] for p, k in zip(PROMPTS, ns)]
    if kind == "qwen3_5":
        assert not undone and bs.queued_steps == 0
        return
    assert len(undone) >= 3 and all(set(d) == {1} for d in undone), undone  # joins and leaves with a step queued
    # A seeded row's sampler keeps its key to itself: nothing is queued beside it.
    now = type("Now", (), {"plain": True})()
    bs.rows, bs.arm = [BatchRow(RowPlan(SamplingConfig()), None, None)], (frozenset(), False, 1)
    assert bs._can_queue(now)
    bs.rows.append(BatchRow(RowPlan(SamplingConfig(temp=1.0), drafts=False, sampler=lambda lp: lp), None, None))
    assert not bs._can_queue(now)
    # A sampled row's key: the queued step's draw is given back when it is undone.
    key = mx.random.key(3)
    row = BatchRow(RowPlan(SamplingConfig(temp=1.0), key=key), None, None)
    bs.rows, bs.ahead, bs.ragged.lengths = [row], object(), [5]
    row.saved_key = key
    row.next_key()
    bs._unqueue = unqueue
    monkeypatch.setattr("mlx_redrafter.step.batched.fit_rows", lambda cache, ragged: None)
    bs._unqueue()
    assert row.plan.key is key and bs.ragged.lengths == [4] and bs.ahead is None


def test_the_width_is_priced_on_the_whole_batch():
    """One row with sure drafts and three with none: a width that pays for
    one row alone does not pay for four rows padded to it."""
    rates = SourceRates()
    for _ in range(50):  # lookup is always right
        rates.observe([[5, 6, 7]], ["lookup"], [5, 6, 7])
    sure = ranked_nodes([[5, 6, 7]], ["lookup"], rates)
    assert [round(p, 2) for _, p in sure] == [0.98, 0.96, 0.94]
    # c(n) = 1 + 0.25 (n - 1): three sure drafts pay for one row ...
    curve = CostCurve(tuple(1.0 + 0.25 * n for n in range(16)))
    assert choose_width([sure], curve) == 4
    # ... and, with three rows that drafted nothing padded to its width, so does a width of 2 at most.
    assert choose_width([sure, [], [], []], curve) == 1
    assert choose_width([sure] * 4, curve) > 1


def test_the_live_cost_follows_the_measured_steps():
    """Measured widths are priced by their own seconds; the others by the
    curve's shape scaled to the nearest measured width."""
    curve = CostCurve(tuple(1.0 + 0.25 * n for n in range(16)))  # c(4) = 1.75, c(8) = 2.75, c(12) = 3.75
    cost = BatchCost(curve)
    assert cost(4, 2) == curve(8)  # nothing measured: the curve
    cost.observe(4, 1, 0.10)
    cost.observe(4, 1, 0.20)  # an exponential average: 0.8 x 0.10 + 0.2 x 0.20
    assert cost(4, 1) == pytest.approx(0.12)
    assert cost(4, 3) == pytest.approx(0.12 * curve(12) / curve(4))
    cost.observe(4, 2, 0.5)  # wider than the curve said: measured, and what lies past it scales from it
    assert cost(4, 2) == 0.5 and cost(4, 3) == pytest.approx(0.5 * curve(12) / curve(8))
    assert cost(4, 1) == pytest.approx(0.98 * 0.12 + 0.02 * 0.5 * curve(4) / curve(8))  # relaxed toward it
    assert cost(2, 2) == curve(4)  # another row count: its own measurements (none yet)
    # The width follows: with sure drafts in all 4 rows, the measured 0.5 s makes width 2 lose to plain steps ...
    rates = SourceRates()
    for _ in range(50):
        rates.observe([[5]], ["lookup"], [5])
    sure = ranked_nodes([[5]], ["lookup"], rates)
    assert choose_width([sure] * 4, curve) == 2 and choose_width([sure] * 4, cost) == 1
    # ... until the plain steps' times, shaped by the curve, have worn the slow reading down: width 2 is tried again.
    steps = 0
    while choose_width([sure] * 4, cost) == 1:
        cost.observe(4, 1, 0.12)
        steps += 1
    assert 20 < steps < 200 and cost(4, 2) < 0.12 * curve(8) / curve(4) * 1.4


@pytest.mark.parametrize("schema", SCHEMAS[:1], ids=["object"])
def test_a_row_under_a_grammar_beside_free_rows(schema):
    model = tiny_model("llama")
    grammar = compile_grammar(CHARS, schema, vocab_size=model.args.vocab_size)
    prompts = [[5, 9, 17, 3], [40, 41, 42, 40, 41, 42], [3, 4, 5, 3, 4, 5, 3]]
    constrained = reference(model, prompts[0], grammar, 60)
    oracle = OracleDrafter(
        model, prompts, 60, 3, inner=random_drafter(), replies=[constrained, *plain(model, prompts[1:], 62)]
    )
    bs = BatchSteps(model, DraftConfig(oracle, 2, 3, lookup=1), curve=FLAT, live=False)
    plans = [RowPlan(SamplingConfig(), grammar=grammar), RowPlan(SamplingConfig()), RowPlan(SamplingConfig())]
    sources = Counter()
    handles, outs = [], []
    for p, plan in zip(prompts, plans):
        row, first = bs.add(make_prompt_cache(model), p, plan)
        handles.append(row)
        outs.append(list(first.tokens))
    while handles[0] in bs.rows:
        for row, st in zip(list(bs.rows), bs.step()):
            i = handles.index(row)
            outs[i] += st.tokens
            if i == 0 and st.stats.accepted:
                sources[st.stats.source] += st.stats.accepted
            if i == 0 and outs[0][-1] in grammar.eos_ids:
                bs.remove(row)
    assert outs[0] == constrained  # plain constrained decoding's, up to and with its EOS
    free = plain(model, prompts[1:], max(len(o) for o in outs[1:]))
    assert outs[1:] == [f[: len(o)] for f, o in zip(free, outs[1:])]
    assert sources["drafter"] >= 2 and sources["grammar"] >= 2, sources  # its own drafts and its forced tokens


def sampled_rows(model, prompt, draft, cfg, runs: int, per_batch: int, seed: int):
    """The first 3 tokens of ``runs`` sampled rows, ``per_batch`` rows in each batch, each on its own key."""
    out, taken, key = Counter(), 0, mx.random.key(seed)
    for _ in range(runs // per_batch):
        bs = BatchSteps(model, draft, curve=FREE, live=False)
        firsts = {}
        for _ in range(per_batch):
            key, sub = mx.random.split(key)
            row, step = bs.add(make_prompt_cache(model), prompt, RowPlan(cfg, key=sub))
            firsts[row] = list(step.tokens)
        while any(len(t) < 3 for t in firsts.values()):
            for row, st in zip(bs.rows, bs.step()):
                firsts[row] += st.tokens
                taken += st.stats.accepted
        out.update(tuple(t[:3]) for t in firsts.values())
    return out, taken


@pytest.fixture(scope="module")
def v5_model():
    """tests/test_sampling.py's model of a 5-token vocabulary (its exact law is enumerable)."""
    cfg = dict(TINY_CONFIGS["llama"], vocab_size=V_SMALL, hidden_size=32, num_attention_heads=2)
    cfg.update(num_key_value_heads=1, intermediate_size=64)
    cfg.pop("rope_scaling")
    TINY_CONFIGS["llama_v5"] = cfg
    try:
        return tiny_model("llama_v5", scale=3.0)
    finally:
        del TINY_CONFIGS["llama_v5"]


class FixedDrafter:
    """Drafts the same beams every step (two deterministic beams of the
    5 tokens): accepted often, rejected often, so the
    sampling walk's residuals matter in most steps. Costs nothing to run."""

    BEAMS = [[0, 1], [2, 4]]

    def draft(self, embed, context, g0, width, length, warp=False, confidences=0):
        from mlx_redrafter.draft.beam import Beams

        return Beams(mx.array(self.BEAMS, mx.int32)[:width, :length], mx.zeros((width,)))


RUNS, PER_BATCH = 1000, 500
FREE = CostCurve((1.0,) * 16)  # any batch costs one step: every draft is verified


@pytest.mark.parametrize("wrong", [None])  # the walks of tests/test_sampling.py's WRONG fail it
def test_a_batched_rows_samples_follow_the_models_distribution(v5_model, monkeypatch, wrong):
    """1000 sampled rows, 500 to a batch, each on its own key, each verifying
    a tree every step: their first three tokens against the exact law. Wrong
    acceptance walks swapped in fail the same check, and so do rows that
    share one key (their samples are the same)."""
    from test_sampling import PROMPT, WRONG

    if wrong is not None:
        monkeypatch.setattr(accept_mod, "walk_tree", WRONG[wrong])
    cfg = SamplingConfig(temp=1.0)
    draft = DraftConfig(FixedDrafter(), 2, 2)
    expected = exact_first_tokens(v5_model, PROMPT, cfg)
    observed, taken = sampled_rows(v5_model, PROMPT, draft, cfg, RUNS, PER_BATCH, seed=5)
    assert chi2_passes(observed, expected, RUNS) == (wrong is None)
    assert taken > RUNS // 2  # drafts were accepted in many rows


def test_sampled_rows_drafting_with_a_draft_model_follow_the_models_distribution(v5_model):
    """The same check with a source with caches of its own: the model as its
    own draft model (each row its own caches, catching up on its own sampled
    tokens), 250 rows to a batch."""
    from test_sampling import PROMPT

    cfg = SamplingConfig(temp=1.0)
    draft = DraftConfig(None, draft_model=v5_model, draft_model_length=2)
    expected = exact_first_tokens(v5_model, PROMPT, cfg)
    observed, taken = sampled_rows(v5_model, PROMPT, draft, cfg, RUNS, 250, seed=7)
    assert chi2_passes(observed, expected, RUNS)
    assert taken > RUNS // 2


def test_one_token_a_row_on_ragged_rows_sees_only_each_rows_own_tokens():
    """After drafting steps left the rows ending in different places, a
    verify call of one token a row gives each row the logits it has alone
    (its own cache, mlx-lm's model call): the columns after a shorter row's
    end hold its rejected drafts and stay hidden. Mutation: ``verify_batch``
    taking mlx-lm's own batched step for any width of 1 (its mask reads the
    rows as ending together)."""
    from mlx_redrafter.llm.batch_cache import extract_row
    from mlx_redrafter.step.batch_verify import RowTree, stack_trees, verify_batch

    model = tiny_model("llama")
    oracle = OracleDrafter(model, PROMPTS, N, 3, inner=random_drafter())
    bs = BatchSteps(model, DraftConfig(oracle, 2, 3, lookup=1), curve=FLAT, live=False)
    for p in PROMPTS:
        bs.add(make_prompt_cache(model), p, RowPlan(SamplingConfig()))
    for _ in range(N - 4):
        if not bs.ragged.aligned:
            break
        bs.step()
    assert not bs.ragged.aligned, bs.ragged
    alone = []
    for b, row in enumerate(bs.rows):
        own = extract_row(bs.cache, bs.ragged, b)
        alone.append(model(mx.array([[row.g0]]), cache=own)[0, -1])
    bt = stack_trees([RowTree(mx.array(row.g0, mx.int32)) for row in bs.rows])
    logits, _ = verify_batch(model, bs.backbone, bs.lm_head, bs.cache, bt, bs.ragged)
    for b, want in enumerate(alone):
        assert mx.allclose(logits[b, 0], want, atol=1e-4).item(), b
