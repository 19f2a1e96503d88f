"""The prompt cache (mlx_redrafter.llm.prompt_cache.PromptCache on mlx-lm's
LRUPromptCache): alternating conversations each reuse their own prefix, the
replies equal fresh decoding, and the bounds on entries and bytes hold."""

import pytest
from helpers import OracleDrafter, accepted_in_steps, generate_tokens, prompts, tiny_model

from mlx_redrafter.config import DraftConfig
from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.llm.prompt_cache import PromptCache

N = 10


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _turn(model, cache: PromptCache, ids, draft=None):
    """One generation through the cache: ``(reply, reused)``; the reply must
    equal plain decoding of ``ids`` from scratch (with a ``draft``: with drafts accepted)."""
    reused = cache.reuse(ids)
    reply, stats = generate_tokens(model, ids[reused:], draft=draft, max_tokens=N, prompt_cache=cache.cache)
    cache.settle(ids + reply)
    fresh, _ = generate_tokens(model, ids, max_tokens=N)
    assert reply == fresh, f"reused {reused} of {len(ids)}"
    assert draft is None or accepted_in_steps(stats, N) >= 2, "no draft accepted"
    return reply, reused


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "drafter"])
def test_alternating_conversations_reuse_their_own_prefix(model, drafted):
    a, b = prompts(2, length=12, seed=5)
    # A drafter that knows every turn's reply (the second turns' prompts hold the first replies).
    first = [generate_tokens(model, p, max_tokens=N)[0] for p in (a, b)]
    turns = [a, b, a + first[0] + [7, 8, 9], b + first[1] + [3, 4]]
    draft = DraftConfig(OracleDrafter(model, turns, N, 3), 2, 3) if drafted else None
    cache = PromptCache(model, max_size=4)
    ra, _ = _turn(model, cache, a, draft)
    rb, _ = _turn(model, cache, b, draft)
    a2, b2 = a + ra + [7, 8, 9], b + rb + [3, 4]
    _, reused_a = _turn(model, cache, a2, draft)
    _, reused_b = _turn(model, cache, b2, draft)
    # Each second turn reuses its whole first turn (the last reply token's KV may be missing).
    assert len(a) + N - 1 <= reused_a <= len(a) + N
    assert len(b) + N - 1 <= reused_b <= len(b) + N
    assert cache.entries == 2  # the first turns were replaced by their longer continuations
    assert cache.hits == 2 and cache.reused_tokens == reused_a + reused_b


def test_the_same_prompt_again_reuses_all_but_its_last_token(model):
    cache = PromptCache(model)
    [p] = prompts(1, length=9, seed=11)
    _turn(model, cache, p)
    _, reused = _turn(model, cache, p)
    assert reused == len(p) - 1


def test_bounds_drop_the_oldest_entries(model):
    ps = prompts(3, length=8, seed=13)
    cache = PromptCache(model, max_size=2)
    for p in ps:
        _turn(model, cache, p)
    assert cache.entries == 2
    assert _turn(model, cache, ps[0])[1] == 0  # the oldest was dropped
    assert _turn(model, cache, ps[2])[1] == len(ps[2]) - 1

    one = cache.nbytes // cache.entries  # every entry here has the same buffer size
    small = PromptCache(model, max_size=10, max_bytes=one)
    assert small.byte_bound == one and cache.byte_bound is None  # /health's bound_bytes: null when unbounded
    for p in ps:
        _turn(model, small, p)
    assert small.entries == 1 and small.nbytes <= one


def test_discard_keeps_the_stored_caches_and_reset_drops_them(model):
    cache = PromptCache(model)
    [p] = prompts(1, length=8, seed=17)
    _turn(model, cache, p)
    cache.reuse(p)
    cache.discard()  # an interrupted generation: its working copy goes
    assert cache.cache is None and cache.entries == 1
    cache.reset()
    assert cache.entries == 0 and cache.reuse(p) == 0
    with pytest.raises(RedrafterError, match="prompt-cache-size"):
        PromptCache(model, max_size=0)


def test_a_cache_taken_from_a_batch_does_not_keep_the_batch_alive(model):
    """A row leaving the server's batch hands back a lazy slice of the whole
    batch's KV; stored as it is, it would pin that buffer for as long as the
    entry lives (the bytes bound counts only the slice)."""
    import gc

    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    gc.collect()
    base = mx.get_active_memory()  # whatever else this process holds
    ps = prompts(8, length=400, seed=19)
    rows = []
    for p in ps:
        c = make_prompt_cache(model)
        mx.eval(model(mx.array([p]), cache=c))
        rows.append(c)
    batch = [BatchKVCache.merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    mx.eval([c.state for c in batch])
    del rows, c
    gc.collect()
    with_batch = mx.get_active_memory() - base  # the batch's KV of 8 rows
    cache = PromptCache(model)
    assert cache.store([c.extract(0) for c in batch], ps[0])
    del batch
    gc.collect()
    left = mx.get_active_memory() - base  # one row's KV
    assert left < with_batch / 2, (left, with_batch, cache.nbytes)
