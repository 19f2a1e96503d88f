"""The n-gram lookup proposer."""

import pytest

from mlx_redrafter.draft.lookup import Lookup


def test_no_match():
    assert Lookup([1, 2, 3, 4, 5]).propose(4) == []
    # A single repeated token is no match for the default 2-token minimum.
    assert Lookup([1, 2, 3, 1]).propose(4) == []


def test_history_shorter_than_n_min():
    lk = Lookup([7], n_max=3, n_min=2)
    assert lk.propose(4) == []
    lk.extend([7])  # "7 7": the suffix (7, 7) has never been seen before
    assert lk.propose(4) == []
    assert Lookup([], n_max=3, n_min=1).propose(4) == []


def test_match_at_the_very_end():
    # The suffix (2, 3) was seen once, at the start; its continuation is 9 then the suffix itself.
    lk = Lookup([2, 3, 9, 5, 2, 3])
    assert lk.propose(3) == [[9, 5, 2]]
    # The continuation reaches the end of the history: it repeats (9 5 2 3 9 ...).
    assert lk.propose(6) == [[9, 5, 2, 3, 9, 5]]


def test_longest_suffix_and_latest_occurrence_win():
    # (1, 2) was followed by 8, then by 4; the 3-gram (0, 1, 2) was followed by 8.
    lk = Lookup([0, 1, 2, 8, 6, 1, 2, 4, 6, 0, 1, 2])
    assert lk.propose(1) == [[8]]
    lk = Lookup([0, 1, 2, 8, 6, 1, 2, 4, 6, 5, 1, 2])
    assert lk.propose(1) == [[4]]  # no 3-gram match: the latest (1, 2) wins


def test_overlapping_repeats():
    lk = Lookup([5, 5, 5, 5])
    assert lk.propose(4) == [[5, 5, 5, 5]]
    lk = Lookup([9, 1, 2, 1, 2, 1])
    assert lk.propose(5) == [[2, 1, 2, 1, 2]]


def test_l_larger_than_the_continuation():
    # (4,) occurred once, right before the last token: its continuation is just [4], repeated.
    lk = Lookup([3, 4, 4], n_min=1)
    assert lk.propose(5) == [[4, 4, 4, 4, 4]]
    lk = Lookup([1, 2, 3, 1], n_min=1)
    assert lk.propose(7) == [[2, 3, 1, 2, 3, 1, 2]]


def test_incremental_equals_built_at_once():
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 2, 3, 1]
    lk = Lookup(n_max=3, n_min=1)
    for i, t in enumerate(seq):
        lk.extend([t])
        assert lk.propose(3, 2) == Lookup(seq[: i + 1], n_max=3, n_min=1).propose(3, 2)


def test_several_drafts_are_distinct_and_longest_first():
    lk = Lookup([7, 1, 2, 3, 9, 2, 3, 8, 5, 1, 2, 3])
    # (1, 2, 3) -> 9; (2, 3) latest -> 8; (3,) latest -> 8 (a duplicate, skipped).
    assert lk.propose(2, 3) == [[9, 2], [8, 5]]
    assert lk.propose(2, 1) == [[9, 2]]


def test_bad_orders_are_refused():
    with pytest.raises(ValueError):
        Lookup(n_max=1, n_min=2)


# --------------------------------------------------------------------------- lookup drafts in the step loop

import mlx.core as mx  # noqa: E402
from helpers import (  # noqa: E402
    TINY_CONFIGS,
    OracleDrafter,
    accepted_drafts,
    accepted_in_steps,
    assert_exact_under_drafting,
    prompts,
    random_drafter,
    run_steps,
    tiny_model,
)

from mlx_redrafter.generate import DraftConfig, generate_tokens, stream_generate  # noqa: E402

N_TOKENS = 64
# These random models fall into loops (lookup drafts get accepted); llama and
# phi3 wander, so their lookup drafts are verified and mostly rejected.
LOOPING = ("qwen3", "gemma3_text")


def repetitive(p):
    """A prompt that repeats itself: lookup drafts find long matches."""
    return p + p + p[: len(p) // 2]


def lookup_accepted(stats):
    return sum(s.accepted for s in stats if s.source == "lookup")


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny(request):
    model = tiny_model(request.param)
    ps = [repetitive(p) for p in prompts(3)]
    refs = [generate_tokens(model, p, max_tokens=N_TOKENS)[0] for p in ps]
    return request.param, model, ps, refs


@pytest.mark.parametrize(
    "draft",
    [DraftConfig(lookup=1), DraftConfig(lookup=2, lookup_length=3), DraftConfig(lookup=1, lookup_length=1)],
    ids=["lookup1", "lookup2_len3", "lookup1_len1"],
)
def test_tiny_models_lookup_only(tiny, draft):
    kind, model, ps, refs = tiny
    taken = verified = 0
    for p, ref in zip(ps, refs):
        out, stats = generate_tokens(model, p, draft=draft, max_tokens=N_TOKENS)
        assert out == ref, kind
        # With this very reply in the context before the prompt (a chat's earlier turn), lookup is right.
        again, again_stats, _ = run_steps(model, p, draft, N_TOKENS, history=p + ref)
        assert again == ref and accepted_in_steps(again_stats, N_TOKENS, "lookup") >= 8, kind
        assert all(s.source in ("", "lookup") for s in stats)
        taken += lookup_accepted(stats)
        verified += sum(s.tree_size > 1 for s in stats)
    assert verified > 0  # lookup drafts were really verified
    if kind in LOOPING:
        assert taken > 0  # and accepted, where the model repeats itself


@pytest.mark.parametrize("width,length,k", [(2, 1, 1), (1, 3, 1), (2, 2, 2)])
def test_tiny_models_lookup_merged(tiny, width, length, k):
    kind, model, ps, refs = tiny
    drafter = random_drafter(exit_dim=48, num_draft_layers=1)
    for p, ref in zip(ps, refs):
        # The real drafter's beams beside the oracle's right one, and lookup rows.
        draft = DraftConfig(OracleDrafter(model, p, N_TOKENS, length, inner=drafter), width, length, lookup=k)
        out, stats = generate_tokens(model, p, draft=draft, max_tokens=N_TOKENS)
        assert out == ref and accepted_in_steps(stats, N_TOKENS) >= 8, kind
        # The tree holds at most every drafter node and every lookup node.
        assert all(s.tree_size <= 1 + width * length + k * draft.lookup_length for s in stats)


def test_lookup_only_without_match_is_plain_steps():
    model = tiny_model("llama")
    p = list(range(10))  # no token repeats, and a random model's first replies rarely do
    ref, _ = generate_tokens(model, p, max_tokens=12)
    out, stats = generate_tokens(model, p, draft=DraftConfig(lookup=1), max_tokens=12)
    assert out == ref
    assert stats[1].tree_size == 1 and stats[1].accepted == 0  # the first step had nothing to look up


# --------------------------------------------------------------------------- default model

COPY_PROMPT = (
    "Repeat the following paragraph exactly, word for word:\n\n"
    "The quick brown fox jumps over the lazy dog. The dog does not move. The fox jumps again, "
    "and again, over the lazy dog, until the sun goes down and the fox goes home."
)
CHAT = ["What is the capital of France?", "Write a Python function that reverses a string.", COPY_PROMPT]


@pytest.fixture(scope="module")
def default_setup(default_model):
    from mlx_redrafter.hub.load import load_drafter
    from mlx_redrafter.runtime import shipped_drafter_path

    model, tok = default_model
    ps = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True) for c in CHAT]
    refs = [generate_tokens(model, p, max_tokens=N_TOKENS, eos_ids=tok.eos_token_ids)[0] for p in ps]
    return model, tok, ps, refs, load_drafter(shipped_drafter_path("default"))


@pytest.mark.parametrize("with_drafter", [False, True], ids=["lookup_only", "merged"])
def test_default_model_lookup_exact(default_setup, with_drafter):
    model, tok, ps, refs, drafter = default_setup
    draft = DraftConfig(drafter if with_drafter else None, 2, 1, lookup=1)
    taken = 0
    for p, ref in zip(ps, refs):
        out, stats = generate_tokens(model, p, draft=draft, max_tokens=N_TOKENS, eos_ids=tok.eos_token_ids)
        assert out == ref
        taken += lookup_accepted(stats)
    assert taken > 0


def _run(model, tok, prompt, **kw):
    rs = list(stream_generate(model, tok, prompt, **{"drafter": None, "lookup": False, **kw}))  # plain unless given
    return [r.token for r in rs], "".join(r.text for r in rs), rs


@pytest.fixture(scope="module")
def lookup_run(default_setup):
    """A lookup-only stream of the copy prompt, and a token inside a multi-token lookup run."""
    model, tok, ps, _, _ = default_setup
    rs = assert_exact_under_drafting(
        model, tok, ps[2], drafter=None, lookup=True, max_tokens=60, min_accepted=10, source="lookup"
    )
    inside = [
        i
        for i in range(1, len(rs) - 1)
        if rs[i].from_draft and rs[i + 1].from_draft and rs[i].stats.step == rs[i + 1].stats.step
    ]
    assert inside, "the copy prompt should give multi-token lookup runs"
    assert all(rs[i].stats.source == "lookup" for i in inside)
    return model, tok, ps[2], rs, inside


def test_lookup_stream_keeps_one_sync_per_step(lookup_run):
    model, tok, prompt, rs, _ = lookup_run
    for r in rs:  # rs: equal to plain decoding (lookup_run)
        assert r.stats.host_syncs == r.stats.step + 1


def test_stop_string_inside_lookup_run(lookup_run):
    model, tok, prompt, rs, inside = lookup_run
    i = inside[len(inside) // 2]
    stop = tok.decode([rs[i].token]).strip() or tok.decode([rs[i].token])
    before = accepted_drafts(rs[: rs.index(next(r for r in rs if stop in tok.decode([r.token])))])
    got = assert_exact_under_drafting(
        model, tok, prompt, drafter=None, lookup=True, max_tokens=60, stop=[stop], min_accepted=before, source="lookup"
    )
    assert got[-1].finish_reason == "stop" and stop not in "".join(r.text for r in got)


def test_eos_inside_lookup_run(lookup_run):
    model, tok, prompt, rs, inside = lookup_run
    tokens = [r.token for r in rs]
    i = next(k for k in inside[len(inside) // 2 :] + inside if tokens.index(tokens[k]) == k)  # its first time
    old = set(tok.eos_token_ids)
    tok.eos_token_ids = old | {rs[i].token}
    try:
        got = assert_exact_under_drafting(
            model, tok, prompt, drafter=None, lookup=True, max_tokens=60, min_accepted=1, source="lookup"
        )
    finally:
        tok.eos_token_ids = old
    assert got[-1].finish_reason == "stop" and got[-1].token == rs[i].token
    assert accepted_drafts(got) == accepted_drafts(rs[: i + 1])  # the drafts up to the EOS, that one included


def test_lookup_history_is_copied_from():
    """Tokens before the prompt (a chat's earlier turns) feed the lookup too."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_redrafter.step.dispatch import redrafter_steps

    model = tiny_model("llama")  # a model that does not repeat itself
    p = prompts(1)[0]
    ref, _ = generate_tokens(model, p, max_tokens=30)

    def run(history):
        steps = redrafter_steps(
            model, mx.array(p), make_prompt_cache(model), draft=DraftConfig(lookup=1), history=history
        )
        out, accepted = [], 0
        for s in steps:
            out += s.tokens
            accepted += s.stats.accepted
            if len(out) >= 30:
                steps.close()
                return out[:30], accepted

    out, accepted = run(p + ref)  # the history already holds this very reply
    assert out == ref and accepted >= 20
    out, accepted = run(())
    assert out == ref and accepted < 20


def test_device_lookup_equals_the_host_proposer():
    """DeviceLookup's draft equals Lookup's first, on random histories
    appended in chunks (with padding after each chunk, as the loop writes)."""
    import random

    import mlx.core as mx

    from mlx_redrafter.draft.lookup import DeviceLookup
    from mlx_redrafter.step.tree import PAD

    rng = random.Random(0)
    for _ in range(150):
        vocab = rng.choice([3, 5, 20])
        history = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        head, rest = history[:5], history[5:]
        dev = DeviceLookup(head)
        dev.GROW = 8  # grow the buffer often
        room = 5
        while rest:
            k = rng.randint(1, room)
            chunk, rest = rest[:k], rest[k:]
            row = mx.array(chunk[:-1] + [99] * (room - len(chunk)))  # 99: junk after the accepted tokens
            dev.append(row, mx.array(len(chunk) - 1), mx.array(chunk[-1]), room)
        length = rng.randint(1, 6)
        want = Lookup(history).propose(length)
        assert dev.propose(length).tolist() == (want[0] if want else [PAD] * length), history
