"""Exactness: greedy ReDrafter output equals plain mlx-lm greedy decoding,
token for token, in runs where drafts are accepted (helpers.assert_tokens_exact
checks both): drafters right by construction (the oracle, alone or as one
beam beside a real drafter's beam search), the shipped drafter, the
official fixtures' drafters.

Mutations seen caught here (bench/mutations.py): C8 (the accepted path read
from the first beam)."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    TINY_CONFIGS,
    OracleDrafter,
    accepted_drafts,
    assert_exact_under_drafting,
    assert_tokens_exact,
    prompts,
    random_drafter,
    tiny_model,
)
from mlx_lm.models.cache import QuantizedKVCache
from mlx_lm.utils import load_model as mlx_load_model

from mlx_redrafter import RedrafterError
from mlx_redrafter.generate import DraftConfig, generate_tokens, stream_generate
from mlx_redrafter.step.verify import install_tree_hooks

GRID = [(w, l) for w in (1, 2, 4) for l in (1, 3, 5)]
N_PROMPTS, N_TOKENS = 5, 64
ORACLE_LENGTH = 5  # the longest beam an oracle drafts here
# An oracle knows the reply a little past the run's end (its last drafts look ahead).
TRUTH_TOKENS = N_TOKENS + ORACLE_LENGTH + 2


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny(request):
    """A tiny model, prompts, plain greedy decoding's N_TOKENS tokens for each,
    and the same runs a few tokens longer: what the oracles know (one plain
    run per prompt for the module, not one per oracle)."""
    model = tiny_model(request.param)
    ps = prompts(N_PROMPTS)
    truths = [generate_tokens(model, p, max_tokens=TRUTH_TOKENS)[0] for p in ps]
    window = TINY_CONFIGS[request.param].get("sliding_window")
    assert window is None or len(ps[0]) + N_TOKENS > 4 * window  # the rotating cache wraps
    return request.param, model, ps, [t[:N_TOKENS] for t in truths], truths


@pytest.mark.parametrize("width,length", GRID)
def test_tiny_models_drafter_beam_search(tiny, width, length):
    """A real drafter's beam search gives every beam but the first, the oracle's
    truth: trees of real beams, one path accepted."""
    kind, model, ps, refs, truths = tiny
    drafter = random_drafter(exit_dim=48, num_draft_layers=1)
    for p, ref, truth in zip(ps, refs, truths):
        draft = DraftConfig(OracleDrafter(model, p, N_TOKENS, length, inner=drafter, replies=[truth]), width, length)
        _, stats = assert_tokens_exact(model, p, draft, plain=ref, max_tokens=N_TOKENS, min_accepted=8)
        assert all(s.tree_size <= 1 + width * length for s in stats), kind


@pytest.mark.parametrize("width,length,pipelined", [(1, 3, True), (2, 3, True), (4, 5, True), (2, 3, False)])
def test_tiny_models_fused_feature_drafter(tiny, width, length, pipelined):
    """A drafter that fuses layer 0's output (EAGLE-3 style) on every model
    type, Gemma's sliding-window layers included: the output is plain decoding's."""
    kind, model, ps, refs, truths = tiny
    drafter = random_drafter(exit_dim=48, num_draft_layers=1, feature_layers=[0])
    for p, ref, truth in zip(ps[:2], refs[:2], truths[:2]):
        # Its beam search fuses the features.
        oracle = OracleDrafter(model, p, N_TOKENS, length, inner=drafter, replies=[truth])
        draft = DraftConfig(oracle, width, length, lookup=1, pipelined=pipelined)
        assert_tokens_exact(model, p, draft, plain=ref, max_tokens=N_TOKENS, min_accepted=8)  # lookup wins on Gemma


@pytest.mark.parametrize("width,length", GRID)
def test_tiny_models_oracle_drafter(tiny, width, length):
    kind, model, ps, refs, truths = tiny
    accepted = []
    for p, ref, truth in zip(ps, refs, truths):
        oracle = OracleDrafter(model, p, N_TOKENS, length, replies=[truth])
        draft = DraftConfig(oracle, width, length)
        _, stats = assert_tokens_exact(model, p, draft, plain=ref, max_tokens=N_TOKENS, min_accepted=8)
        accepted += [s.accepted for s in stats[1:]]
    # The oracle really drives long acceptances and compactions of every length.
    assert np.mean(accepted) > 0.3 * length
    assert max(accepted) == length


def test_quantized_kv_cache_compaction():
    cfg = dict(TINY_CONFIGS["llama"], num_attention_heads=2, num_key_value_heads=1)
    TINY_CONFIGS["llama_q"] = cfg
    try:
        model = tiny_model("llama_q")
    finally:
        del TINY_CONFIGS["llama_q"]

    def qcache():
        return [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]

    for p in prompts(3):
        draft = DraftConfig(OracleDrafter(model, p, 48, 4), 2, 4)
        _, stats = assert_tokens_exact(model, p, draft, max_tokens=48, prompt_cache=qcache, min_accepted=8)
        assert max(s.accepted for s in stats) == 4


# --------------------------------------------------------------------------- default model

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three fruits that are red.",
    "Write a Python function that reverses a string.",
]


@pytest.fixture(scope="module")
def default_refs(default_model):
    """The chat prompts, plain greedy decoding's reply (N_TOKENS tokens at
    most, up to the EOS), and the same run a few tokens longer, EOS and what
    follows included: what the oracles know. One plain run per prompt for the
    whole module: each costs seconds on the default model."""
    model, tok = default_model
    ps = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True) for c in CHAT_PROMPTS]
    truths = [generate_tokens(model, p, max_tokens=TRUTH_TOKENS)[0] for p in ps]
    ends = [next((i for i, t in enumerate(truth) if t in tok.eos_token_ids), len(truth)) for truth in truths]
    return ps, [truth[: min(end, N_TOKENS)] for truth, end in zip(truths, ends)], truths


def test_default_model_shipped_drafter(default_model, default_refs):
    """The drafter shipped for the default model (a reduced draft vocabulary), its drafts accepted."""
    from mlx_redrafter.hub.load import load_drafter

    model, tok = default_model
    d = load_drafter("default")
    for p, ref in zip(*default_refs[:2]):
        draft = DraftConfig(d, 2, 3)
        assert_tokens_exact(model, p, draft, plain=ref, max_tokens=N_TOKENS, eos_ids=tok.eos_token_ids, min_accepted=2)


def test_default_model_oracle_drafter(default_model, default_refs):
    model, tok = default_model
    accepted = []
    for p, ref, truth in zip(*default_refs):
        draft = DraftConfig(OracleDrafter(model, p, N_TOKENS, ORACLE_LENGTH, replies=[truth]), 3, ORACLE_LENGTH)
        short = min(8, len(ref) // 2)  # a reply may end after a few tokens (one prompt's has 7)
        _, stats = assert_tokens_exact(
            model, p, draft, plain=ref, max_tokens=N_TOKENS, eos_ids=tok.eos_token_ids, min_accepted=short
        )
        accepted += [s.accepted for s in stats[1:]]
    assert np.mean(accepted) > 3


# --------------------------------------------------------------------------- fixture LLM


@pytest.fixture(scope="module")
def fixture_llm(fixtures_dir):
    model, _ = mlx_load_model(fixtures_dir / "llm")
    mx.eval(model.parameters())
    return model, np.load(fixtures_dir / "reference.npz")


@pytest.mark.parametrize("tag, folder", [("rnn_w2_l4", "drafter_rnn"), ("distilled_w2_l4", "drafter_rnn_distilled")])
@pytest.mark.parametrize("p", [0, 1])
def test_fixture_generation_matches_official(fixture_llm, fixtures_dir, tag, folder, p):
    """Official BeamShape(width=2, length=4) counts g0: our beam_length=3."""
    from mlx_redrafter.hub.load import load_drafter

    model, ref = fixture_llm
    drafter = load_drafter(fixtures_dir / folder)
    prompt = ref[f"gen_p{p}_prompt"].tolist()
    plain, _ = generate_tokens(model, prompt, max_tokens=32)
    assert plain == ref[f"gen_p{p}_autoregressive_new_tokens"].tolist()
    for warp in (False, True):
        out, stats = generate_tokens(model, prompt, draft=DraftConfig(drafter, 2, 3, warp=warp), max_tokens=32)
        assert out == ref[f"gen_{tag}_p{p}_redrafter_new_tokens"].tolist()
    # With the official warping, each step accepts as many drafts, from the same beam.
    official = ref[f"gen_{tag}_p{p}_accepted"].tolist()
    ours = [s.accepted for s in stats[1:]][: len(official)]
    assert ours == official
    seq = ref[f"gen_{tag}_p{p}_seq_in_beam"].tolist()
    assert [s.beam for s in stats[1:]][: len(seq)] == seq
    if tag.startswith("distilled"):
        assert sum(official) > 0


# --------------------------------------------------------------------------- stopping and syncs


def _run(model, tok, prompt, drafter, **kw):
    rs = list(stream_generate(model, tok, prompt, drafter=drafter, **kw))
    return [r.token for r in rs], "".join(r.text for r in rs), rs


@pytest.fixture(scope="module")
def oracle_setup(default_model, default_refs):
    model, tok = default_model
    prompts_, _, truths = default_refs
    prompt = prompts_[4]
    # Its oracle knows the plain reply past these runs' 60 tokens (and their last drafts).
    assert len(truths[4]) > 60 + ORACLE_LENGTH
    oracle = OracleDrafter(model, prompt, 60, ORACLE_LENGTH, replies=[truths[4]])
    rs = assert_exact_under_drafting(
        model, tok, prompt, drafter=oracle, beam_width=2, beam_length=5, max_tokens=60, min_accepted=20
    )
    # A token that came from an accepted draft and is not the last of its run.
    inside = [
        i
        for i in range(1, len(rs) - 1)
        if rs[i].from_draft and rs[i + 1].from_draft and rs[i].stats.step == rs[i + 1].stats.step
    ]
    assert inside, "the oracle should produce multi-token accepted runs"
    return model, tok, prompt, oracle, rs, inside


def test_stop_string_inside_accepted_run(oracle_setup):
    model, tok, prompt, oracle, rs, inside = oracle_setup
    i = inside[len(inside) // 2]
    stop = tok.decode([rs[i].token]).strip() or tok.decode([rs[i].token])
    before = accepted_drafts(rs[: rs.index(next(r for r in rs if stop in tok.decode([r.token])))])
    got = assert_exact_under_drafting(
        model, tok, prompt, drafter=oracle, beam_width=2, beam_length=5, max_tokens=60, stop=[stop], min_accepted=before
    )
    assert got[-1].finish_reason == "stop" and stop not in "".join(r.text for r in got)


def test_eos_inside_accepted_run(oracle_setup):
    model, tok, prompt, oracle, rs, inside = oracle_setup
    tokens = [r.token for r in rs]
    i = next(k for k in inside[len(inside) // 2 :] + inside if tokens.index(tokens[k]) == k)  # its first time
    old = set(tok.eos_token_ids)
    tok.eos_token_ids = old | {rs[i].token}
    try:
        got = assert_exact_under_drafting(
            model, tok, prompt, drafter=oracle, beam_width=2, beam_length=5, max_tokens=60, min_accepted=1
        )
    finally:
        tok.eos_token_ids = old
    assert got[-1].finish_reason == "stop" and got[-1].token == rs[i].token
    assert accepted_drafts(got) == accepted_drafts(rs[: i + 1])  # the drafts up to the EOS, that one included


@pytest.mark.parametrize("max_tokens", [1, 7, 13])
def test_max_tokens_inside_accepted_run(oracle_setup, max_tokens):
    model, tok, prompt, oracle, rs, _ = oracle_setup
    got = _run(model, tok, prompt, oracle, beam_width=2, beam_length=5, max_tokens=max_tokens)
    assert got[0] == [r.token for r in rs[:max_tokens]]  # rs: plain decoding's (oracle_setup)
    assert got[2][-1].generation_tokens == max_tokens and got[2][-1].finish_reason == "length"
    assert accepted_drafts(got[2]) == accepted_drafts(rs[:max_tokens]) > (0 if max_tokens > 1 else -1)


def test_one_host_sync_per_step(oracle_setup):
    _, _, _, _, rs, _ = oracle_setup
    for r in rs:
        assert r.stats.host_syncs == r.stats.step + 1
    assert rs[-1].stats.step < len(rs)  # fewer steps than tokens: drafts were accepted


# --------------------------------------------------------------------------- bad input


def test_drafter_for_another_model_is_refused():
    model = tiny_model("llama")
    for kw, msg in (
        (dict(hidden=32), "hidden_size is 32 but the model's is 64"),
        (dict(vocab=120), "vocab_size is 120 but the model's embedding has 97 rows"),
    ):
        with pytest.raises(RedrafterError, match=msg):
            generate_tokens(model, [1, 2, 3], draft=DraftConfig(random_drafter(**kw), 2, 2), max_tokens=4)


def test_fit_check_skips_an_embedding_without_weight():
    import mlx.nn as nn

    from mlx_redrafter.draft.redrafter import check_fits

    model = tiny_model("llama")
    check_fits(random_drafter(), model)  # the same sizes: fits
    with pytest.raises(RedrafterError, match="hidden_size"):
        check_fits(random_drafter(hidden=32), model)
    check_fits(random_drafter(feature_layers=[0, 1]), model)
    with pytest.raises(RedrafterError, match="layers"):  # a fused drafter made for a deeper model
        check_fits(random_drafter(feature_layers=[1, 7]), model)
    model.model.embed_tokens = nn.Module()  # nothing to compare with: no error from the check itself
    check_fits(random_drafter(hidden=32), model)


@pytest.mark.parametrize("width,length", [(0, 3), (2, 0), (-1, -1)])
def test_beam_shape_below_one_is_refused(width, length):
    model = tiny_model("llama")
    with pytest.raises(RedrafterError, match="Beam width and length must be at least 1"):
        generate_tokens(model, [1, 2, 3], draft=DraftConfig(random_drafter(), width, length), max_tokens=4)


def test_prompt_longer_than_context_is_refused():
    model = tiny_model("llama")
    with pytest.raises(RedrafterError, match="prompt has 600 tokens but the model's context is 512"):
        generate_tokens(model, [1] * 600, draft=DraftConfig(random_drafter(), 2, 2), max_tokens=4)


def test_unsupported_rope_is_named():
    cfg = dict(TINY_CONFIGS["llama"], rope_scaling={"type": "dynamic", "factor": 2.0})
    TINY_CONFIGS["llama_dyn"] = cfg
    try:
        model = tiny_model("llama_dyn")
    finally:
        del TINY_CONFIGS["llama_dyn"]
    # Never an error once drafting was asked for: one line that names the positions, then plain decoding.
    with pytest.warns(UserWarning, match="DynamicNTKScalingRoPE.*Decoding without drafting"):
        out, stats = generate_tokens(model, [1, 2, 3], draft=DraftConfig(random_drafter(), 2, 2), max_tokens=4)
    assert out == generate_tokens(model, [1, 2, 3], max_tokens=4)[0] and all(s.tree_size == 1 for s in stats)
    with pytest.raises(RedrafterError, match="DynamicNTKScalingRoPE"):
        install_tree_hooks(model)
