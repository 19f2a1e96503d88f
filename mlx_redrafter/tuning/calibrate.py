"""Measure this device's verify-cost curve c(N) (:mod:`~mlx_redrafter.step.curve`)
and its batched-decoding gains in a short calibration: ``doctor --calibrate``
and ``sweep --save-profile`` run it."""

from __future__ import annotations

import random
import time
from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..llm.recurrent import kv_leaves, recurrent_states, restore_states
from ..step.curve import BATCH_SIZES, BUCKET_SIZES, CONTEXT_TOKENS, LONG_CONTEXT_TOKENS, MAX_SIZE, CostCurve, curve_key

BASE_REPEATS = 3  # N = 1 bursts per round


def _tree_for(n: int):
    """A tree of ``n`` tokens shaped like the loop's: g0, then rows of up to 4 tokens."""
    from ..step.tree import Tree, layout

    tokens = mx.arange(n, dtype=mx.int32) % 100 + 1
    if n == 1:
        return Tree(tokens, mx.zeros((1,), mx.int32), None, None, mx.ones((1, 1), mx.bool_))
    rows, left = [], n - 1
    while left > 0:
        rows.append(min(4, left))
        left -= rows[-1]
    lay = layout(tuple(rows))
    return Tree(tokens, lay.depth, lay.parent, lay.node_index, lay.mask, levels=max(rows) + 1, host=lay.host)


class _Timer:
    """Pipelined forwards over ``n`` tokens, like the loop: build the next
    call, queue it, then wait for the last. The call left in flight at the
    end of a burst is waited for by the next burst's first, untimed wait,
    so no burst drains the device and none pays for another's shape."""

    def __init__(self, model, backbone, head, cache, rewind):
        self.model, self.backbone, self.head, self.cache, self.rewind = model, backbone, head, cache, rewind
        self.pending = None

    def call(self, n: int, tree) -> mx.array:
        from ..step.verify import tree_hooks

        tokens = tree.tokens[None]
        if n == 1:
            hidden = self.backbone(tokens, cache=self.cache)[0]
        else:
            with tree_hooks(self.model, self.cache, tree):
                hidden = self.backbone(tokens, cache=self.cache)[0]
        out = mx.argmax(self.head(hidden), axis=-1).astype(mx.int32)
        self.rewind()
        return out

    def shape(self, n: int):
        """What a call of size ``n`` needs, built before it is timed."""
        return _tree_for(n)

    def burst(self, n: int, calls: int) -> float:
        """Mean seconds per call over ``calls`` timed calls of size ``n``."""
        shape = self.shape(n)
        times = []
        for i in range(calls + 1):
            tic = time.perf_counter()
            following = self.call(n, shape)
            mx.async_eval(following)
            if self.pending is not None:
                self.pending.tolist()
            self.pending = following
            if i:  # the first wait is for the previous burst's call
                times.append(time.perf_counter() - tic)
        return float(np.mean(times)) if times else 0.0

    def drain(self) -> None:
        if self.pending is not None:
            self.pending.tolist()
        self.pending = None


class _BatchTimer(_Timer):
    """Pipelined plain decoding steps of ``n`` sequences at once (mlx-lm's
    ``BatchKVCache``, as ``serve`` batches), each after the same context."""

    def __init__(self, model, cache):
        super().__init__(model, None, None, cache, None)
        self.batches = {}

    def shape(self, n: int):
        if n not in self.batches:
            merged = [c.merge([c] * n) for c in self.cache]
            self.batches[n] = (merged, recurrent_states(merged))
        return self.batches[n]

    def call(self, n: int, batch) -> mx.array:
        cache, states = batch
        logits = self.model(mx.ones((n, 1), mx.int32), cache=cache)
        for c in kv_leaves(cache):  # rewind: every call sees the same context
            c.trim(1)
        restore_states(cache, states)  # a recurrent state is replaced by each call, never written in place
        return mx.argmax(logits[:, -1], axis=-1)


def _context_cache(model, backbone, tokens: int):
    """A cache holding ``tokens`` positions, and a function that rewinds it
    there. Only the length matters to the timing, so the keys and values
    are random rows after one real token: no prefill (a 4-bit model on a
    CPU would spend most of the budget on it)."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..llm.cache import rewinder

    cache = make_prompt_cache(model)
    mx.eval(backbone(mx.array([[1]]), cache=cache))
    for c in kv_leaves(cache):  # recurrent layers' states are as large after one token as after many
        b, h, _, d = c.keys.shape
        rows = mx.random.normal((b, h, tokens - 1, d)).astype(c.keys.dtype)
        c.update_and_fetch(rows, rows)
        mx.eval(c.keys, c.values)
    return cache, rewinder(cache)


def _sample_order(sizes) -> list:
    """Bucket sizes first (step/select.py's BUCKETS), so a slow device that runs
    out of budget has measured the sizes the selection uses."""
    first = [n for n in BUCKET_SIZES if n in sizes]
    return first + [n for n in sizes if n not in first]


def _fill(sizes, ratios: Dict[int, float]) -> Tuple[float, ...]:
    """c(N) at every size: measured where there is one, else interpolated
    linearly between measured sizes (past the last, its slope continues;
    with N = 1 alone, c(N) = N, which makes drafting never pay)."""
    known = sorted(ratios)
    if len(known) == 1:
        return tuple(float(n) for n in sizes)
    out = []
    for n in sizes:
        if n in ratios:
            out.append(ratios[n])
        elif n > known[-1]:
            slope = (ratios[known[-1]] - ratios[known[-2]]) / (known[-1] - known[-2])
            out.append(ratios[known[-1]] + max(slope, 0.0) * (n - known[-1]))
        else:
            out.append(float(np.interp(n, known, [ratios[k] for k in known])))
    return tuple(out)


def measure_curve(
    model,
    model_spec: Optional[str] = None,
    max_size: int = MAX_SIZE,
    budget_s: float = 30.0,
    calls: int = 2,
    max_rounds: int = 15,
    context: int = CONTEXT_TOKENS,
    seed: int = 0,
    long_context: int = LONG_CONTEXT_TOKENS,
    long_share: float = 1 / 3,
    batch_s: Optional[float] = None,
) -> CostCurve:
    """Measure c(N) for ``N = 1..max_size`` in at most about ``budget_s`` seconds,
    then the batch curve (:func:`measure_batch`) in ``batch_s`` more (None: a
    quarter of ``budget_s``; 0: not measured, the built-in gains serve).

    Each round times a short pipelined burst of every size, in a new random
    order (so drift and other processes on the machine hit every size
    alike), with ``BASE_REPEATS`` bursts of N = 1. c(N) is the median over
    rounds of each size's time divided by that round's N = 1 time (the
    median of its N = 1 bursts, so one disturbed burst does not skew a
    round). No burst starts that would end past the budget: on a slow
    device the sizes never timed are interpolated (``CostCurve.measured``
    lists those that were).

    Attention over a long context makes every extra token dearer (on this
    CPU c(7) is 1.8 after 220 tokens, 2.1 after 1024, 2.8 after 2048), so
    ``long_share`` of the budget measures the bucket sizes again after
    ``long_context`` tokens (0, or a model whose context is shorter: not
    measured); :meth:`CostCurve.at` interpolates between the two.
    """
    from ..llm.parts import context_limit
    from ..step.verify import install_tree_hooks

    if max_size < 1:
        raise ValueError(f"max_size must be at least 1 (got {max_size})")
    sizes = list(range(1, max_size + 1))
    install_tree_hooks(model)
    limit = context_limit(model)
    if long_context and limit and long_context + max_size > limit:
        long_context = 0
    short_s = budget_s * (1 - long_share) if long_context else budget_s
    rng = random.Random(seed)
    ratios, rounds, base_ms = _measure_at(model, context, sizes, short_s, calls, max_rounds, rng)
    long_costs = ()
    if long_context:
        long_sizes = [n for n in sizes if n in BUCKET_SIZES]
        long_ratios, _, _ = _measure_at(model, long_context, long_sizes, budget_s - short_s, calls, max_rounds, rng)
        if len(long_ratios) > 1:
            long_costs = _fill(sizes, long_ratios)
        else:
            long_context = 0
    batch_s = budget_s / 4 if batch_s is None else batch_s
    gains = measure_batch(model, budget_s=batch_s, context=context, calls=calls, max_rounds=max_rounds, rng=rng)
    device, ident, variant = curve_key(model, model_spec)
    return CostCurve(
        _fill(sizes, ratios),
        device,
        ident,
        variant,
        base_ms=base_ms,
        source=f"measured {time.strftime('%Y-%m-%d %H:%M')}, {rounds} rounds of {calls} calls",
        rounds=rounds,
        measured=tuple(sorted(ratios)),
        context=context,
        long_costs=long_costs,
        long_context=long_context,
        batch_sizes=tuple(sorted(gains)),
        batch_gains=tuple(gains[n] for n in sorted(gains)),
    )


def measure_batch(
    model,
    sizes=BATCH_SIZES,
    budget_s: float = 8.0,
    context: int = CONTEXT_TOKENS,
    calls: int = 2,
    max_rounds: int = 15,
    rng=None,
) -> Dict[int, float]:
    """``{batch size: gain}``: plain batched decoding's aggregate tokens/s at
    each size over one sequence's (``size / t(size) * t(1)``), after
    ``context`` cached tokens, in at most about ``budget_s`` seconds. As for
    c(N): every round times a burst of each size in a new random order, and
    a size's gain is its median over the rounds (sizes never timed are left
    out; fewer than two sizes timed: ``{}``)."""
    from ..llm.parts import model_parts

    _, backbone, _ = model_parts(model)
    cache, _ = _context_cache(model, backbone, context)
    timer = _BatchTimer(model, cache)
    rng = rng or random.Random(0)
    deadline = time.perf_counter() + budget_s
    guess: Dict[int, float] = {}
    for n in sizes:  # first calls of every shape: kernels and allocations
        tic = time.perf_counter()
        if tic + 2 * guess.get(max(guess, default=0), 0.0) * n >= deadline:
            break
        timer.burst(n, 0)
        timer.drain()
        guess[n] = time.perf_counter() - tic
    raw: Dict[int, list] = {n: [] for n in guess if n != 1}
    for _ in range(max_rounds if 1 in guess else 0):
        order = list(guess)
        rng.shuffle(order)
        if time.perf_counter() + sum(guess[n] * (calls + 1) for n in order) >= deadline:
            break
        times = {n: timer.burst(n, calls) for n in order}
        for n in raw:
            raw[n].append(n * times[1] / times[n])
    timer.drain()
    gains = {n: float(np.median(r)) for n, r in raw.items() if r}
    return {1: 1.0, **gains} if gains else {}


def _measure_at(model, context: int, sizes, budget_s: float, calls: int, max_rounds: int, rng):
    """``(ratios, rounds, base_ms)``: c(N) of the sizes timed after ``context`` cached tokens."""
    from ..llm.parts import model_parts

    _, backbone, head = model_parts(model)
    cache, rewind = _context_cache(model, backbone, context)
    timer = _Timer(model, backbone, head, cache, rewind)
    deadline = time.perf_counter() + budget_s
    guess: Dict[int, float] = {}  # seconds per call, from the first call of each shape

    def fits(n: int, k: int) -> bool:
        # An untimed size is guessed from the largest timed one, scaled by size (as a quantized CPU model grows).
        top = max(guess, default=None)
        per_call = guess[n] if n in guess else (guess[top] * n / top if top else 0.0)
        return time.perf_counter() + per_call * k < deadline

    for n in _sample_order(sizes):  # first calls of every shape: kernels and allocations
        if not fits(n, 2):
            break
        tic = time.perf_counter()
        timer.burst(n, 0)
        timer.drain()
        guess[n] = time.perf_counter() - tic
    raw: Dict[int, list] = {n: [] for n in guess}
    rounds = 0
    while rounds < max_rounds and 1 in guess:
        order = [n for n in guess if n != 1] + [1] * BASE_REPEATS
        rng.shuffle(order)
        times: Dict[int, list] = {}
        for n in order:
            if fits(n, calls + 1):
                times.setdefault(n, []).append(timer.burst(n, calls))
        if 1 not in times or len(times) == 1:
            break
        base = float(np.median(times.pop(1)))
        for n, t in times.items():
            raw[n].append(t[0] / base)
        raw[1].append(base)
        rounds += 1
    timer.drain()
    # No size verifies for less than one token does (a lower ratio is noise: another process slowed N = 1).
    ratios = {1: 1.0, **{n: max(1.0, float(np.median(r))) for n, r in raw.items() if n != 1 and r}}
    base_ms = 1000 * float(np.median(raw[1])) if raw.get(1) else 1000 * guess.get(1, 0.0)
    return ratios, rounds, base_ms
