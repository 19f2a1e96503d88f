"""Hidden states of intermediate LLM layers, captured without modifying the model.

EAGLE-3 feeds its draft head a fusion of a low, a middle and the last layer's
hidden states. :func:`capture_layers` wraps chosen layer modules of an mlx-lm
model for the length of a ``with`` block; each wrapped layer records its
output, and the block yields the records. The model's code and weights are
untouched (as :mod:`.verify` hooks RoPE), so any mlx-lm decoder works.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Sequence

import mlx.core as mx
import mlx.nn as nn

from .errors import RedrafterError


def default_feature_layers(num_layers: int) -> List[int]:
    """A low and a middle layer (EAGLE-3's choice; the last layer's post-norm
    state is always the drafter's context)."""
    return sorted({min(2, num_layers - 1), num_layers // 2})


class _Tap(nn.Module):
    """Calls the wrapped layer and keeps its output in ``store[index]``."""

    def __init__(self, layer, index: int, store: Dict[int, mx.array]):
        super().__init__()
        self.layer, self.index, self.store = layer, index, store

    def __call__(self, x, *args, **kwargs):
        out = self.layer(x, *args, **kwargs)
        self.store[self.index] = out[0] if isinstance(out, tuple) else out
        return out

    def __getattr__(self, name):
        # Models read attributes of their layers (e.g. Gemma's use_sliding).
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)


def _layer_list(model) -> list:
    backbone = getattr(model, "model", None) or getattr(model, "language_model", None)
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, list):
        raise RedrafterError(f"Model type {type(model).__module__} has no `model.layers` list to capture features from.")
    return layers


def check_layers(model, layers: Sequence[int]) -> None:
    n = len(_layer_list(model))
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise RedrafterError(f"Feature layers {bad} do not exist: the model has layers 0-{n - 1}.", "Pick layer indices inside that range.")


@contextmanager
def capture_layers(model, layers: Sequence[int]):
    """``with capture_layers(model, [2, 15]) as store:`` run the model, then
    ``store[2]`` is layer 2's output ``[B, L, h]`` from the last call."""
    check_layers(model, layers)
    container = _layer_list(model)
    store: Dict[int, mx.array] = {}
    originals = {i: container[i] for i in layers}
    try:
        for i, layer in originals.items():
            container[i] = _Tap(layer, i, store)
        yield store
    finally:
        for i, layer in originals.items():
            container[i] = layer


def rms_each(features: mx.array, hidden: int) -> mx.array:
    """``features [..., n*h]`` with each ``h``-wide slice RMS-normalized."""
    shape = features.shape
    x = features.reshape(*shape[:-1], shape[-1] // hidden, hidden).astype(mx.float32)
    x = x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return x.reshape(shape)
