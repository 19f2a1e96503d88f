"""Tree verification through recurrent layers (hybrid models), with the layers' own code.

Hybrid models (Qwen3.5, Qwen3-Next, Nemotron-H, Granite 4, Falcon-H1, LFM2...)
interleave attention with layers that keep a recurrent state in an
``ArraysCache``: gated delta nets, Mamba2 blocks, short convolutions. Such a
layer scans its input in order, but a packed tree is not a sequence: each
node's state must come from its parent's, and each node's convolution window
runs along its own ancestors.

mlx-lm's recurrent mixers all honour one padding contract, the one its
batched generation uses: a batch of right-padded rows, a ``mask [B, T]`` of
the real positions (the recurrence holds its state past them) and
``cache.lengths [B]`` (the convolution state is taken at each row's end).
During a verify call each covered mixer is swapped for a :class:`TreeMixer`
that feeds the unmodified mixer one row per node: the node's path from the
root, right-padded to the tree's depth, from a copy of the layer's state
broadcast over the rows. Row ``i``'s output at its last real position is node
``i``'s output, and the row's final state is the state after node ``i``: the
states of every node are kept (``pending``) until acceptance picks one
(:func:`~mlx_redrafter.llm.recurrent.take_tree_states`). No second forward runs
over the accepted tokens, and plain decoding never goes through here.

The rows repeat each node's ancestors. The mixer's input projections would
then run once per (row, position); :class:`_Gathered` runs them once per
node and gathers, and :class:`_Picked` runs the output projection only at
each row's last real position. So the matmuls cost what the tree's N tokens
cost; only the (cheap, elementwise) convolution and recurrence run over
``N x (depth + 1)`` positions, in ``depth + 1`` sequential steps instead of N.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

# mlx-lm's recurrent mixer classes that a tree can run through, each tested for
# tree exactness (tests/test_hybrid.py) on a tiny model of its family, and how:
# "padded", one call over every node's path (the mixer honours the padding
# contract), or "stepwise", one decode step per depth (it does not: Nemotron-H's
# scan ignores the rows' lengths).
COVERED_MIXERS = {
    "GatedDeltaNet": ("gated delta net (qwen3_5, qwen3_5_moe)", "padded"),
    "Qwen3NextGatedDeltaNet": ("gated delta net (qwen3_next)", "padded"),
    "KimiDeltaAttention": ("Kimi delta attention (kimi_linear)", "padded"),
    "NemotronHMamba2Mixer": ("Mamba2 (nemotron_h)", "stepwise"),
    "GraniteMoeHybridMamba2Mixer": ("Mamba2 (granitemoehybrid)", "padded"),
    "FalconH1Mixer": ("Mamba2 (falcon_h1)", "padded"),
    "ShortConv": ("short convolution (lfm2, lfm2_moe)", "padded"),
}
# The names under which mlx-lm's mixers take their input, mask and cache.
_INPUT_NAMES = ("x", "inputs", "hidden_states", "input_states")


@dataclass
class TreePaths:
    """Each node's path from the root, for feeding a tree to a recurrent layer.

    ``path [N, T]``: the node's ancestor at depth ``t`` (itself at its own
    depth; padding past it), ``real [N, T]``: ``t <= depth``, ``depth [N]``,
    with ``T`` the tree's depth + 1.
    """

    path: mx.array
    real: mx.array
    depth: mx.array
    host: Optional["DepthPlan"] = None  # the depth-by-depth plan, when the host knows the tree's shape

    @classmethod
    def of(cls, mask: mx.array, depth: mx.array, levels: int, host=None) -> "TreePaths":
        """From a tree's ancestor mask ``[N, N]`` (``[q, k]``: k is q or an
        ancestor) and node depths ``[N]``; ``levels`` (host): the depth + 1;
        ``host``: the tree's shape on the host, if known (then the nodes run
        depth by depth, :meth:`TreeMixer._by_depth`)."""
        t = mx.arange(levels, dtype=mx.int32)
        at_depth = mask[:, None, :] & (depth[None, None, :] == t[None, :, None])  # [N, T, N]
        path = mx.argmax(at_depth.astype(mx.int32), axis=-1).astype(mx.int32)
        plan = DepthPlan(*host) if host is not None else None
        return cls(path, t[None, :] <= depth[:, None], depth.astype(mx.int32), plan)


class DepthPlan:
    """A tree's nodes depth by depth, from its shape on the host (built once per
    verify call, shared by every recurrent layer): each depth's nodes, where
    each node's parent sits in the depth above, and the way back to node order."""

    def __init__(self, depths: tuple, parents: tuple):
        levels = [[i for i, d in enumerate(depths) if d == t] for t in range(max(depths) + 1)]
        where = {i: k for level in levels for k, i in enumerate(level)}  # node -> its place in its level
        self.nodes = [mx.array(level, mx.int32) for level in levels]
        self.up = [None] + [mx.array([where[parents[i]] for i in level], mx.int32) for level in levels[1:]]
        order = [i for level in levels for i in level]
        self.inverse = mx.array(sorted(range(len(order)), key=order.__getitem__), mx.int32)
        self.depth = mx.array(depths, mx.int32)
        self.place = mx.array([where[i] for i in range(len(depths))], mx.int32)


class _Gathered(nn.Module):
    """A mixer's input projection, run once per node and gathered along the paths
    (``rows`` and ``path`` may change between the stepwise calls)."""

    def __init__(self, inner, rows: mx.array, nodes: mx.array, path: mx.array):
        super().__init__()
        self.inner, self._rows, self._nodes, self._path = inner, rows, nodes, path
        self._projected = None

    def __call__(self, x):
        if x is self._rows:  # the mixer's own input: project the N nodes, not the N x T positions
            if self._projected is None:
                self._projected = self.inner(self._nodes)
            return self._projected[self._path]
        return self.inner(x)


class _Picked(nn.Module):
    """A mixer's output projection, run only at each row's last real position
    (the one output the tree keeps), broadcast over the row."""

    def __init__(self, inner, depth: mx.array):
        super().__init__()
        self.inner, self._depth = inner, depth

    def __call__(self, y):
        n, t = y.shape[:2]
        out = self.inner(y[mx.arange(n), self._depth])
        return mx.broadcast_to(out[:, None], (n, t, *out.shape[1:]))


def _swapped(mixer, rows, nodes, paths: TreePaths) -> Dict[str, nn.Module]:
    """The mixer's direct projections to swap during the call: ``{name: wrapper}``."""
    out = {}
    for name, child in mixer.children().items():
        if not isinstance(child, (nn.Linear, nn.QuantizedLinear)):
            continue
        if name == "out_proj":
            out[name] = _Picked(child, paths.depth)
        else:
            out[name] = _Gathered(child, rows, nodes, paths.path)
    return out


_SIGNATURES: Dict[type, Tuple[str, List[str]]] = {}


def _bind(mixer, args, kwargs):
    """``(input, cache)`` of a mixer call, by the mixer's own signature."""
    cls = type(mixer)
    if cls not in _SIGNATURES:
        names = list(inspect.signature(cls.__call__).parameters)[1:]
        _SIGNATURES[cls] = (next(n for n in names if n in _INPUT_NAMES), names)
    first, names = _SIGNATURES[cls]
    bound = dict(zip(names, args), **kwargs)
    return bound[first], bound.get("cache")


class TreeMixer(nn.Module):
    """Stands in for a recurrent mixer during one verify call (see the module doc)."""

    def __init__(self, inner, paths: TreePaths):
        super().__init__()
        self.inner, self._paths = inner, paths
        self._stepwise = COVERED_MIXERS[type(inner).__name__][1] == "stepwise"

    def __call__(self, *args, **kwargs):
        x, cache = _bind(self.inner, args, kwargs)
        if self._paths.host is not None:
            out, cache.pending = self._by_depth(x[0], cache)
            return out[None]
        n = x.shape[1]
        proxy = ArraysCache(len(cache.cache))
        proxy.cache = [None if e is None else mx.broadcast_to(e, (n, *e.shape[1:])) for e in cache.cache]
        run = self._steps if self._stepwise else self._padded
        out = run(x[0], proxy)
        cache.pending = NodeStates(proxy.cache)  # every node's state; acceptance takes one
        return out[None]

    def _by_depth(self, nodes: mx.array, cache: ArraysCache):
        """Depth by depth (the tree's shape known on the host): each depth's
        nodes take one decode step together, each from its parent's state,
        so the whole tree costs N decode steps of the mixer, in depth + 1 calls."""
        plan = self._paths.host
        states, outs = [list(cache.cache)], []  # per level: each entry's states, rows in level order
        for level, up in zip(plan.nodes, plan.up):
            proxy = ArraysCache(len(cache.cache))
            proxy.cache = [None if e is None or up is None else e[up] for e in states[-1]]
            if up is None:  # the root's state is the cache's
                proxy.cache = list(cache.cache)
            outs.append(self.inner(nodes[level][:, None], mask=None, cache=proxy)[:, 0])
            states.append(list(proxy.cache))
        return mx.concatenate(outs)[plan.inverse], LevelStates(states[1:], plan)

    def _padded(self, nodes: mx.array, proxy: ArraysCache) -> mx.array:
        """One call over every node's path, right-padded (the padding contract)."""
        paths = self._paths
        rows = nodes[paths.path]  # [N, T, h]
        proxy.lengths = paths.depth + 1
        with _projections(self.inner, _swapped(self.inner, rows, nodes, paths)):
            out = self.inner(rows, mask=paths.real, cache=proxy)
        return out[mx.arange(nodes.shape[0]), paths.depth]

    def _steps(self, nodes: mx.array, proxy: ArraysCache) -> mx.array:
        """One decode step per depth, every node's row from its ancestor at that
        depth; a row past its node's depth keeps its state."""
        paths = self._paths
        out = None
        gathered = {
            name: _Gathered(child, None, nodes, None)
            for name, child in self.inner.children().items()
            if isinstance(child, (nn.Linear, nn.QuantizedLinear)) and name != "out_proj"
        }
        with _projections(self.inner, gathered):
            for t in range(paths.path.shape[1]):
                step = nodes[paths.path[:, t]][:, None]  # [N, 1, h]
                for wrapper in gathered.values():
                    wrapper._rows, wrapper._path = step, paths.path[:, t : t + 1]
                before = list(proxy.cache)
                y = self.inner(step, mask=None, cache=proxy)[:, 0]
                real = paths.real[:, t]
                proxy.cache = [_where_rows(real, new, old) for new, old in zip(proxy.cache, before)]
                out = y if out is None else _where_rows(paths.depth == t, y, out)
        return out


class NodeStates:
    """Every node's recurrent state after a verify call, one row per node."""

    def __init__(self, entries: List[Optional[mx.array]]):
        self.entries = entries

    def take(self, node: mx.array) -> List[Optional[mx.array]]:
        """The cache entries of tree node ``node`` (a device index ``[1]``: no sync)."""
        return [None if e is None else mx.take(e, node, axis=0) for e in self.entries]


class LevelStates:
    """Every node's recurrent state after a depth-by-depth verify call, kept by
    depth (no copy of them all into one array: each can be a megabyte a layer)."""

    def __init__(self, levels: List[list], plan: DepthPlan):
        self.levels, self.plan = levels, plan

    def take(self, node: mx.array) -> List[Optional[mx.array]]:
        depth, place = self.plan.depth[node], self.plan.place[node]
        out = None
        for t, entries in enumerate(self.levels):
            rows = [None if e is None else mx.take(e, mx.minimum(place, e.shape[0] - 1), axis=0) for e in entries]
            out = rows if out is None else [_where_rows(depth == t, r, o) for r, o in zip(rows, out)]
        return out


def _where_rows(rows: mx.array, a, b):
    """``a`` where ``rows [N]`` is true, else ``b`` (arrays of any rank, rows first)."""
    if a is None:
        return b
    return mx.where(rows.reshape(-1, *([1] * (a.ndim - 1))), a, b)


class _projections:
    """Swap a mixer's projections for wrappers for the length of a ``with`` block."""

    def __init__(self, mixer, swapped: Dict[str, nn.Module]):
        self.mixer, self.swapped = mixer, swapped
        self.originals = {name: mixer[name] for name in swapped}

    def __enter__(self):
        for name, wrapper in self.swapped.items():
            setattr(self.mixer, name, wrapper)

    def __exit__(self, *exc):
        for name, child in self.originals.items():
            setattr(self.mixer, name, child)


def find_mixers(model) -> List[Tuple[nn.Module, str, nn.Module]]:
    """``(parent, name, mixer)`` of every covered recurrent mixer in ``model``."""
    found = []
    for _, module in model.named_modules():
        for name, child in module.children().items():
            if isinstance(child, nn.Module) and type(child).__name__ in COVERED_MIXERS:
                found.append((module, name, child))
    return found


def uncovered_layers(model) -> List[str]:
    """Class names of layers that look recurrent (a causal convolution or a
    scan) but are not covered: a model with them cannot verify trees."""
    covered = [path for path, m in model.named_modules() if type(m).__name__ in COVERED_MIXERS]
    names = set()
    for path, module in model.named_modules():
        kind = type(module).__name__
        if kind in COVERED_MIXERS or any(path.startswith(c + ".") for c in covered) or "Norm" in kind:
            continue
        convs = any(isinstance(c, nn.Conv1d) for c in module.children().values())
        scans = any(word in kind for word in ("Mamba", "Delta", "RGLRU", "Recurrent", "TimeMixing"))
        if convs or scans:
            names.add(kind)
    return sorted(names)
