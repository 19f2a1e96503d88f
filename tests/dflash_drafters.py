"""DFlash drafters for the tests (tests/test_dflash*.py): random ones written
in either published layout, with the published config fields and tensor
names, and an oracle whose blocks hold the target's own continuation.

* z-lab's layout: a flat Qwen3 config with ``architectures:
  ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` and
  ``dflash_config: {mask_token_id, target_layer_ids}``; tensors ``fc``,
  ``hidden_norm``, ``norm``, ``layers.N.*`` (no embedding, no LM head).
* vLLM speculators': ``speculators_model_type: "dflash"``, the layer in
  ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` (hidden_states
  indexes: one more than z-lab's ids), a reduced ``draft_vocab_size`` with its
  ``lm_head``, ``d2t`` and ``t2d``, and the ``embed_tokens`` and
  ``verifier_norm`` copies such exports may carry (left out when read).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_redrafter.draft.dflash import DFlashDrafter

HEAD_DIM, INTER = 16, 48


def dims(target):
    """``(hidden, vocab, layers)`` of a target model."""
    from mlx_redrafter.llm.identity import model_dims

    return model_dims(target)


def layer_config(hidden: int, vocab: int, layers: int, **extra) -> dict:
    return dict(
        model_type="qwen3",
        hidden_act="silu",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=INTER,
        num_attention_heads=hidden // HEAD_DIM,
        num_key_value_heads=max(1, hidden // HEAD_DIM // 2),
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        attention_bias=False,
        tie_word_embeddings=False,
        **extra,
    )


def random_tensors(hidden: int, taps: int, layers: int, seed: int, scale: float = 1.0) -> dict:
    """Random weights of a DFlash drafter, z-lab's names (norm weights near 1)."""
    rng = np.random.default_rng(seed)
    heads, kv = hidden // HEAD_DIM, max(1, hidden // HEAD_DIM // 2)
    f32 = np.float32

    def lin(o, i):
        return (rng.standard_normal((o, i)) * scale / np.sqrt(i)).astype(f32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(f32)

    w = {"fc.weight": lin(hidden, taps * hidden), "hidden_norm.weight": norm(hidden), "norm.weight": norm(hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        w.update(
            {
                p + "self_attn.q_proj.weight": lin(heads * HEAD_DIM, hidden),
                p + "self_attn.k_proj.weight": lin(kv * HEAD_DIM, hidden),
                p + "self_attn.v_proj.weight": lin(kv * HEAD_DIM, hidden),
                p + "self_attn.o_proj.weight": lin(hidden, heads * HEAD_DIM),
                p + "self_attn.q_norm.weight": norm(HEAD_DIM),
                p + "self_attn.k_norm.weight": norm(HEAD_DIM),
                p + "mlp.gate_proj.weight": lin(INTER, hidden),
                p + "mlp.up_proj.weight": lin(INTER, hidden),
                p + "mlp.down_proj.weight": lin(hidden, INTER),
                p + "input_layernorm.weight": norm(hidden),
                p + "post_attention_layernorm.weight": norm(hidden),
            }
        )
    return w


def save_zlab(
    folder,
    target,
    target_layer_ids,
    *,
    layers: int = 2,
    block: int = 6,
    mask: int = 3,
    seed: int = 0,
    newer: bool = False,
    layer_types=None,
    sliding_window=None,
    tensors=None,
) -> Path:
    """A random drafter for ``target`` in z-lab's layout (``newer``: ``block_size`` in ``dflash_config``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hidden, vocab, n = dims(target)
    extra = {}
    if layer_types is not None:
        extra.update(layer_types=list(layer_types), sliding_window=sliding_window)
    config = {
        "architectures": ["DFlashDraftModel"],
        **layer_config(hidden, vocab, layers, **extra),
        "num_target_layers": n,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(target_layer_ids)},
        "torch_dtype": "float32",
    }
    if newer:
        config["dflash_config"]["block_size"] = block
    else:
        config["block_size"] = block
    tensors = tensors if tensors is not None else random_tensors(hidden, len(target_layer_ids), layers, seed)
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in tensors.items()})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def save_speculators(
    folder, target, target_layer_ids, *, draft_vocab: int, layers: int = 2, block: int = 6, mask: int = 3, seed: int = 0
) -> Path:
    """A random drafter for ``target`` in vLLM speculators' layout, its vocabulary reduced to ``draft_vocab``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hidden, vocab, _ = dims(target)
    rng = np.random.default_rng(seed + 100)
    ids = np.sort(rng.choice(vocab, draft_vocab, replace=False)).astype(np.int64)
    w = random_tensors(hidden, len(target_layer_ids), layers, seed)
    w["lm_head.weight"] = np.array(
        target.lm_head.weight if "lm_head" in target else target.model.embed_tokens.weight, np.float32
    )[ids]
    w["d2t"] = ids - np.arange(draft_vocab)
    w["t2d"] = np.isin(np.arange(vocab), ids)
    w["embed_tokens.weight"] = np.array(target.model.embed_tokens.weight, np.float32)
    w["verifier_norm.weight"] = np.ones(hidden, np.float32)
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer_config(hidden, vocab, layers),
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden,
        "block_size": block,
        "aux_hidden_state_layer_ids": [i + 1 for i in target_layer_ids],
        "mask_token_id": mask,
        "speculators_version": "0.3.0",
    }
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in w.items()})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


class OracleDFlash(DFlashDrafter):
    """A real DFlash drafter whose block logits are replaced by the target's
    own continuation, found from where its context ends: the block after
    ``p`` context entries predicts ``text[p + 1 ...]``. So its drafts are
    right exactly when its cache holds one entry per token of the target's.

    Each step (``calls``) it spoils some positions (irregularly: partial
    acceptance of every length) and, with ``rank > 0``, lowers the truth at
    one position to the ``rank``-th best (cycling ``1..rank``), so that the
    right path is another row of the tree each step. Its real forward still
    runs (the context is cached through it)."""

    def __init__(self, config, text, rank: int = 0):
        super().__init__(config)
        object.__setattr__(self, "_text", list(text))
        object.__setattr__(self, "_rank", rank)
        object.__setattr__(self, "calls", 0)

    def block_logits(self, tokens, cache):
        real = super().block_logits(tokens, cache)  # the real forward, kept in the graph
        length, vocab = tokens.shape[1] - 1, real.shape[-1]
        p = cache[0].offset
        truth = [self._text[min(p + 1 + j, len(self._text) - 1)] for j in range(length)]
        step = self.calls
        object.__setattr__(self, "calls", step + 1)
        spoil = (step * 5 + 3) % (length + 2)  # no spoiled position (the whole block right) when >= length
        logits = np.full((length, vocab), -20.0, np.float32)
        for j, t in enumerate(truth):
            if j == spoil:
                t = (t + 1) % vocab
            order = [t] + [(t + 1 + i) % vocab for i in range(vocab - 1)]
            rank = 1 + step % self._rank if self._rank and j == step % length else 0
            order[0], order[rank] = order[rank], order[0]
            for r, tok in enumerate(order[:4]):
                logits[j, tok] = 10.0 - 2.0 * r
        return mx.array(logits)[None] + 0.0 * real
