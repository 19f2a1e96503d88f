"""The DFlash block drafter (Chen et al., arXiv 2602.06036), in MLX: a small
Qwen3-style decoder stack that drafts a whole block in one forward pass,
conditioned on the target's hidden states.

The forward is z-lab's (``dflash/model_mlx.py``, ``dflash/model.py``) and
mlx-vlm's (``speculative/drafters/qwen3_dflash``):

* **Context.** The target's hidden states at ``target_layer_ids`` (the
  outputs of ``layers[lid]``, 0-based: :func:`~mlx_redrafter.llm.parts.capture_layers`'
  convention, so ``taps`` are those ids as they are) are concatenated and
  fused, ``c = hidden_norm(fc(concat))``. Every draft layer turns ``c`` into
  keys and values with its own ``k_proj``/``k_norm``/``v_proj``, with RoPE
  at the context's positions, and caches them (:meth:`DFlashDrafter.context`):
  a context entry depends on the context alone, so it is computed once,
  when its position is accepted.
* **The block.** ``[last verified token, mask x (B - 1)]`` at the positions
  after the context, embedded with the *target's* embedding. Its queries,
  keys and values come from the block; it attends to the cached context and,
  non-causally, to itself (a sliding layer: causally, within its window).
  The block's own keys are never cached.
* **Logits.** ``norm`` then the *target's* LM head (a checkpoint with a
  reduced ``draft_vocab_size``, vLLM speculators', has its own ``lm_head``
  and a ``d2t`` map back to target ids). Position ``k`` of the block
  predicts the token ``k`` places after the last verified one.

Configs and weights, both published layouts: :mod:`.dflash_io`. How a block
drafts in the step loop (its cache kept in step, its rows): :mod:`.dflash_chain`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import RedrafterError

KIND = "dflash"
SLIDING = "sliding_attention"


@dataclass
class DFlashConfig:
    """A DFlash drafter's shape, as both published layouts describe it
    (read by :func:`~mlx_redrafter.draft.dflash_io.config_from_dict`)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (the embedding's rows)
    target_layer_ids: Tuple[int, ...]  # outputs of the target's layers[lid], 0-based
    mask_token_id: int
    block_size: int = 16
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    num_target_layers: Optional[int] = None
    draft_vocab_size: Optional[int] = None  # rows of an own lm_head (None: the target's head)
    target_hidden_size: Optional[int] = None
    layer_types: Optional[List[str]] = None
    sliding_window: Optional[int] = None
    causal: Optional[bool] = None  # dflash_config.causal: every layer (None: sliding layers only)
    extra: dict = field(default_factory=dict)  # the rest of the config as read (kept when saved again)

    def __post_init__(self):
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise RedrafterError(
                f"The DFlash config names {len(self.layer_types)} layer_types for {self.num_hidden_layers} layers.",
                "Use the drafter's own config.json.",
            )
        if SLIDING in self.layer_types and not self.sliding_window:
            raise RedrafterError(
                "The DFlash config has sliding layers but no sliding_window.", "Use the drafter's own config.json."
            )

    def sliding(self, i: int) -> bool:
        return self.layer_types[i] == SLIDING

    def layer_causal(self, i: int) -> bool:
        """Whether layer ``i``'s block attends causally to itself (vLLM's rule:
        ``dflash_config.causal`` for every layer, else the sliding layers)."""
        return self.causal if self.causal is not None else self.sliding(i)

    def fit_problem(self, hidden: int, vocab: int, num_layers: int) -> Optional[str]:
        """Why a drafter of this config cannot draft for a model of these sizes, or None."""
        if self.target_hidden_size != hidden:
            width = self.target_hidden_size
            return f"The DFlash drafter reads hidden states of width {width} but the model's is {hidden}."
        if self.vocab_size != vocab:
            return f"The DFlash drafter's vocab_size is {self.vocab_size} but the model's embedding has {vocab} rows."
        bad = [i for i in self.target_layer_ids if not 0 <= i < num_layers]
        if bad:
            return (
                f"The DFlash drafter reads the outputs of layers {list(self.target_layer_ids)} (target_layer_ids), "
                f"but the model has layers 0-{num_layers - 1}."
            )
        return None


class Attention(nn.Module):
    """A draft layer's attention: the block's queries over the cached context and the block itself."""

    def __init__(self, config: DFlashConfig, i: int):
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.scale = d**-0.5
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.window = config.sliding_window if config.sliding(i) else None
        self.causal = config.layer_causal(i)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        b, t, _ = x.shape
        return x.reshape(b, t, n, -1).transpose(0, 2, 1, 3)

    def keys_values(self, x: mx.array, rope, offset: int) -> Tuple[mx.array, mx.array]:
        """Keys (normed, rotated from position ``offset``) and values of ``x [B, T, H]``."""
        k = rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads)), offset=offset)
        return k, self._heads(self.v_proj(x), self.n_kv_heads)

    def __call__(self, x: mx.array, rope, cache: KVCache) -> mx.array:
        b, t, _ = x.shape
        start = cache.offset  # the block sits right after the context
        q = rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=start)
        k, v = self.keys_values(x, rope, start)
        mask = None
        if cache.keys is not None and start:
            ctx_k, ctx_v = cache.keys[..., :start, :], cache.values[..., :start, :]
            first = 0 if self.window is None else max(0, start - self.window + 1)  # older context: out of every window
            k = mx.concatenate([ctx_k[..., first:, :], k], axis=2)
            v = mx.concatenate([ctx_v[..., first:, :], v], axis=2)
        else:
            first = start
        if self.causal or self.window is not None:
            qpos = mx.arange(start, start + t)[:, None]
            kpos = mx.arange(first, start + t)[None, :]
            allowed = kpos <= qpos if self.causal else mx.ones((t, kpos.shape[1]), mx.bool_)
            if self.window is not None:
                allowed = allowed & (qpos - kpos < self.window)
            mask = allowed
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class Layer(nn.Module):
    def __init__(self, config: DFlashConfig, i: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, i)
        self.mlp = MLP(h, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)

    def __call__(self, x, rope, cache):
        h = x + self.self_attn(self.input_layernorm(x), rope, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """A DFlash block drafter (see the module doc). Its embedding and LM head
    are the target's, set by :meth:`bind`; a reduced vocabulary's own
    ``lm_head`` and ``d2t`` are its parameters."""

    kind = KIND
    source = KIND  # what its drafts are called in step stats

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = [Layer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        if self.reduced:
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            self.d2t = mx.zeros((config.draft_vocab_size,), dtype=mx.int32)  # target id - draft id (data)
            self.freeze(keys=["d2t"], recurse=False)
        self.rope = initialize_rope(
            config.head_dim, config.rope_theta, False, config.rope_scaling, config.max_position_embeddings
        )
        # Plain attributes (not parameters): the taps, and the target's parts once bound.
        object.__setattr__(self, "taps", tuple(config.target_layer_ids))
        object.__setattr__(self, "_target", None)

    @property
    def reduced(self) -> bool:
        return self.config.draft_vocab_size != self.config.vocab_size

    @property
    def draft_to_target(self) -> Optional[mx.array]:
        """``[Vd]`` int32: the target id of each draft id (None: the target's vocabulary)."""
        if not self.reduced:
            return None
        return mx.arange(self.config.draft_vocab_size, dtype=mx.int32) + self.d2t

    @property
    def default_shape(self) -> Tuple[int, int]:
        """``(rows, tokens)`` a step drafts by default: the trained block as one chain."""
        return 1, self.config.block_size - 1

    default_tree = "auto"  # a block is long: the device's cost curve decides how much of it to verify

    def bind(self, model) -> "DFlashDrafter":
        """Take the target ``model``'s embedding (with its scale) and LM head."""
        from ..llm.parts import backbone_of, model_parts

        embed, _, head = model_parts(model)
        backbone = backbone_of(model)[0]
        scale = getattr(embed, "embed_scale", getattr(backbone, "embed_scale", 1.0))
        object.__setattr__(self, "_target", (embed, head, scale))
        return self

    def _bound(self):
        if self._target is None:
            raise RedrafterError(
                "This DFlash drafter uses its target's embedding and LM head and was not bound to a model.",
                "Call drafter.bind(model) with the model it drafts for.",
            )
        return self._target

    def make_cache(self) -> list:
        """The context's keys and values, one mlx-lm cache per layer (a sliding
        layer's too: its window is applied when it attends, so every layer
        trims like the target's cache)."""
        return [KVCache() for _ in self.layers]

    def fuse(self, taps: mx.array) -> mx.array:
        """``hidden_norm(fc(taps))`` of the target's taps ``[..., n * H]``
        (a trailing extra slice, the fused backbone's final state, is dropped)."""
        width = len(self.taps) * self.config.target_hidden_size
        return self.hidden_norm(self.fc(taps[..., :width].astype(self.fc.weight.dtype)))

    def context(self, taps: mx.array, cache: list) -> None:
        """Append the context of the target's taps ``[B, T, n * H]`` to ``cache`` (lazily)."""
        c = self.fuse(taps)
        for layer, lc in zip(self.layers, cache):
            k, v = layer.self_attn.keys_values(c, self.rope, lc.offset)
            lc.update_and_fetch(k, v)

    def hidden(self, tokens: mx.array, cache: list) -> mx.array:
        """The block's final states ``[B, T, H]`` (after ``norm``) for ``tokens [B, T]``
        at the positions after the cached context (the cache is not changed)."""
        embed, _, scale = self._bound()
        h = embed(tokens).astype(self.fc.weight.dtype)
        if scale != 1.0:
            h = h * scale
        for layer, lc in zip(self.layers, cache):
            h = layer(h, self.rope, lc)
        return self.norm(h)

    def logits(self, hidden: mx.array) -> mx.array:
        """Logits over the draft vocabulary (the target's, or the reduced one) of final states."""
        if self.reduced:
            return self.lm_head(hidden)
        return self._bound()[1](hidden)

    def block_logits(self, tokens: mx.array, cache: list) -> mx.array:
        """``[B, T - 1, Vd]``: the drafts' logits of a block ``tokens [B, T]``
        (its first token the last verified one, then masks)."""
        return self.logits(self.hidden(tokens, cache)[:, 1:])

    def make_chain(self, width: int, length: int, controller=None):
        """The step loop's source of this drafter's blocks (draft/dflash_chain.py)."""
        from .dflash_chain import BlockChain

        return BlockChain(self, width, length, controller)

    def num_params(self) -> int:
        """Trained parameters (d2t left out)."""
        from mlx.utils import tree_flatten

        return sum(v.size for k, v in tree_flatten(self.parameters()) if k != "d2t")
