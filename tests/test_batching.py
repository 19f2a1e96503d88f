"""The server's scheduler on a tiny in-code model (no HTTP, nothing
downloaded): concurrent requests decoded together equal each served alone
(greedy), join and leave mid-batch without changing the others, keep their
own sampling streams and grammars, are admitted oldest first, and the rule
that picks batching over drafting follows the device's curves."""

from __future__ import annotations

import math
import threading
import time

import mlx.core as mx
import pytest
from helpers import OracleDrafter, byte_tokenizer, tiny_model

from mlx_redrafter.config import DraftConfig, SamplingConfig
from mlx_redrafter.generate import stream_generate
from mlx_redrafter.runtime import Runtime
from mlx_redrafter.serve.batch import DraftGain, batch_pays
from mlx_redrafter.serve.engine import Engine, GenParams
from mlx_redrafter.serve.scheduler import JobQueue, QueueFull
from mlx_redrafter.step.curve import CostCurve

FLAT = tuple(1.0 + 0.1 * n for n in range(16))  # a verify-cost curve on which drafts pay
BATCH_PAYS = CostCurve(FLAT, batch_sizes=(1, 2, 4, 8), batch_gains=(1.0, 10.0, 20.0, 40.0))
BATCH_NEVER = CostCurve(FLAT, batch_sizes=(1, 2, 4, 8), batch_gains=(1.0, 0.5, 0.5, 0.5))  # together is slower
LOOKUP = dict(lookup=1, lookup_length=3)  # drafting by lookup: no drafter to build
TIMEOUT = 120


@pytest.fixture(autouse=True)
def priced_by_the_curve(monkeypatch):
    """A drafting batch's widths from the curve alone (serve/batch.py): no timing in these tests."""
    from mlx_redrafter.serve.batch import BatchDecoder

    monkeypatch.setattr(BatchDecoder, "live_cost", False)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """mlx-lm's tokenizer wrapper over a byte-level BPE (256 tokens + EOS)."""
    return byte_tokenizer(tmp_path_factory.mktemp("bytes"))


@pytest.fixture(scope="module")
def model(tokenizer):
    model = tiny_model("llama", vocab_size=264)  # the 257 tokens, and ids past them
    # Evaluate the arrays the model builds lazily (its RoPE frequencies) here:
    # a graph made on this thread's stream cannot be evaluated on the worker's.
    mx.eval(model(mx.array([[1]])))
    return model


PROMPTS = [[40, 41, 42, 43], [100, 7, 9, 200, 12, 13], [5, 5, 60], [70, 71, 72, 73, 74, 75, 76, 77], [90, 3]]


class Client:
    """A job and what it emitted (``sources``: each token's, in order);
    ``on_text(client, piece)`` and ``on_done(client)`` run on the worker."""

    def __init__(self, engine, ids, params, on_text=None, on_done=None):
        self.pieces, self.sources, self.result, self.error = [], [], None, None
        self.on_text, self.on_done = on_text, on_done
        self.done = threading.Event()
        self.job = engine.job(list(ids), params, self.emit)

    def emit(self, kind, value):
        if kind == "text":
            self.pieces.append(value.text)
            self.sources += value.sources
            if self.on_text is not None:
                self.on_text(self, value)
        else:
            self.result, self.error = (value, None) if kind == "done" else (None, value)
            if self.on_done is not None:
                self.on_done(self)
            self.done.set()

    def wait(self):
        assert self.done.wait(TIMEOUT), "the job did not finish"
        assert self.error is None, self.error
        return self.result


def _engine(model, tokenizer, curve=BATCH_PAYS, max_batch=4, queue=8, drafter=None, **draft):
    rt = Runtime(model, tokenizer, "tiny", draft=DraftConfig(drafter, curve=curve, **draft))
    return Engine(rt, max_tokens=16, max_batch=max_batch, queue_size=queue)


def _plain(model, tokenizer, ids, n, **kw):
    """Plain decoding alone (the reference): its tokens, EOS left out."""
    out = [r.token for r in stream_generate(model, tokenizer, ids, drafter=None, lookup=False, max_tokens=n, **kw)]
    return [t for t in out if t not in tokenizer.eos_token_ids]


def _served(engine, clients, later=()):
    """Submit ``clients`` (before the worker starts: they join together), then
    wait for them and for ``later`` (clients that others' callbacks submit);
    the worker is always stopped."""
    for c in clients:
        engine.submit(c.job)
    engine.start()
    try:
        return [c.wait() for c in [*clients, *later]]
    finally:
        engine.stop()


def test_concurrent_greedy_requests_equal_each_alone(model, tokenizer):
    engine = _engine(model, tokenizer)
    clients = [Client(engine, p, GenParams(12)) for p in PROMPTS[:4]]
    results = _served(engine, clients)
    for p, c, res in zip(PROMPTS, clients, results):
        assert res.tokens == _plain(model, tokenizer, p, 12)
        assert res.batched_tokens == len(res.tokens) > 0  # decoded in the batch
        assert "".join(c.pieces) == res.text and res.finish_reason in ("stop", "length")
    status = engine.queue.status()
    assert status["active"] == status["waiting"] == 0 and status["served"] == 4


def test_a_request_joining_and_one_hanging_up_leave_the_others_unchanged(model, tokenizer):
    engine = _engine(model, tokenizer)
    late, joined = Client(engine, PROMPTS[2], GenParams(10)), []

    def join_late(client, piece):  # on the worker thread, mid-batch
        if piece.tokens >= 4 and not joined:
            joined.append(engine.submit(late.job))

    def hang_up(client, piece):
        if piece.tokens >= 3:
            client.job.cancel()

    first = Client(engine, PROMPTS[0], GenParams(16), on_text=join_late)
    second = Client(engine, PROMPTS[1], GenParams(16))
    leaver = Client(engine, PROMPTS[3], GenParams(16), on_text=hang_up)
    results = _served(engine, [first, second, leaver], later=[late])
    for p, n, res in zip([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [16, 16, 10], [results[0], results[1], results[3]]):
        assert res.tokens == _plain(model, tokenizer, p, n) and not res.cancelled
    assert results[2].cancelled and 3 <= len(results[2].tokens) < 16
    assert engine.queue.status()["cancelled"] == 1 and engine.queue.status()["active"] == 0


def test_a_request_alone_drafts_then_moves_into_the_batch_and_back(model, tokenizer):
    """Alone, the first request runs the runtime's drafting loop; joined, it
    moves into the batch; alone again, back to drafting: its tokens equal
    plain decoding all along."""
    # A drafter that knows the reply: drafting pays, so the row goes back to it.
    engine = _engine(model, tokenizer, drafter=OracleDrafter(model, PROMPTS[0], 40, 2), beam_width=2, beam_length=2)
    first_had = []  # the first reply's length when the other one ended
    ended = lambda c: first_had.append(len(first.sources))  # noqa: E731
    other, joined_at = Client(engine, PROMPTS[1], GenParams(6), on_done=ended), []

    def join(client, piece):
        if not joined_at:
            joined_at.append(piece.tokens)
            engine.submit(other.job)

    first = Client(engine, PROMPTS[0], GenParams(40), on_text=join)
    res, res_other = _served(engine, [first], later=[other])
    assert res_other.tokens == _plain(model, tokenizer, PROMPTS[1], 6)
    assert res.tokens == _plain(model, tokenizer, PROMPTS[0], 40)
    assert 0 < res.batched_tokens <= len(res.tokens) - joined_at[0]  # batched while the other decoded ...
    assert len(res.tokens) - res.batched_tokens > joined_at[0]  # ... then alone again
    # ... where it drafted again: drafts accepted after the other reply ended (not plain decoding alone).
    after = first.sources[first_had[0] :]
    assert after.count("drafter") >= 2 and res.drafted_by_source["drafter"] >= 2, first.sources


def _joined_mid_reply(engine, first_params, prompt=PROMPTS[0]):
    """``prompt`` sent alone, and another greedy request sent once its reply has begun."""
    other, joined = Client(engine, PROMPTS[1], GenParams(6)), []

    def join(client, piece):
        if not joined:
            joined.append(engine.submit(other.job))

    first = Client(engine, prompt, first_params, on_text=join)
    res, res_other = _served(engine, [first], later=[other])
    assert res_other.tokens == _plain(engine.rt.model, engine.rt.tokenizer, PROMPTS[1], 6)
    assert res_other.batched_tokens > 0  # it was decoded while the first one was
    return res


def test_a_structured_request_alone_moves_into_the_batch_with_its_parse(model, tokenizer):
    """Batching's exactness under a grammar (the row stays in the batch: nothing is drafted after its first token)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}
    engine = _engine(model, tokenizer, **LOOKUP)
    grammar = engine.compile_grammar(schema)
    res = _joined_mid_reply(engine, GenParams(30, grammar=grammar))
    assert res.tokens == _plain(model, tokenizer, PROMPTS[0], 30, grammar=grammar)
    assert 0 < res.batched_tokens < len(res.tokens)  # the grammar's state went along into the batch


def test_a_seeded_request_alone_keeps_drafting_while_others_batch(model, tokenizer):
    """A seeded request that started alone stays alone (its samples are
    ``generate --seed``'s, drafts accepted), interleaved with the batch, whose
    rows draw from their own keys and leave the global random stream alone."""
    # A drafter that knows the greedy reply, and a temperature low enough that
    # samples follow it at times: drafts are accepted (4 with this seed).
    sampling = SamplingConfig(temp=0.2, top_k=20)
    engine = _engine(model, tokenizer, drafter=OracleDrafter(model, PROMPTS[0], 40, 2), beam_width=2, beam_length=2)
    res = _joined_mid_reply(engine, GenParams(24, sampling, seed=3))
    rs = list(
        stream_generate(model, tokenizer, PROMPTS[0], draft=engine.rt.draft, sampling=sampling, seed=3, max_tokens=24)
    )
    assert res.tokens == [r.token for r in rs if r.token not in tokenizer.eos_token_ids] and res.batched_tokens == 0
    assert res.drafted_by_source.get("drafter", 0) >= 2  # the seeded drafting path ran, drafts accepted


def test_batching_waits_where_it_does_not_pay(model, tokenizer):
    """On a curve where decoding together gains nothing, requests are drafted one at a time."""
    oracle = OracleDrafter(model, PROMPTS[:3], 8, 2)  # knows each reply: their drafts are accepted
    engine = _engine(model, tokenizer, curve=BATCH_NEVER, drafter=oracle, beam_width=2, beam_length=2, **LOOKUP)
    clients = [Client(engine, p, GenParams(8)) for p in PROMPTS[:3]]
    results = _served(engine, clients)
    assert all(r.batched_tokens == 0 for r in results)
    assert [r.tokens for r in results] == [_plain(model, tokenizer, p, 8) for p in PROMPTS[:3]]
    assert all(r.drafted_by_source["drafter"] >= 2 for r in results)


def test_each_row_keeps_its_sampling_seed_stop_and_grammar(model, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def batch(companions):
        engine = _engine(model, tokenizer)
        grammar = engine.compile_grammar(schema)
        seeded = Client(engine, PROMPTS[0], GenParams(12, SamplingConfig(temp=0.9, top_p=0.95), seed=5))
        clients = [seeded, Client(engine, PROMPTS[1], GenParams(12, grammar=grammar))]
        clients += [Client(engine, p, GenParams(12, SamplingConfig(temp=t, top_k=k))) for p, t, k in companions]
        return _served(engine, clients), grammar

    (seeded, structured, *_), grammar = batch([(PROMPTS[2], 0.7, 5), (PROMPTS[3], 1.2, 0)])
    again, _ = batch([(PROMPTS[4], 0.5, 0)])
    assert again[0].tokens == seeded.tokens  # the seeded row's samples do not depend on the others
    assert seeded.batched_tokens == len(seeded.tokens)
    # ... and they are plain decoding's alone with that seed.
    assert seeded.tokens == _plain(model, tokenizer, PROMPTS[0], 12, temp=0.9, top_p=0.95, seed=5)
    assert structured.tokens == _plain(model, tokenizer, PROMPTS[1], 12, grammar=grammar)  # greedy under the grammar
    assert structured.structured and structured.batched_tokens > 0


def test_a_stop_string_ends_a_batched_row_exactly(model, tokenizer):
    def alone(**kw):
        rs = list(stream_generate(model, tokenizer, PROMPTS[0], drafter=None, lookup=False, max_tokens=12, **kw))
        return "".join(r.text for r in rs), rs[-1].finish_reason

    text, _ = alone()
    at = next(i for i in range(4, len(text) - 1) if "\ufffd" not in text[i : i + 2])  # whole characters
    stop = text[at : at + 2]
    engine = _engine(model, tokenizer)
    clients = [Client(engine, PROMPTS[0], GenParams(12, stop=[stop])), Client(engine, PROMPTS[1], GenParams(12))]
    res = _served(engine, clients)[0]
    assert (res.text, res.finish_reason) == alone(stop=[stop]) == (text[: text.index(stop)], "stop")
    assert res.stop_sequence == stop and res.batched_tokens > 0


def test_the_oldest_waiting_request_joins_first_and_a_full_queue_says_when_to_retry(model, tokenizer):
    engine = _engine(model, tokenizer, max_batch=2, queue=3)
    decoder, joined = engine.queue.decoder, []
    admit = decoder.admit
    decoder.admit = lambda jobs: (joined.extend(jobs), admit(jobs))  # records the order rows join in
    clients = [Client(engine, p, GenParams(3 + 2 * (i % 3))) for i, p in enumerate(PROMPTS)]
    for c in clients:  # 2 decoding + 3 waiting: all five fit
        engine.submit(c.job)
    with pytest.raises(QueueFull) as full:
        engine.submit(Client(engine, PROMPTS[0], GenParams(3)).job)
    assert full.value.retry_after >= 1 and engine.queue.status()["shed"] == 1
    _served(engine, [], later=clients)
    assert joined == [c.job for c in clients]
    status = engine.queue.status()
    assert status["served"] == 5 and status["waiting"] == status["active"] == 0 and status["seconds_per_request"] > 0


def _until(check, what: str, timeout: float = TIMEOUT) -> None:
    """Poll ``check()`` until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.01)


class _Held:
    """A :class:`JobQueue` (one decoding, two waiting) whose handler takes
    ``sleep_s`` for job ``[0]`` and holds every other job until released."""

    def __init__(self, sleep_s: float = 0.0):
        from mlx_redrafter.serve.jobs import Job, Result

        self.gate = threading.Semaphore(0)

        def handler(job):
            if job.ids == [0]:
                time.sleep(sleep_s)
            else:
                self.gate.acquire(timeout=TIMEOUT)
            res = Result(finish_reason="stop")
            job.emit("done", res)
            return res

        self.q = JobQueue(handler, size=2)
        self.jobs = [Job([i], GenParams(1), lambda kind, value: None) for i in range(6)]

    def fill(self, first: int) -> int:
        """Job ``first`` decoding and the next two waiting; the refused one's ``retry_after``."""
        _until(lambda: self.q.status()["running"] == 1, "the job did not start")
        for j in self.jobs[first + 1 : first + 3]:
            self.q.submit(j)
        assert self.q.status()["waiting"] == 2
        with pytest.raises(QueueFull) as full:
            self.q.submit(self.jobs[first + 3])
        return full.value.retry_after

    def stop(self):
        for _ in self.jobs:
            self.gate.release()
        self.q.stop()


def test_retry_after_follows_the_measured_time_per_request():
    """A job of known duration finished: each of the three requests ahead of a
    new one (the decoding one, two waiting) takes that long, one at a time."""
    held = _Held(sleep_s=1.0)
    held.q.start()
    try:
        tic = time.perf_counter()
        held.q.submit(held.jobs[0])
        _until(lambda: held.q.status()["served"] == 1, "the timed job did not finish")
        took = time.perf_counter() - tic  # the scheduler measured between 1.0 s and this
        assert 1.0 <= held.q.request_s <= took
        held.q.submit(held.jobs[1])
        assert math.ceil(3 * 1.0) <= held.fill(1) <= math.ceil(3 * took)
    finally:
        held.stop()


def test_retry_after_before_any_request_finished_uses_the_running_ones_time():
    held = _Held()
    held.q.start()
    try:
        tic = time.perf_counter()
        held.q.submit(held.jobs[1])
        _until(lambda: held.q.status()["running"] == 1, "the job did not start")
        time.sleep(1.0)  # the running job has run at least this long, nothing finished
        retry = held.fill(1)
        ran = time.perf_counter() - tic
        assert held.q.request_s == 0 and math.ceil(3 * 1.0) <= retry <= math.ceil(3 * ran)
    finally:
        held.stop()


def test_retry_after_with_nothing_started_counts_a_second_per_round_of_the_batch():
    """No time measured at all: one second per request, ``max_batch`` at a time."""
    from types import SimpleNamespace

    from mlx_redrafter.serve.jobs import Job
    from mlx_redrafter.serve.scheduler import Scheduler

    for max_batch, size, expected in ((1, 2, 4), (2, 4, 4), (4, 4, 3)):  # ceil(1 s x (waiting + 1) / max_batch)
        q = Scheduler(SimpleNamespace(max_batch=max_batch, active=0), size=size)  # no worker: all wait
        for i in range(max_batch + size):
            q.submit(Job([i], GenParams(1), lambda kind, value: None))
        with pytest.raises(QueueFull) as full:
            q.submit(Job([99], GenParams(1), lambda kind, value: None))
        assert full.value.retry_after == expected, (max_batch, size)


def test_the_rule_batches_where_the_batch_gain_beats_drafting():
    assert not batch_pays(BATCH_PAYS, 1, 1.0)  # one request: nothing to batch
    curve = CostCurve(FLAT, batch_sizes=(1, 2, 4, 8), batch_gains=(1.0, 1.5, 2.5, 4.0))
    assert batch_pays(curve, 2, 1.2) and not batch_pays(curve, 2, 1.8) and batch_pays(curve, 4, 1.8)
    assert curve.batch_gain(3) == pytest.approx(2.0) and curve.batch_gain(16) == 4.0  # flat past the largest
    gain = DraftGain(curve)
    assert gain.value == 1.0  # nothing drafted yet

    class Step:  # 3 tokens from a tree of 4 (c(4) = 1.3)
        tokens, stats = [1, 2, 3], type("S", (), {"tree_size": 4})

    gain.add(Step)
    assert gain.value == pytest.approx(3 / 1.3)


def test_a_request_that_fails_is_told_and_the_others_go_on(model, tokenizer):
    engine = _engine(model, tokenizer)
    bad = [Client(engine, PROMPTS[0], GenParams(8, grammar="not a grammar")) for _ in range(2)]
    good = Client(engine, PROMPTS[1], GenParams(8))
    for c in bad + [good]:
        engine.submit(c.job)
    engine.start()
    try:
        assert good.wait().tokens == _plain(model, tokenizer, PROMPTS[1], 8)
        for c in bad:
            assert c.done.wait(TIMEOUT) and c.error is not None and c.result is None
        alone = Client(engine, PROMPTS[0], GenParams(8, grammar="not a grammar"))  # fails alone too
        engine.submit(alone.job)
        assert alone.done.wait(TIMEOUT) and alone.error is not None
        again = Client(engine, PROMPTS[2], GenParams(8))
        engine.submit(again.job)
        assert again.wait().tokens == _plain(model, tokenizer, PROMPTS[2], 8)
    finally:
        engine.stop()
    status = engine.queue.status()
    assert status["served"] == 5 and status["active"] == status["waiting"] == 0


def test_calibration_measures_the_batch_curve_and_stores_it(tmp_path, monkeypatch):
    from mlx_redrafter.step import curve as vc
    from mlx_redrafter.tuning.calibrate import measure_curve

    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path))
    model = tiny_model("llama")
    # A budget no run reaches: the rounds bound the work, and what is measured does not depend on the clock.
    c = measure_curve(model, max_size=2, budget_s=600.0, context=16, max_rounds=2, long_context=0)
    assert c.batch_sizes == (1, 2, 4, 8) and c.batch_gains[0] == 1.0 and all(g > 0 for g in c.batch_gains)
    assert c.batch_gain(4) == c.batch_gains[2] and "batched decoding" in vc.format_curve(c)
    vc.save_curve(c, model)
    assert vc.curve_for(model).batch_gains == c.batch_gains  # stored with the verify-cost curve
    assert measure_curve(model, max_size=2, budget_s=0.0).batch_sizes == ()  # none timed: the built-in gains
    builtin = vc.builtin_curve()
    assert builtin.batch_gain(8) == pytest.approx(59 / 13) and builtin.batch_gain(2) > 1  # docs/tuning.md
    assert vc.builtin_curve("q4g64-float32").batch_gain(4) < 1.1  # quantized on this CPU: batching gains nothing
