"""A source defined here, in the test file alone (the public protocol: a
``name`` and ``propose(tokens)``), drafts exactly through both schedules on
an attention model and a hybrid, with the right row at any position among
wrong ones; its label names its tokens; sampling keeps the model's
distribution; what is not a source is refused by name."""

from __future__ import annotations

import random
from collections import Counter

import mlx.core as mx
import pytest
from helpers import accepted_in_steps, tiny_model
from hybrids import tiny_hybrid
from test_sampling import PROMPT, V_SMALL, chi2_passes, exact_first_tokens, small_model  # noqa: F401

from mlx_redrafter.config import DraftConfig
from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.generate import generate_tokens

N = 40


class KnowsTheReply:
    """Proposes ``rows`` rows a step: the model's own continuation (``reply``
    after ``prompt``, cut or corrupted at irregular steps so that acceptance
    lengths vary), at a random position among wrong rows, some of which share
    its first token (the walk must find the right one wherever it is)."""

    name = "mine"

    def __init__(self, prompt, reply, rows=4, length=5, seed=0, vocab=97):
        self.prompt, self.reply, self.rows, self.length = list(prompt), list(reply), rows, length
        self.rng, self.vocab, self.calls, self.places = random.Random(seed), vocab, 0, Counter()

    def propose(self, tokens):
        self.calls += 1
        done = len(tokens) - len(self.prompt)
        if tokens[: len(self.prompt)] != self.prompt or done < 0:
            return []
        right = self.reply[done : done + self.length]
        if not right:
            return []
        if self.rng.random() < 0.3:  # a wrong token somewhere: a partial acceptance
            k = self.rng.randrange(len(right))
            right = right[:k] + [(right[k] + 1) % self.vocab]
        wrong = [[(t + 1 + i) % self.vocab for t in right] for i in range(self.rows - 1)]
        if len(wrong) > 1:
            wrong[1] = right[:1] + wrong[1][1:]  # shares the right row's first token
        place = self.rng.randrange(self.rows)
        self.places[place] += 1
        return wrong[:place] + [right] + wrong[place:]


MODELS = {"llama": lambda: tiny_model("llama"), "qwen3_5": lambda: tiny_hybrid("qwen3_5")}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return request.param, MODELS[request.param]()


@pytest.mark.parametrize("pipelined", [True, False], ids=["ahead", "after-read"])
@pytest.mark.parametrize("tree", ["fixed", "auto"])
def test_a_users_source_drafts_exactly_with_the_right_row_anywhere(model, pipelined, tree):
    name, m = model
    prompt = [5, 9, 11, 3, 7, 2]
    plain, _ = generate_tokens(m, prompt, max_tokens=N)
    source = KnowsTheReply(prompt, plain, seed=len(name) + pipelined)
    draft = DraftConfig(sources=(source,), pipelined=pipelined, tree=tree)
    tokens, stats = generate_tokens(m, prompt, draft=draft, max_tokens=N)
    assert tokens == plain, name
    assert accepted_in_steps(stats, N, "mine") >= N // 4  # its rows were verified and accepted
    assert {s.source for s in stats if s.accepted} == {"mine"}
    assert len(source.places) >= 3  # the right row stood at several positions
    assert all(s.host_syncs == s.step + 1 for s in stats)  # still one read per step


def test_its_rows_join_the_drafters_in_one_tree(model):
    """Beside lookup: both sources' rows in each tree, both accepted."""
    name, m = model
    prompt = [5, 9, 11, 3, 7, 2]
    plain, _ = generate_tokens(m, prompt, max_tokens=N)
    for pipelined in (True, False):
        source = KnowsTheReply(prompt, plain, rows=2, seed=3)
        draft = DraftConfig(lookup=1, sources=(source,), pipelined=pipelined)
        tokens, stats = generate_tokens(m, prompt, draft=draft, max_tokens=N)
        assert tokens == plain
        assert accepted_in_steps(stats, N, "mine") >= 4


def test_sampling_with_a_users_rows_keeps_the_model_distribution(small_model):  # noqa: F811
    """Deterministic rows, each prefix walked once: the first three tokens
    sampled follow the model's own distribution."""
    from mlx_redrafter.config import SamplingConfig

    class Guess:
        name = "guess"

        def propose(self, tokens):
            return [[tokens[-1], 1, 2], [tokens[-1], 3], [2, 2, 2], [0]]

    cfg, n = SamplingConfig(temp=1.0), 1200
    expected = exact_first_tokens(small_model, PROMPT, cfg)
    mx.random.seed(7)
    observed, taken = Counter(), 0
    for i in range(n):
        draft = DraftConfig(sources=(Guess(),), pipelined=bool(i % 2))
        tokens, stats = generate_tokens(small_model, PROMPT, draft=draft, max_tokens=3, temp=cfg.temp)
        observed[tuple(tokens)] += 1
        taken += accepted_in_steps(stats, len(tokens), "guess")
    assert taken > n // 10  # its rows were accepted in many runs
    assert chi2_passes(observed, expected, n)


def test_what_is_not_a_source_is_refused_by_name():
    m = tiny_model("llama")

    class NoName:
        def propose(self, tokens):
            return []

    with pytest.raises(RedrafterError, match="NoName lacks name"):
        generate_tokens(m, [1, 2, 3], draft=DraftConfig(sources=(NoName(),)), max_tokens=4)

    class OutOfVocab:
        name = "bad"

        def propose(self, tokens):
            return [[10**6]]

    with pytest.raises(RedrafterError, match="outside the model's vocabulary"):
        generate_tokens(m, [1, 2, 3], draft=DraftConfig(sources=(OutOfVocab(),)), max_tokens=4)


def test_stream_generate_takes_sources(tmp_path):
    """The public keyword: ``stream_generate(..., sources=[...])``, its label in the responses' stats."""
    from helpers import save_tiny_folder

    from mlx_redrafter.generate import stream_generate
    from mlx_redrafter.llm.load import load_model

    save_tiny_folder(tmp_path / "m")
    m, tok = load_model(str(tmp_path / "m"))
    prompt = tok.encode("w1 w2 w3 w4")
    plain = [r.token for r in stream_generate(m, tok, prompt, drafter=None, max_tokens=24)]
    source = KnowsTheReply(prompt, plain, seed=5)
    got = list(stream_generate(m, tok, prompt, drafter=None, sources=[source], max_tokens=24))
    assert [r.token for r in got] == plain
    assert any(r.from_draft and r.stats.source == "mine" for r in got)
