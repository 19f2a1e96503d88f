"""Sources with caches of their own in a batch (issue 57): an MTP head, a
draft model, an EAGLE-3 head and a DFlash drafter draft for every row of a
batch, each row's source with its own caches, and each row gets exactly what
it gets alone.

What is asserted: at temperature 0 every row's tokens equal plain greedy
decoding of that row alone, on an attention model and a hybrid, with drafts
accepted in every row and different accepted lengths in a step; rows join
mid-batch (a prompt, or a reply under way) and leave at their own lengths.
Heads that are right only through the target's features at the right
positions (tests/feature_heads.py) are accepted in every row as they are
alone, so a row's source fed another row's hidden states, another node's,
or nothing, shows; so does a source that misses the tokens of plain steps
(the batch's governor switching drafting off and on).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from dflash_drafters import OracleDFlash, save_zlab
from feature_heads import mtp_head, previous_token_target, save_eagle3_head
from helpers import tiny_model
from hybrids import tiny_hybrid
from mlx_lm.models.cache import make_prompt_cache
from test_batch_trees import FLAT, batch_flat, check_drafts, plain, run_batch, timed_by
from test_sources import pass_through_head, qwen35_pass_through_head, repeating_qwen35, repeating_target

from mlx_redrafter.config import DraftConfig, SamplingConfig, library_draft
from mlx_redrafter.generate import generate_tokens
from mlx_redrafter.hub.load import load_drafter
from mlx_redrafter.step.batched import BatchSteps, RowPlan
from mlx_redrafter.step.governor import PLAIN, Governor

PROMPTS = [[1, 2, 3, 4, 5, 6], [10, 11, 12, 10, 11, 12, 10, 11], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36]]
N = 20


def targets(kind: str):
    """``(target, its MTP head, a draft model)``: a leaky target (its pass-through
    head and its leak-free copy right most of the time, not always)."""
    if kind == "mimo":
        target = repeating_target(0.02)
        return target, pass_through_head(target), repeating_target(0.0)
    target = repeating_qwen35(0.2)
    return target, qwen35_pass_through_head(target), repeating_qwen35(0.0)


def batch_equals_alone(model, draft, prompts=PROMPTS, n=N, **kw):
    """Rows two and three join at the third step; each leaves at its own length."""
    ns = [n + 2 * i for i in range(len(prompts))]
    bs = BatchSteps(model, draft, curve=FLAT, live=False)
    got, accepted = run_batch(bs, prompts, ns, join_at=2, **kw)
    assert got == [plain(model, [p], k)[0] for p, k in zip(prompts, ns)]
    assert len(bs) == 0 and bs.cache == []
    return bs, accepted


@pytest.mark.parametrize("kind", ["mimo", "qwen3_5"])
@pytest.mark.parametrize("source", ["mtp", "mtp+lookup", "draft-model"])
def test_stateful_sources_draft_in_every_row_exactly(kind, source):
    """Seen to fail: a row's source not told what a step put in its cache
    (step/batch_row.py ``BatchRow.entered`` doing nothing: drafts rejected,
    the MTP rows' acceptance gone)."""
    target, head, sibling = targets(kind)
    draft = {
        "mtp": DraftConfig(head=head, head_length=3),
        "mtp+lookup": DraftConfig(head=head, head_width=2, head_length=2, lookup=1),
        "draft-model": DraftConfig(draft_model=sibling, draft_model_length=3),
    }[source]
    bs, accepted = batch_equals_alone(target, draft)
    check_drafts(accepted, len(PROMPTS))
    assert bs.syncs > 0


@pytest.fixture(scope="module")
def feature_target(tmp_path_factory):
    model = previous_token_target()
    folder = save_eagle3_head(tmp_path_factory.mktemp("eagle3-batch"), model, 72)
    return model, {"mtp": mtp_head(model), "eagle3": load_drafter(folder, dtype="float32")}


@pytest.mark.parametrize("kind, width, length", [("mtp", 1, 3), ("eagle3", 1, 1), ("decoy", 2, 2)])
def test_heads_right_only_through_their_features_are_right_in_every_row(feature_target, kind, width, length):
    """Each row's head reads its own row's features, at its accepted nodes:
    each row accepts in every step what it accepts alone, the head's whole
    draft nearly always (tests/test_head_features.py). ``decoy``: the MTP head's right draft is
    its second beam (helpers.DecoyHead), so the accepted nodes are not the
    tree's first ones.

    Seen to fail: another row's hidden states handed to a row's source
    (``now.hidden[0]`` for every row), the tree's first nodes instead of the
    accepted path's (``decoy``), and the taps fused in reverse (EAGLE-3)."""
    from helpers import DecoyHead

    model, heads = feature_target
    prompts = [[5, 9, 11, 3, 20], [7, 2, 30, 14], [40, 41, 8, 6, 1, 3], [12, 50, 33]]
    head = heads.get(kind)
    if kind == "decoy":
        seen = {t for p in prompts for t in p + plain(model, [p], 40)[0]}
        head = DecoyHead(heads["mtp"], next(t for t in range(97) if t not in seen))
    draft = DraftConfig(head=head, head_width=width, head_length=length)
    _, accepted = batch_equals_alone(model, draft, prompts=prompts, n=24)
    for i, p in enumerate(prompts):
        alone = [s.accepted for s in generate_tokens(model, p, draft=draft, max_tokens=24 + 2 * i)[1][1:]]
        assert [a[i] for a in accepted if i in a] == alone  # step for step, as the row alone
        assert alone.count(length) >= len(alone) - 2, alone  # the whole draft, but for a step or two


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_a_dflash_drafter_drafts_in_every_row(tmp_path, kind):
    """A DFlash drafter (z-lab's layout, its real forward run) whose blocks
    are the model's own continuation, right only where its context is the
    row's own, token for token (tests/dflash_drafters.py ``OracleDFlash``).
    Every row decodes the same prompt, joining at other steps: each row's
    blocks come from its own cache's length, spoiled on other steps."""
    from mlx.utils import tree_flatten
    from test_dflash import PROMPT

    from mlx_redrafter.draft.dflash_io import config_from_dict, read_dflash
    from mlx_redrafter.draft.eagle3_io import read_config_dict

    model = (
        tiny_model("qwen3", vocab_size=31, num_hidden_layers=4, tie_word_embeddings=False)
        if kind == "qwen3"
        else tiny_hybrid("qwen3_5", vocab_size=31)
    )
    folder = save_zlab(tmp_path / "d", model, [1, 3], block=5, mask=0)
    oracle = OracleDFlash(config_from_dict(read_config_dict(folder)), PROMPT + plain(model, [PROMPT], N + 30)[0])
    oracle.load_weights(tree_flatten(read_dflash(folder, dtype="float32").parameters()))
    mx.eval(oracle.parameters())
    _, accepted = batch_equals_alone(
        model, library_draft(model, oracle, 1, None, 0, tree="fixed"), prompts=[PROMPT] * 4
    )
    check_drafts(accepted, 4)


def test_a_reply_under_way_joins_with_a_stateful_source():
    """A sequence that decoded 5 tokens alone joins two fresh rows with its
    cache and its next token: its head starts from the last cached token's
    state and drafts from there, exactly."""
    target, head, _ = targets("mimo")
    prompts = PROMPTS[:3]
    ref = [plain(target, [p], N)[0] for p in prompts]
    bs = BatchSteps(target, DraftConfig(head=head, head_length=3), curve=FLAT, live=False)
    cache = make_prompt_cache(target)
    known = prompts[2] + ref[2][:5]
    mx.eval(target(mx.array(known[:-1])[None], cache=cache))
    row, _ = bs.add(cache, [], RowPlan(SamplingConfig()), history=known[:-1], g0=known[-1])
    others = [bs.add(make_prompt_cache(target), p, row.plan)[0] for p in prompts[:2]]
    outs = {r: [] for r in [row, *others]}
    drafted = 0
    while len(outs[row]) < N - 5:
        for r, st in zip(bs.rows, bs.step()):
            outs[r] += st.tokens
            drafted += st.stats.accepted if r is row else 0
    assert ref[2][:5] + outs[row][: N - 5] == ref[2]
    assert [outs[o][: N - 6] for o in others] == [r[1 : N - 5] for r in ref[:2]]
    assert drafted >= 4


def test_a_source_catches_up_on_the_plain_steps_between_its_drafts(feature_target, monkeypatch):
    """The batch's governor runs plain decoding and the MTP head in turns
    (two steps each): the head, told the plain steps' tokens and states,
    drafts right after each plain stretch, in every row.

    Seen to fail: a plain step's tokens not told to the rows' sources."""
    model, heads = feature_target
    timed_by(monkeypatch, batch_flat)  # governed, its steps timed by a table: the trees' width is never cut
    turns = iter([PLAIN, PLAIN, frozenset({"mtp"}), frozenset({"mtp"})] * 20)
    monkeypatch.setattr(Governor, "choose", lambda self: (next(turns), False))
    prompts = [[5, 9, 11, 3, 20], [7, 2, 30, 14], [40, 41, 8, 6, 1, 3]]
    bs = BatchSteps(model, DraftConfig(head=heads["mtp"], head_length=2), curve=FLAT)
    assert bs.governed
    modes, step = [], bs.step

    def logged():
        out = step()
        modes.append({st.stats.mode for st in out})
        return out

    bs.step = logged
    got, accepted = run_batch(bs, prompts, 30)
    assert got == [plain(model, [p], 30)[0] for p in prompts]
    drafting = [a for a, m in zip(accepted, modes) if m == {"draft"}]
    assert len(drafting) >= 4 and {"plain"} in modes, modes
    assert all(set(a.values()) == {2} for a in drafting), accepted  # every row, the whole draft


def test_a_row_with_nothing_cached_but_its_next_token_decodes_plainly():
    """A row joining with an empty cache and only its next token (nothing for
    a head's state to come from) decodes plainly beside a drafting row,
    exactly: its next tokens are plain decoding's after that token.
    Seen to fail: the head asked to draft from no state (a TypeError)."""
    target, head, _ = targets("mimo")
    bs = BatchSteps(target, DraftConfig(head=head, head_length=3), curve=FLAT, live=False)
    lone, _ = bs.add(make_prompt_cache(target), [], RowPlan(SamplingConfig()), g0=5)
    other, _ = bs.add(make_prompt_cache(target), PROMPTS[0], RowPlan(SamplingConfig()))
    outs = {lone: [], other: []}
    for _ in range(8):
        for r, st in zip(bs.rows, bs.step()):
            outs[r] += st.tokens
    assert outs[lone][:8] == plain(target, [[5]], 8)[0]
    assert outs[other][:7] == plain(target, [PROMPTS[0]], 8)[0][1:]
    assert lone.drafts is None


def test_a_row_joining_on_a_cached_prefix_keeps_its_sources_caches():
    """A draft model whose drafts hang on its whole context: a row that
    left the batch carries its draft model's caches out after the model's
    (as a prompt cache keeps them), and a row joining on that cache (the
    next turn) drafts what a row given the whole prompt anew drafts, then
    decodes exactly.

    Seen to fail: the kept caches not taken (the draft model sees the new
    turn alone: other drafts), and a leaving row's caches not carried out."""
    target = repeating_target(0.02)
    draft = DraftConfig(draft_model=repeating_target(0.5, seed=3), draft_model_length=3)
    first, turn = [3, 9, 14, 2, 27, 5, 11, 30, 8, 19, 4, 22], [6, 17, 1, 25]

    def joined(cache, tokens, history=()):
        bs = BatchSteps(target, draft, curve=FLAT, live=False)
        row, _ = bs.add(cache, tokens, RowPlan(SamplingConfig()), history=list(history))
        return bs, row

    anew = joined(make_prompt_cache(target), first + turn)[1].rows
    bs, row = joined(make_prompt_cache(target), first)
    cache = bs.remove(row)
    assert len(cache) > len(make_prompt_cache(target))  # the draft model's caches came out after the model's
    bs, row = joined(cache, turn, history=first)
    assert row.rows == anew and row.rows
    outs = []
    while len(outs) < 12:
        outs += bs.step()[0].tokens
    assert outs[:12] == plain(target, [first + turn], 13)[0][1:]


def test_a_reply_under_way_on_a_hybrid_rejoins_with_new_source_caches():
    """A hybrid's cache cannot be trimmed to re-feed its last token, so a
    reply under way rejoins with its head fed that token from no context:
    its draft model's kept caches (which hold the token already) are set
    aside for new ones, and the row decodes exactly.
    Seen to fail: the kept caches kept and fed the last token again (13 entries, not 2)."""
    target = tiny_hybrid("qwen3_5", vocab_size=31)
    draft = DraftConfig(draft_model=tiny_model("qwen3", vocab_size=31, seed=2), draft_model_length=2)
    prompt = [3, 9, 14, 2, 27, 5, 11]
    bs = BatchSteps(target, draft, curve=FLAT, live=False)
    row, first = bs.add(make_prompt_cache(target), prompt, RowPlan(SamplingConfig()))
    known = prompt + first.tokens
    for _ in range(3):
        known += bs.step()[0].tokens
    cache = bs.remove(row)
    assert len(cache) > len(make_prompt_cache(target))  # the draft model's caches, carried out
    row, _ = bs.add(cache, [], RowPlan(SamplingConfig()), history=known[:-1], g0=known[-1])
    # New ones: the last cached token, then the next one its first draft starts from (the kept held all of known[:-1]).
    assert [c.offset for c in row.caches] == [2] * len(row.caches)
    outs = []
    while len(outs) < 8:
        outs += bs.step()[0].tokens
    ref = plain(target, [prompt], len(known) - len(prompt) + 8)[0]
    assert known[len(prompt) :] + outs[:8] == ref[: len(known) - len(prompt) + 8]
