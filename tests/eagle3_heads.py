"""EAGLE-3 heads that are right by construction on :func:`helpers.bigram_model`,
written in either published layout (for tests/test_eagle3_draft.py).

The head passes the token it is fed straight to its output: the fused taps
are dropped (``fc = 0``, ``hidden_norm = 0``), attention attends to the
token's own position alone and copies its normed embedding (``v = [I | 0]``,
``o = I``), the MLP adds nothing. Its logits are then the target's LM head
over the token's embedding under the target's final norm: the bigram model's
next token, without the context it weighs at 2%. In the speculators layout
(``norm_before_residual``) the residual is ``hidden_norm(g) = 0``, so every
chained call is right alike; the EAGLE repository's adds the un-normed state,
so there its first draft of a step is right and chained ones less often.

Attending to itself alone, with queries and keys that do not depend on the
input: both are the same constant vector (the projections' biases), on RoPE's
four fastest pairs. Rotated by positions ``i`` and ``j``, their dot product is
``A^2 sum_k cos(theta_k (i - j))``: largest at ``i == j`` and, for any
distance under 400, at least ``0.21 A^2`` smaller (scaled by ``1/sqrt(16)``).
With ``A = 32`` that gap is 54 nats: every other position gets ``e^-54``.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from torch_format import write_zip

HEAD_DIM, INTER, PAIRS, A = 16, 32, 4, 32.0


def layer_config(hidden: int, vocab: int) -> dict:
    """The head's decoder layer, as both layouts' configs name it (a Llama layer)."""
    return dict(
        model_type="llama",
        num_hidden_layers=1,
        hidden_act="silu",
        hidden_size=hidden,
        intermediate_size=INTER,
        num_attention_heads=hidden // HEAD_DIM,
        num_key_value_heads=hidden // HEAD_DIM,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        max_position_embeddings=512,
        rope_theta=10000.0,
        attention_bias=True,
    )


def dims(target):
    """``(hidden, vocab)`` of a target model."""
    return target.model.embed_tokens.weight.shape[1], target.model.embed_tokens.weight.shape[0]


def draft_vocabulary(target, size: int) -> np.ndarray:
    """``size`` target ids, sorted, holding every token the target predicts
    from one token alone (the reduced vocabulary's ids, so d2t is not the identity)."""
    e = target.model.embed_tokens.weight
    logits = target.lm_head(target.model.norm(e))
    predicted = sorted(set(np.array(mx.argmax(logits, axis=-1)).tolist()))
    rest = [i for i in range(e.shape[0] - 1, -1, -1) if i not in predicted]
    assert len(predicted) <= size, (len(predicted), size)
    return np.array(sorted(predicted + rest[: size - len(predicted)]), np.int64)


def pass_through_tensors(target, ids: np.ndarray, eagle_layout: bool) -> dict:
    """The head's tensors with the published names (``midlayer.*`` and no
    embedding in the EAGLE repository's layout)."""
    (h, vocab), f32 = dims(target), np.float32
    bias = np.zeros((h // HEAD_DIM, HEAD_DIM), f32)
    bias[:, :PAIRS] = A
    layer = "midlayer" if eagle_layout else "layers.0"
    w = {
        "fc.weight": np.zeros((h, 3 * h), f32),
        "norm.weight": np.array(target.model.norm.weight, f32),
        "lm_head.weight": np.array(target.lm_head.weight, f32)[ids],
    }
    if len(ids) < vocab:  # a reduced draft vocabulary: d2t (and its inverse t2d) map it back
        w["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
        w["t2d"] = np.isin(np.arange(vocab), ids)
    if not eagle_layout:
        w["embed_tokens.weight"] = np.array(target.model.embed_tokens.weight, f32)
    parts = {
        "input_layernorm.weight": np.ones(h, f32),
        "hidden_norm.weight": np.zeros(h, f32),
        "post_attention_layernorm.weight": np.ones(h, f32),
        "self_attn.q_proj.weight": np.zeros((h, 2 * h), f32),
        "self_attn.q_proj.bias": bias.reshape(-1),
        "self_attn.k_proj.weight": np.zeros((h, 2 * h), f32),
        "self_attn.k_proj.bias": bias.reshape(-1),
        "self_attn.v_proj.weight": np.concatenate([np.eye(h, dtype=f32), np.zeros((h, h), f32)], axis=1),
        "self_attn.v_proj.bias": np.zeros(h, f32),
        "self_attn.o_proj.weight": np.eye(h, dtype=f32),
        "self_attn.o_proj.bias": np.zeros(h, f32),
        "mlp.gate_proj.weight": np.zeros((INTER, h), f32),
        "mlp.up_proj.weight": np.zeros((INTER, h), f32),
        "mlp.down_proj.weight": np.zeros((h, INTER), f32),
    }
    w.update({f"{layer}.{k}": v for k, v in parts.items()})
    return w


def save_pass_through_head(folder, target, layout: str, draft_vocab: int, layer_ids=None) -> Path:
    """A right-by-construction head for ``target`` in ``layout`` (``"speculators"``:
    config.json with ``transformer_layer_config``, model.safetensors;
    ``"eagle"``: the EAGLE repository's flat Llama config and a PyTorch
    ``pytorch_model.bin``). ``layer_ids``: its taps (None: the default ones)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = draft_vocabulary(target, draft_vocab)
    tensors = pass_through_tensors(target, ids, layout == "eagle")
    hidden, vocab = dims(target)
    layer = layer_config(hidden, vocab)
    if layout == "eagle":
        config = {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": draft_vocab}
        config["tie_word_embeddings"] = False
        write_zip(folder / "pytorch_model.bin", tensors)
    else:
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "draft_vocab_size": draft_vocab,
            "target_hidden_size": hidden,
            "norm_before_residual": True,
            "transformer_layer_config": layer,
        }
        mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in tensors.items()})
    if layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(layer_ids)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
