"""Tiny random hybrid models (recurrent layers between attention layers), built
with mlx-lm's own classes in the layouts their families publish.

Each family keeps a recurrent state in an ``ArraysCache``: gated delta nets
(qwen3_5, qwen3_5_moe, qwen3_next, kimi_linear), Mamba2 (nemotron_h,
granitemoehybrid, falcon_h1), short convolutions (lfm2, lfm2_moe).
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.utils import _get_classes

VOCAB = 97
HIDDEN = 64

_QWEN35_TEXT = dict(
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
    tie_word_embeddings=False,
    rope_parameters=dict(rope_theta=10000.0, partial_rotary_factor=0.5, rope_type="default"),
)

HYBRID_CONFIGS = {
    "qwen3_5": dict(model_type="qwen3_5", text_config=dict(model_type="qwen3_5_text", **_QWEN35_TEXT)),
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe",
        text_config=dict(
            model_type="qwen3_5_moe_text",
            **_QWEN35_TEXT,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    ),
    "qwen3_next": dict(
        model_type="qwen3_next",
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=32,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        max_position_embeddings=512,
        full_attention_interval=2,
    ),
    "nemotron_h": dict(
        model_type="nemotron_h",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        max_position_embeddings=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=False,
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=16,
        conv_kernel=4,
        n_groups=2,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        hybrid_override_pattern=["M", "*", "M", "-"],
        num_hidden_layers=4,
    ),
    "granitemoehybrid": dict(
        model_type="granitemoehybrid",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=4,
        max_position_embeddings=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=False,
        embedding_multiplier=2.0,
        attention_multiplier=0.25,
        logits_scaling=2.0,
        residual_multiplier=0.5,
        layer_types=["mamba", "attention", "mamba", "attention"],
        rms_norm_eps=1e-6,
        shared_intermediate_size=128,
        # transformers checks mamba_n_heads * mamba_d_head == 2 * hidden_size
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_proj_bias=False,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_n_groups=2,
        mamba_conv_bias=True,
        tie_word_embeddings=True,
    ),
    "falcon_h1": dict(
        model_type="falcon_h1",
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_d_conv=4,
        mamba_d_head=16,
        mamba_d_ssm=64,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_n_heads=4,
        vocab_size=VOCAB,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    "lfm2": dict(
        model_type="lfm2",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=HIDDEN,
        block_ff_dim=128,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        full_attn_idxs=[1, 3],
        rope_theta=10000.0,
    ),
    "lfm2_moe": dict(
        model_type="lfm2_moe",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_expert_bias=False,
        num_dense_layers=1,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        rope_theta=10000.0,
    ),
    "kimi_linear": dict(
        model_type="kimi_linear",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        linear_attn_config=dict(num_heads=4, head_dim=16, short_conv_kernel_size=4, kda_layers=[1]),
        model_max_length=512,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        tie_word_embeddings=False,
    ),
}

FAMILIES = list(HYBRID_CONFIGS)


def tiny_hybrid(kind: str, seed: int = 0, scale: float = 4.0, **changes):
    """A random mlx-lm model of a hybrid family, float32, parameters evaluated;
    weights scaled up so that argmax margins are far above float32 rounding.
    ``changes`` (e.g. ``vocab_size=5``) go into the text config."""
    config = dict(HYBRID_CONFIGS[kind])
    if "text_config" in config:
        config["text_config"] = {**config["text_config"], **changes}
    else:
        config.update(changes)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    model.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model
