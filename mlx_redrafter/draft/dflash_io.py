"""DFlash drafters on disk: both published layouts in, z-lab's out.

* **z-lab** (``z-lab/Qwen3-8B-DFlash-b16``, the Qwen3.5 and Qwen3-Coder
  series): a flat Qwen3 ``config.json`` with ``architectures:
  ["DFlashDraftModel"]``, ``block_size`` (newer configs move it into
  ``dflash_config``), ``num_target_layers`` and ``dflash_config:
  {mask_token_id, target_layer_ids}`` (the outputs of the target's
  ``layers[lid]``, 0-based), optionally ``layer_types`` and
  ``sliding_window``; tensors ``fc``, ``hidden_norm``, ``norm`` and
  ``layers.N.*`` (a ``model.`` prefix is dropped). No embedding and no LM
  head: the target's are used.
* **vLLM speculators** (``speculators_model_type: "dflash"``): the Qwen3
  fields in ``transformer_layer_config``, ``block_size``, ``mask_token_id``,
  ``aux_hidden_state_layer_ids`` (Hugging Face ``hidden_states`` indexes:
  ``target_layer_ids`` are one less, as vLLM's ``update_dflash`` maps
  them), ``target_hidden_size`` and a reduced ``draft_vocab_size`` with its
  own ``lm_head`` and ``d2t`` (``t2d`` is checked and dropped; an
  ``embed_tokens`` or ``verifier_*`` copy of the target's is left out).

:func:`save_dflash` writes z-lab's layout, so what ``make-drafter --head
dflash`` trains loads in z-lab's code, mlx-vlm and vLLM too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ..errors import RedrafterError
from ..files import atomic_file, write_text_atomic
from .dflash import DFlashConfig, DFlashDrafter

ZLAB_ARCH = "DFlashDraftModel"
ZLAB, SPECULATORS = "z-lab", "speculators"
QWEN3_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "attention_bias",
    "layer_types",
    "sliding_window",
)
SKIPPED = ("embed_tokens.weight", "t2d")  # a copy of the target's embedding; d2t inverted
SKIPPED_PREFIXES, SKIPPED_SUFFIXES = ("verifier_",), ("rotary_emb.inv_freq",)


def layout_of(d: dict) -> Optional[str]:
    """``"z-lab"``, ``"speculators"`` or None (not a DFlash drafter) for a config dict."""
    if d.get("speculators_model_type") == "dflash":
        return SPECULATORS
    if ZLAB_ARCH in (d.get("architectures") or []) or "dflash_config" in d:
        return ZLAB
    return None


def config_from_dict(d: dict, where: str = "config.json") -> DFlashConfig:
    """The :class:`DFlashConfig` of either layout's ``config.json``."""
    layout = layout_of(d)
    if layout is None:
        raise RedrafterError(f"{where} is not a DFlash drafter's config.")
    dflash = dict(d.get("dflash_config") or {})
    if layout == SPECULATORS:
        layer = dict(d.get("transformer_layer_config") or {})
        aux = d.get("aux_hidden_state_layer_ids")
        ids = [i - 1 for i in aux] if aux else None
        mask, block = d.get("mask_token_id"), d.get("block_size")
        draft_vocab, target_hidden = d.get("draft_vocab_size"), d.get("target_hidden_size")
    else:
        layer = dict(d)
        ids, mask = dflash.get("target_layer_ids"), dflash.get("mask_token_id")
        block = dflash.get("block_size", d.get("block_size"))
        draft_vocab, target_hidden = None, d.get("target_hidden_size")
    missing = [
        k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size") if k not in layer
    ]
    missing += [
        k
        for k, v in (("target_layer_ids", ids), ("mask_token_id", mask), ("vocab_size", layer.get("vocab_size")))
        if v is None
    ]
    if missing:
        raise RedrafterError(f"{where} lacks {', '.join(missing)}.", "Use the DFlash drafter's own config.json.")
    if layer.get("hidden_act", "silu") != "silu":
        raise RedrafterError(f"{where}: hidden_act {layer['hidden_act']!r} is not supported (only silu).")
    args = {k: layer[k] for k in QWEN3_FIELDS if layer.get(k) is not None}
    args.setdefault("num_key_value_heads", args["num_attention_heads"])
    known = {"dflash_config", "transformer_layer_config", "aux_hidden_state_layer_ids", "mask_token_id", "block_size"}
    known |= {"draft_vocab_size", "target_hidden_size", "num_target_layers"} | set(QWEN3_FIELDS)
    return DFlashConfig(
        target_layer_ids=tuple(ids),
        mask_token_id=int(mask),
        block_size=int(block or 16),
        num_target_layers=d.get("num_target_layers"),
        draft_vocab_size=draft_vocab,
        target_hidden_size=target_hidden,
        causal=dflash.get("causal"),
        extra={k: v for k, v in d.items() if k not in known},
        **args,
    )


def _tensors(folder: Path) -> dict:
    from .eagle3_io import _tensors as read

    return read(folder)


def _check_keys(drafter: DFlashDrafter, weights: dict, source: str) -> None:
    from mlx.utils import tree_flatten

    expected = dict(tree_flatten(drafter.parameters()))
    missing, unknown = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unknown:
        parts = ([f"missing keys: {', '.join(missing)}"] if missing else []) + (
            [f"unknown keys: {', '.join(unknown)}"] if unknown else []
        )
        raise RedrafterError(
            f"The DFlash drafter's weights in {source} do not match its config.json ({'; '.join(parts)}).",
            "Check that config.json belongs to these weights.",
        )
    for k, v in expected.items():
        if tuple(weights[k].shape) != tuple(v.shape):
            raise RedrafterError(
                f"DFlash weight {k} in {source} has shape {tuple(weights[k].shape)} "
                f"but config.json implies {tuple(v.shape)}.",
                "Check hidden_size, intermediate_size, the head counts, the taps and draft_vocab_size.",
            )


def read_dflash(path, dtype=None) -> DFlashDrafter:
    """The DFlash drafter in folder ``path`` (either layout); it drafts once
    :meth:`~mlx_redrafter.draft.dflash.DFlashDrafter.bind` gave it its target's
    embedding and LM head. ``dtype`` defaults to the LLM policy."""
    from ..llm.load import default_dtype, parse_dtype
    from .eagle3_io import _check_t2d, read_config_dict

    path = Path(path).expanduser()
    path = path.parent if path.is_file() else path
    config = config_from_dict(read_config_dict(path), str(path / "config.json"))
    raw = {}
    for k, v in _tensors(path).items():
        k = k[len("model.") :] if k.startswith("model.") else k
        raw[k] = v
    if "t2d" in raw and "d2t" in raw:
        _check_t2d(raw["t2d"].astype(bool), raw["d2t"].astype(np.int64), str(path))
    raw = {
        k: v
        for k, v in raw.items()
        if k not in SKIPPED and not k.startswith(SKIPPED_PREFIXES) and not k.endswith(SKIPPED_SUFFIXES)
    }
    drafter = DFlashDrafter(config)
    _check_keys(drafter, raw, str(path))
    dtype = parse_dtype(dtype) or default_dtype()
    weights = [(k, mx.array(v.astype(np.int32)) if k == "d2t" else mx.array(v).astype(dtype)) for k, v in raw.items()]
    drafter.load_weights(weights)
    mx.eval(drafter.parameters())
    drafter.source_path = path
    return drafter


def zlab_config(config: DFlashConfig) -> dict:
    """``config`` as z-lab's ``config.json`` (what a read config carried besides, kept)."""
    out = {k: v for k, v in config.extra.items() if k not in ("speculators_model_type", "speculators_config")}
    out.update({k: getattr(config, k) for k in QWEN3_FIELDS if getattr(config, k) is not None})
    dflash = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)}
    if config.causal is not None:
        dflash["causal"] = config.causal
    out.update(
        architectures=[ZLAB_ARCH],
        model_type="qwen3",
        hidden_act="silu",
        tie_word_embeddings=False,
        block_size=config.block_size,
        num_target_layers=config.num_target_layers,
        dflash_config=dflash,
    )
    if config.target_hidden_size != config.hidden_size:
        out["target_hidden_size"] = config.target_hidden_size
    return out


def save_dflash(drafter: DFlashDrafter, path, dtype=None, extra_config: Optional[dict] = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in z-lab's layout (a drafter
    over the target's vocabulary: a reduced one has no place in it)."""
    from mlx.utils import tree_flatten

    from ..llm.load import parse_dtype

    if drafter.reduced:
        raise RedrafterError(
            "z-lab's DFlash layout has no reduced draft vocabulary.", "Save a drafter over the target's vocabulary."
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = parse_dtype(dtype)
    weights = {k: (v.astype(dtype) if dtype is not None else v) for k, v in tree_flatten(drafter.parameters())}
    cfg = zlab_config(drafter.config)
    cfg["torch_dtype"] = str(weights["fc.weight"].dtype).split(".")[-1]
    cfg.update(extra_config or {})
    with atomic_file(path / "model.safetensors") as tmp:
        mx.save_safetensors(str(tmp), weights, {"format": "pt"})
    write_text_atomic(path / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path
