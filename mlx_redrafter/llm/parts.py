"""The parts of an mlx-lm model that ReDrafter calls, and taps on its layers.

:func:`model_parts` splits a causal LM into ``(embed, backbone, head)``, so
that one backbone call gives both the hidden states the drafter reads and
the logits verification reads. :func:`context_limit` is the model's context.

Hidden states of intermediate layers are captured without modifying the
model. EAGLE-3 feeds its draft head a fusion of a low, a middle and the last layer's
hidden states. :func:`capture_layers` wraps chosen layer modules of an mlx-lm
model for the length of a ``with`` block; each wrapped layer records its
output, and the block yields the records. The model's code and weights are
untouched (as :mod:`~mlx_redrafter.step.verify` hooks RoPE), so any mlx-lm decoder works.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..errors import RedrafterError


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
    return backbone_of(model)[0].layers


def check_layers(model, layers: Sequence[int]) -> None:
    n = len(_layer_list(model))
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise RedrafterError(
            f"Feature layers {bad} do not exist: the model has layers 0-{n - 1}.",
            "Pick layer indices inside that range.",
        )


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


def backbone_of(model: nn.Module):
    """``(backbone, embedding)`` of an mlx-lm causal LM: the module holding its
    decoder layers (``model.model``, or ``model.backbone`` as in Nemotron-H and
    Mamba2) and its token embedding (``embed_tokens`` or ``embeddings``)."""
    for name in ("model", "backbone"):
        backbone = getattr(model, name, None)
        if isinstance(backbone, nn.Module) and isinstance(getattr(backbone, "layers", None), list):
            embed = getattr(backbone, "embed_tokens", None) or getattr(backbone, "embeddings", None)
            if embed is not None:
                return backbone, embed
    raise RedrafterError(
        f"Model type {type(model).__module__} has no decoder layers with a token embedding "
        "(`model.embed_tokens`); ReDrafter needs a decoder-only LM."
    )


class _Given(nn.Module):
    """Stands in for a model's backbone: returns the hidden states it is given."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.hidden = inner, None

    def __call__(self, *args, **kwargs):
        return self.hidden

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)


def model_head(model: nn.Module, backbone: nn.Module):
    """``head(hidden) -> logits``: whatever the model's own ``__call__`` does
    after its backbone (an ``lm_head`` or the tied embedding, logit scaling
    (Granite 4, Falcon-H1), soft-capping (Gemma)), run by calling the model
    with its backbone swapped for one that returns ``hidden``."""
    holder, key = next(
        (m, k) for _, m in model.named_modules() for k, child in m.children().items() if child is backbone
    )
    given = _Given(backbone)
    dummy = mx.zeros((1, 1), mx.int32)

    def head(hidden):
        given.hidden = hidden
        setattr(holder, key, given)
        try:
            return model(dummy)
        finally:
            setattr(holder, key, backbone)
            given.hidden = None

    return head


def model_parts(model: nn.Module, feature_layers=None):
    """``(embed_tokens, backbone, head)`` of an mlx-lm causal LM.

    ``backbone(tokens, cache)`` returns post-norm hidden states and
    ``head(hidden)`` returns logits, exactly as the model computes them
    (:func:`model_head`). One backbone call gives both hidden states and logits.
    With ``feature_layers`` (a fused drafter's), the backbone returns those
    layers' outputs followed by the post-norm state, ``[..., (n+1)*h]``, and
    the head reads the last ``h`` of it.
    """
    backbone, embed = backbone_of(model)
    head = model_head(model, backbone)
    if feature_layers:
        backbone, head = _fused(model, backbone, head, list(feature_layers))
    return embed, backbone, head


def _fused(model, backbone, head, layers):
    """A backbone that also returns ``layers``' outputs (:func:`capture_layers`), and the head for it."""
    check_layers(model, layers)
    width = hidden_size(model)

    def fused_backbone(tokens, cache=None):
        with capture_layers(model, layers) as taps:
            last = backbone(tokens, cache=cache)
        return mx.concatenate([taps[i] for i in layers] + [last], axis=-1)

    return fused_backbone, lambda x: head(x[..., -width:])


def text_args(model):
    """The args of the model's language part: ``model.args``, or for a model
    that wraps one (Qwen3.5's ``language_model``) that one's."""
    inner = getattr(model, "language_model", None)
    return getattr(inner, "args", None) or getattr(model, "args", None)


def hidden_size(model) -> int:
    """The width of the model's hidden states."""
    return int(text_args(model).hidden_size)


def context_limit(model) -> Optional[int]:
    """The model's context in tokens (``max_position_embeddings``), if it says."""
    return getattr(text_args(model), "max_position_embeddings", None)
