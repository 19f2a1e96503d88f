"""What the exactness tests read of the step loops, in one place: which loop
ran a generation, and the caches a generation leaves when it is stopped.

Everything else the tests do goes through the entry points a generation
runs (``token_steps``, what ``stream_generate`` and ``generate_tokens``
run; ``redrafter_steps``). A refactor of the loops (step/) updates this
module, not the tests: :data:`LOOPS` names each loop by the function
``step/dispatch.py`` calls for it. One skeleton runs two schedules
(step/loop.py): the pipelined loop is its build-ahead schedule; the
synchronous, sourced and constrained loops are its read-then-build
schedule, told apart by their plan (a source with a cache of its own: the
sourced loop; a grammar: the constrained one).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from mlx_redrafter.config import SamplingConfig
from mlx_redrafter.llm.recurrent import kv_leaves, leaves
from mlx_redrafter.step.dispatch import token_steps
from mlx_redrafter.step.plan import make_plan
from mlx_redrafter.step.source import STATES

# Each loop, by the name under which step/dispatch.py calls its schedule.
LOOPS = {
    "pipelined": "ahead_steps",
    "synchronous": "after_read_steps",
    "sourced": "after_read_steps",
    "constrained": "after_read_steps",
}
# float32 on the CPU: a tree's node and plain decoding's same token differ by rounding only.
TOL = dict(atol=1e-4, rtol=1e-4)


@contextmanager
def loops_called():
    """Counts the schedules that start inside the block: ``{function name: calls}``."""
    import mlx_redrafter.step.dispatch as dispatch

    calls: Counter = Counter()
    with pytest.MonkeyPatch.context() as mp:
        for name in sorted(set(LOOPS.values())):
            attr = name
            real = getattr(dispatch, attr)

            def counted(*args, _real=real, _name=name, **kw):
                calls[_name] += 1
                return _real(*args, **kw)

            mp.setattr(dispatch, attr, counted)
        yield calls


def steps_then_close(
    model,
    prompt: Sequence[int],
    draft,
    steps: int,
    *,
    loop: str,
    sampling=None,
    cache=None,
    history=(),
    grammar=None,
    tokens: Optional[int] = None,
):
    """Run a generation's steps (``token_steps``, as ``stream_generate`` does)
    for ``steps`` steps after the first token (or until ``tokens`` are
    emitted), then close it (a loop restores and compacts its caches when
    closed); checks that ``loop`` ran. ``history``: the lookup context before
    the prompt; ``grammar``: a compiled grammar (the constrained loop).
    Returns ``(tokens emitted, step stats, cache)``."""
    cache = make_prompt_cache(model) if cache is None else cache
    sampling = sampling or SamplingConfig()
    plan = make_plan(model, draft, grammar=grammar is not None, cache=cache)
    stateful = any(s.needs == STATES for s in plan.sources)
    kind = "constrained" if grammar is not None else "sourced" if stateful else "synchronous"
    assert loop == "pipelined" or loop == kind, f"the {loop} loop was asked for, the plan makes a {kind} one"
    with loops_called() as calls:
        it = token_steps(
            model, mx.array(prompt, mx.int32), cache, plan=plan, sampling=sampling, history=history, grammar=grammar
        )
        emitted, stats = [], []
        for s in it:
            emitted += s.tokens
            stats.append(s.stats)
            if len(stats) > steps or (tokens is not None and len(emitted) >= tokens):
                break
        it.close()
    assert dict(calls) == {LOOPS[loop]: 1}, f"the {loop} loop was asked for, {dict(calls)} ran"
    return emitted, stats, cache


class PlainStates:
    """The caches plain decoding leaves: ``model`` fed ``prompt``, then each
    of ``tokens`` one at a time, as mlx-lm's ``generate_step`` feeds them;
    every recurrent state is kept at every length."""

    def __init__(self, model, prompt: Sequence[int], tokens: Sequence[int]):
        self.prompt = len(prompt)
        self.cache = make_prompt_cache(model)
        model(mx.array(prompt, mx.int32)[None], cache=self.cache)
        self.states: Dict[int, List[list]] = {0: self._recurrent()}
        for i, t in enumerate(tokens):
            model(mx.array([[t]], mx.int32), cache=self.cache)
            self.states[i + 1] = self._recurrent()
        mx.eval([c.state for c in self.cache])

    def _recurrent(self) -> List[list]:
        states = [list(c.cache) for c in leaves(self.cache) if isinstance(c, ArraysCache)]
        mx.eval(states)
        return states

    def check(self, cache, held: int, where: str) -> None:
        """``cache`` holds the prompt and the first ``held`` tokens exactly as
        plain decoding leaves them: every attention layer's keys and values
        (the valid rows), every recurrent layer's states."""
        mine = list(leaves(cache))
        assert [type(c) for c in mine] == [type(c) for c in leaves(self.cache)], where
        length = self.prompt + held
        for c, r in zip(kv_leaves(cache), kv_leaves(self.cache)):
            assert c.offset == length, f"{where}: {c.offset} tokens cached, plain decoding holds {length}"
            for got, want in ((c.keys, r.keys), (c.values, r.values)):
                a, b = np.array(got[..., :length, :]), np.array(want[..., :length, :])
                assert np.allclose(a, b, **TOL), f"{where}: keys or values differ from plain decoding's"
        recurrent = [c for c in mine if isinstance(c, ArraysCache)]
        for i, (c, want) in enumerate(zip(recurrent, self.states[held])):
            for a, b in zip(c.cache, want):
                if b is None:
                    assert a is None, where
                    continue
                assert a is not None and a.shape == b.shape, f"{where}: recurrent layer {i}'s state has another shape"
                assert np.allclose(np.array(a), np.array(b), **TOL), f"{where}: recurrent layer {i}'s state differs"


def held_tokens(cache, prompt: Sequence[int]) -> Optional[int]:
    """Tokens after the prompt that ``cache`` holds (an attention layer's count)."""
    for c in kv_leaves(cache):
        return c.offset - len(prompt)
    return None


def check_caches(model, prompt, cache, tokens, where: str, states=None, copies: int = 0) -> None:
    """After a closed generation that emitted ``tokens``: the model's caches
    hold the prompt and every emitted token but the last, as plain decoding
    leaves them (keys, values and recurrent states); so do ``copies`` more
    after them (the model itself as its own draft model). ``states``: plain
    decoding's (:class:`PlainStates`) over tokens that these extend."""
    held = held_tokens(cache, prompt)
    assert held == len(tokens) - 1, f"{where}: {held} tokens held after {len(tokens)} emitted"
    states, size = states or PlainStates(model, prompt, tokens[:held]), len(make_prompt_cache(model))
    assert len(cache) >= (1 + copies) * size, where
    for i in range(1 + copies):
        states.check(cache[i * size : (i + 1) * size], held, where + (" (the draft model's caches)" if i else ""))
