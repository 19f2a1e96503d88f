"""The host protocol of the step loop's two schedules (loop.py): the
prefill, the one read per step and what the host rebuilds from it.

Both schedules yield the same :class:`StepTokens`. Each reads the device
once per step, through :func:`host_read`, so that a test can check where
the loop touches the host. What a step reads has one layout, written by
:func:`step_read` and read back by :meth:`StepRead.parse`::

    [n, beam, g0, path (depth + 1), row (depth), codes (tree auto), what sources need read]

``n`` drafts were accepted from row ``beam``; ``g0`` is the LLM's own next
token; ``path`` holds the accepted nodes' indices in the verified tree (0 is
the root), ``row`` the drafted tokens of the accepted row; ``codes`` the
nodes tree auto chose (step/select.py), then what the next step's early
sources need on the host (a controller's depth; their rows, when the tree
is packed: loop.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import mlx.core as mx

from ..llm.cache import PREFILL_STEP, feed  # noqa: F401  (PREFILL_STEP re-exported for the server's batch)


@dataclass
class StepStats:
    """What one ReDrafter step did (``drafter=None``: accepted 0, tree_size 1)."""

    step: int = 0
    accepted: int = 0  # drafted tokens accepted in this step
    tree_size: int = 1  # tokens verified (g0 + packed unique prefixes)
    step_time: float = 0.0  # wall time of the whole step, seconds
    host_syncs: int = 0  # cumulative device->host syncs of the loop
    beam: int = 0  # index of the beam the accepted drafts came from (best first)
    depth: int = 0  # drafted depth verified (beam_length, or the controller's choice)
    source: str = ""  # the label of the source the accepted drafts came from ("" if none): "drafter", "lookup"...
    # Phase times in seconds, measured only with timings=True (which adds syncs):
    draft_time: float = 0.0  # beam search for the next step
    pack_time: float = 0.0  # dedup + packing of this step's beams
    verify_time: float = 0.0  # the LLM's tree forward
    accept_time: float = 0.0  # acceptance (a needed KV-cache move runs lazily with the next verify)
    # A governed step (step/governor.py): "draft" (its sources pay), "plain" (none
    # did: plain decoding), "probe" (measuring an arm); "" ungoverned.
    mode: str = ""
    plain_rate: float = 0.0  # tokens/s of plain decoding as measured live so far (0: not yet)


@dataclass
class StepTokens:
    """What one step emits: its tokens, which of them were drafts, its stats."""

    tokens: List[int]
    from_draft: List[bool]
    stats: StepStats


def first_step(g0: int, elapsed: float, syncs: int) -> StepTokens:
    """Step 0: the token the prompt's logits give (nothing drafted yet)."""
    return StepTokens([g0], [False], StepStats(0, 0, 1, elapsed, syncs))


def step_read(acc, row: mx.array) -> mx.array:
    """The flat int32 array a step's sync reads (see the module doc), from an
    :class:`~mlx_redrafter.step.accept.Accepted` and the accepted row (lazy)."""
    return mx.concatenate([mx.stack([acc.n, acc.beam, acc.next_token]), acc.path, row])


@dataclass
class StepRead:
    """A step's read, on the host (see the module doc for the layout)."""

    n: int  # drafts accepted
    beam: int  # the row they came from
    g0: int  # the LLM's own next token
    path: List[int]  # [depth + 1] tree indices of g0 and the accepted nodes (then padding)
    row: List[int]  # [depth] the accepted row's drafted tokens
    rest: List[int]  # whatever the loop read after the layout

    @classmethod
    def parse(cls, vals: List[int], depth: int) -> "StepRead":
        n, beam, g0 = vals[:3]
        return cls(n, beam, g0, vals[3 : 4 + depth], vals[4 + depth : 4 + 2 * depth], vals[4 + 2 * depth :])

    @classmethod
    def alone(cls, g0: int) -> "StepRead":
        """The read of ``g0`` verified alone (a plain step): nothing accepted, a path of its root."""
        return cls(0, 0, g0, [0], [], [])

    @property
    def emitted(self) -> List[int]:
        """The step's tokens: the accepted drafts, then the LLM's own."""
        return self.row[: self.n] + [self.g0]

    @property
    def in_place(self) -> bool:
        """Whether the accepted nodes already sit in order after ``g0`` (no cache rows to move)."""
        return self.path[: self.n + 1] == list(range(self.n + 1))

    def tokens(
        self, step: int, tree_size: int, elapsed: float, syncs: int, depth: int, labels: Sequence[str]
    ) -> StepTokens:
        """The :class:`StepTokens` of this step; ``labels`` names each row's source."""
        source = labels[self.beam] if self.n else ""
        stats = StepStats(step, self.n, tree_size, elapsed, syncs, self.beam, depth, source=source)
        return StepTokens(self.emitted, [True] * self.n + [False], stats)


def host_read(*arrays: mx.array) -> List[int]:
    """The loop's one sync: read several int arrays in one transfer.

    A single flat int32 array is read as it is. That matters when the next
    step is already queued: a new op here (a concatenation) would wait on
    the stream behind that whole step, and the pipeline would stall.
    """
    if len(arrays) == 1 and arrays[0].ndim == 1 and arrays[0].dtype == mx.int32:
        return arrays[0].tolist()
    flat = mx.concatenate([a.reshape(-1).astype(mx.int32) for a in arrays])
    return flat.tolist()


def prefill(backbone, head, cache, prompt: mx.array, sink=None):
    """Feed the prompt; return ``(logits, hidden)`` at its last position (lazy).

    ``sink(start, hidden)``: called with the hidden states ``[T, F]`` of each
    chunk from prompt position ``start`` (a source that catches up on the
    target's hidden states reads them, loop.py); they are evaluated with the chunk's cache."""
    feed(backbone, cache, prompt[:-1], sink=sink)
    hidden = backbone(prompt[-1:][None], cache=cache)[0]
    if sink is not None:
        sink(prompt.size - 1, hidden)
    return head(hidden[-1]), hidden[-1]
