"""What both step loops share: a step's stats and tokens, the prefill, and the one host read.

The synchronous loop (generate.py) and the pipelined one (pipeline.py) yield
the same :class:`StepTokens`; each reads the device once per step, through
:func:`host_read`, so that a test can check where the loops touch the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import mlx.core as mx

PREFILL_STEP = 512


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
    source: str = ""  # where the accepted drafts came from: "drafter" or "lookup" ("" if none)
    # Phase times in seconds, measured only with profile=True (which adds syncs):
    draft_time: float = 0.0  # beam search for the next step
    pack_time: float = 0.0  # dedup + packing of this step's beams
    verify_time: float = 0.0  # the LLM's tree forward
    accept_time: float = 0.0  # acceptance (a needed KV-cache move runs lazily with the next verify)


@dataclass
class StepTokens:
    tokens: List[int]
    from_draft: List[bool]
    stats: StepStats


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


def prefill(backbone, head, cache, prompt: mx.array):
    """Feed the prompt; return ``(logits, hidden)`` at its last position (lazy)."""
    for start in range(0, prompt.size - 1, PREFILL_STEP):
        chunk = prompt[start : min(start + PREFILL_STEP, prompt.size - 1)]
        backbone(chunk[None], cache=cache)
        mx.eval([c.state for c in cache])
    hidden = backbone(prompt[-1:][None], cache=cache)[0, -1]
    return head(hidden), hidden
