"""Hybrid models (recurrent layers between attention layers) verify draft trees exactly.

On a tiny random model of every covered family, built with mlx-lm's own
classes: with the right row anywhere among wrong ones (the drafter's,
lookup's, a draft model's) and drafts accepted whole, in part and not at
all, greedy output equals plain decoding token for token in every step loop
(pipelined, synchronous, sourced, constrained: tests/loops.py checks which
ran), and after every step the caches (keys, values, every recurrent state)
equal what plain decoding of the same tokens leaves, sampling too; sampling
keeps the model's distribution; a model whose recurrent layers no hook
covers decodes plainly after one line that names the layer.

Mutations seen caught here (bench/mutations.py): H1, C1, C7, C8.
"""

from __future__ import annotations

from collections import Counter
from itertools import accumulate

import mlx.core as mx
import numpy as np
import pytest
from helpers import OracleDrafter, accepted_in_steps, random_drafter, run_steps
from hybrids import FAMILIES, tiny_hybrid
from test_sampling import chi2_passes

from mlx_redrafter.config import DraftConfig, SamplingConfig
from mlx_redrafter.generate import generate_tokens
from mlx_redrafter.llm.parts import model_parts
from mlx_redrafter.step.accept import target_probs

PROMPT = [5, 9, 13, 2, 7, 11, 3]
N = 24


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, tiny_hybrid(request.param)


def accepted(stats) -> int:
    return sum(s.accepted for s in stats)


# Each loop and the draft that runs it: the drafter's rows (W=2 x L=3, under
# MAX_SHARED_NODES: pipelined unless told not to), two lookup rows, and in the
# sourced loop the model itself as a draft model beside them (its chain, its
# caches): every row can be the one accepted. tests/loops.py checks which loop
# ran. The seeds: where every case the test asks for comes within a few steps.
LOOP_DRAFTS = {
    "pipelined": dict(seed=3),
    "synchronous": dict(seed=4, pipelined=False),
    "sourced": dict(seed=1, draft_model_length=2),
}
N_ANYWHERE = 40  # the most tokens a run may take to show every case


_PLAIN = {}


def plain_run(name: str, model):
    """Plain greedy decoding's tokens after PROMPT and the caches it leaves
    (:class:`loops.PlainStates`), once per family."""
    from loops import PlainStates

    if name not in _PLAIN:
        plain, _ = generate_tokens(model, PROMPT, max_tokens=N_ANYWHERE + 8)
        _PLAIN[name] = plain, PlainStates(model, PROMPT, plain)
    return _PLAIN[name]


def anywhere_draft(model, loop: str, plain, seed=None):
    """The draft of :data:`LOOP_DRAFTS` for ``loop`` and the lookup context
    that misleads lookup's first row (``(draft, history)``), for a model whose
    plain greedy reply is ``plain``: the drafter's right row at a random
    place among wrong ones (:class:`helpers.AnywhereOracle`)."""
    from helpers import AnywhereOracle, misleading_history

    extra = dict(LOOP_DRAFTS[loop])
    seed = extra.pop("seed") if seed is None else seed
    extra.pop("seed", None)
    oracle = AnywhereOracle(model, PROMPT, N_ANYWHERE + 8, 3, seed=seed, replies=[plain])
    if loop == "sourced":
        extra["draft_model"] = model
    draft = DraftConfig(oracle, 2, 3, lookup=2, **extra)
    return draft, misleading_history(PROMPT + plain, len(PROMPT), seed=seed)


def covering_steps(stats, loop: str, length: int = 3):
    """The number of steps after which a run has shown every case: drafts
    accepted from a drafter row but the first and from lookup's second row,
    in part, whole and (but in the sourced loop, whose draft model is the
    model itself) not at all. None if it never has."""
    lookup_second = 2 + (loop == "sourced") + 1  # after the drafter's rows (and the draft model's)
    cases = {
        "another drafter row": lambda s: s.accepted and s.source == "drafter" and s.beam > 0,
        "lookup's second row": lambda s: s.accepted and s.source == "lookup" and s.beam == lookup_second,
        "in part": lambda s: 0 < s.accepted < length,
        "whole": lambda s: s.accepted >= length,
        "not at all": lambda s: s.accepted == 0 or loop == "sourced",
    }
    seen = set()
    for i, s in enumerate(stats[1:], 1):
        seen |= {name for name, case in cases.items() if case(s)}
        if len(seen) == len(cases):
            return i
    return None


@pytest.mark.parametrize("loop", list(LOOP_DRAFTS))
def test_the_accepted_row_anywhere_keeps_output_and_caches_plain(family, loop):
    """Greedy, in every loop: the right row sits anywhere among wrong ones
    (the drafter's at a random row, lookup's second behind a wrong first, the
    draft model's after them), accepted whole, in part and not at all. The
    output is plain decoding's, and after every step (the loop stopped and
    closed there) the caches are plain decoding's: keys, values and every
    recurrent state.

    Seen to catch: a recurrent state taken from the first node of the
    accepted depth (step/mixers.py LevelStates.take, ``place * 0``: the
    pipelined and sourced loops)."""
    from loops import check_caches, steps_then_close

    name, model = family
    plain, states = plain_run(name, model)
    draft, history = anywhere_draft(model, loop, plain)
    _, stats, _ = steps_then_close(model, PROMPT, draft, N_ANYWHERE, loop=loop, history=history, tokens=N_ANYWHERE)
    emitted = accumulate(1 + s.accepted for s in stats)
    covered = covering_steps([s for s, n in zip(stats, emitted) if n <= N_ANYWHERE], loop)
    assert covered, f"{name}, {loop} loop: not every case within {N_ANYWHERE} tokens"
    for steps in range(1, covered + 1):
        tokens, stats, cache = steps_then_close(model, PROMPT, draft, steps, loop=loop, history=history)
        where = f"{name}, {loop} loop, after step {steps}"
        assert tokens == plain[: len(tokens)], f"{where}: drafting changed the greedy output"
        check_caches(model, PROMPT, cache, tokens, where, states, copies=int(loop == "sourced"))


SAMPLING_FAMILIES = ["qwen3_5", "nemotron_h", "lfm2"]  # a padded scan, a stepwise one, a convolution


@pytest.fixture(scope="module", params=SAMPLING_FAMILIES)
def peaked(request):
    """A family's model with peaked logits (weights scaled by 8) and its plain greedy reply."""
    model = tiny_hybrid(request.param, scale=8.0)
    return request.param, model, generate_tokens(model, PROMPT, max_tokens=N_ANYWHERE + 8)[0]


@pytest.mark.parametrize("loop", list(LOOP_DRAFTS))
def test_sampling_with_the_accepted_row_anywhere_keeps_the_caches_plain(peaked, loop):
    """Sampling, in every loop: whatever was sampled, after every step the
    caches hold the emitted tokens as plain decoding of them leaves them,
    with the sampling walk's accepted node anywhere too. A peaked model at a
    low temperature, so that the oracle's rows (the greedy reply's) are
    accepted; the distribution itself is the chi-square tests' below."""
    from loops import check_caches, steps_then_close

    name, model, plain = peaked
    draft, history = anywhere_draft(model, loop, plain, seed=1)
    sampling, taken = SamplingConfig(temp=0.2), set()
    for steps in range(1, 6):
        mx.random.seed(steps)
        tokens, stats, cache = steps_then_close(
            model, PROMPT, draft, steps, loop=loop, history=history, sampling=sampling
        )
        check_caches(
            model,
            PROMPT,
            cache,
            tokens,
            f"{name}, {loop} loop, sampling, after step {steps}",
            copies=int(loop == "sourced"),
        )
        taken |= {s.beam for s in stats if s.accepted}
    assert max(taken, default=0) > 0, f"{name}: no draft accepted from a row but the first: the check says little"


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])  # a padded scan and a stepwise one
@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "synchronous"])
def test_tree_auto_on_a_hybrid_equals_plain(name, pipelined):
    """tree="auto" verifies a selected subset, a tree whose shape the host does
    not know: the recurrent layers then run it from the nodes' paths. The
    right row anywhere among the drafter's; after every step the caches are
    plain decoding's."""
    from helpers import AnywhereOracle
    from loops import PlainStates, check_caches, steps_then_close

    from mlx_redrafter.step.curve import CostCurve

    model = tiny_hybrid(name)
    plain, _ = generate_tokens(model, PROMPT, max_tokens=N + 20)
    oracle = AnywhereOracle(model, PROMPT, N, 3, seed=1)
    curve = CostCurve(tuple(1.0 + 0.05 * n for n in range(16)))  # drafts pay: the selection verifies several nodes
    draft = DraftConfig(oracle, 3, 3, lookup=1, pipelined=pipelined, tree="auto", curve=curve)
    loop, states = "pipelined" if pipelined else "synchronous", PlainStates(model, PROMPT, plain)
    for steps in range(1, 7):
        out, stats, cache = steps_then_close(model, PROMPT, draft, steps, loop=loop)
        assert out == plain[: len(out)], f"after step {steps}: drafting changed the greedy output"
        check_caches(model, PROMPT, cache, out, f"{name}, tree auto, {loop} loop, after step {steps}", states)
    out, stats, _ = run_steps(model, PROMPT, draft, N)
    assert out == plain[:N] and accepted_in_steps(stats, N, "drafter") >= N // 3
    assert any(s.accepted and s.beam > 0 for s in stats), "no row but the first accepted"
    assert any(s.tree_size > 2 for s in stats), "the selection verified no tree"


# --------------------------------------------------------------------------- sampling

V_SMALL = 5
SAMPLING_FAMILIES = ["qwen3_5", "nemotron_h", "lfm2"]  # a padded scan, a stepwise one, a convolution


def exact_first_tokens(model, prompt, cfg, k=3):
    """P(first k sampled tokens) from the model, by enumerating all prefixes."""
    _, backbone, head = model_parts(model)
    probs = {(): 1.0}
    for _ in range(k):
        seqs = list(probs)
        logits = head(backbone(mx.array([prompt + list(s) for s in seqs], mx.int32)))[:, -1]
        rows = np.array(target_probs(logits, cfg), np.float64)
        probs = {s + (t,): probs[s] * row[t] for s, row in zip(seqs, rows) for t in range(V_SMALL) if row[t] > 0}
    return probs


@pytest.mark.parametrize("name", SAMPLING_FAMILIES)
def test_sampling_with_drafts_keeps_the_model_distribution(name):
    model = tiny_hybrid(name, scale=2.0, vocab_size=V_SMALL)
    hidden = model_parts(model)[0].weight.shape[1]
    drafter = random_drafter(hidden=hidden, vocab=V_SMALL, exit_dim=32, num_draft_layers=1)
    cfg, n, prompt = SamplingConfig(temp=1.0), 600, [1, 3, 0, 2]
    mx.random.seed(1)
    observed, drafted = Counter(), 0
    for _ in range(n):
        tokens, stats = generate_tokens(model, prompt, draft=DraftConfig(drafter, 3, 2), max_tokens=3, temp=cfg.temp)
        observed[tuple(tokens)] += 1
        drafted += accepted(stats)
    assert drafted > n // 4, "too few drafts accepted for the test to say anything"
    assert chi2_passes(observed, exact_first_tokens(model, prompt, cfg), n)


# --------------------------------------------------------------------------- not covered


def test_a_family_with_uncovered_recurrent_layers_decodes_plainly_and_says_why():
    """Jamba's Mamba mixer keeps a state no hook covers: a one-line warning
    that names the layer, then plain decoding (never an error after drafting
    was asked for)."""
    from helpers import TINY_CONFIGS, tiny_model

    TINY_CONFIGS["jamba"] = dict(
        model_type="jamba",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_offset=1,
        attn_layer_period=2,
        expert_layer_offset=1,
        expert_layer_period=2,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=8,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
    )
    try:
        model = tiny_model("jamba")
    finally:
        del TINY_CONFIGS["jamba"]
    plain, _ = generate_tokens(model, PROMPT, max_tokens=8)
    with pytest.warns(UserWarning, match=r"JambaMambaMixer .*not cover.*Decoding without drafting"):
        out, stats = generate_tokens(model, PROMPT, draft=DraftConfig(lookup=1), max_tokens=8)
    assert out == plain and accepted(stats) == 0


# --------------------------------------------------------------------------- across turns and requests


def test_a_second_turn_reuses_the_first_from_its_boundary_state(family):
    """A recurrent state cannot be trimmed back: the prompt cache keeps the
    state at each prompt's last-but-one token, which the next turn's prompt
    extends, and the reply's end when the cache holds exactly known tokens."""
    from mlx_redrafter.llm.prompt_cache import PromptCache

    name, model = family
    cache = PromptCache(model)
    first = PROMPT + [1, 2, 3]
    reused = cache.reuse(first)
    assert reused == len(first) - 1  # prefilled by the cache itself, up to its boundary...
    # ...which it does not count as reused (it once said so: "7 reused" on a fresh chat's first turn).
    assert cache.reused == 0 and cache.hits == 0 and cache.reused_tokens == 0
    oracle = OracleDrafter(model, first, 8, 2)
    reply, stats = generate_tokens(
        model, first[reused:], draft=DraftConfig(oracle, 1, 2, lookup=1), max_tokens=8, prompt_cache=cache.cache
    )
    assert reply == generate_tokens(model, first, max_tokens=8)[0]
    assert accepted_in_steps(stats, 8, "drafter") >= 3, name
    cache.settle(first + reply)
    second = first + reply + [4, 5, 6, 4, 5, 6]
    oracle = OracleDrafter(model, second, 12, 2)
    reused = cache.reuse(second)
    assert reused == len(second) - 1 and cache.hits == 1
    # What came from the store: the first turn, its reply (the last token's KV may be missing).
    assert len(first + reply) - 1 <= cache.reused <= len(first + reply) and cache.reused_tokens == cache.reused
    out, stats = generate_tokens(
        model, second[reused:], draft=DraftConfig(oracle, 1, 2), max_tokens=12, prompt_cache=cache.cache
    )
    assert out == generate_tokens(model, second, max_tokens=12)[0], name
    assert accepted_in_steps(stats, 12, "drafter") >= 5, name


@pytest.fixture(scope="module")
def chat_parts(tmp_path_factory):
    from helpers import byte_tokenizer

    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tok = byte_tokenizer(tmp_path_factory.mktemp("hybrid-tok"), chat_template=template)
    model = tiny_hybrid("qwen3_5", vocab_size=264)
    mx.eval(model(mx.array([[1]])))  # lazily built arrays (RoPE frequencies) made on this thread
    return model, tok


def test_a_multi_turn_chat_reuses_its_cache_and_equals_plain_greedy(chat_parts):
    """Each turn equals plain greedy decoding of the whole conversation, with
    drafts accepted from an oracle that knows both turns' plain replies."""
    from mlx_redrafter.chat.commands import status_line
    from mlx_redrafter.chat.conversation import ChatSession
    from mlx_redrafter.chat.settings import ChatSettings
    from mlx_redrafter.generate import generate
    from mlx_redrafter.prompts import build_messages, chat_prompt_ids, render_messages

    model, tok = chat_parts
    users = ["abcabcabc", "abcabc again"]
    plain1 = generate(
        model, tok, render_messages(tok, build_messages(None, [], users[0])), drafter=None, lookup=False, max_tokens=12
    )
    prompts = [chat_prompt_ids(tok, build_messages(None, [], users[0]))]
    prompts.append(chat_prompt_ids(tok, build_messages(None, [(users[0], plain1)], users[1])))
    oracle = OracleDrafter(model, prompts, 12, 3)
    session = ChatSession(model, tok, oracle, ChatSettings(max_tokens=12, beam_width=2, beam_length=3, lookup=1))
    t1 = session.reply(users[0])
    t2 = session.reply(users[1])
    # A fresh chat's first turn reuses nothing, whatever the cache prefilled itself at its boundary.
    assert t1.reused_tokens == 0 and t1.prefilled_tokens == len(prompts[0])
    # Turn 1's prompt not recomputed (its random bytes' reply re-templates to other ids: not reused).
    assert t2.reused_tokens >= t1.prefilled_tokens - 1
    assert t2.reused_tokens + t2.prefilled_tokens == len(prompts[1])
    assert f"prefill {len(prompts[0])} tokens (0 reused from the cache)" in status_line(t1)
    stats = session.handle_command("/stats").message
    reused = t2.reused_tokens / (len(prompts[0]) + len(prompts[1]))
    assert f"{t2.reused_tokens} reused from the cache ({reused:.0%})" in stats
    full = render_messages(tok, build_messages(None, [(users[0], t1.reply)], users[1]))
    assert t1.reply == plain1
    assert t2.reply == generate(model, tok, full, drafter=None, lookup=False, max_tokens=12)
    for turn in (t1, t2):
        assert turn.tally.source_tokens.get("drafter", 0) >= 4, turn.tally


def test_serve_batches_hybrid_rows_and_a_row_alone_drafts(chat_parts):
    """Concurrent hybrid requests are decoded together by mlx-lm's
    BatchGenerator and equal each alone; a request alone drafts (accepted
    drafts) and moves into the batch and back; a request that repeats
    another's prompt reuses its cached prefix."""
    from test_batching import Client, GenParams, _engine, _plain, _served

    model, tok = chat_parts
    prompts = [[40, 41, 42, 43, 40, 41, 42], [100, 7, 9, 200, 12], [5, 5, 60, 5, 5]]
    engine = _engine(model, tok)
    results = _served(engine, [Client(engine, p, GenParams(10)) for p in prompts])
    for p, res in zip(prompts, results):
        assert res.tokens == _plain(model, tok, p, 10) and res.batched_tokens > 0
    oracle = OracleDrafter(model, prompts[0], 30, 2)
    engine = _engine(model, tok, drafter=oracle, beam_width=1, beam_length=2)
    other, joined = Client(engine, prompts[1], GenParams(6)), []

    def join(client, piece):
        if not joined:
            joined.append(engine.submit(other.job))

    first = Client(engine, prompts[0], GenParams(30), on_text=join)
    res, res_other = _served(engine, [first], later=[other])
    assert res.tokens == _plain(model, tok, prompts[0], 30) and res_other.tokens == _plain(model, tok, prompts[1], 6)
    assert res.tally.drafted_tokens - res.tally.lookup_tokens > 0 and 0 < res.batched_tokens < len(res.tokens)
    again = _served(engine, [Client(engine, prompts[0], GenParams(8))])[0]
    assert again.tokens == _plain(model, tok, prompts[0], 8) and engine.cache.hits > 0


# --------------------------------------------------------------------------- the commands


def test_make_drafter_doctor_and_sweep_run_on_a_hybrid_folder(tmp_path, monkeypatch):
    """A hybrid model's hidden states train a ReDrafter drafter like any
    model's: make-drafter runs every stage and its verdict (identical
    outputs); doctor measures its verify-cost curve; generate drafts on it."""
    import json
    import random

    from helpers import cli, save_tiny_folder
    from test_make_drafter import recipe

    from mlx_redrafter.train.recipe import make_drafter

    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / "cache"))
    folder = save_tiny_folder(tmp_path / "model", kind="qwen3_5")
    rng, prompts = random.Random(0), tmp_path / "prompts.jsonl"
    words = [f"w{i}" for i in range(5, 90)]
    prompts.write_text(
        "".join(json.dumps({"id": f"c{i}", "turns": [" ".join(rng.choices(words, k=8))]}) + "\n" for i in range(120))
    )
    report = make_drafter(recipe((folder, prompts), tmp_path / "work"))
    assert report.verdict["identical"] and report.verdict["drafter"]["identical_outputs"] == report.verdict["prompts"]
    assert (tmp_path / "work" / "drafter" / "model.safetensors").is_file()
    assert cli(["doctor", "--model", str(folder), "--calibrate"]) == 0
    assert cli(["generate", "--model", str(folder), "--prompt", "w5 w6 w7 w5 w6 w7 w5 w6", "-n", "12"]) == 0


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h", "lfm2"])
def test_the_constrained_loop_with_the_accepted_row_anywhere_keeps_output_and_caches_plain(name):
    """Structured output (the constrained loop) with the right row anywhere
    among wrong ones: plain constrained decoding's tokens, and after every
    step the caches plain decoding of them leaves.

    Seen to catch: the last tree node's recurrent state kept (step/mixers.py
    NodeStates.take, bench/mutations.py C1)."""
    from helpers import AnywhereOracle
    from loops import PlainStates, check_caches, steps_then_close
    from test_grammar import CHARS, SCHEMAS, reference

    from mlx_redrafter.step.grammar import compile_grammar

    model = tiny_hybrid(name)
    grammar = compile_grammar(CHARS, SCHEMAS[1], vocab_size=97)
    prompt = [5, 9, 17, 3]
    ref = reference(model, prompt, grammar, 120)
    draft = DraftConfig(AnywhereOracle(model, prompt, 120, 2, replies=[ref]), 2, 2, lookup=1)
    states, taken = PlainStates(model, prompt, ref), set()
    for steps in range(1, 9):
        tokens, stats, cache = steps_then_close(model, prompt, draft, steps, loop="constrained", grammar=grammar)
        where = f"{name}, constrained loop, after step {steps}"
        assert tokens == ref[: len(tokens)], f"{where}: drafting changed the constrained output"
        check_caches(model, prompt, cache, tokens, where, states)
        taken |= {(s.source, s.beam) for s in stats if s.accepted}
    assert ("drafter", 1) in taken, taken


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h", "lfm2"])
def test_grammar_constrained_output_on_a_hybrid_equals_plain_constrained_decoding(name):
    """Structured output (the synchronous constrained loop: forced rows the
    grammar dictates, lookup and drafter rows, each node masked) on a hybrid:
    a real drafter's beams beside an oracle's that knows the constrained reply,
    whose drafts are accepted (a random drafter's alone never are)."""
    from collections import Counter

    from test_grammar import CHARS, SCHEMAS, check_valid, reference, speculative

    from mlx_redrafter.step.grammar import compile_grammar

    model = tiny_hybrid(name)
    grammar = compile_grammar(CHARS, SCHEMAS[1], vocab_size=97)  # short strings: a random model completes it
    prompt = [5, 9, 17, 3]
    ref = reference(model, prompt, grammar, 120)
    check_valid(ref, SCHEMAS[1])
    oracle = OracleDrafter(model, prompt, 120, 2, inner=random_drafter(), replies=[ref])
    taken = Counter()
    assert speculative(model, prompt, grammar, DraftConfig(oracle, 2, 2, lookup=1), 120, taken=taken) == ref
    assert taken["drafter"] >= 4, taken
