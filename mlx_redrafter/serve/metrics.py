"""``GET /metrics``: the server's counters in Prometheus' text format
(``prometheus-client``, one :class:`~prometheus_client.CollectorRegistry`
per app, so that several apps in one process do not share counters).

Names (counters end in ``_total`` on the wire):

* ``redrafter_requests_total{route,status}``: answered HTTP requests, by
  route template (the chat page's files as ``/ui/{path}``, ``unmatched`` for
  unknown paths) and status code;
* ``redrafter_prompt_tokens_total``, ``redrafter_generated_tokens_total``;
* ``redrafter_tokens_per_step``: a histogram of the tokens each step emitted;
* ``redrafter_draft_tokens_accepted_total{source}``: emitted tokens that were
  accepted drafts, by source (``drafter``, ``mtp``, ``draft-model``,
  ``eagle3``, ``dflash``, ``lookup``, ``datastore``);
* ``redrafter_prompt_cache_hits_total``, ``redrafter_prompt_cache_reused_tokens_total``,
  ``redrafter_prompt_cache_entries``, ``redrafter_prompt_cache_bytes``;
* ``redrafter_queue_waiting``, ``redrafter_queue_running`` (requests
  decoding, also as ``redrafter_requests_active``);
* ``redrafter_requests_shed_total``: requests answered 503 (queue full);
* ``redrafter_batch_size``: a histogram of the requests each step decoded;
* ``redrafter_batch_tokens_per_step``: a histogram of the tokens a step of
  the drafting batch emitted, all its rows together (serve/batch.py);
* ``redrafter_batch_draft_tokens_verified_total{source}`` and
  ``redrafter_batch_draft_tokens_accepted_total{source}``: draft tokens the
  drafting batch verified and accepted, by source (their ratio is each
  source's acceptance under batching).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..step.sources import BATCH_LABELS, LABELS
from .engine import Engine, Result

# Labels shown from the start, at 0: every built-in source's (step/sources/), and
# those a drafting batch drafts with (step/batched.py).
DRAFT_SOURCES = LABELS
BATCH_SOURCES = BATCH_LABELS
STEP_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32)
BATCH_STEP_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class Metrics:
    """The counters of one app, fed by the engine's listeners and by
    :class:`RequestCounter` (every HTTP answer)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: Engine):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("redrafter_requests", "HTTP requests answered.", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("redrafter_prompt_tokens", "Prompt tokens of generations.", registry=r)
        self.generated = Counter("redrafter_generated_tokens", "Tokens generated.", registry=r)
        self.per_step = Histogram(
            "redrafter_tokens_per_step",
            "Tokens emitted by one step (1 + accepted drafts).",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.accepted = Counter(
            "redrafter_draft_tokens_accepted", "Emitted tokens that were accepted drafts.", ["source"], registry=r
        )
        for source in DRAFT_SOURCES:
            self.accepted.labels(source)
        self.modes = Counter(
            "redrafter_governed_steps",
            "Steps of drafting generations by what the live choice ran (step/governor.py): 'draft' (its sources "
            "paid), 'plain' (none paid: plain decoding), 'probe' (measuring a choice left out).",
            ["mode"],
            registry=r,
        )
        for mode in ("draft", "plain", "probe"):
            self.modes.labels(mode)
        self.hits = Counter(
            "redrafter_prompt_cache_hits", "Generations that reused a cached prompt prefix.", registry=r
        )
        self.reused = Counter(
            "redrafter_prompt_cache_reused_tokens", "Prompt tokens whose KV came from the cache.", registry=r
        )
        cache, queue = engine.cache, engine.queue
        Gauge("redrafter_prompt_cache_entries", "Sequences in the prompt cache.", registry=r).set_function(
            lambda: cache.entries
        )
        Gauge("redrafter_prompt_cache_bytes", "Bytes of the prompt cache's KV.", registry=r).set_function(
            lambda: cache.nbytes
        )
        Gauge("redrafter_queue_waiting", "Requests waiting for the model.", registry=r).set_function(
            lambda: queue.status()["waiting"]
        )
        Gauge("redrafter_queue_running", "Requests being generated.", registry=r).set_function(
            lambda: queue.status()["running"]
        )
        Gauge("redrafter_requests_active", "Requests decoding (at most --max-batch).", registry=r).set_function(
            lambda: queue.status()["active"]
        )
        self.shed = Counter("redrafter_requests_shed", "Requests refused with a 503: the queue was full.", registry=r)
        self.batch = Histogram(
            "redrafter_batch_size", "Requests decoded by one step.", buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_step = Histogram(
            "redrafter_batch_tokens_per_step",
            "Tokens a step of the drafting batch emitted, all its rows together.",
            buckets=BATCH_STEP_BUCKETS,
            registry=r,
        )
        self.batch_verified = Counter(
            "redrafter_batch_draft_tokens_verified", "Draft tokens the batch verified.", ["source"], registry=r
        )
        self.batch_accepted = Counter(
            "redrafter_batch_draft_tokens_accepted", "Draft tokens the batch accepted.", ["source"], registry=r
        )
        for source in BATCH_SOURCES:
            self.batch_verified.labels(source)
            self.batch_accepted.labels(source)
        engine.listeners.append(self.observe)
        queue.step_listeners.append(self.batch.observe)
        getattr(queue.decoder, "batch_listeners", []).append(self.observe_batch)
        queue.shed_listeners.append(self.shed.inc)

    def observe(self, res: Result) -> None:
        """Count one finished or cancelled generation (on the worker thread)."""
        self.prompt_tokens.inc(res.prompt_tokens)
        self.generated.inc(res.completion_tokens)
        for n in res.step_tokens:
            self.per_step.observe(n)
        for source, n in res.drafted_by_source.items():
            self.accepted.labels(source).inc(n)
        for mode, n in res.tally.modes.items():
            self.modes.labels(mode).inc(n)
        if res.reused_tokens:
            self.hits.inc()
            self.reused.inc(res.reused_tokens)

    def observe_batch(self, batch) -> None:
        """Count one step of the drafting batch (a step/batched.py ``BatchSteps``, on the worker thread)."""
        self.batch_step.observe(batch.tokens)
        for source, n in batch.verified.items():
            self.batch_verified.labels(source).inc(n)
        for source, n in batch.accepted.items():
            self.batch_accepted.labels(source).inc(n)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware counting every HTTP answer by route and status
    (plain ASGI: a BaseHTTPMiddleware would hide client disconnects).
    ``app.add_middleware(RequestCounter, metrics=...)``."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = []

        async def sending(message):
            if message["type"] == "http.response.start":  # counted as it starts: a client may ask right after
                started.append(message["status"])
                self._count(scope, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            if not started:  # an exception before any answer is a 500
                self._count(scope, 500)
            raise

    def _count(self, scope, status: int) -> None:
        self.metrics.requests.labels(route_label(scope), str(status)).inc()


def route_label(scope) -> str:
    """The route a request matched, as ``/metrics`` names it: its path
    template (FastAPI puts the matched route in the scope), a mounted app's
    prefix with ``{path}`` (the chat page's files: ``/ui/{path}``), else ``unmatched``."""
    route = scope.get("route")
    if route is not None:
        return route.path
    if "endpoint" in scope:  # a Mount matched: Starlette moved its prefix into root_path
        return scope.get("root_path", "")[len(scope.get("app_root_path", "")) :] + "/{path}"
    return "unmatched"
