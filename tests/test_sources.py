"""Stateful draft sources (an MTP head, a draft model) in the one packed tree:
exact output with drafts really accepted, caches rolled back, the
distribution kept under sampling.

Mutations seen caught here (bench/mutations.py): C2 (a source's cache not
trimmed), H1 (a recurrent state from the first node of the accepted depth:
the MTP head's right beam anywhere)."""

from __future__ import annotations

import json
from collections import Counter

import mlx.core as mx
import pytest
from helpers import accepted_in_steps, tiny_model
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.utils import _get_classes
from test_sampling import chi2_passes, exact_first_tokens

from mlx_redrafter.draft.mtp import load_head
from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.generate import DraftConfig, SamplingConfig, generate_tokens
from mlx_redrafter.llm.parts import model_parts
from mlx_redrafter.llm.recurrent import cache_length

PROMPT = [5, 9, 11, 3]
MIMO = dict(
    model_type="mimo",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    vocab_size=97,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
)


def repeating_target(leak: float = 0.0, seed: int = 0, **changes):
    """A tiny MiMo (pure attention, mlx-lm's class) whose layers add only
    ``leak`` times their attention and MLP outputs: with ``leak=0`` its next
    token depends on the current token alone, so its greedy output cycles."""
    config = {**MIMO, **changes}
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * leak
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * leak
    mx.eval(model.parameters())
    return model


def pass_through_head(target):
    """A real MiMo MTP head (draft/mtp.py, loaded from checkpoint-named
    weights) that passes the token through: ``input_proj`` keeps the token
    half, the decoder layer adds nothing, ``final_layernorm`` is the target's
    norm. It predicts what a current-token-only target says next: right by
    construction on a ``leak=0`` target, right most of the time on a small leak."""
    h = target.args.hidden_size
    block = type(target.model.layers[0])(target.args)
    raw = dict(tree_flatten(block.parameters()))
    raw["self_attn.o_proj.weight"] = mx.zeros_like(raw["self_attn.o_proj.weight"])
    raw["mlp.down_proj.weight"] = mx.zeros_like(raw["mlp.down_proj.weight"])
    raw["input_proj.weight"] = mx.concatenate([mx.zeros((h, h)), mx.eye(h)], axis=1)  # [hidden, token] -> token
    raw["token_layernorm.weight"] = raw["hidden_layernorm.weight"] = mx.ones((h,))
    raw["final_layernorm.weight"] = target.model.norm.weight
    return load_head(target, "mimo", raw, zero_centred=False)


@pytest.fixture(scope="module")
def cycling():
    target = repeating_target(0.0)
    return target, pass_through_head(target)


@pytest.fixture(scope="module")
def leaky():
    target = repeating_target(0.02)
    return target, pass_through_head(target)


def run(model, draft, n=40, prompt=PROMPT, cache=None, **kw):
    return generate_tokens(model, prompt, draft=draft, max_tokens=n, prompt_cache=cache, **kw)


def per_step(tokens, stats) -> float:
    return len(tokens) / len(stats)


@pytest.mark.parametrize("width, length", [(1, 1), (1, 2), (2, 2), (1, 3)])
def test_an_mtp_head_that_is_right_gives_its_tokens(cycling, width, length):
    target, head = cycling
    plain, _ = run(target, None)
    tokens, stats = run(target, DraftConfig(head=head, head_width=width, head_length=length))
    assert tokens == plain
    assert per_step(tokens, stats) > 1.5
    assert sum(s.accepted for s in stats) >= len(stats) // 2
    assert {s.source for s in stats if s.accepted} == {"mtp"}
    assert all(s.host_syncs == s.step + 1 for s in stats)  # one read per step


@pytest.mark.parametrize("extra", [dict(lookup=1), dict(lookup=2, tree="auto")], ids=["lookup", "auto"])
def test_mtp_beams_join_lookup_in_one_tree(leaky, extra):
    target, head = leaky
    plain, _ = run(target, None, n=60)
    tokens, stats = run(target, DraftConfig(head=head, head_length=3, **extra), n=60)
    assert tokens == plain
    assert accepted_in_steps(stats, 60, "mtp") >= 10  # 18-20 measured, beside 9-11 from lookup
    assert max(s.tree_size for s in stats) > 1 + 3 or extra.get("tree") == "auto"


def head_reference_keys(target, head, sequence):
    """The head's keys after a teacher-forced pass over ``sequence``: every
    pair ``(t[i+1], h[i])`` with the target's own hidden states."""
    _, backbone, _ = model_parts(target)
    ids = mx.array(sequence, mx.int32)[None]
    hidden = backbone(ids)
    cache = head.make_cache()
    head(ids[:, 1:], hidden[:, :-1], cache, first=True)
    return cache[0].keys[..., : cache[0].offset, :]


def test_partial_acceptance_leaves_the_head_cache_as_a_clean_pass(leaky):
    """Drafts accepted in part, then rejected: the head's cache holds exactly
    the entries a teacher-forced pass over the accepted text gives, one fewer
    than the model's (its last entry pairs the model's last cached token)."""
    target, head = leaky
    cache = make_prompt_cache(target)
    tokens, stats = run(target, DraftConfig(head=head, head_length=3), cache=cache)
    accepted = [s.accepted for s in stats[1:]]
    assert 0 in accepted and any(0 < a < 3 for a in accepted) and 3 in accepted
    model_cache, head_cache = cache[0], cache[-1]
    assert len(cache) == len(target.model.layers) + 1
    assert head_cache.offset == model_cache.offset - 1
    text = PROMPT + run(target, None, n=60)[0]  # the cache may hold accepted drafts past max_tokens
    assert text[4 : 4 + len(tokens)] == tokens
    want = head_reference_keys(target, head, text[: model_cache.offset])
    got = head_cache.keys[..., : head_cache.offset, :]
    assert got.shape == want.shape and mx.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_a_model_as_its_own_draft_model_gives_its_tokens():
    target = tiny_model("llama")
    plain, _ = run(target, None)
    for width, length in ((1, 3), (2, 2)):
        cache = make_prompt_cache(target)
        draft = DraftConfig(draft_model=target, draft_model_width=width, draft_model_length=length)
        tokens, stats = run(target, draft, cache=cache)
        assert tokens == plain and per_step(tokens, stats) > 1.8
        assert {s.source for s in stats if s.accepted} == {"draft-model"}
        n = len(target.model.layers)
        assert len(cache) == 2 * n and cache[n].offset == cache[0].offset  # the same tokens
        assert mx.allclose(cache[n].keys[..., : cache[0].offset, :], cache[0].keys[..., : cache[0].offset, :])


def test_another_draft_model_rolls_back_its_cache(leaky):
    """A draft model right most of the time (the leak-free copy of a leaky
    target): drafts accepted whole, in part and not at all; exact output, and
    its cache equals a fresh prefill of the text the model kept."""
    target, _ = leaky
    sibling = repeating_target(0.0)
    plain, _ = run(target, None)
    cache = make_prompt_cache(target)
    tokens, stats = run(target, DraftConfig(draft_model=sibling, draft_model_length=3, lookup=1), cache=cache)
    assert tokens == plain
    assert accepted_in_steps(stats, len(tokens), "draft-model") >= 8  # 16 measured
    mine = [s.accepted for s in stats[1:] if s.source in ("draft-model", "")]
    assert 0 in mine and any(0 < a < 3 for a in mine), "no draft-model draft was rejected, in part or whole"
    n, held = len(target.model.layers), cache[0].offset
    text = PROMPT + run(target, None, n=60)[0]  # the cache may hold accepted drafts past max_tokens
    fresh = make_prompt_cache(sibling)
    sibling(mx.array(text[:held], mx.int32)[None], cache=fresh)
    assert cache[n].offset == held
    assert mx.allclose(cache[n].keys[..., :held, :], fresh[0].keys[..., :held, :], atol=1e-4, rtol=1e-4)


def test_a_hybrid_draft_model_drafts_in_copies_of_its_state():
    """Recurrent layers cannot be trimmed: beams run in copies, the state only
    advances over accepted tokens. The draft model is a leak-free copy of a
    leaky hybrid target (tiny Qwen3.5s): right often, wrong often."""
    target, drafter = repeating_qwen35(0.2), repeating_qwen35(0.0)
    plain, _ = run(target, None, n=24)
    n = len(target.layers)
    for width in (1, 2):
        cache = make_prompt_cache(target)
        draft = DraftConfig(draft_model=drafter, draft_model_width=width, draft_model_length=2)
        tokens, stats = run(target, draft, n=24, cache=cache)
        assert tokens == plain
        assert accepted_in_steps(stats, 24, "draft-model") >= 4  # 7 measured
        accepted = [s.accepted for s in stats[1:]]
        assert 0 in accepted and 1 in accepted and 2 in accepted  # none, in part, whole
        assert len(cache) == 2 * n and any(isinstance(c, ArraysCache) for c in cache[n:])
        assert any(isinstance(c, KVCache) for c in cache[n:])


def test_a_prompt_cache_keeps_the_sources_across_turns(leaky):
    """Turn two reuses the cache (the head's too): the same tokens as plain
    decoding of the whole text; a cache made for other sources is refused."""
    target, head = leaky
    draft = DraftConfig(head=head, head_length=2)
    cache = make_prompt_cache(target)
    first, _ = run(target, draft, n=12, cache=cache)
    held = cache[0].offset
    turn = [7, 8, 9]
    text = (PROMPT + first)[:held] + turn
    second, stats = run(target, draft, n=20, prompt=text[held:], cache=cache)
    plain, _ = run(target, None, n=20, prompt=text)
    assert second == plain and accepted_in_steps(stats, 20, "mtp") >= 2  # 3 measured
    other = DraftConfig(draft_model=tiny_model("llama"), draft_model_length=2)
    with pytest.raises(RedrafterError, match="other draft sources"):
        run(target, other, n=4, prompt=[1, 2], cache=cache)
    run(target, None, n=4, prompt=[1, 2], cache=cache)  # plain decoding drops them: they would fall behind
    assert len(cache) == len(target.model.layers)


# --------------------------------------------------------------------------- sampling


V = 5
N_RUNS = 800  # each run drafts with both sources: about 45 ms on this 2-core box


def test_sampling_with_mtp_and_draft_model_matches_the_model():
    """Temperature 1: the first three tokens follow the model's own
    distribution (chi-square), with an MTP head and a draft model drafting."""
    target = repeating_target(0.02, vocab_size=V, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    head = pass_through_head(target)
    cfg = DraftConfig(head=head, head_width=2, head_length=2, draft_model=target, draft_model_length=2)
    prompt = [1, 3, 0, 2]
    expected = exact_first_tokens(target, prompt, SamplingConfig(temp=1.0))
    mx.random.seed(7)
    observed, drafted = Counter(), 0
    for _ in range(N_RUNS):
        tokens, stats = run(target, cfg, n=3, prompt=prompt, temp=1.0)
        observed[tuple(tokens)] += 1
        drafted += sum(s.accepted for s in stats)
    assert drafted > N_RUNS // 2  # drafts were accepted in many runs
    assert chi2_passes(observed, expected, N_RUNS)


def test_bad_source_shapes_are_refused(cycling):
    """Refused where every caller's draft is planned (step/plan.py ``make_plan``)."""
    from mlx_redrafter.step.plan import make_plan

    model, head = cycling
    with pytest.raises(RedrafterError, match="MTP head's beams"):
        make_plan(model, DraftConfig(head=head, head_length=0))
    with pytest.raises(RedrafterError, match="draft model's beams"):
        make_plan(model, DraftConfig(draft_model=object(), draft_model_width=0))


def test_long_prompts_are_fed_to_the_head_in_chunks(leaky, monkeypatch):
    """Chunked prefill (the model's and the head's own chunks): the same
    tokens, and the head's cache still equals a clean pass."""
    import mlx_redrafter.draft.chain as chain
    import mlx_redrafter.llm.cache as cache_ops

    monkeypatch.setattr(cache_ops, "PREFILL_STEP", 3)
    monkeypatch.setattr(chain, "CHUNK", 4)
    target, head = leaky
    prompt = [5, 9, 11, 3, 7, 2, 40, 41, 8, 9, 13]
    plain, _ = run(target, None, n=30, prompt=prompt)
    cache = make_prompt_cache(target)
    tokens, stats = run(target, DraftConfig(head=head, head_length=2), n=12, prompt=prompt, cache=cache)
    assert tokens == plain[:12] and accepted_in_steps(stats, 12, "mtp") >= 2  # 4 measured
    held = cache[0].offset
    want = head_reference_keys(target, head, (prompt + plain)[:held])
    assert mx.allclose(cache[-1].keys[..., : held - 1, :], want, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- Qwen3.5: a hybrid target


def repeating_qwen35(leak: float = 0.0, seed: int = 0):
    """The MTP fixture's tiny Qwen3.5 (a gated-delta-net layer and an attention
    layer, mlx-lm's classes) with random weights whose layers add only
    ``leak`` times their outputs: with ``leak=0`` it repeats itself."""
    from test_mtp import FIXTURE

    config = json.loads((FIXTURE / "checkpoint" / "config.json").read_text())
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    for layer in model.layers:
        mixer = layer.linear_attn if layer.is_linear else layer.self_attn
        out = mixer.out_proj if layer.is_linear else mixer.o_proj
        out.weight = out.weight * leak
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * leak
    mx.eval(model.parameters())
    return model


def qwen35_pass_through_head(target):
    """A real Qwen3.5 MTP head (``mtp.*`` names, draft/mtp.py) that passes the
    token through: ``fc`` keeps the embedding half, its full-attention layer
    adds nothing, ``norm`` is the target's final norm."""
    from mlx_lm.models.qwen3_5 import DecoderLayer

    from mlx_redrafter.draft.mtp import text_args

    args = text_args(target)
    h = args.hidden_size
    layer = DecoderLayer(args, layer_idx=args.full_attention_interval - 1)
    raw = {f"layers.0.{k}": v for k, v in tree_flatten(layer.parameters())}
    raw["layers.0.self_attn.o_proj.weight"] = mx.zeros_like(raw["layers.0.self_attn.o_proj.weight"])
    raw["layers.0.mlp.down_proj.weight"] = mx.zeros_like(raw["layers.0.mlp.down_proj.weight"])
    raw["fc.weight"] = mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1)  # [token, hidden] -> token
    raw["pre_fc_norm_embedding.weight"] = raw["pre_fc_norm_hidden.weight"] = mx.ones((h,))
    raw["norm.weight"] = target.model.norm.weight
    return load_head(target, "qwen3_5", raw, zero_centred=False)


def test_an_mtp_head_drafts_on_a_qwen3_5_hybrid():
    """The family the MTP heads ship with: recurrent states follow the
    accepted path, the head's cache a clean pass, the output plain decoding's."""
    target = repeating_qwen35(0.0)
    head = qwen35_pass_through_head(target)
    plain, _ = run(target, None, n=30)
    for width, length in ((1, 2), (2, 3)):
        tokens, stats = run(target, DraftConfig(head=head, head_width=width, head_length=length), n=30)
        assert tokens == plain and accepted_in_steps(stats, 30, "mtp") >= 15  # 20 and 22 measured
        tokens, stats = run(target, DraftConfig(head=head, head_width=width, head_length=length, lookup=1), n=30)
        assert tokens == plain and per_step(tokens, stats) > 1.5  # lookup wins most steps here (2-3 from mtp)
        assert "mtp" in {s.source for s in stats if s.accepted}
    leaky = repeating_qwen35(0.2)
    head = qwen35_pass_through_head(leaky)
    plain, _ = run(leaky, None, n=60)
    cache = make_prompt_cache(leaky)
    tokens, stats = run(leaky, DraftConfig(head=head, head_length=3), n=40, cache=cache)
    assert tokens == plain[:40]
    accepted = [s.accepted for s in stats[1:]]
    assert 0 in accepted and any(0 < a < 3 for a in accepted) and 3 in accepted  # in part, whole, none
    held = cache_length(cache[:-1])
    assert cache[-1].offset == held - 1
    want = head_reference_keys(leaky, head, (PROMPT + plain)[:held])
    assert mx.allclose(cache[-1].keys[..., : held - 1, :], want, atol=1e-4, rtol=1e-4)


def test_an_mtp_heads_right_beam_anywhere_keeps_a_hybrids_caches_plain():
    """The head's own best draft is its second beam (a decoy ranks first,
    helpers.DecoyHead), on a hybrid target (Qwen3.5, leaky: drafts accepted
    whole, in part and not at all): plain decoding's tokens, and after every
    step (the loop stopped and closed there) the target's caches are plain
    decoding's: keys, values and recurrent states.

    Seen to catch: a recurrent state taken from the first node of the
    accepted depth (step/mixers.py LevelStates.take, bench/mutations.py H1)."""
    from helpers import DecoyHead
    from loops import PlainStates, check_caches, steps_then_close

    target = repeating_qwen35(0.2)
    plain, _ = run(target, None, n=40)
    decoy = next(t for t in range(target.args.text_config["vocab_size"]) if t not in plain)
    draft = DraftConfig(head=DecoyHead(qwen35_pass_through_head(target), decoy), head_width=2, head_length=2)
    states, seen = PlainStates(target, PROMPT, plain), set()
    for steps in range(1, 9):
        tokens, stats, cache = steps_then_close(target, PROMPT, draft, steps, loop="sourced")
        assert tokens == plain[: len(tokens)], f"after step {steps}: drafting changed the greedy output"
        check_caches(target, PROMPT, cache, tokens, f"after step {steps}", states)
        seen |= {(s.accepted, s.beam) for s in stats[1:]}
    assert {(2, 1), (1, 1)} <= seen and any(a == 0 for a, _ in seen), seen  # beam 1: whole, in part; none


def test_timings_split_the_phases_of_a_step_with_a_stateful_source(cycling):
    """One step skeleton: timings wrap its phases whatever drafts (they were
    refused beside an MTP head while it ran a loop of its own)."""
    target, head = cycling
    plain, _ = run(target, None, n=12)
    tokens, stats = run(target, DraftConfig(head=head, head_length=2), n=12, timings=True)
    assert tokens == plain and accepted_in_steps(stats, 12, "mtp") >= 4
    assert all(s.verify_time > 0 and s.draft_time > 0 for s in stats[1:])
