"""How much memory one sweep cell needs, and how much the device has: the
sweep skips a cell that would not fit instead of failing half-way."""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx


def _nbytes(tree) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(tree) if isinstance(v, mx.array))


def kv_bytes_per_token(model) -> int:
    """KV-cache bytes per token over all layers, measured with a one-token
    forward (for every cache type and head layout). Caches allocate in
    blocks, so each array's bytes are divided by its rows along the
    sequence axis (-2 in mlx-lm's ``[B, heads, S, D]`` layout)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    arrays = [a for c in cache for _, a in tree_flatten(c.state) if isinstance(a, mx.array) and a.ndim >= 2]
    mx.eval(arrays)
    return sum(a.nbytes // a.shape[-2] for a in arrays)


def estimate_cell_bytes(
    model, drafter, width: int, length: int, prompt_tokens: int, max_tokens: int, kv_per_token: Optional[int] = None
) -> int:
    """An upper estimate of the memory one cell needs: the weights, the KV
    cache for prompt + max_tokens + one tree, the tree's logits (N x V,
    float32, plus as much again for the acceptance temporaries) and the
    drafter's beam scores (W x draft vocabulary per depth, with the
    softmax and top-k temporaries)."""
    from ..llm.parts import model_parts

    embed, _, _ = model_parts(model)
    vocab = int(embed.weight.shape[0])
    config = getattr(drafter, "config", None)  # None: a grid of another source's beams (no drafter)
    hidden = int(config.hidden_size) if config is not None else int(embed.weight.shape[-1])
    head = int(getattr(config, "head_size", vocab))
    n = 1 + width * length
    kv = (kv_per_token if kv_per_token is not None else kv_bytes_per_token(model)) * (prompt_tokens + max_tokens + n)
    tree = 2 * n * vocab * 4 + 4 * n * hidden * 4
    beams = 3 * width * length * head * 4
    weights = _nbytes(model.parameters()) + (_nbytes(drafter.parameters()) if hasattr(drafter, "parameters") else 0)
    return weights + kv + tree + beams


def memory_budget_bytes(limit_gb: Optional[float] = None) -> int:
    """``limit_gb``, else the GPU's recommended working set, else what the
    OS can still give (MemAvailable) plus what MLX already holds."""
    if limit_gb is not None:
        return int(limit_gb * 1e9)
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        return avail + mx.get_active_memory()
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
