"""The EAGLE-3 draft head (Li et al., 2025), in MLX: one decoder layer over the
token embedding and a fusion of three of the target's layers, with its own
KV cache.

The forward is the references' (vLLM ``llama_eagle3.py``, the EAGLE
repository's ``cnets.py``, mlx-vlm's ``speculative/drafters/eagle3``):

* ``g = fc(concat(h_a, h_b, h_c))``: the target's residual stream entering
  its layers ``a, b, c`` (``eagle_aux_hidden_state_layer_ids``, Hugging
  Face ``hidden_states`` indexes, so index ``k`` is the output of layer
  ``k - 1``; default ``[2, L // 2, L - 3]``). With ``norm_before_fc`` an
  RMSNorm over the concatenation comes first (``input_norm``).
* ``x = concat(input_layernorm(embed(token)), hidden_norm(g))`` feeds q, k
  and v (input ``2H``); ``y = r + o_proj(attn(x))`` where ``r`` is ``g``, or
  ``hidden_norm(g)`` with ``norm_before_residual``; then ``y += mlp(
  post_attention_layernorm(y))``.
* ``logits = lm_head(norm(y))`` over the draft vocabulary; draft id ``i`` is
  target id ``i + d2t[i]``. ``y`` is what the next draft call reads instead of
  ``g`` (a chain of draft calls feeds the head its own state).

The pair at position ``t`` is the target's features there and the token the
target chose from them, so the head's output at ``t`` predicts the token after
that one: the head runs one token behind the target, like every layer head
(draft/head.py's protocol: ``taps``, ``draft_to_target``, ``make_cache`` and
``__call__(tokens, features, cache, first)``).

Configs, both published layouts and our own files: :mod:`.eagle3_io`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.llama import MLP, Attention, ModelArgs

from ..errors import RedrafterError

KIND = "eagle3"


@dataclass
class Eagle3Config:
    """An EAGLE-3 head's shape, as both published layouts describe it (read by
    :func:`~mlx_redrafter.draft.eagle3_io.config_from_dict`)."""

    hidden_size: int  # H, the head's width
    vocab_size: int  # the target's vocabulary (the embedding's rows)
    draft_vocab_size: int  # rows of lm_head; d2t maps them to target ids when smaller
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: Optional[int] = None
    attention_bias: bool = False
    mlp_bias: bool = False
    target_hidden_size: Optional[int] = None  # the target's width (None: H)
    layer_ids: Optional[List[int]] = None  # hidden_states indexes of the fused taps (None: [2, L//2, L-3])
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    extra: dict = field(default_factory=dict)  # the rest of the config as read (kept when saved again)

    def __post_init__(self):
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size

    def llama_args(self) -> ModelArgs:
        """The layer's shape as mlx-lm's Llama arguments (its attention, MLP and RoPE are reused)."""
        return ModelArgs(
            model_type="llama",
            hidden_size=self.hidden_size,
            num_hidden_layers=1,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            num_key_value_heads=self.num_key_value_heads,
            attention_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            tie_word_embeddings=False,
        )

    def taps_for(self, num_layers: int) -> tuple:
        """The target layers whose outputs the head fuses, for a target of ``num_layers`` layers."""
        ids = self.layer_ids or default_layer_ids(num_layers)
        bad = [i for i in ids if not 1 <= i <= num_layers]
        if bad or len(ids) != 3:
            raise RedrafterError(
                f"The EAGLE-3 head fuses the target's hidden states {ids} (eagle_aux_hidden_state_layer_ids), "
                f"but a model of {num_layers} layers has hidden states 1-{num_layers}, and the head needs three.",
                "Use the head with the model it was trained for.",
            )
        return tuple(i - 1 for i in ids)  # hidden_states[k] is layer k - 1's output

    def fit_problem(self, hidden: int, vocab: int, num_layers: int) -> Optional[str]:
        """Why a head of this config cannot draft for a model of these sizes, or None."""
        if self.target_hidden_size != hidden:
            return (
                f"The EAGLE-3 head reads hidden states of width {self.target_hidden_size} but the model's is {hidden}."
            )
        if self.vocab_size != vocab:
            return f"The EAGLE-3 head's vocab_size is {self.vocab_size} but the model's embedding has {vocab} rows."
        try:
            self.taps_for(num_layers)
        except RedrafterError as e:
            return e.problem
        return None


def default_layer_ids(num_layers: int) -> List[int]:
    """EAGLE-3's default taps (vLLM's and the EAGLE repository's): a low, a middle and a high layer."""
    return [2, num_layers // 2, num_layers - 3]


class Eagle3Layer(nn.Module):
    """The head's decoder layer: mlx-lm's Llama attention (q, k, v over ``2H``) and MLP."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        args = config.llama_args()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.hidden_norm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.self_attn = Attention(args)
        attn, bias = self.self_attn, config.attention_bias
        # The one change to a Llama layer: queries, keys and values read [embedding, state].
        attn.q_proj = nn.Linear(2 * h, attn.n_heads * attn.head_dim, bias=bias)
        attn.k_proj = nn.Linear(2 * h, attn.n_kv_heads * attn.head_dim, bias=bias)
        attn.v_proj = nn.Linear(2 * h, attn.n_kv_heads * attn.head_dim, bias=bias)
        self.mlp = MLP(args)

    def inputs(self, embeds: mx.array, hidden: mx.array):
        """``(x, residual)``: what attention reads and what its output is added to."""
        normed = self.hidden_norm(hidden)
        x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        return x, normed if self.norm_before_residual else hidden

    def finish(self, residual: mx.array, attended: mx.array) -> mx.array:
        """The layer's output from its attention's output (before ``o_proj`` is applied: it is here)."""
        y = residual + attended
        return y + self.mlp(self.post_attention_layernorm(y))

    def __call__(self, embeds, hidden, mask=None, cache=None) -> mx.array:
        x, residual = self.inputs(embeds, hidden)
        return self.finish(residual, self.self_attn(x, mask=mask, cache=cache))


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head (see the module doc); a layer head for draft/head.py's beam search.

    ``embed_tokens`` is the head's own embedding when its checkpoint has one
    (the speculators layout), else the target's, set by :meth:`bind`.
    """

    kind = KIND
    source = KIND  # what its drafts are called in step stats (draft/head.py's protocol)

    def __init__(self, config: Eagle3Config, own_embedding: bool = True):
        super().__init__()
        self.config = config
        h, th = config.hidden_size, config.target_hidden_size
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.fc = nn.Linear(3 * th, h, bias=False)
        if config.norm_before_fc:
            self.input_norm = nn.RMSNorm(3 * th, eps=config.rms_norm_eps)
        self.layers = [Eagle3Layer(config)]
        self.norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        if self.reduced:
            # d2t[i]: target id of draft id i, minus i (the published format). Data, not trained.
            self.d2t = mx.zeros((config.draft_vocab_size,), dtype=mx.int32)
            self.freeze(keys=["d2t"], recurse=False)
        # Plain attributes (not parameters): the taps, and the target's embedding when bound.
        taps = tuple(i - 1 for i in config.layer_ids) if config.layer_ids else None
        object.__setattr__(self, "taps", taps)
        object.__setattr__(self, "_target_embed", None)

    @property
    def reduced(self) -> bool:
        return self.config.draft_vocab_size != self.config.vocab_size

    @property
    def draft_to_target(self) -> Optional[mx.array]:
        """``[Vd]`` int32: the target id of each draft id (None: the same vocabulary)."""
        if not self.reduced:
            return None
        return mx.arange(self.config.draft_vocab_size, dtype=mx.int32) + self.d2t

    def bind(self, model) -> "Eagle3Head":
        """Fit the head to the target ``model``: its taps from the model's layer count
        (when the config names none) and, without an embedding of its own, the model's."""
        from ..llm.parts import model_parts

        layers = getattr(getattr(model, "model", None), "layers", None) or []
        object.__setattr__(self, "taps", self.config.taps_for(len(layers)))
        if "embed_tokens" not in self:
            object.__setattr__(self, "_target_embed", model_parts(model)[0])
        return self

    def embed(self, tokens: mx.array) -> mx.array:
        if "embed_tokens" in self:
            return self.embed_tokens(tokens)
        if self._target_embed is None:
            raise RedrafterError(
                "This EAGLE-3 head has no embedding of its own (the EAGLE repository's layout) and was not bound "
                "to its target model.",
                "Call head.bind(model) with the model it drafts for.",
            )
        return self._target_embed(tokens)

    def fuse(self, taps: mx.array) -> mx.array:
        """``g = fc(taps)`` from the target's three taps ``[..., 3 * target_hidden]``
        (a trailing extra slice, the fused backbone's final state, is dropped)."""
        width = 3 * self.config.target_hidden_size
        taps = taps[..., :width].astype(self.fc.weight.dtype)
        if "input_norm" in self:
            taps = self.input_norm(taps)
        return self.fc(taps)

    def make_cache(self) -> list:
        """The head's own KV cache (mlx-lm's)."""
        return [KVCache() for _ in self.layers]

    def logits(self, y: mx.array) -> mx.array:
        return self.lm_head(self.norm(y))

    def __call__(self, tokens: mx.array, features: mx.array, cache=None, first: bool = True, mask=None, last=False):
        """``(logits [B, T, Vd], hidden [B, T, H])`` for ``tokens [B, T]``.

        ``first``: ``features`` are the target's taps (fused here); else they
        are this head's own ``hidden`` from its previous call. ``mask``
        defaults to causal over ``cache`` (mlx-lm's). ``last``: the last
        position's logits alone (``[B, 1, Vd]``): a catch-up call over several
        accepted positions needs one distribution, and the vocabulary
        projection is much of the head's cost."""
        g = self.fuse(features) if first else features.astype(self.fc.weight.dtype)
        e = self.embed(tokens).astype(g.dtype)
        layer_cache = cache[0] if cache else None
        if mask is None:
            mask = create_attention_mask(g, layer_cache)
        y = self.layers[0](e, g, mask=mask, cache=layer_cache)
        return self.logits(y[:, -1:] if last else y), y

    def num_params(self) -> int:
        """Trained parameters (the embedding, d2t left out)."""
        from mlx.utils import tree_flatten

        return sum(v.size for k, v in tree_flatten(self.parameters()) if k not in ("embed_tokens.weight", "d2t"))
