"""Native MTP heads: loading every layout, parity with mlx-vlm, the next-n families' forward."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, load_model

from mlx_redrafter.draft.head import LayerHead
from mlx_redrafter.draft.mtp_load import find_mtp, load_mtp, locate_mtp
from mlx_redrafter.errors import RedrafterError

FIXTURE = Path(__file__).parent / "fixtures" / "mtp_qwen3_5"


@pytest.fixture(scope="module")
def qwen35():
    """The fixture's tiny Qwen3.5, loaded by mlx-lm (which drops the ``mtp.*`` weights)."""
    model, _ = load_model(FIXTURE / "checkpoint")
    return model


@pytest.mark.parametrize("where", ["checkpoint", "split"])
def test_the_head_matches_mlx_vlm_on_both_layouts(qwen35, where):
    """The original checkpoint (zero-centred norms, +1 on load) and mlx-vlm's
    split folder give mlx-vlm's logits, on the first call and a chained one."""
    expected = mx.load(str(FIXTURE / "expected.safetensors"))
    head = load_mtp(qwen35, FIXTURE / where)
    assert isinstance(head, LayerHead) and head.source == "mtp" and head.taps is None
    assert head.found.layout == where and head.found.family == "qwen3_5"
    cache = head.make_cache()
    logits, hidden = head(expected["tokens"], expected["hidden"], cache, first=True)
    assert cache[0].offset == expected["tokens"].shape[1]
    assert mx.allclose(logits, expected["logits"], atol=1e-4, rtol=1e-4)
    chained, _ = head(expected["chained_token"], hidden[:, -1:], cache, first=False)
    assert mx.allclose(chained, expected["chained_logits"], atol=1e-4, rtol=1e-4)


def test_a_model_loaded_from_its_checkpoint_finds_its_head(qwen35, tmp_path):
    """Without a path the head is read from the folder the model was loaded from."""
    assert load_mtp(qwen35) is None  # mlx-lm's loader records no folder
    qwen35.redrafter_path = FIXTURE / "checkpoint"
    try:
        head = load_mtp(qwen35)
        assert head is not None and head.found.path == FIXTURE / "checkpoint"
    finally:
        del qwen35.redrafter_path


def test_a_checkpoint_without_mtp_weights_has_no_head(qwen35, tmp_path):
    folder = tmp_path / "converted"
    folder.mkdir()
    shutil.copy(FIXTURE / "checkpoint" / "config.json", folder)
    weights = mx.load(str(FIXTURE / "checkpoint" / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"), {k: v for k, v in weights.items() if "mtp." not in k})
    assert find_mtp(folder) is None
    with pytest.raises(RedrafterError, match="No MTP weights"):
        locate_mtp(qwen35, folder)
    with pytest.raises(RedrafterError, match="does not exist"):
        locate_mtp(qwen35, tmp_path / "nowhere")


def test_a_split_folder_for_another_model_is_refused(qwen35, tmp_path):
    folder = tmp_path / "split"
    shutil.copytree(FIXTURE / "split", folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["hidden_size"] = 128
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(RedrafterError, match="hidden_size 128"):
        load_mtp(qwen35, folder)


# --------------------------------------------------------------------------- DeepSeek-V3 style next-n layer

DEEPSEEK = dict(
    model_type="deepseek_v3",
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
)


def _random(module, seed):
    """``module`` with random weights: matrices N(0, 0.2), norms and biases 1 + N(0, 0.1)."""
    from mlx.utils import tree_unflatten

    mx.random.seed(seed)
    flat = [
        (k, 0.2 * mx.random.normal(v.shape) if v.ndim > 1 else 1 + 0.1 * mx.random.normal(v.shape))
        for k, v in tree_flatten(module.parameters())
    ]
    module.update(tree_unflatten(flat))
    return module


def deepseek_checkpoint(folder: Path):
    """A tiny DeepSeek-V3 target and, in its folder, the next-n layer in the
    original layout (``model.layers.2.*``: experts one by one, ``kv_b_proj``),
    plus the pieces the test's own reference forward uses."""
    model_cls, args_cls = _get_classes(DEEPSEEK)
    args = args_cls.from_dict(DEEPSEEK)
    target = _random(model_cls(args), 0)
    layer = _random(type(target.model.layers[0])(args, 2), 1)  # MoE: 2 >= first_k_dense_replace
    extra = _random(_NextN(64, 97), 2)
    keys = {}
    for k, v in tree_flatten(layer.parameters()):
        if ".switch_mlp." in k:  # back to the checkpoint's experts one by one
            for e in range(v.shape[0]):
                keys[k.replace("switch_mlp", f"experts.{e}")] = v[e]
        elif k.endswith(("embed_q.weight", "unembed_out.weight")):
            continue
        else:
            keys[k] = v
    attn = layer.self_attn
    kv_b = mx.concatenate([attn.embed_q.weight.swapaxes(-1, -2), attn.unembed_out.weight], axis=1)
    keys["self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
    for k, v in tree_flatten(extra.parameters()):
        keys[k] = v
    keys["embed_tokens.weight"] = target.model.embed_tokens.weight
    folder.mkdir(parents=True, exist_ok=True)
    weights = {f"model.layers.2.{k}": v for k, v in keys.items()}
    weights.update({k: v for k, v in tree_flatten(target.parameters())})
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(DEEPSEEK))
    return target, layer, extra


class _NextN(nn.Module):
    """The next-n layer's own parts, named as in the checkpoint."""

    def __init__(self, h, v):
        super().__init__()
        self.enorm, self.hnorm = nn.RMSNorm(h), nn.RMSNorm(h)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = {"norm": nn.RMSNorm(h), "head": nn.Linear(h, v, bias=False)}


def _next_n_reference(target, layer, extra, tokens, feats, mask_first=True):
    """vLLM's DeepSeekMultiTokenPredictorLayer, written out: ``(logits, hidden before the head's norm)``."""
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import KVCache

    emb = target.model.embed_tokens(tokens)
    if mask_first:
        emb = mx.where((mx.arange(tokens.shape[1]) == 0)[None, :, None], 0, emb)
    x = extra.eh_proj(mx.concatenate([extra.enorm(emb), extra.hnorm(feats)], axis=-1))
    cache = KVCache()
    x = layer(x, create_attention_mask(x, cache, return_array=True), cache)
    return extra.shared_head["head"](extra.shared_head["norm"](x)), x


def test_a_deepseek_v3_next_n_layer_runs_vllms_forward(tmp_path):
    """Names mapped, experts stacked and kv_b_proj split by mlx-lm's own
    sanitize; the token embedding zeroed at position 0; the chained hidden
    state is taken before the shared head's norm (vLLM's deepseek_mtp.py)."""
    target, layer, extra = deepseek_checkpoint(tmp_path / "ds")
    head = load_mtp(target, tmp_path / "ds")
    assert head.found.family == "deepseek_v3" and head.found.layout == "checkpoint"
    mx.random.seed(5)
    tokens = mx.random.randint(0, 97, (1, 5)).astype(mx.int32)
    feats = mx.random.normal((1, 5, 64))
    logits, hidden = head(tokens, feats, head.make_cache(), first=True)
    want, x = _next_n_reference(target, layer, extra, tokens, feats)
    # float32, the same ops in another order (MLA's weights rebuilt from kv_b_proj): 1e-3
    assert mx.allclose(logits, want, atol=1e-3, rtol=1e-3)
    assert mx.allclose(hidden, x, atol=1e-3, rtol=1e-3)
    unmasked, _ = _next_n_reference(target, layer, extra, tokens, feats, mask_first=False)
    assert not mx.allclose(logits, unmasked, atol=1e-3)  # position 0's embedding did matter
