"""The server's batch drafts (issue 57): concurrent requests decoded together
each verify their own draft tree in the batch's one forward, and each gets
exactly the tokens it gets alone (greedy, on a tiny in-code model, no HTTP:
the scheduler and engine of ``serve``, as tests/test_batching.py). Rows join
and leave mid-batch, a row under a grammar decodes beside free ones, a
seeded row keeps plain decoding's samples, and ``/metrics`` counts what the
batch verified and accepted by source and its tokens per step."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import OracleDrafter, byte_tokenizer, tiny_model
from hybrids import tiny_hybrid
from test_batching import BATCH_PAYS, PROMPTS, Client, _plain, _served

from mlx_redrafter.config import DraftConfig, SamplingConfig
from mlx_redrafter.runtime import Runtime
from mlx_redrafter.serve.engine import Engine, GenParams
from mlx_redrafter.serve.metrics import Metrics

N = 14


@pytest.fixture(autouse=True)
def priced_by_the_curve(monkeypatch):
    """The batch's widths from the curve alone: no timing, the same steps every run."""
    from mlx_redrafter.serve.batch import BatchDecoder

    monkeypatch.setattr(BatchDecoder, "live_cost", False)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return byte_tokenizer(tmp_path_factory.mktemp("bytes"))


@pytest.fixture(scope="module")
def model(tokenizer):
    model = tiny_model("llama", vocab_size=264)
    mx.eval(model(mx.array([[1]])))  # its lazy arrays, on this thread (the worker evaluates the rest)
    return model


def _engine(model, tokenizer, draft: DraftConfig, max_batch=4, batch_drafts=True, **kw):
    rt = Runtime(model, tokenizer, "tiny", draft=draft)
    return Engine(rt, max_tokens=N, max_batch=max_batch, queue_size=8, batch_drafts=batch_drafts, **kw)


def _oracle(model, prompts, n=40):
    """A drafter that knows each prompt's greedy reply (its drafts are accepted), and a lookup row."""
    return DraftConfig(OracleDrafter(model, prompts, n, 3), beam_width=2, beam_length=3, lookup=1, curve=BATCH_PAYS)


def _metric(text: str, name: str, label: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + label + " ") or line.startswith(name + label + "{") and not label:
            return float(line.split()[-1])
    raise AssertionError(f"{name}{label} not in /metrics")


LONG = [PROMPTS[i] for i in (0, 1, 3, 4)]  # replies that do not end before N tokens


def test_concurrent_drafting_rows_equal_each_alone_and_metrics_count_them(model, tokenizer):
    engine = _engine(model, tokenizer, _oracle(model, LONG))
    metrics = Metrics(engine)
    assert engine.queue.decoder.trees  # the batch drafts
    clients = [Client(engine, p, GenParams(N)) for p in LONG]
    results = _served(engine, clients)
    for p, res in zip(LONG, results):
        assert res.tokens == _plain(model, tokenizer, p, N)
        assert res.batched_tokens == len(res.tokens)  # all decoded in the batch ...
        assert res.drafted_by_source.get("drafter", 0) >= 2, res.drafted_by_source  # ... drafts accepted in each
    text = metrics.text().decode()
    accepted = _metric(text, "redrafter_batch_draft_tokens_accepted_total", '{source="drafter"}')
    verified = _metric(text, "redrafter_batch_draft_tokens_verified_total", '{source="drafter"}')
    assert 0 < accepted <= verified
    assert accepted == sum(r.drafted_by_source.get("drafter", 0) for r in results)
    steps = _metric(text, "redrafter_batch_tokens_per_step_count")
    tokens = _metric(text, "redrafter_batch_tokens_per_step_sum")
    # The first token of each row comes from its prefill; the steps emitted the rest, more than one a row-step.
    assert tokens >= sum(len(r.tokens) for r in results) - len(results) and tokens / steps > 4
    assert steps <= N // 2  # each row read all its tokens of a step as they came (several a step)


@pytest.mark.parametrize("source", ["drafter", "draft-model"])
def test_rows_join_and_leave_a_drafting_batch(model, tokenizer, source):
    """One request joins late, one hangs up: the others' tokens are plain
    decoding's, with drafts accepted (a draft model's: each row's own caches)."""
    draft = (
        _oracle(model, PROMPTS)
        if source == "drafter"
        else DraftConfig(None, draft_model=model, draft_model_length=3, curve=BATCH_PAYS)
    )
    engine = _engine(model, tokenizer, draft)
    late, joined = Client(engine, PROMPTS[4], GenParams(10)), []

    def join_late(client, piece):  # on the worker thread, mid-batch
        if piece.tokens >= 4 and not joined:
            joined.append(engine.submit(late.job))

    def hang_up(client, piece):
        if piece.tokens >= 3:
            client.job.cancel()

    first = Client(engine, PROMPTS[0], GenParams(N), on_text=join_late)
    second = Client(engine, PROMPTS[1], GenParams(N))
    leaver = Client(engine, PROMPTS[3], GenParams(N), on_text=hang_up)
    results = _served(engine, [first, second, leaver], later=[late])
    for p, n, res in zip([PROMPTS[0], PROMPTS[1], PROMPTS[4]], [N, N, 10], [results[0], results[1], results[3]]):
        assert res.tokens == _plain(model, tokenizer, p, n) and not res.cancelled
        assert res.batched_tokens > 0 and sum(res.drafted_by_source.values()) >= 2
    assert results[2].cancelled
    assert engine.queue.status()["active"] == 0


def test_a_grammar_row_and_a_seeded_row_beside_drafting_rows(model, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    engine = _engine(model, tokenizer, _oracle(model, PROMPTS))
    grammar = engine.compile_grammar(schema)
    sampling = SamplingConfig(temp=0.9, top_p=0.95)
    structured = Client(engine, PROMPTS[1], GenParams(N, grammar=grammar))
    seeded = Client(engine, PROMPTS[0], GenParams(N, sampling, seed=5))
    free = [Client(engine, p, GenParams(N)) for p in PROMPTS[3:5]]
    res = _served(engine, [structured, seeded, *free])
    assert res[0].tokens == _plain(model, tokenizer, PROMPTS[1], N, grammar=grammar) and res[0].batched_tokens > 0
    assert res[0].drafted_by_source.get("grammar", 0) >= 1  # its grammar's forced tokens, verified as drafts
    # The seeded row does not draft: its samples stay plain decoding's with its seed.
    assert res[1].tokens == _plain(model, tokenizer, PROMPTS[0], N, temp=0.9, top_p=0.95, seed=5)
    assert res[1].batched_tokens == len(res[1].tokens) and not res[1].drafted_by_source
    for p, r in zip(PROMPTS[3:5], res[2:]):
        assert r.tokens == _plain(model, tokenizer, p, N) and r.drafted_by_source.get("drafter", 0) >= 2


def test_a_draft_model_drafts_for_every_row_and_a_grammar_row(model, tokenizer):
    """A source with caches of its own (the model as its own draft model:
    always right) in the server's batch: each row's draft model keeps its
    own cache, every free row's drafts are accepted, a grammar row beside
    them gives its constrained tokens (the draft model's rows pruned by its
    grammar), and ``/metrics`` counts them under the source's name.
    Seen to fail: the batch's plan leaving stateful sources out
    (step/plan.py, as before issue 57's rows drafted with them)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    draft = DraftConfig(None, draft_model=model, draft_model_length=3, curve=BATCH_PAYS)
    engine = _engine(model, tokenizer, draft)
    metrics = Metrics(engine)
    assert engine.queue.decoder.trees
    grammar = engine.compile_grammar(schema)
    structured = Client(engine, PROMPTS[1], GenParams(N, grammar=grammar))
    free = [Client(engine, p, GenParams(N)) for p in (PROMPTS[0], PROMPTS[3], PROMPTS[4])]
    res = _served(engine, [structured, *free])
    assert res[0].tokens == _plain(model, tokenizer, PROMPTS[1], N, grammar=grammar) and res[0].batched_tokens > 0
    for p, r in zip((PROMPTS[0], PROMPTS[3], PROMPTS[4]), res[1:]):
        assert r.tokens == _plain(model, tokenizer, p, N) and r.batched_tokens == len(r.tokens)
        assert r.drafted_by_source.get("draft-model", 0) >= 4, r.drafted_by_source
    accepted = _metric(metrics.text().decode(), "redrafter_batch_draft_tokens_accepted_total", '{source="draft-model"}')
    assert accepted >= sum(r.drafted_by_source.get("draft-model", 0) for r in res[1:])


def test_without_batch_drafts_the_batch_decodes_plainly(model, tokenizer):
    engine = _engine(model, tokenizer, _oracle(model, PROMPTS[:3]), batch_drafts=False)
    assert not engine.queue.decoder.trees
    clients = [Client(engine, p, GenParams(N)) for p in PROMPTS[:3]]
    for p, res in zip(PROMPTS, _served(engine, clients)):
        assert res.tokens == _plain(model, tokenizer, p, N)
        assert res.batched_tokens == len(res.tokens) and not res.drafted_by_source


def test_a_hybrid_models_rows_draft_together(tokenizer):
    """A gated-delta-net hybrid: each row's recurrent state is its own accepted node's."""
    model = tiny_hybrid("qwen3_5", vocab_size=264)
    mx.eval(model(mx.array([[1]])))
    engine = _engine(model, tokenizer, _oracle(model, LONG[:3]))
    assert engine.queue.decoder.trees
    results = _served(engine, [Client(engine, p, GenParams(N)) for p in LONG[:3]])
    for p, res in zip(LONG, results):
        assert res.tokens == _plain(model, tokenizer, p, N) and res.batched_tokens == len(res.tokens)
        assert res.drafted_by_source.get("drafter", 0) >= 2


def test_batching_pays_where_drafting_inside_the_batch_makes_up_for_batching(model, tokenizer):
    """The rule weighs drafting alone against the batch gain times what
    drafting gains inside the batch (each measured, set here)."""
    from dataclasses import replace

    from mlx_redrafter.step.curve import CostCurve

    curve = CostCurve(BATCH_PAYS.costs, batch_sizes=(1, 2, 4, 8), batch_gains=(1.0, 1.5, 2.5, 4.0))
    engine = _engine(model, tokenizer, replace(_oracle(model, LONG), curve=curve))
    d = engine.queue.decoder
    d.gain.tokens, d.gain.cost = 3.0, 1.0  # drafting alone: 3x plain decoding
    assert d.capacity(4) == 1  # plain batching's 2.5x does not beat it
    d.batch_gain.add(tokens=8, rows=4, width=2)  # 2 tokens a row-step, at c(8) / c(4) of a plain batched step
    assert d.batch_gain.value == pytest.approx(8 / (4 * curve(8) / curve(4)))
    assert d.capacity(4) == 4 and d.capacity(2) == 1  # 2.5 x 1.64 > 3 > 1.5 x 1.64


def test_a_long_prompt_joins_a_chunk_a_step_while_the_others_decode(model, tokenizer, monkeypatch):
    """A prompt longer than a prefill chunk is prefilled a chunk per step of
    the batch (3 tokens a chunk here): the rows decoding emit tokens between
    its arrival and its first token, and it decodes exactly."""
    from mlx_redrafter.serve import batch as batch_mod

    monkeypatch.setattr(batch_mod, "PREFILL_STEP", 3)
    long = [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81]
    engine = _engine(model, tokenizer, _oracle(model, LONG + [long]))
    events, joined = [], []
    late = Client(engine, long, GenParams(8), on_text=lambda c, piece: events.append("late"))

    def join(client, piece):
        events.append("first")
        if piece.tokens >= 2 and not joined:
            joined.append(engine.submit(late.job))
            events.append("joined")

    first = Client(engine, LONG[0], GenParams(30), on_text=join)
    second = Client(engine, LONG[1], GenParams(30))
    results = _served(engine, [first, second], later=[late])
    assert results[2].tokens == _plain(model, tokenizer, long, 8) and results[2].batched_tokens > 0
    assert [r.tokens for r in results[:2]] == [_plain(model, tokenizer, p, 30) for p in LONG[:2]]
    between = events[events.index("joined") + 1 : events.index("late")]
    assert between.count("first") >= 2, events  # the batch went on while the long prompt was prefilled
