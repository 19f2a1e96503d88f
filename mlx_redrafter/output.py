"""What a generation outputs: the response per token, stop strings, and what is counted over a stream.

:class:`RedrafterResponse` is mlx-lm's ``GenerationResponse`` plus the step's
stats; :class:`StopMatcher` ends streamed text exactly at a stop string;
:class:`Tally` totals a stream (the chat's, the server's and the CLI's
speed lines).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from mlx_lm.generate import GenerationResponse

from .step.protocol import StepStats


@dataclass
class RedrafterResponse(GenerationResponse):
    """mlx-lm's ``GenerationResponse`` plus the ReDrafter stats of the step
    that produced ``token``."""

    stats: StepStats = field(default_factory=StepStats)
    # Structured output only: True on the last response when the output ended
    # (max_tokens, a stop string) before its grammar was complete, so the
    # JSON will not parse.
    incomplete: bool = False


class StopMatcher:
    """Finds stop strings in streamed text and holds back what could start one."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.pending = ""

    def feed(self, text: str):
        """``(text_to_emit, stopped)``."""
        self.pending += text
        if not self.stop:
            out, self.pending = self.pending, ""
            return out, False
        hits = [self.pending.find(s) for s in self.stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        keep = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Tally:
    """Totals over a stream of responses: tokens, steps, accepted drafts, speed."""

    tokens: int = 0
    steps: int = 0
    drafted_tokens: int = 0
    lookup_tokens: int = 0  # the part of drafted_tokens that came from lookup beams
    tree_tokens: int = 0  # tokens verified, summed over the steps (g0 included)
    datastore_tokens: int = 0  # the part that came from datastore rows
    datastore_steps: int = 0  # steps that accepted datastore tokens
    # Accepted draft tokens of the other sources: "drafter", "mtp", "draft-model", "eagle3", "dflash".
    source_tokens: dict = field(default_factory=dict)
    # Governed steps (step/governor.py) by mode: "draft", "plain" (drafting did not pay), "probe".
    modes: dict = field(default_factory=dict)
    plain_rate: float = 0.0  # tokens/s of plain decoding, measured live (0: not measured)
    last: Optional[RedrafterResponse] = None
    _step: int = -1

    def add(self, r: RedrafterResponse) -> bool:
        """Count a response; False for the EOS response, which emits no token."""
        self.last = r
        if r.generation_tokens <= self.tokens:
            return False
        self.tokens = r.generation_tokens
        self.drafted_tokens += int(r.from_draft)
        self.lookup_tokens += int(r.from_draft and r.stats.source == "lookup")
        self.datastore_tokens += int(r.from_draft and r.stats.source == "datastore")
        if r.from_draft and r.stats.source not in ("lookup", "datastore"):
            source = r.stats.source or "drafter"
            self.source_tokens[source] = self.source_tokens.get(source, 0) + 1
        if r.stats.step != self._step:
            self.steps += 1
            self.tree_tokens += r.stats.tree_size
            self._step = r.stats.step
            mode = r.stats.mode
            if mode:
                self.modes[mode] = self.modes.get(mode, 0) + 1
                self.plain_rate = r.stats.plain_rate or self.plain_rate
            self.datastore_steps += int(r.from_draft and r.stats.source == "datastore")
        return True

    def merge(self, other: "Tally") -> None:
        """Add the totals of another stream (e.g. one chat turn) to these."""
        self.tokens += other.tokens
        self.steps += other.steps
        self.drafted_tokens += other.drafted_tokens
        self.lookup_tokens += other.lookup_tokens
        self.tree_tokens += other.tree_tokens
        self.datastore_tokens += other.datastore_tokens
        self.datastore_steps += other.datastore_steps
        for source, n in other.source_tokens.items():
            self.source_tokens[source] = self.source_tokens.get(source, 0) + n
        for mode, n in other.modes.items():
            self.modes[mode] = self.modes.get(mode, 0) + n
        self.plain_rate = other.plain_rate or self.plain_rate
        self.last = other.last or self.last

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(self.steps, 1)

    @property
    def mean_tree_size(self) -> float:
        """Tokens verified per step (1: plain decoding, or g0 alone)."""
        return self.tree_tokens / max(self.steps, 1)

    @property
    def draft_share(self) -> float:
        """The fraction of tokens that came from accepted drafts."""
        return self.drafted_tokens / max(self.tokens, 1)

    @property
    def lookup_share(self) -> float:
        """The fraction of tokens that came from accepted lookup drafts."""
        return self.lookup_tokens / max(self.tokens, 1)

    @property
    def by_source(self) -> dict:
        """Accepted draft tokens per source (``drafter``, ``lookup`` and ``datastore``
        always; ``mtp``, ``draft-model``, ``eagle3``, ``dflash`` when they drafted)."""
        others = {k: n for k, n in self.source_tokens.items() if k != "drafter"}
        drafter = self.source_tokens.get("drafter", 0)
        return {"drafter": drafter, **others, "lookup": self.lookup_tokens, "datastore": self.datastore_tokens}

    def draft_summary(self) -> str:
        """``"40% from drafts"``, split by source when more than the drafter's were accepted."""
        text = f"{self.draft_share:.0%} from drafts"
        if self.lookup_tokens or self.datastore_tokens or set(self.source_tokens) - {"drafter"}:
            parts = [f"{n / max(self.tokens, 1):.0%} {k}" for k, n in self.by_source.items() if n or k != "datastore"]
            text += f" ({', '.join(parts)})"
        return text

    def governor_summary(self) -> str:
        """Whether drafting helped: ``"drafted 40 of 60 steps, 16 plain (drafting
        did not pay), 4 measuring; 1.31x plain decoding (measured live)"``;
        "" when no step was governed."""
        steps = sum(self.modes.values())
        if not steps:
            return ""
        plain, probes = self.modes.get("plain", 0), self.modes.get("probe", 0)
        text = f"drafted {self.modes.get('draft', 0)} of {steps} steps"
        if plain:
            text += f", {plain} plain (drafting did not pay)"
        if probes:
            text += f", {probes} measuring"
        speed = self.vs_plain()
        return text + (f"; {speed}" if speed else "")

    def vs_plain(self) -> str:
        """``"1.31x plain decoding (measured live)"``: the reply's speed over
        plain decoding's as this run's plain steps measured it ("" when none did)."""
        r = self.last
        if self.plain_rate <= 0 or r is None or r.generation_tps <= 0:
            return ""
        return f"{r.generation_tps / self.plain_rate:.2f}x plain decoding (measured live)"

    def summary(self) -> str:
        r = self.last
        if r is None:
            return "no tokens generated"
        governed = self.governor_summary()
        return (
            f"prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tok/s | "
            f"generation: {self.tokens} tokens, {r.generation_tps:.1f} tok/s, "
            f"{self.tokens_per_step:.2f} tokens/step, "
            f"{self.draft_summary()} | "
            + (f"{governed} | " if governed else "")
            + f"peak memory {r.peak_memory:.2f} GB"
        )
