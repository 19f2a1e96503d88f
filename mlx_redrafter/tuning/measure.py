"""Timed generation on token ids: the measuring core of ``sweep`` and
``bench/``. It runs on tiny random models without a tokenizer; prompts are
templated into ids by :mod:`mlx_redrafter.prompts`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..config import DraftConfig
from ..generate import generate_tokens
from ..step.protocol import StepStats

PHASES = ("draft", "pack", "verify", "accept", "other")


@dataclass
class Run:
    """One greedy generation and its timings (seconds)."""

    tokens: List[int]
    steps: List[StepStats]  # steps[0] is the prefill (+ the first draft)
    wall_time: float
    peak_memory: int  # bytes, mx.get_peak_memory() over this generation

    @property
    def ttft(self) -> float:
        """Time to the first token."""
        return self.steps[0].step_time if self.steps else self.wall_time

    @property
    def decode_tokens(self) -> int:
        return max(len(self.tokens) - 1, 0)

    @property
    def decode_time(self) -> float:
        return max(self.wall_time - self.ttft, 0.0)

    def step_tokens(self) -> List[Tuple[int, StepStats]]:
        """``(tokens emitted, stats)`` of each decode step. The last step may
        be cut by ``max_tokens`` or EOS; a step that emitted nothing is left out."""
        left = self.decode_tokens
        out = []
        for s in self.steps[1:]:
            n = min(1 + s.accepted, left)
            left -= n
            if n > 0:
                out.append((n, s))
        return out

    def token_latencies(self) -> List[float]:
        """Per-token latency: each decode step's time shared by the tokens it emitted."""
        return [s.step_time / n for n, s in self.step_tokens() for _ in range(n)]


def measure(
    model,
    prompt: Sequence[int],
    *,
    draft: Optional[DraftConfig] = None,
    max_tokens: int = 128,
    eos_ids: Sequence[int] = (),
    timings: bool = False,
    temp: float = 0.0,
    top_p: float = 0.0,
) -> Run:
    """Generate from token ids (greedy unless ``temp > 0``) and time it.

    ``draft=None`` (or one that drafts nothing: no drafter, no lookup) is plain mlx-lm decoding:
    ``generate_tokens`` then runs mlx-lm's own ``generate_step`` on the same
    model object, not our loop.
    """
    mx.reset_peak_memory()
    tic = time.perf_counter()
    tokens, steps = generate_tokens(
        model,
        list(prompt),
        draft=draft,
        max_tokens=max_tokens,
        eos_ids=eos_ids,
        temp=temp,
        top_p=top_p,
        timings=timings,
    )
    wall = time.perf_counter() - tic
    return Run(tokens, steps, wall, mx.get_peak_memory())


@dataclass
class Pass:
    """One configuration (the baseline or one cell) over every prompt."""

    runs: List[Run]

    @property
    def peak_memory(self) -> int:
        return max((r.peak_memory for r in self.runs), default=0)

    @property
    def decode_time(self) -> float:
        return sum(r.decode_time for r in self.runs)

    @property
    def tokens_per_s(self) -> float:
        """Decoding throughput over every prompt (the prefill left out: it is
        the same work for every way of decoding)."""
        secs = self.decode_time
        return sum(r.decode_tokens for r in self.runs) / secs if secs > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per decode step (1 for plain decoding)."""
        emitted = [n for r in self.runs for n, _ in r.step_tokens()]
        return sum(emitted) / len(emitted) if emitted else 0.0


def run_pass(
    model,
    prompts,
    draft: Optional[DraftConfig],
    *,
    max_tokens: int,
    eos_ids: Sequence[int] = (),
    temp: float = 0.0,
    top_p: float = 0.0,
    seed: int = 0,
    timings: bool = False,
    tick: Optional[Callable[[], None]] = None,
) -> Pass:
    """Measure every prompt once (prompt ``i`` sampled from ``seed + i`` when
    ``temp > 0``, the same draws for every pass); ``tick()`` after each.
    ``timings`` splits the steps of a drafting pass into phases."""
    from ..step.plan import asks

    drafting = asks(draft)
    runs = []
    for i, p in enumerate(prompts):
        if temp > 0:
            mx.random.seed(seed + i)
        runs.append(
            measure(
                model,
                p,
                draft=draft,
                max_tokens=max_tokens,
                eos_ids=eos_ids,
                timings=timings and drafting,
                temp=temp,
                top_p=top_p,
            )
        )
        if tick:
            tick()
    return Pass(runs)


def warm_up(model, prompt, draft: DraftConfig) -> None:
    """One short untimed generation each way: the first call in a process
    pays for allocations and kernel set-up that later calls do not."""
    measure(model, prompt, max_tokens=4)
    measure(model, prompt, draft=draft, max_tokens=4)


def time_split_ms(steps: List[StepStats]) -> Dict[str, float]:
    """Mean milliseconds per step in draft / pack / verify / accept, and the
    rest of the step ("other": host sync, cache bookkeeping, Python)."""
    if not steps:
        return {k: 0.0 for k in PHASES}
    n = len(steps)
    out = {
        "draft": sum(s.draft_time for s in steps),
        "pack": sum(s.pack_time for s in steps),
        "verify": sum(s.verify_time for s in steps),
        "accept": sum(s.accept_time for s in steps),
    }
    out["other"] = max(sum(s.step_time for s in steps) - sum(out.values()), 0.0)
    return {k: 1000 * v / n for k, v in out.items()}
