"""A target whose next token needs the features a layer head is handed, and
MTP and EAGLE-3 heads right by construction on it only through those
features (for tests/test_head_features.py).

**The target** (:func:`previous_token_target`): a tiny MiMo (mlx-lm's class)
whose next token is a function of the token *before* the current one,
``t[n+1] = f(t[n-1])``. Its embeddings fill the first half of the hidden
state; layer 1 attends to the previous position alone and copies that
token's normed embedding into the second half; the LM head ``[0 | W]``
reads only the second half (``f(t) = argmax W e_t``); every other layer adds
nothing. Attending to the previous position alone, with queries and keys that
do not depend on the input: both are constant vectors (the projections'
biases) on RoPE's four fastest pairs, the keys' turned back by one position's
angle, so that their dot product ``A^2 sum_k cos(theta_k (i - j - 1))`` peaks
at ``j = i - 1`` (tests/eagle3_heads.py uses the same trick at ``j = i``).

So the layers' outputs differ: layer 0's is ``[e_t, 0]``, layer 1's and
after ``[e_t, n(e_prev)]``.

**The heads.** A head is fed ``(t[p+1], h[p])`` and must predict
``t[p+2] = f(t[p])``: the token it is fed says nothing about it, the
target's features at ``p`` hold ``e(t[p])`` in their first half.

* MTP (MiMo's layout): ``input_proj`` moves the hidden state's first half
  (``e(t[p])``) to the second and keeps the token's embedding in the first;
  its layer adds nothing; the target's LM head then reads ``f(t[p])``. A
  chained call reads the head's own state, whose first half is the token it
  was fed: every depth is right.
* EAGLE-3 (the speculators layout, taps ``[1, 2, 4]``: layers 0, 1, 3):
  ``fc`` takes the first tap's first half plus ``K`` times its second half
  into the second half of its state; the layer adds nothing (``o_proj``
  and the MLP zero); its LM head is the target's over a reduced vocabulary
  (d2t). In order, the first tap is layer 0's ``[e_t, 0]``: right. Reversed,
  it is layer 3's, whose second half ``n(e_prev)`` outweighs ``e_t``: wrong.
  A chained call reads the head's own state again: only depth 1 is right.

Both heads' queries, keys and values are random: their caches hold entries
that depend on the tokens and the features.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

HIDDEN, HALF, VOCAB, HEAD_DIM, PAIRS, A = 64, 32, 97, 16, 4, 32.0
K = 8.0  # how much more the EAGLE-3 head's fc weighs a tap's second half
CONFIG = dict(
    model_type="mimo",
    hidden_size=HIDDEN,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=HIDDEN // HEAD_DIM,
    num_key_value_heads=HIDDEN // HEAD_DIM,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
)
TAPS = [1, 2, 4]  # EAGLE-3 hidden_states indexes: the outputs of layers 0, 1 and 3


def _rope_angles(theta: float) -> np.ndarray:
    """RoPE's angle per position of each of the head's pairs (nn.RoPE, not traditional)."""
    return theta ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)


def previous_token_target(seed: int = 0, scale: float = 4.0):
    """The target described in the module doc, float32, parameters evaluated."""
    model_cls, args_cls = _get_classes(CONFIG)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(CONFIG))
    rng = np.random.default_rng(seed)
    f32 = np.float32
    embed = np.zeros((VOCAB, HIDDEN), f32)
    embed[:, :HALF] = rng.normal(size=(VOCAB, HALF))
    model.model.embed_tokens.weight = mx.array(embed)
    head = np.zeros((VOCAB, HIDDEN), f32)
    head[:, HALF:] = scale * rng.normal(size=(VOCAB, HALF))
    model.lm_head.weight = mx.array(head)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        attn.o_proj.weight = mx.zeros_like(attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
        if i != 1:
            continue
        heads = HIDDEN // HEAD_DIM
        angle = _rope_angles(CONFIG["rope_theta"])[:PAIRS]
        q, k = np.zeros((heads, HEAD_DIM), f32), np.zeros((heads, HEAD_DIM), f32)
        q[:, :PAIRS] = A
        k[:, :PAIRS], k[:, HEAD_DIM // 2 : HEAD_DIM // 2 + PAIRS] = A * np.cos(angle), A * np.sin(angle)
        attn.q_proj.weight, attn.q_proj.bias = mx.zeros_like(attn.q_proj.weight), mx.array(q.reshape(-1))
        attn.k_proj.weight, attn.k_proj.bias = mx.zeros_like(attn.k_proj.weight), mx.array(k.reshape(-1))
        v = np.zeros((HIDDEN, HIDDEN), f32)
        v[:HALF, :HALF] = np.eye(HALF)  # the normed embedding's half
        attn.v_proj.weight, attn.v_proj.bias = mx.array(v), mx.zeros((HIDDEN,))
        o = np.zeros((HIDDEN, HIDDEN), f32)
        o[HALF:, :HALF] = np.eye(HALF)  # into the second half
        attn.o_proj.weight = mx.array(o)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def following(model, token: int) -> int:
    """``f(token)``: the target's next token after ``token`` at the position after it."""
    e = model.model.embed_tokens.weight[token]
    return int(mx.argmax(model.lm_head.weight[:, HALF:] @ e[:HALF]))


def mtp_head(target):
    """The MTP head of the module doc (MiMo's checkpoint names, draft/mtp.py's loader)."""
    from mlx_redrafter.draft.mtp import load_head

    block = type(target.model.layers[0])(target.args)
    mx.eval(block.parameters())
    raw = dict(tree_flatten(block.parameters()))
    raw["self_attn.o_proj.weight"] = mx.zeros_like(raw["self_attn.o_proj.weight"])
    raw["mlp.down_proj.weight"] = mx.zeros_like(raw["mlp.down_proj.weight"])
    fc = np.zeros((HIDDEN, 2 * HIDDEN), np.float32)  # MiMo reads [hidden, token]
    fc[HALF:, :HALF] = np.eye(HALF)  # the state's first half, e(t[p]), into the second
    fc[:HALF, HIDDEN : HIDDEN + HALF] = np.eye(HALF)  # the token's embedding stays in the first
    raw["input_proj.weight"] = mx.array(fc)
    raw["token_layernorm.weight"] = raw["hidden_layernorm.weight"] = mx.ones((HIDDEN,))
    raw["final_layernorm.weight"] = mx.ones((HIDDEN,))
    return load_head(target, "mimo", raw, zero_centred=False)


def draft_vocabulary(target, size: int) -> np.ndarray:
    """``size`` target ids, sorted, holding every ``f(t)`` (the head's reduced vocabulary)."""
    predicted = sorted({following(target, t) for t in range(VOCAB)})
    rest = [i for i in range(VOCAB - 1, -1, -1) if i not in predicted]
    assert len(predicted) <= size, (len(predicted), size)
    return np.array(sorted(predicted + rest[: size - len(predicted)]), np.int64)


def save_eagle3_head(folder, target, draft_vocab: int, seed: int = 1) -> Path:
    """The EAGLE-3 head of the module doc, in the speculators layout (config.json, model.safetensors)."""
    from eagle3_heads import INTER, layer_config

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng, f32, h = np.random.default_rng(seed), np.float32, HIDDEN
    ids = draft_vocabulary(target, draft_vocab)
    fc = np.zeros((h, 3 * h), f32)
    fc[HALF:, :HALF] = np.eye(HALF)  # the first tap's first half, e(t[p]) in layer 0's output ...
    fc[HALF:, HALF:h] = K * np.eye(HALF)  # ... and K times its second half (0 there; n(e_prev) later)
    heads = h // HEAD_DIM
    w = {
        "fc.weight": fc,
        "norm.weight": np.ones(h, f32),
        "lm_head.weight": np.array(target.lm_head.weight, f32)[ids],
        "d2t": (ids - np.arange(len(ids))).astype(np.int64),
        "t2d": np.isin(np.arange(VOCAB), ids),
        "embed_tokens.weight": np.array(target.model.embed_tokens.weight, f32),
    }
    layer = {
        "input_layernorm.weight": np.ones(h, f32),
        "hidden_norm.weight": np.ones(h, f32),
        "post_attention_layernorm.weight": np.ones(h, f32),
        "mlp.gate_proj.weight": np.zeros((INTER, h), f32),
        "mlp.up_proj.weight": np.zeros((INTER, h), f32),
        "mlp.down_proj.weight": np.zeros((h, INTER), f32),
        "self_attn.o_proj.weight": np.zeros((h, heads * HEAD_DIM), f32),
        "self_attn.o_proj.bias": np.zeros(h, f32),
    }
    for name in ("q", "k", "v"):  # random: the cache's entries depend on the token and the state
        layer[f"self_attn.{name}_proj.weight"] = (0.2 * rng.normal(size=(heads * HEAD_DIM, 2 * h))).astype(f32)
        layer[f"self_attn.{name}_proj.bias"] = np.zeros(heads * HEAD_DIM, f32)
    w.update({f"layers.0.{k}": v for k, v in layer.items()})
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": h,
        "norm_before_residual": True,
        "eagle_aux_hidden_state_layer_ids": TAPS,
        "transformer_layer_config": layer_config(h, VOCAB),
    }
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in w.items()})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


class Rewired:
    """A layer head whose target features are changed before it reads them
    (``change(features)`` on each call with the target's features), otherwise
    the head itself: what it would draft if the loop fed it these."""

    def __init__(self, head, change):
        object.__setattr__(self, "inner", head)
        object.__setattr__(self, "change", change)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, tokens, features, cache, first: bool = True, last: bool = False):
        if first and features is not None:
            features = self.change(features)
        return self.inner(tokens, features, cache, first, last=last)


def zeros(features):
    return mx.zeros_like(features)


def taps_reversed(features):
    """The three taps ``[..., 3 * H]`` in the other order."""
    a, b, c = mx.split(features[..., : 3 * HIDDEN], 3, axis=-1)
    return mx.concatenate([c, b, a, features[..., 3 * HIDDEN :]], axis=-1)
