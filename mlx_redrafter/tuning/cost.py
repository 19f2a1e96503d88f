"""Cost of one draft step against one LLM decode step: analytic, and measured.

Batch-1 decoding on any device is a chain of matrix-vector products, so two
numbers describe a step: multiply-accumulates (MACs, one per weight element
used) and the parameter bytes it reads. Both come from shapes alone, so the
same arithmetic serves ``inspect`` and the head-size tables of training
without running anything. Embedding-row lookups (one row per token) are left
out on both sides: they are tiny and the same for every head size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass(frozen=True)
class StepCost:
    macs: int  # multiply-accumulates
    bytes: int  # parameter bytes read

    @property
    def flops(self) -> int:
        return 2 * self.macs


def draft_step_cost(config, itemsize: int = 4) -> StepCost:
    """One draft step for one beam, from a :class:`~mlx_redrafter.draft.redrafter.DrafterConfig`.

    MACs = rnn ``2 h^2`` + input_proj ``2h E`` (when ``E != 2h``) +
    ``num_draft_layers E^2`` + head ``E V_head``; every weight element is used
    once, so the weights read equal the MACs, plus the biases. ``itemsize`` is
    the bytes per parameter (the LLM's dtype: the drafter runs in it).
    """
    h, e, v, n = config.hidden_size, config.exit_dim, config.head_size, config.num_draft_layers
    macs = n * e * e + e * v
    biases = n * e
    if config.rnn:
        macs += 2 * h * h
        biases += h
    if e != 2 * h:
        macs += 2 * h * e
        biases += e
    return StepCost(macs, (macs + biases) * itemsize)


def _module_cost(module: nn.Module) -> StepCost:
    """A layer's MACs (its logical parameter count) and its parameter bytes."""
    from mlx.utils import tree_flatten

    params = [v for _, v in tree_flatten(module.parameters())]
    nbytes = sum(v.nbytes for v in params)
    if hasattr(module, "bits"):  # quantized: packed uint32 weights plus scales/biases
        macs = module.weight.size * 32 // module.bits
        if "bias" in module:
            macs += module.bias.size
        return StepCost(macs, nbytes)
    return StepCost(sum(v.size for v in params), nbytes)


def decode_step_cost(model: nn.Module) -> StepCost:
    """One batch-1 decode step of an mlx-lm model: its non-embedding
    parameters plus the output head ``V x h`` (the input embedding when the
    model ties them), from the actual parameter shapes and dtypes."""
    from mlx.utils import tree_flatten

    from ..llm.parts import model_parts

    embed, _, _ = model_parts(model)
    macs = nbytes = 0
    for _, m in tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)):
        if m is embed:
            continue
        c = _module_cost(m)
        macs, nbytes = macs + c.macs, nbytes + c.bytes
    if "lm_head" not in model:  # tied: the embedding table is the head
        c = _module_cost(embed)
        macs, nbytes = macs + c.macs, nbytes + c.bytes
    return StepCost(macs, nbytes)


def model_dtype(model: nn.Module) -> mx.Dtype:
    """The model's floating-point dtype (that of its scales when quantized)."""
    from ..llm.parts import model_parts

    embed, _, _ = model_parts(model)
    return (embed.scales if "scales" in embed else embed.weight).dtype


# --------------------------------------------------------------------------- measured


def median_ms(fn: Callable[[], None], repeats: int = 20, after: Optional[Callable[[], None]] = None) -> float:
    """Median wall time of ``fn()`` in ms, after one warm-up call; ``after()``
    runs (untimed) after every call, e.g. to rewind a cache."""
    fn()
    if after is not None:
        after()
    ts = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - tic)
        if after is not None:
            after()
    return 1000 * float(np.median(ts))
