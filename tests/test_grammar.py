"""Structured output under speculative decoding equals plain constrained decoding.

The reference is mlx-lm's own ``generate_step`` with the grammar's mask as a
logits processor. Tiny random models use a character tokenizer built here
(95 printable ASCII characters + EOS: 96 tokens under a 97-token model, so
one model id lies outside the tokenizer and must never be allowed).
"""

import json
import math
from collections import Counter

import jsonschema_rs
import llguidance
import mlx.core as mx
import numpy as np
import pytest
from helpers import VOCAB, OracleDrafter, random_drafter, tiny_model
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from test_sampling import chi2_passes

from mlx_redrafter.config import DraftConfig, SamplingConfig
from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.llm.parts import model_parts
from mlx_redrafter.step import grammar as grammar_mod
from mlx_redrafter.step.accept import Accepted, target_probs, walk_tree
from mlx_redrafter.step.accept import _path as accept_path
from mlx_redrafter.step.dispatch import token_steps
from mlx_redrafter.step.grammar import compile_grammar, grammar_logits_processor, tree_masks
from mlx_redrafter.step.plan import AFTER_READ, DraftPlan, TreePolicy, make_plan

EOS = 95


class CharTokens:
    """What llguidance's TokenizerWrapper needs: one token per printable character, then EOS."""

    eos_token_id, bos_token_id, special_token_ids = EOS, None, [EOS]
    tokens = [bytes([32 + i]) for i in range(95)] + [b"<|eos|>"]

    def __call__(self, s):
        return [b - 32 for b in s]


CHARS = llguidance.LLTokenizer(llguidance.TokenizerWrapper(CharTokens()))


def decode(tokens):
    return "".join(chr(32 + t) for t in tokens if t != EOS)


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"},
            "tag": {"enum": ["alpha", "beta", "gamma"]},
        },
        "required": ["id", "ok", "tag"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 2, "maxItems": 3},
]


def reference(model, prompt, grammar, max_tokens, sampling=SamplingConfig()):
    """Plain constrained decoding: mlx-lm's generate_step with the grammar's logits processor."""
    sampler = make_sampler(sampling.temp, sampling.top_p, sampling.min_p, top_k=sampling.top_k)
    out = []
    for token, _ in generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=[grammar_logits_processor(grammar)],
        prompt_cache=make_prompt_cache(model),
    ):
        out.append(int(token))
        if out[-1] in grammar.eos_ids:
            break
    return out


def constrained_steps(model, prompt, cache, draft, sampling, grammar, history=()):
    """The step loop under ``grammar``, drafting whatever ``draft`` asks for
    (with nothing else, the grammar's forced tokens alone: a plan that drafts
    them, which the library leaves to plain constrained decoding)."""
    plan = make_plan(model, draft, grammar=True)
    if not plan.sources:
        plan = DraftPlan((), TreePolicy("fixed", packed=True), AFTER_READ, structured=True)
    sampling = sampling or SamplingConfig()
    return token_steps(model, prompt, cache, plan=plan, sampling=sampling, history=history, grammar=grammar)


def speculative(model, prompt, grammar, draft, max_tokens, sampling=SamplingConfig(), history=(), taken=None):
    """The constrained speculative loop, cut like stream_generate cuts (EOS
    included here); ``taken``: a Counter of the emitted drafted tokens by source."""
    cache = make_prompt_cache(model)
    out, steps = [], constrained_steps(model, mx.array(prompt), cache, draft, sampling, grammar, history)
    for step in steps:
        for t, drafted in zip(step.tokens, step.from_draft):
            out.append(t)
            if taken is not None and drafted:
                taken[step.stats.source] += 1
            if t in grammar.eos_ids or len(out) >= max_tokens:
                steps.close()
                return out
    return out


def check_valid(tokens, schema, text=None, eos=(EOS,)):
    assert tokens[-1] in eos, "the grammar was not completed"
    value = json.loads(text if text is not None else decode(tokens))
    jsonschema_rs.validate(schema, value)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


# Each kind of draft (``oracle``: a real drafter's beams beside one that knows
# the constrained reply) and the source whose drafts must be accepted.
DRAFTS = {
    "drafter": (lambda oracle: DraftConfig(oracle, 3, 3), "drafter"),
    "lookup": (lambda oracle: DraftConfig(None, lookup=2, lookup_length=4), "lookup"),
    "both": (lambda oracle: DraftConfig(oracle, 2, 2, lookup=1), ("drafter", "lookup")),  # lookup's often win
    "forced_only": (lambda oracle: DraftConfig(None), "grammar"),  # the grammar's forced tokens
}


def _tuple(source):
    return source if isinstance(source, tuple) else (source,)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "array"])
@pytest.mark.parametrize("kind", list(DRAFTS))
def test_greedy_equals_plain_constrained_decoding(model, schema, kind):
    grammar = compile_grammar(CHARS, schema, vocab_size=VOCAB)
    make, source = DRAFTS[kind]
    for prompt in ([5, 9, 17, 3], [40, 41, 42, 43, 44, 45]):
        ref = reference(model, prompt, grammar, 120)
        check_valid(ref, schema)
        draft = make(OracleDrafter(model, prompt, 120, 3, inner=random_drafter(), replies=[ref]))
        # Lookup copies from a context holding this very reply (an earlier turn's): right by construction.
        taken = Counter()
        got = speculative(model, prompt, grammar, draft, 120, history=prompt + ref, taken=taken)
        assert got == ref
        assert sum(taken[k] for k in _tuple(source)) >= 2, taken  # the source under test was accepted
    # The loop ends by itself once the grammar is complete: no token past the EOS.
    steps = list(constrained_steps(model, mx.array(prompt), make_prompt_cache(model), draft, None, grammar))
    assert sum(len(s.tokens) for s in steps) == len(ref)


def test_model_ids_past_the_tokenizer_are_never_allowed():
    grammar = compile_grammar(CHARS, "json", vocab_size=VOCAB)
    m = grammar.matcher()
    mask = np.array(m.mask())
    assert mask.shape == (VOCAB,) and not mask[VOCAB - 1] and mask[ord("{") - 32]
    assert not m.allows(VOCAB - 1)


def test_tree_masks_prune_rejected_drafts_and_match_each_node():
    grammar = compile_grammar(CHARS, {"enum": ["red", "rose", "blue"]}, vocab_size=VOCAB)
    m = grammar.matcher()
    m.consume(ord('"') - 32)
    c = lambda s: [ord(ch) - 32 for ch in s]
    rows, words = tree_masks(m, [c("rex"), c("ros"), c("x"), c('blue"') + [EOS, 7]])
    assert [[t for t in r if t >= 0] for r in rows] == [c("re"), c("ros"), [], c('blue"') + [EOS]]
    length = len(rows[0])
    for w, row in enumerate(rows):  # each node's mask is a fresh matcher's after that prefix
        for j, t in enumerate(t for t in row if t >= 0):
            fresh = grammar.matcher()
            for s in [ord('"') - 32] + row[: j + 1]:
                fresh.consume(s)
            assert np.array_equal(words[1 + w * length + j], fresh.bitmask())
    assert m.forced_tokens() == [] and not m.is_done()  # the matcher is left where it was


def test_default_model_greedy_equals_plain_constrained_decoding():
    from mlx_redrafter.hub.load import load_drafter
    from mlx_redrafter.llm.load import load_model
    from mlx_redrafter.llm.text import encode_prompt
    from mlx_redrafter.runtime import shipped_drafter_path

    llm, tokenizer = load_model("default")
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        },
        "required": ["name", "year"],
        "additionalProperties": False,
    }  # about 23 tokens
    grammar = compile_grammar(tokenizer, schema, vocab_size=llm.args.vocab_size)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Give the name and birth year of Ada Lovelace as JSON."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = encode_prompt(tokenizer, text)
    ref = reference(llm, prompt, grammar, 40)
    assert ref[-1] in grammar.eos_ids
    check_valid(ref, schema, tokenizer.decode(ref[:-1]), grammar.eos_ids)
    drafter = load_drafter(shipped_drafter_path("default"))
    drafts = {"drafter": DraftConfig(drafter, 2, 2), "lookup": DraftConfig(None, lookup=1)}
    for source, draft in [*drafts.items(), (("drafter", "lookup"), DraftConfig(drafter, 2, 2, lookup=1))]:
        taken = Counter()  # lookup: the reply in an earlier turn, which it copies from
        assert speculative(llm, prompt, grammar, draft, 40, history=prompt + ref, taken=taken) == ref
        assert sum(taken[k] for k in _tuple(source)) >= 2, (source, taken)


# --------------------------------------------------------------------------- sampling

CHOICES = ["red", "green", "blue", "grey"]


def exact_choice_distribution(model, prompt, grammar, cfg):
    """P(each complete output) of plain constrained sampling: every token
    sequence the grammar allows, by enumeration, times the masked target
    probability of each of its tokens."""
    _, backbone, head = model_parts(model)
    probs, frontier = {}, [((), 1.0)]
    while frontier:
        seq, p = frontier.pop()
        m = grammar.matcher()
        for t in seq:
            m.consume(t)
        logits = head(backbone(mx.array([prompt + list(seq)])))[0, -1]
        q = np.array(target_probs(grammar_mod.apply_mask(logits, m.mask()), cfg), np.float64)
        for t in np.nonzero(q)[0].tolist():
            if t == EOS:
                probs[decode(seq)] = probs.get(decode(seq), 0.0) + p * q[t]
            else:
                frontier.append((seq + (t,), p * q[t]))
    return probs


def sample_choices(model, prompt, grammar, draft, cfg, n, seed, taken=None):
    """Outputs of ``n`` runs; a run that emits a token the grammar forbids
    (the loop raises) counts as the outcome "invalid". ``taken``: drafted
    tokens by source, counted."""
    mx.random.seed(seed)
    out = Counter()
    for _ in range(n):
        try:
            out[decode(speculative(model, prompt, grammar, draft, 20, cfg, taken=taken))] += 1
        except RedrafterError:
            out["invalid"] += 1
    return out


N_RUNS = 600


@pytest.fixture(scope="module")
def choice_setup(model):
    grammar = compile_grammar(CHARS, {"enum": CHOICES}, vocab_size=VOCAB)
    prompt = [ord(c) - 32 for c in '"green" "grey" "red" "blue" "gr']
    cfg = SamplingConfig(temp=2.0)  # the tiny model is peaked: flatten it so every choice is seen
    expected = exact_choice_distribution(model, prompt, grammar, cfg)
    assert set(expected) == {json.dumps(c) for c in CHOICES} and math.isclose(sum(expected.values()), 1.0, rel_tol=1e-4)
    assert min(expected.values()) > 0.02  # every choice is seen often enough for the test to have power
    return grammar, prompt, cfg, expected


def test_sampling_follows_the_masked_distribution(model, choice_setup):
    grammar, prompt, cfg, expected = choice_setup
    draft = DraftConfig(random_drafter(), 2, 2, lookup=1)
    taken = Counter()
    observed = sample_choices(model, prompt, grammar, draft, cfg, N_RUNS, seed=7, taken=taken)
    assert chi2_passes(observed, expected, N_RUNS)
    assert taken["lookup"] > N_RUNS // 10, taken  # copies from the prompt's choices were accepted


def test_unrenormalized_acceptance_fails_the_same_test(model, choice_setup, monkeypatch):
    """Negative control: acceptance with the allowed tokens' unmasked
    probabilities, not renormalized over the grammar's mask (a plausible
    bug), fails the same check."""
    grammar, prompt, cfg, expected = choice_setup

    def wrong(beams, tree, logits, masks, sampling):
        p = target_probs(logits, sampling) * masks  # allowed tokens keep their unmasked probability
        u = mx.random.uniform(shape=beams.shape[::-1])
        gumbel = mx.random.gumbel(shape=(p.shape[-1],))
        n, beam, last, token = walk_tree(beams, tree.node_index, tree.parent, p, u, gumbel)
        return Accepted(n, beam, accept_path(tree.node_index, beam, n), last, token)

    monkeypatch.setattr("mlx_redrafter.step.grammar.accept_constrained", wrong)
    draft = DraftConfig(random_drafter(), 2, 2, lookup=1)
    observed = sample_choices(model, prompt, grammar, draft, cfg, N_RUNS, seed=7)
    assert not chi2_passes(observed, expected, N_RUNS)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"type": "strin"}, "Invalid type: strin"),
        ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum (5) is greater than maximum (2)"),
        ({"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}, "/defs/x"),
        ({"type": "object", "dependentSchemas": {"a": {}}}, "Unimplemented keys"),
        ({"type": "string", "format": "no-such-format"}, "Unknown format"),
        ("start: yaml", "Invalid grammar"),
        (42, "Unknown grammar '42'"),
    ],
)
def test_invalid_schemas_are_clear_errors(spec, message):
    with pytest.raises(RedrafterError, match=message.replace("(", r"\(").replace(")", r"\)").replace("$", r"\$")):
        compile_grammar(CHARS, spec, vocab_size=VOCAB)


def test_engine_grammars_are_accepted(model):
    lark = llguidance.grammar_from("lark", 'start: "yes" | "no"')
    grammar = compile_grammar(CHARS, lark, vocab_size=VOCAB)
    out = speculative(model, [1, 2, 3], grammar, DraftConfig(None, lookup=1), 10)
    assert decode(out) in ("yes", "no") and out[-1] == EOS
