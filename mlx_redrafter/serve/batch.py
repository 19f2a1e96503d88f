"""Decoding concurrent requests together (continuous batching).

A request alone decodes as ``generate`` does: the runtime's step loop with
its drafter, lookup and tree. When others are active, the server decodes
them together where that serves more tokens per second than drafting them
one at a time: :func:`batch_pays` compares the device's batch gain ``g(n)``
(``doctor --calibrate`` measures it beside the verify-cost curve; a built-in
curve otherwise, step/curve.py), times what drafting gains inside the batch
(:class:`BatchGain`), with drafting's measured gain alone ``d``
(:class:`DraftGain`). Where batching does not pay, the others wait and
requests are drafted one at a time.

The batch drafts (issue 57): every row proposes its own draft tree (its
drafter's beams, lookup rows, its MTP or EAGLE-3 head's, draft model's or
DFlash drafter's rows, its grammar's forced tokens), all rows' trees
are verified in one forward whose width is priced on the whole batch, and
each row keeps its own accepted tokens (step/batched.py). Where the model
cannot (a sliding window's rotating cache, a layer no tree covers), or with
``batch_drafts=False`` (``serve --no-batch-drafts``), the batch decodes
plainly on mlx-lm's ``BatchGenerator`` and ``BatchKVCache``, as before.

A request that arrives joins at the next step with its own prefill (its
cached prefix from the prompt cache reused); one that ends or whose client
left leaves at once, and its KV cache is stored in the prompt cache. A
request decoding alone that others join moves into the batch between two of
its steps, its cache handed in; one left alone in the batch moves back to
drafting the same way (not under a grammar: the constrained loop starts its
parse at the prompt). Every row keeps its sampling, seed, stop strings and
grammar (serve/rows.py). Greedy rows give the tokens they give alone, up to
the rounding of batched matmuls (docs/server.md, "Several clients at once").
"""

from __future__ import annotations

import time
from typing import Callable, List, Tuple

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from ..llm.batch_cache import can_batch_rows
from ..llm.cache import feed, prefill_forward, target_size, trim_to_known
from ..llm.text import wrap_tokenizer
from ..step.batch_budget import batch_cost
from ..step.batched import BatchSteps
from ..step.curve import curve_for
from ..step.protocol import PREFILL_STEP
from .rows import Row, row_plan, row_processors, row_sampler
from .scheduler import Finished, tell

# DraftGain follows the last steps drafted alone: each older step weighs this much less.
GAIN_DECAY = 0.98
# What moving a row from the batch to drafting costs, in plain steps: the
# batch's step already queued for it is dropped, and the step loop starts
# again with a one-token prefill.
SWITCH_STEPS = 2.0


def batch_pays(curve, n: int, drafting_gain: float) -> bool:
    """Whether decoding ``n`` requests together (plain decoding) serves more
    tokens per second than drafting them one at a time: the batch gain
    ``g(n)`` (aggregate tokens/s over one sequence's, measured on this
    device) beats drafting's gain ``d`` over plain decoding."""
    return n > 1 and curve.batch_gain(n) > drafting_gain


class DraftGain:
    """Drafting's measured gain over plain decoding: over the recent steps
    drafted alone, tokens per step over the step's cost in plain steps, the
    verify-cost curve's c(tree size). 1 before any step (no evidence that
    drafting helps)."""

    def __init__(self, curve):
        self.curve = curve
        self.tokens = self.cost = 0.0

    def add(self, step) -> None:
        self.tokens = GAIN_DECAY * self.tokens + len(step.tokens)
        self.cost = GAIN_DECAY * self.cost + self.curve(step.stats.tree_size)

    @property
    def value(self) -> float:
        return self.tokens / self.cost if self.cost else 1.0


class BatchGain:
    """What drafting gains inside the batch, over plain batched decoding:
    over the recent batched steps, the tokens each row emitted per step
    over the step's cost in plain batched steps of as many rows
    (step/batch_budget.py ``batch_cost``). 1 before any step."""

    def __init__(self, curve):
        self.curve = curve
        self.tokens = self.cost = 0.0

    def add(self, tokens: int, rows: int, width: int) -> None:
        ratio = batch_cost(self.curve, rows, width) / batch_cost(self.curve, rows, 1)
        self.tokens = GAIN_DECAY * self.tokens + tokens
        self.cost = GAIN_DECAY * self.cost + rows * ratio

    @property
    def value(self) -> float:
        return self.tokens / self.cost if self.cost else 1.0


def can_batch_trees(rt) -> bool:
    """Whether the batch's rows can draft (step/batched.py): the runtime's
    plan drafts (so the model verifies trees and drafting pays), its batch
    plan too, and the model's caches batch row by row."""
    return rt.plan().drafting and rt.plan(batched=True).drafting and can_batch_rows(make_prompt_cache(rt.model))


def can_batch(model) -> bool:
    """Whether the model's caches merge into a batch (as mlx-lm's server asks)."""
    return all(hasattr(c, "merge") for c in make_prompt_cache(model))


class BatchDecoder:
    """The decoder of :class:`~mlx_redrafter.serve.engine.Engine`'s
    scheduler: the rows decoding, at most one alone (with drafts), the others
    in one batch (:class:`~mlx_redrafter.step.batched.BatchSteps`, every row
    drafting, or mlx-lm's ``BatchGenerator``); ``max_batch`` rows at most
    (1: one request at a time, alone, as before batching). ``batch_drafts``:
    whether the batch's rows draft where the model allows it.
    ``batch_listeners`` are called after each step of a drafting batch with
    its :class:`~mlx_redrafter.step.batched.BatchSteps` (``/metrics``)."""

    live_cost = True  # the drafting batch prices its steps by their measured time (False: by the curve alone)

    def __init__(self, engine, max_batch: int, batch_drafts: bool = False):
        rt = engine.rt
        self.engine, self.model = engine, rt.model
        self.tokenizer = wrap_tokenizer(rt.tokenizer)
        self.rt = rt
        self.curve = rt.draft.curve or curve_for(rt.model)
        self.drafts = rt.plan().drafting
        self.max_batch = max_batch if max_batch > 1 and can_batch(rt.model) else 1
        self.trees = batch_drafts and self.max_batch > 1 and can_batch_trees(rt)
        self.gain = DraftGain(self.curve)
        self.batch_gain = BatchGain(self.curve)
        self.rows: List[Row] = []
        self.by_uid = {}
        self.gen = None  # BatchGenerator, or BatchSteps where the batch drafts
        self.batch_listeners: List[Callable[[BatchSteps], None]] = []
        self.joining: list = []  # (row, cache, held) of long prompts prefilled a chunk a step before they join
        self._failed: Finished = []  # rows that failed since the last reap (already told)

    @property
    def active(self) -> int:
        return len(self.rows)

    def capacity(self, wanting: int) -> int:
        """Rows to decode when ``wanting`` requests are in: all of them (up to
        ``max_batch``) where batching pays, else one. Drafting's gain alone
        is weighed against what drafting gains inside the batch."""
        n = min(wanting, self.max_batch)
        alone = self.gain.value if self.drafts else 1.0
        inside = self.batch_gain.value if self.trees else 1.0
        return n if batch_pays(self.curve, n, alone / inside) else 1

    def admit(self, jobs) -> None:
        """New rows: alone when nothing else decodes, else into the batch (a
        row alone already moves there at the next step)."""
        alone = not self.rows and len(jobs) == 1
        for job in jobs:
            row = Row(job, self.tokenizer)
            self.rows.append(row)
            try:
                cache, reused, held = self.engine.cache_for(job)
                row.begin(reused)
                if alone:
                    plan = self.rt.plan(job.params.grammar is not None)
                    row.start_alone(self.model, plan, cache, job.ids[held:], job.ids[:held], self.gain.add)
                else:
                    self._insert(row, cache, held)
            except Exception as e:
                self._fail(row, e)

    # ------------------------------------------------------------------ a step

    def step(self) -> Tuple[Finished, int]:
        """One step of every row: the one alone (one step of its loop, all its
        accepted tokens) and the batch (each row's accepted drafts and its own
        token; one token each when it decodes plainly, after the prefill of
        rows joining)."""
        self._rebalance()
        advanced = 0
        for row in [r for r in self.rows if r.alone]:
            self._guarded(row, row.step_alone)
            advanced += 1
        if self.gen is not None and self.by_uid:
            advanced += self._tree_step() if self.trees else self._batch_step()
        if self.joining:
            row = self.joining[0][0]
            self._guarded(row, self._prefill_chunk)
        return self._reap(), advanced

    def _batch_step(self) -> int:
        tic = time.perf_counter()
        try:
            _, responses = self.gen.next()
        except Exception as e:  # the batch is lost: its rows fail, a new one starts with the next row
            self._lose_batch(e)
            return 0
        seconds = time.perf_counter() - tic
        for r in responses:
            row = self.by_uid.get(r.uid)
            if row is not None and not row.done and not row.job.cancelled.is_set():
                self._guarded(row, lambda: row.push(r.token, seconds))
        return len(responses)

    def _tree_step(self) -> int:
        """One step of the drafting batch: each row's tokens through its text path."""
        batch = self.gen
        try:
            steps = batch.step()
        except Exception as e:
            self._lose_batch(e)
            return 0
        self.batch_gain.add(sum(len(st.tokens) for st in steps), len(steps), batch.last_width)
        for handle, st in zip(list(batch.rows), steps):
            row = self.by_uid.get(handle)
            if row is not None and not row.done and not row.job.cancelled.is_set():
                self._guarded(row, lambda: row.push_step(st))
        for listener in self.batch_listeners:
            listener(batch)
        return len(steps)

    def _lose_batch(self, error: BaseException) -> None:
        """The batch is lost: its rows fail, a new one starts with the next row."""
        for row in list(self.by_uid.values()):
            self._fail(row, error)
        self.gen, self.by_uid = None, {}

    def _rebalance(self) -> None:
        """Move the row alone into the batch when others are active; move a
        row left alone in the batch back to drafting where what drafting
        saves on its remaining tokens (``1 - 1/d`` plain steps a token)
        outweighs the switch (``SWITCH_STEPS``)."""
        alone = [r for r in self.rows if r.alone]
        if alone and len(self.rows) > 1 and alone[0].switchable:
            row = alone[0]
            self._guarded(row, lambda: self._insert(row, *row.leave_alone()))
        elif len(self.rows) == 1 and self.by_uid and self.drafts:
            row, d = self.rows[0], self.gain.value
            pays = row.remaining() * (1 - 1 / d) > SWITCH_STEPS
            if pays and row.switchable and row.job.params.grammar is None and not row.done:
                self._guarded(row, lambda: self._to_alone(row))

    def _insert(self, row: Row, cache, held: int) -> None:
        """Put ``row`` into the batch: ``cache`` holds its first ``held`` known tokens, the rest is prefilled."""
        if cache is None:
            cache, held = make_prompt_cache(self.model), 0
        if self.trees:  # a drafting batch's row keeps its sources' caches (an MTP head's, a draft model's)
            self._insert_tree(row, cache, held)
            return
        # A cache a row drafted in may end with an MTP head's or a draft
        # model's caches: a plain batch decodes with the model's alone.
        cache = cache[: target_size(self.model)]
        if self.gen is None:
            self.gen = BatchGenerator(
                self.model,
                completion_batch_size=self.max_batch,
                prefill_batch_size=self.max_batch,
                prefill_step_size=PREFILL_STEP,
            )
        known, p = row.known, row.job.params
        (row.uid,) = self.gen.insert(
            [known[held:]],
            max_tokens=[row.remaining() + 2],  # past the text path's own end: it ends the row
            caches=[cache],
            all_tokens=[known[:held]],
            samplers=[row_sampler(p.sampling, p.seed)],
            logits_processors=[row_processors(p.grammar, row.job.ids)],
        )
        self.by_uid[row.uid] = row

    def _insert_tree(self, row: Row, cache, held: int) -> None:
        """Into the drafting batch: a new request's prompt is prefilled there
        and its first token sampled; a reply under way goes on from its next
        token (the last one known). A prompt longer than ``PREFILL_STEP``
        waits in :attr:`joining` and is prefilled a chunk a step
        (:meth:`_prefill_chunk`), so that the rows decoding go on meanwhile,
        as ``BatchGenerator`` interleaves prefill chunks with its steps."""
        if len(row.known) - 1 - held > PREFILL_STEP:  # its chunks feed the model's caches alone: its sources start anew
            self.joining.append((row, cache[: target_size(self.model)], held))
            return
        if self.gen is None:
            self.gen = BatchSteps(self.model, self.rt.draft, self.curve, live=self.live_cost)
        known, plan = row.known, row_plan(row.job.params)
        if row.generated:
            row.uid, first = self.gen.add(
                cache, known[held:-1], plan, history=known[:held], g0=known[-1], reply=row.generated
            )
        else:
            row.uid, first = self.gen.add(cache, known[held:], plan, history=known[:held])
        self.by_uid[row.uid] = row
        if first is not None:
            row.push_step(first)

    def _prefill_chunk(self) -> None:
        """``PREFILL_STEP`` more tokens of the oldest joining row's prompt into
        its cache; it joins once one chunk or less is left."""
        row, cache, held = self.joining.pop(0)
        if row.done or row.job.cancelled.is_set():
            return
        feed(prefill_forward(self.model), cache, mx.array(row.known[held : held + PREFILL_STEP], mx.int32))
        self._guarded(row, lambda: self._insert_tree(row, cache, held + PREFILL_STEP))

    def _leave_batch(self, row: Row):
        """Take ``row`` out of the batch; its KV cache (None: none came back)."""
        uid, row.uid = row.uid, None
        self.by_uid.pop(uid, None)
        if self.gen is None:
            return None
        if self.trees:
            return self.gen.remove(uid) if uid in self.gen.rows else None
        caches = self.gen.remove([uid], return_prompt_caches=True)
        return caches[uid][0] if uid in caches else None

    def _to_alone(self, row: Row) -> None:
        known = row.known
        cache, held = trim_to_known(self._leave_batch(row), known)
        if cache is None:
            cache = make_prompt_cache(self.model)
        plan = self.rt.plan(row.job.params.grammar is not None)
        row.start_alone(self.model, plan, cache, known[held:], known[:held], self.gain.add)

    def _take(self, row: Row):
        """End ``row``'s decoding; its KV cache (None: none to keep)."""
        self.joining = [j for j in self.joining if j[0] is not row]  # its prompt's part prefilled: not kept
        cache = self._leave_batch(row) if row.uid is not None else row.cache
        row.close()
        return cache

    # ------------------------------------------------------------------ rows that end

    def _reap(self) -> Finished:
        finished, self._failed = self._failed, []
        for row in [r for r in self.rows if r.done or r.job.cancelled.is_set()]:
            self.rows.remove(row)
            try:
                self.engine.finish(row, self._take(row))
                finished.append((row.job, row.res))
            except Exception as e:
                tell(row.job, "error", e)
                finished.append((row.job, None))
        return finished

    def _guarded(self, row: Row, fn) -> None:
        try:
            fn()
        except Exception as e:
            self._fail(row, e)

    def _fail(self, row: Row, error: BaseException) -> None:
        """``row`` failed: out of the batch, told, nothing of it cached."""
        if row not in self.rows:
            return
        self.rows.remove(row)
        try:
            self._take(row)
        except Exception:
            pass  # the batch itself failed
        tell(row.job, "error", error)
        self._failed.append((row.job, None))

    def fail(self, error: BaseException) -> Finished:
        """Every row failed (a step raised where it should not): all are told."""
        for row in list(self.rows):
            self._fail(row, error)
        self.gen, self.by_uid, self.joining = None, {}, []
        finished, self._failed = self._failed, []
        return finished
