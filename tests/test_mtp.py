"""Native MTP heads: loading every layout, parity with mlx-vlm, the next-n families' forward.

Mutations seen caught here (bench/mutations.py): C4 (the two input norms swapped)."""

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


def deepseek_checkpoint(folder: Path, leak=None):
    """A tiny DeepSeek-V3 target and, in its folder, the next-n layer in the
    original layout (``model.layers.2.*``: experts one by one, ``kv_b_proj``),
    plus the pieces the test's own reference forward uses. ``leak``: random
    weights made predictable (:func:`_pass_through`)."""
    model_cls, args_cls = _get_classes(DEEPSEEK)
    args = args_cls.from_dict(DEEPSEEK)
    target = _random(model_cls(args), 0)
    layer = _random(type(target.model.layers[0])(args, 2), 1)  # MoE: 2 >= first_k_dense_replace
    extra = _random(_NextN(64, 97), 2)
    if leak is not None:
        _pass_through(target, layer, extra, leak)
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


def _scale_outputs(module, factor):
    """Scale the projections that write a layer's output (attention's
    ``o_proj``, every MLP's and expert's ``down_proj``) by ``factor``."""
    from mlx.utils import tree_unflatten

    ends = ("o_proj.weight", "down_proj.weight")
    module.update(tree_unflatten([(k, v * factor) for k, v in tree_flatten(module.parameters()) if k.endswith(ends)]))


def _pass_through(target, layer, extra, leak):
    """The target's layers add only ``leak`` times their outputs (its next
    token then mostly follows from the current one), and the next-n layer
    passes the token through: ``eh_proj`` keeps the embedding half, the layer
    adds nothing, ``shared_head`` is the target's norm and LM head. The head
    is then right by construction at ``leak=0``, and mostly right above it."""
    _scale_outputs(target, leak)
    _scale_outputs(layer, 0.0)
    extra.eh_proj.weight = mx.concatenate([mx.eye(64), mx.zeros((64, 64))], axis=1)
    extra.enorm.weight = extra.hnorm.weight = mx.ones((64,))
    extra.shared_head["norm"].weight = target.model.norm.weight
    extra.shared_head["head"].weight = target.lm_head.weight
    mx.eval(target.parameters(), layer.parameters(), extra.parameters())


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


def test_a_deepseek_v3_target_drafts_with_its_next_n_head_exactly(tmp_path):
    """MLA attention through tree verification, with the next-n head's beams
    and lookup in one tree: plain decoding's tokens, the head's drafts
    accepted whole, in part and not at all (a pass-through head on a leaky
    target), and the head's cache a clean pass over the kept tokens."""
    from helpers import accepted_in_steps
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_redrafter.config import DraftConfig
    from mlx_redrafter.generate import generate_tokens
    from mlx_redrafter.llm.parts import model_parts

    target, _, _ = deepseek_checkpoint(tmp_path / "ds", leak=0.02)
    head = load_mtp(target, tmp_path / "ds")
    prompt = [5, 9, 11, 3, 5, 9]
    plain, _ = generate_tokens(target, prompt, max_tokens=40)
    cache = make_prompt_cache(target)
    tokens, stats = generate_tokens(
        target,
        prompt,
        draft=DraftConfig(head=head, head_width=2, head_length=2, lookup=1),
        max_tokens=24,
        prompt_cache=cache,
    )
    assert tokens == plain[:24] and max(s.tree_size for s in stats) >= 5  # head beams (2 x 2) and lookup verified
    assert accepted_in_steps(stats, 24, "mtp") >= 5  # 10 measured
    assert {0, 1, 2} <= {s.accepted for s in stats[1:]}
    held = cache[0].offset
    ids = mx.array((prompt + plain)[:held], mx.int32)[None]
    _, backbone, _ = model_parts(target)
    ref = head.make_cache()
    head(ids[:, 1:], backbone(ids)[:, :-1], ref, first=True)
    assert cache[-1].offset == held - 1
    got = cache[-1].keys[..., : held - 1, :]
    assert mx.allclose(got, ref[0].keys[..., : held - 1, :], atol=1e-3, rtol=1e-3)


QWEN3_NEXT = dict(
    model_type="qwen3_next",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
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
    vocab_size=97,
    rope_theta=10000.0,
    partial_rotary_factor=0.25,
    max_position_embeddings=512,
    full_attention_interval=2,
    tie_word_embeddings=False,
)


def test_a_qwen3_next_checkpoint_head_stacks_experts_and_restores_norms(tmp_path):
    """Qwen3-Next's ``mtp.*``: experts stored one by one become mlx-lm's
    ``switch_mlp``, every zero-centred norm gains 1, the layer is the
    family's MoE full-attention layer (vLLM's ``qwen3_next_mtp.py``)."""
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import KVCache
    from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

    model_cls, args_cls = _get_classes(QWEN3_NEXT)
    args = args_cls.from_dict(QWEN3_NEXT)
    target = _random(model_cls(args), 0)
    layer = _random(Qwen3NextDecoderLayer(args, layer_idx=1), 1)
    fc = _random(nn.Linear(128, 64, bias=False), 2)
    norms = {n: 1 + 0.1 * mx.random.normal((64,)) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    keys = {"mtp.fc.weight": fc.weight, **{f"mtp.{n}.weight": w - 1 for n, w in norms.items()}}
    for k, v in tree_flatten(layer.parameters()):
        if ".switch_mlp." in k:
            for e in range(v.shape[0]):
                keys[f"mtp.layers.0.{k.replace('switch_mlp', f'experts.{e}')}"] = v[e]
        else:  # zero-centred in the checkpoint: the loader adds 1 back
            keys[f"mtp.layers.0.{k}"] = v - 1 if k.endswith("norm.weight") and "linear_attn" not in k else v
    folder = tmp_path / "next"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), keys, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(QWEN3_NEXT))
    head = load_mtp(target, folder)
    assert head.found.family == "qwen3_next"
    mx.random.seed(6)
    tokens, feats = mx.random.randint(0, 97, (1, 4)).astype(mx.int32), mx.random.normal((1, 4, 64))
    logits, hidden = head(tokens, feats, head.make_cache(), first=True)
    rms = lambda x, w: mx.fast.rms_norm(x, w, 1e-6)  # noqa: E731
    x = fc(
        mx.concatenate(
            [
                rms(target.model.embed_tokens(tokens), norms["pre_fc_norm_embedding"]),
                rms(feats, norms["pre_fc_norm_hidden"]),
            ],
            axis=-1,
        )
    )
    cache = KVCache()
    x = rms(layer(x, create_attention_mask(x, cache, return_array=True), cache), norms["norm"])
    assert mx.allclose(logits, target.lm_head(x), atol=1e-3, rtol=1e-3) and mx.allclose(hidden, x, atol=1e-3)


def test_quantized_mtp_weights_load_and_follow_the_dtype_policy(qwen35, tmp_path):
    """A split folder with 4-bit MTP weights: on the CPU the head is
    dequantized at load (the model's policy), and its logits are those of the
    same weights stored dequantized."""
    weights = mx.load(str(FIXTURE / "split" / "model.safetensors"))
    quant, dequant = {}, {}
    for k, v in weights.items():
        if v.ndim == 2 and k.endswith(".weight"):
            w, scales, biases = mx.quantize(v, group_size=32, bits=4)
            base = k[: -len(".weight")]
            quant.update({k: w, f"{base}.scales": scales, f"{base}.biases": biases})
            dequant[k] = mx.dequantize(w, scales, biases, group_size=32, bits=4)
        else:
            quant[k] = dequant[k] = v
    heads = []
    for name, tensors in (("q4", quant), ("dq", dequant)):
        folder = tmp_path / name
        shutil.copytree(FIXTURE / "split", folder)
        mx.save_safetensors(str(folder / "model.safetensors"), tensors, {"format": "mlx"})
        heads.append(load_mtp(qwen35, folder))
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in heads[0].named_modules())  # CPU: dequantized
    expected = mx.load(str(FIXTURE / "expected.safetensors"))
    a, _ = heads[0](expected["tokens"], expected["hidden"], heads[0].make_cache(), first=True)
    b, _ = heads[1](expected["tokens"], expected["hidden"], heads[1].make_cache(), first=True)
    assert mx.allclose(a, b, atol=1e-5) and not mx.allclose(a, expected["logits"], atol=1e-3)
