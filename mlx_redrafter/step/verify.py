"""Run a packed draft tree through an unmodified mlx-lm model.

mlx-lm models take no mask argument and apply RoPE with ``cache.offset``. Two
small hooks make them verify a tree:

* **Mask.** Every backbone asks ``cache.make_mask(N, ...)`` for its mask. For
  the verify call only, each layer cache's ``make_mask`` is shadowed by one
  that returns the boolean tree mask ``[N, K + N]`` (the cached prefix, then
  ancestors-or-self; windowed for sliding-window layers).
* **Positions.** Each attention's ``rope`` module is wrapped once. With no
  positions set it passes straight through; during a verify call it moves the
  token axis into the batch axis and passes one offset per token, which
  ``mx.fast.rope`` supports for every RoPE variant.

Keys are cached after RoPE, so the accepted path's rows are moved into place
afterwards (llm/cache.py) without touching their values.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..errors import RedrafterError
from ..llm.cache import cached_length
from ..llm.recurrent import kv_leaves
from .mixers import COVERED_MIXERS, TreeMixer, TreePaths, find_mixers, uncovered_layers

SUPPORTED_ROPES = ("RoPE", "Llama3RoPE", "YarnRoPE", "SuScaledRoPE", "ProportionalRoPE")


class TreeRoPE(nn.Module):
    """Wraps a model's RoPE module; applies per-token positions while a tree is verified.

    ``_depth`` (set): token ``i`` sits at ``offset + depth[i]``, ``offset``
    being the cache's. ``_base`` (set): positions count from this device
    scalar instead of the cache's offset (the pipelined loop's cache holds
    holes, so its offset is not the position).
    """

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.inner = rope
        self._depth: Optional[mx.array] = None
        self._base: Optional[mx.array] = None

    def __call__(self, x, offset=0, **kwargs):
        depth, base = self._depth, self._base
        if base is not None:
            offset = base
        if depth is None:
            return self.inner(x, offset=offset, **kwargs)
        B, H, L, D = x.shape
        if depth.ndim == 2:  # issue 57, a batch of trees (step/batch_verify.py): row b's offset[b] + depth[b]
            y = x.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D)
            y = self.inner(y, offset=(offset[:, None] + depth).reshape(-1), **kwargs)
            return y.reshape(B, L, H, D).transpose(0, 2, 1, 3)
        y = x.transpose(2, 0, 1, 3).reshape(L, B * H, 1, D)
        y = self.inner(y, offset=offset + depth, **kwargs)
        return y.reshape(L, B, H, D).transpose(1, 2, 0, 3)


@dataclass
class TreeHooks:
    """What a model needs to verify a tree: its RoPE wrappers and its recurrent mixers."""

    ropes: List[TreeRoPE]
    mixers: List[Tuple[nn.Module, str, nn.Module]]  # (parent, name, mixer): step/mixers.py


def install_tree_hooks(model: nn.Module) -> TreeHooks:
    """Wrap every attention's ``rope`` (idempotent), find the recurrent mixers,
    and return both.

    Raises a clear error for position schemes and recurrent layers a tree
    cannot use (:func:`tree_support` says so without raising).
    """
    hooks = getattr(model, "_redrafter_hooks", None)
    if hooks is not None:
        return hooks
    problem = tree_support(model)
    if problem:
        raise RedrafterError(problem, "Decode this model without drafting (plain decoding: no drafter and no lookup).")
    ropes = []
    for _, module in model.named_modules():
        rope = module.get("rope") if isinstance(module, nn.Module) else None
        if rope is None or isinstance(rope, TreeRoPE):
            continue
        wrapper = TreeRoPE(rope)
        module.rope = wrapper
        ropes.append(wrapper)
    hooks = TreeHooks(ropes, find_mixers(model))
    object.__setattr__(model, "_redrafter_hooks", hooks)
    return hooks


def tree_support(model: nn.Module) -> Optional[str]:
    """Why ``model`` cannot verify a draft tree (one line naming the layer or
    position type), or None when it can (the answer is kept on the model)."""
    if getattr(model, "_redrafter_hooks", None) is not None:
        return None
    if "_redrafter_no_tree" not in model.__dict__:
        object.__setattr__(model, "_redrafter_no_tree", _why_not(model))
    return model.__dict__["_redrafter_no_tree"]


def _why_not(model: nn.Module) -> Optional[str]:
    uncovered = uncovered_layers(model)
    if uncovered:
        return (
            f"Layers of type {', '.join(uncovered)} keep a recurrent state that tree verification does not cover "
            f"(covered: {', '.join(sorted({name for name, _ in COVERED_MIXERS.values()}))})."
        )
    ropes = [m.get("rope") for _, m in model.named_modules() if isinstance(m, nn.Module) and m.get("rope") is not None]
    for rope in ropes:
        name = type(rope).__name__
        if name not in SUPPORTED_ROPES and not isinstance(rope, TreeRoPE):
            return (
                f"This model uses {name} positions, which tree verification does not support "
                f"(supported: {', '.join(SUPPORTED_ROPES)})."
            )
    # Recurrent layers carry positions: their attention layers may have none (Nemotron-H, Granite 4).
    if not ropes and not find_mixers(model):
        return f"No RoPE modules found in {type(model).__module__}; ReDrafter needs rotary positions."
    return None


def tree_attention_mask(
    tree_mask: mx.array, depth: mx.array, cached: int, window: Optional[int], valid: Optional[mx.array] = None
) -> mx.array:
    """``[N, cached + N]`` bool mask: every cached key, then the tree's ancestors-or-self.

    With a sliding ``window``, a key is visible only if its position is within
    ``window`` of the query's (as in mlx-lm's ``create_causal_mask``).
    ``valid [cached]`` (the pipelined loop's cache, which holds holes): only
    the cached keys marked valid are visible; windows are not supported then.
    """
    n = tree_mask.shape[0]
    if valid is not None:
        if window is not None:
            raise RedrafterError("A cache with holes cannot serve a sliding-window layer.")
        return mx.concatenate([mx.broadcast_to(valid[None], (n, cached)), tree_mask], axis=1)
    prefix = mx.ones((n, cached), dtype=mx.bool_)
    tree = tree_mask
    if window is not None:
        # cached key i sits at relative position i - cached; node q at depth[q].
        rel = mx.arange(cached, dtype=mx.int32)[None, :] - cached
        prefix = rel > (depth[:, None] - window)
        tree = tree & (depth[None, :] > depth[:, None] - window)
    return mx.concatenate([prefix, tree], axis=1)


@contextmanager
def tree_hooks(
    model, cache, tree, base: Optional[mx.array] = None, valid: Optional[mx.array] = None, chain: bool = False
):
    """Inside the block, a model call on ``tree.tokens`` runs as a tree.

    ``base`` and ``valid`` (the pipelined loop): the position of ``g0`` as a
    device scalar, and which cached rows are real tokens. ``chain=True`` (a
    single path) gives consecutive positions from ``base`` without moving
    the token axis. Recurrent mixers run each node from its parent's state
    (step/mixers.py); their states wait in ``pending`` until acceptance.
    """
    hooks = install_tree_hooks(model)
    patched, swapped = [], []
    try:
        for r in hooks.ropes:
            r._depth, r._base = (None if chain else tree.depth), base
        for c in kv_leaves(cache):
            cached = c.offset if valid is not None else cached_length(c)

            def make_mask(N, return_array=False, window_size=None, _cached=cached):
                return tree_attention_mask(tree.mask, tree.depth, _cached, window_size, valid)

            c.make_mask = make_mask  # shadows the class method for this call only
            patched.append(c)
        if hooks.mixers:
            paths = TreePaths.of(tree.mask, tree.depth, levels_of(tree), host_shape(tree, chain))
            for parent, name, mixer in hooks.mixers:
                setattr(parent, name, TreeMixer(mixer, paths))
                swapped.append((parent, name, mixer))
        yield
    finally:
        for r in hooks.ropes:
            r._depth = r._base = None
        for c in patched:
            del c.make_mask
        for parent, name, mixer in swapped:
            setattr(parent, name, mixer)


def host_shape(tree, chain: bool):
    """``(depths, parents)`` of the tree's nodes when the host knows them: a
    single path's always, else what the tree's builder recorded (None: not known)."""
    if chain:
        n = tree.size
        return tuple(range(n)), tuple(range(-1, n - 1))
    return tree.host


def levels_of(tree) -> int:
    """The tree's depth + 1, known on the host (no sync): ``tree.levels`` where
    the tree's builder knew it, else the node count (always enough)."""
    return tree.levels or tree.size


def needs_hooks(model, chain: bool) -> bool:
    """Whether a call over a tree needs :func:`tree_hooks`: always for a tree,
    and for a chain through recurrent layers (their states must be kept per node)."""
    return not chain or len(install_tree_hooks(model).mixers) > 0


def verify(model, backbone, head, cache, tree, chain: bool = False):
    """One forward over ``tree.tokens``: ``(logits [N, V], hidden [N, h])``.

    ``chain=True`` says the tree is a single path (every beam the same, or
    W=1): its positions and mask are the model's own causal ones, so the
    call runs unhooked, like a prefill chunk.
    """
    if not needs_hooks(model, chain):
        hidden = backbone(tree.tokens[None], cache=cache)[0]
        return head(hidden), hidden
    with tree_hooks(model, cache, tree, chain=chain):
        hidden = backbone(tree.tokens[None], cache=cache)[0]
    return head(hidden), hidden
