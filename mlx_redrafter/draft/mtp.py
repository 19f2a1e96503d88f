"""Native multi-token-prediction (MTP) heads, as layer heads (draft/head.py).

Several model families ship an extra decoder layer trained to predict the
token after next. Each is one :class:`MTPHead`: two RMSNorms, a projection
of their concatenation, the family's own decoder layer(s) (mlx-lm's class,
so the attention, MLP and MoE are exactly the family's), a final norm and
the target's LM head::

    x = fc(concat[norm_e(embed(t[i+1])), norm_h(h[i])])   # MiMo: [norm_h, norm_e]
    x = layers(x)                                        # its own KV cache
    logits = lm_head(norm(x))

where ``h[i]`` is the target's final hidden state after its final norm
(first call) or the head's previous ``hidden`` (chained calls). What
differs by family (:class:`Style`), as vLLM's ``qwen3_next_mtp.py``,
``deepseek_mtp.py`` and ``mimo_mtp.py`` and mlx-vlm's ``qwen3_5_mtp``
run them:

=====================  =======================  ==================  ======================
family                 weights (checkpoint)     chained ``hidden``  also
=====================  =======================  ==================  ======================
Qwen3.5/3.6/3.8,       ``mtp.*`` (``fc``,        after ``norm``      zero-centred norms
Qwen3-Next             ``pre_fc_norm_*``,                           (HF stores ``w - 1``)
                       ``layers.i``, ``norm``)
DeepSeek-V3/V3.2,      ``model.layers.{N}.*``    before              own ``shared_head.head``;
GLM-4.5+               (``enorm``, ``hnorm``,    ``shared_head.norm``  token embedding zeroed at
                       ``eh_proj``,                                  position 0
                       ``shared_head.*``)
MiMo                   ``model.mtp_layers.0.*``  after               ``[hidden, token]`` order;
                       (``token_layernorm``,     ``final_layernorm``   zeroed at position 0
                       ``hidden_layernorm``,
                       ``input_proj``)
=====================  =======================  ==================  ======================

Reading the weights (the original checkpoint beside the model, mlx-vlm's
split folder) is :mod:`~mlx_redrafter.draft.mtp_load`'s job; this module
builds the head for a loaded target and maps a family's keys onto it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import RedrafterError

QWEN = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
NEXT_N = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa")
MIMO = ("mimo",)
# Norms a Hugging Face Qwen3.5/Qwen3-Next checkpoint stores zero-centred (``w - 1``).
ZERO_CENTRED = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


@dataclass(frozen=True)
class Style:
    """How a family's MTP forward differs (see the module doc)."""

    hidden_first: bool = False  # MiMo concatenates [hidden, token]
    mask_first: bool = False  # DeepSeek and MiMo zero the token embedding at position 0
    chain_normed: bool = True  # the chained hidden is after the final norm (Qwen, MiMo)
    own_head: bool = False  # DeepSeek/GLM: shared_head.head, their own copy of the LM head


STYLES = {
    **{t: Style() for t in QWEN},
    **{t: Style(mask_first=True, chain_normed=False, own_head=True) for t in NEXT_N},
    **{t: Style(hidden_first=True, mask_first=True) for t in MIMO},
}


def family_of(model) -> str:
    """The model type that says where a target's MTP weights live."""
    return str(getattr(getattr(model, "args", None), "model_type", "") or getattr(model, "model_type", ""))


def text_args(model):
    """The target's text-model arguments (Qwen3.5 nests them under ``language_model``)."""
    inner = getattr(model, "language_model", None)
    return inner.args if inner is not None and hasattr(inner, "args") else model.args


class MTPHead(nn.Module):
    """A native MTP head (see the module doc); a
    :class:`~mlx_redrafter.draft.head.LayerHead` with ``taps=None``."""

    source = "mtp"
    taps = None
    draft_to_target = None

    def __init__(self, target, family: str, num_layers: int = 1):
        super().__init__()
        args = text_args(target)
        h, eps = args.hidden_size, args.rms_norm_eps
        self.family, self.style = family, STYLES[family]
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
        self.layers = [_decoder_layer(target, family, i) for i in range(num_layers)]
        self.norm = nn.RMSNorm(h, eps=eps)
        if self.style.own_head:
            self.head = nn.Linear(h, args.vocab_size, bias=False)
        self.hidden_size, self.vocab_size = h, args.vocab_size
        bind(self, target)

    def make_cache(self) -> list:
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]

    def __call__(self, tokens: mx.array, features: mx.array, cache: list, first: bool = True, last: bool = False):
        from mlx_lm.models.base import create_attention_mask

        emb = self._embed(tokens)
        if self.style.mask_first and cache[0].offset == 0:  # vLLM: the token at position 0 is not used
            emb = mx.where((mx.arange(tokens.shape[1]) == 0)[None, :, None], 0, emb)
        e, hid = self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(features.astype(emb.dtype))
        x = self.fc(mx.concatenate([hid, e] if self.style.hidden_first else [e, hid], axis=-1))
        mask = create_attention_mask(x, cache[0], return_array=True)  # MLA attention takes arrays only
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask, c)
        normed = self.norm(x)
        wanted = normed[:, -1:] if last else normed  # the catch-up call needs the last position's alone
        logits = self.head(wanted) if self.style.own_head else self._lm_head(wanted)
        return logits, (normed if self.style.chain_normed else x)


def bind(head, target) -> None:
    """Point ``head`` at the target's embedding and LM head, which it shares
    but does not own (they are not its parameters)."""
    from ..llm.parts import model_parts

    embed, _, lm_head = model_parts(target)
    object.__setattr__(head, "_embed", embed)
    object.__setattr__(head, "_lm_head", lm_head)


def _decoder_layer(target, family: str, index: int) -> nn.Module:
    """The family's own mlx-lm decoder layer for MTP layer ``index``: a
    full-attention layer for the Qwen hybrids, layer ``num_hidden_layers +
    index`` (dense or MoE as the config says) for the next-n families."""
    args = text_args(target)
    if family in ("qwen3_5", "qwen3_5_moe"):
        from mlx_lm.models.qwen3_5 import DecoderLayer

        return DecoderLayer(args, layer_idx=args.full_attention_interval - 1)
    if family == "qwen3_next":
        from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

        return Qwen3NextDecoderLayer(args, layer_idx=args.full_attention_interval - 1)
    layer_cls = type(target.model.layers[0])
    if family in MIMO:
        return layer_cls(args)
    return layer_cls(args, args.num_hidden_layers + index)


# --------------------------------------------------------------------------- weights


NEXT_N_NAMES = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc"}
MIMO_NAMES = {
    "token_layernorm": "pre_fc_norm_embedding",
    "hidden_layernorm": "pre_fc_norm_hidden",
    "input_proj": "fc",
    "final_layernorm": "norm",
}


def checkpoint_keys(family: str, num_hidden_layers: int) -> re.Pattern:
    """The pattern of a family's MTP keys in its original checkpoint (group 1: the rest of the key)."""
    if family in QWEN:
        return re.compile(r"^(?:model\.)?mtp\.(.+)$")
    if family in NEXT_N:
        return re.compile(rf"^model\.layers\.{num_hidden_layers}\.(.+)$")
    return re.compile(r"^model\.mtp_layers\.0\.(.+)$")


def head_weights(target, family: str, raw: Dict[str, mx.array], zero_centred: bool) -> Dict[str, mx.array]:
    """``raw`` (one family's MTP keys, the checkpoint prefix removed) as
    :class:`MTPHead` parameters: the family's names mapped, its decoder
    layer's keys through the target's own ``sanitize`` (expert stacking,
    fp8 and MLA conversions), zero-centred norms restored (``+1``)."""
    if family in QWEN:
        out = _qwen_keys(raw)
    else:
        names = NEXT_N_NAMES if family in NEXT_N else MIMO_NAMES
        out, block = {}, {}
        for key, value in raw.items():
            top = key.split(".")[0]
            if key.startswith("shared_head."):
                out[key[len("shared_head.") :]] = value  # its norm and its own copy of the LM head
            elif top in names:
                out[names[top] + key[len(top) :]] = value
            elif top != "embed_tokens":  # the target's embedding is shared
                block[key] = value
        out.update(_through_sanitize(target, block))
    if zero_centred:
        out = {k: v + 1.0 if k.endswith(ZERO_CENTRED) and v.ndim == 1 else v for k, v in out.items()}
    return out


def _qwen_keys(raw: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Qwen's names are the head's; experts stored one by one (Qwen3-Next) or
    fused (Qwen3.5-MoE) become mlx-lm's ``switch_mlp``."""
    out = dict(raw)
    for key in [k for k in out if k.endswith(".experts.gate_up_proj")]:
        base = key[: -len(".experts.gate_up_proj")]
        gate_up = out.pop(key)
        mid = gate_up.shape[-2] // 2
        out[f"{base}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[f"{base}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        out[f"{base}.switch_mlp.down_proj.weight"] = out.pop(f"{base}.experts.down_proj")
    pattern = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")
    groups: Dict[tuple, Dict[int, mx.array]] = {}
    for key in list(out):
        m = pattern.match(key)
        if m:
            groups.setdefault((m.group(1), m.group(3), m.group(4)), {})[int(m.group(2))] = out.pop(key)
    for (base, proj, kind), experts in groups.items():
        out[f"{base}.switch_mlp.{proj}.{kind}"] = mx.stack([experts[e] for e in sorted(experts)])
    return out


def _through_sanitize(target, block: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """The next-n layer's keys as the target's own ``sanitize`` converts its
    layers' (run on them as if they were layer 0), renamed ``layers.0.*``."""
    prefix = "model.layers.0."
    renamed = {prefix + k: v for k, v in block.items()}
    if hasattr(target, "sanitize"):
        renamed = target.sanitize(renamed)
    return {"layers.0." + k[len(prefix) :]: v for k, v in renamed.items() if k.startswith(prefix)}


def load_head(target, family: str, raw: Dict[str, mx.array], zero_centred: bool, num_layers: int = 1) -> MTPHead:
    """An :class:`MTPHead` for ``target`` with the weights ``raw`` (quantized
    ones too), checked key by key, then the dtype policy of the target's
    loader (llm/load.py): float32 on the CPU, quantized layers dequantized."""
    from mlx.utils import tree_flatten

    from ..llm.load import apply_dtype

    head = MTPHead(target, family, num_layers)
    weights = head_weights(target, family, raw, zero_centred)
    if any(k.endswith(".scales") for k in weights):
        _quantize_like(head, weights)
    expected = dict(tree_flatten(head.parameters()))
    missing = sorted(set(expected) - set(weights))
    unknown = sorted(set(weights) - set(expected))
    if missing or unknown:
        raise RedrafterError(
            f"The MTP weights do not fit the {family} head "
            f"(missing: {', '.join(missing[:6]) or 'none'}; unknown: {', '.join(unknown[:6]) or 'none'}).",
            "Check that the MTP weights belong to this model (same family, sizes and layer count).",
        )
    for k, v in expected.items():
        if tuple(weights[k].shape) != tuple(v.shape):
            raise RedrafterError(
                f"MTP weight {k} has shape {tuple(weights[k].shape)} but the model implies {tuple(v.shape)}.",
                "Check that the MTP weights belong to this model (hidden size, vocabulary).",
            )
    head.load_weights(list(weights.items()))
    dtype = _weight_dtype(target)
    return apply_dtype(head, dtype, keep_quantized=None)


def _quantize_like(head: MTPHead, weights: Dict[str, mx.array]) -> None:
    """Quantize the head's layers that are stored quantized (as mlx-lm's loader does)."""
    from mlx_lm.utils import infer_quant_config

    def predicate(path, module):
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(head, class_predicate=predicate)


def _weight_dtype(target) -> Optional[mx.Dtype]:
    """The target's floating dtype, so that the head computes in the same one."""
    from mlx.utils import tree_flatten

    for _, v in tree_flatten(target.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return v.dtype
    return None
