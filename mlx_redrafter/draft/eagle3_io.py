"""EAGLE-3 heads on disk: both published layouts in, vLLM's ``speculators`` layout out.

* **speculators** (vLLM's ``Eagle3Speculator``: ``RedHatAI/*.eagle3``, the
  AngelSlim heads): ``config.json`` with ``speculators_model_type: "eagle3"``,
  ``draft_vocab_size``, ``norm_before_residual`` (vLLM reads a missing one as
  true), ``eagle_aux_hidden_state_layer_ids`` and a Llama
  ``transformer_layer_config``; tensors ``embed_tokens``, ``fc``,
  ``layers.0.*``, ``norm``, ``lm_head``, ``d2t`` (int64) and ``t2d`` (bool).
* **EAGLE repository** (``LlamaForCausalLMEagle3``:
  ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``): a flat Llama config with
  ``draft_vocab_size``; the same tensors under ``midlayer.*`` and no
  ``embed_tokens`` (the target's is used), usually in ``pytorch_model.bin``
  (read without running the pickle by hub/locate.py, through
  converters/torch_pickle.py, and handed to :func:`read_eagle3`). Its residual
  is the un-normed state (``norm_before_residual`` false).

``t2d`` is checked against ``d2t`` and not kept (it is ``d2t`` inverted).
Tensors named ``verifier_*`` (a copy of the target's own head some exports
carry) and RoPE's ``rotary_emb.inv_freq`` are left out; any other unknown key
is an error. :func:`save_eagle3` writes the speculators layout, so what
``make-drafter`` trains loads in vLLM and mlx-vlm too; a head that uses the
target's embedding is saved without one (both read the target's then).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ..errors import RedrafterError
from ..files import atomic_file, write_text_atomic
from .eagle3 import Eagle3Config, Eagle3Head

SPECULATORS_ARCH = "Eagle3Speculator"
EAGLE_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
LLAMA_FIELDS = (
    "hidden_size",
    "vocab_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "attention_bias",
    "mlp_bias",
)
SKIPPED_PREFIXES = ("verifier_",)
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def layout_of(d: dict) -> Optional[str]:
    """``"speculators"``, ``"eagle"`` or None (not an EAGLE-3 head) for a config dict."""
    archs = d.get("architectures") or []
    if d.get("speculators_model_type") not in (None, "eagle3"):  # another speculators kind (DFlash)
        return None
    if d.get("speculators_model_type") == "eagle3" or SPECULATORS_ARCH in archs or "transformer_layer_config" in d:
        return "speculators"
    if any(a in EAGLE_ARCHS for a in archs):
        return "eagle"
    return None


def _check_layer(layer: dict, where: str) -> None:
    if (layer.get("num_hidden_layers") or 1) != 1:
        raise RedrafterError(
            f"{where} describes an EAGLE-3 head of {layer['num_hidden_layers']} decoder layers; "
            "only the published one-layer head is supported.",
            "Use a one-layer EAGLE-3 head.",
        )
    if layer.get("hidden_act", "silu") != "silu":
        raise RedrafterError(f"{where}: hidden_act {layer['hidden_act']!r} is not supported (only silu).")
    missing = [k for k in ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads") if k not in layer]
    if missing:
        raise RedrafterError(f"{where} lacks {', '.join(missing)}.", "Use the head's own config.json.")


def config_from_dict(d: dict, where: str = "config.json") -> Eagle3Config:
    """The :class:`Eagle3Config` of either layout's ``config.json``."""
    layout = layout_of(d)
    if layout is None:
        raise RedrafterError(f"{where} is not an EAGLE-3 head's config.")
    layer = dict(d.get("transformer_layer_config") or {}) if layout == "speculators" else dict(d)
    _check_layer(layer, where)
    args = {k: layer[k] for k in LLAMA_FIELDS if layer.get(k) is not None}
    args.setdefault("num_key_value_heads", args["num_attention_heads"])
    ids = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    # vLLM reads a speculators head without the field as norm_before_residual=true; the EAGLE repository's layer
    # adds the un-normed state.
    default_nbr = layout == "speculators"
    known = {"transformer_layer_config", "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "norm_before_fc"}
    return Eagle3Config(
        draft_vocab_size=int(d.get("draft_vocab_size") or args["vocab_size"]),
        target_hidden_size=d.get("target_hidden_size"),
        layer_ids=list(ids) if ids else None,
        norm_before_residual=bool(d.get("norm_before_residual", default_nbr)),
        norm_before_fc=bool(d.get("norm_before_fc", False)),
        extra={k: v for k, v in d.items() if k not in known and (layout == "speculators" or k not in LLAMA_FIELDS)},
        **args,
    )


def read_config_dict(path: Path) -> dict:
    cfg = Path(path) / "config.json"
    try:
        return json.loads(cfg.read_text())
    except FileNotFoundError:
        raise RedrafterError(f"No config.json in {path}.", "A drafter folder holds config.json and weights.") from None
    except json.JSONDecodeError as e:
        raise RedrafterError(f"{cfg} is not valid JSON: {e}") from None


# --------------------------------------------------------------------------- weights


def safetensors_files(folder: Path) -> list:
    """The head's safetensors weights: ``model.safetensors``, or the shards its index lists ([] when none)."""
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return [folder / f for f in dict.fromkeys(json.loads(index.read_text())["weight_map"].values())]
        except (ValueError, KeyError, TypeError) as e:
            raise RedrafterError(f"{index} is not a valid shard index ({e}).", "Download the head again.") from None
    return []


def _tensors(folder: Path) -> dict:
    """Every tensor of the folder's safetensors weights, as numpy (bfloat16 widened to float32)."""
    files = safetensors_files(folder)
    if not files:
        raise RedrafterError(
            f"No safetensors weights in {folder} (a PyTorch pickle is read by load_drafter and --drafter).",
            f"Load it with mlx_redrafter.load_drafter({str(folder)!r}).",
        )
    out = {}
    for f in files:
        if not f.is_file():
            raise RedrafterError(
                f"{folder} lists a weights file that is missing: {f.name}.", "Download the head again."
            )
        try:
            arrays = mx.load(str(f))
        except Exception as e:
            raise RedrafterError(
                f"{f} cannot be read (truncated or corrupt): {e}", "Download the head again."
            ) from None
        out.update({k: np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v) for k, v in arrays.items()})
    return out


def _rename(tensors: dict) -> dict:
    """The EAGLE repository's names as ours (``midlayer.`` is layer 0); skipped keys out."""
    out = {}
    for k, v in tensors.items():
        if k.startswith(SKIPPED_PREFIXES) or k.endswith(SKIPPED_SUFFIXES):
            continue
        out[k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k] = v
    return out


def _check_t2d(t2d: np.ndarray, d2t: np.ndarray, source: str) -> None:
    targets = np.arange(len(d2t)) + d2t
    ok = t2d.shape[0] > targets.max(initial=0) and t2d[targets].all() and int(t2d.sum()) == len(d2t)
    if not ok:
        raise RedrafterError(
            f"The EAGLE-3 head in {source} has a t2d map that does not match its d2t map.",
            "Download or copy the head again.",
        )


def _check_keys(expected: dict, weights: dict, source: str) -> None:
    missing = sorted(set(expected) - set(weights))
    unknown = sorted(set(weights) - set(expected))
    if missing or unknown:
        parts = ([f"missing keys: {', '.join(missing)}"] if missing else []) + (
            [f"unknown keys: {', '.join(unknown)}"] if unknown else []
        )
        raise RedrafterError(
            f"The EAGLE-3 head's weights in {source} do not match its config.json ({'; '.join(parts)}).",
            "Check that config.json belongs to these weights.",
        )
    for k, v in expected.items():
        if tuple(weights[k].shape) != tuple(v.shape):
            raise RedrafterError(
                f"EAGLE-3 weight {k} in {source} has shape {tuple(weights[k].shape)} "
                f"but config.json implies {tuple(v.shape)}.",
                "Check hidden_size, intermediate_size, the head counts and draft_vocab_size in config.json.",
            )


def read_eagle3(path, dtype=None, tensors: Optional[dict] = None) -> Eagle3Head:
    """The EAGLE-3 head in folder ``path`` (either layout; see the module doc).
    ``dtype`` defaults to the LLM policy. A head without an embedding of its
    own drafts once :meth:`~mlx_redrafter.draft.eagle3.Eagle3Head.bind` gave it the target's.
    ``tensors``: its weights as numpy arrays, when the caller read them (a
    PyTorch pickle, through hub/locate.py); else its safetensors are read."""
    from mlx.utils import tree_flatten

    from ..llm.load import default_dtype, parse_dtype

    path = Path(path).expanduser()
    path = path.parent if path.is_file() else path
    config = config_from_dict(read_config_dict(path), str(path / "config.json"))
    raw = _rename(_tensors(path) if tensors is None else tensors)
    t2d = raw.pop("t2d", None)
    if t2d is not None and "d2t" in raw:
        _check_t2d(t2d.astype(bool), raw["d2t"].astype(np.int64), str(path))
    if "lm_head.weight" not in raw and "embed_tokens.weight" in raw and config.draft_vocab_size == config.vocab_size:
        raw["lm_head.weight"] = raw["embed_tokens.weight"]  # a tied head (tie_word_embeddings, full vocabulary)
    head = Eagle3Head(config, own_embedding="embed_tokens.weight" in raw)
    _check_keys(dict(tree_flatten(head.parameters())), raw, str(path))
    dtype = parse_dtype(dtype) or default_dtype()
    weights = [(k, mx.array(v.astype(np.int32)) if k == "d2t" else mx.array(v).astype(dtype)) for k, v in raw.items()]
    head.load_weights(weights)
    mx.eval(head.parameters())
    head.source_path = path
    return head


def save_eagle3(head: Eagle3Head, path, dtype=None, extra_config: Optional[dict] = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the speculators layout."""
    from mlx.utils import tree_flatten

    from ..llm.load import parse_dtype

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = parse_dtype(dtype)
    weights = {}
    for k, v in tree_flatten(head.parameters()):
        if k == "d2t":
            continue
        weights[k] = v.astype(dtype) if dtype is not None and mx.issubdtype(v.dtype, mx.floating) else v
    cfg = speculators_config(head.config)
    if head.taps is not None:  # other tools cannot know the target's layer count: name the taps
        cfg["eagle_aux_hidden_state_layer_ids"] = [t + 1 for t in head.taps]
    if head.reduced:
        d2t = np.array(head.d2t).astype(np.int64)
        t2d = np.zeros(head.config.vocab_size, bool)
        t2d[np.arange(len(d2t)) + d2t] = True
        weights["d2t"], weights["t2d"] = mx.array(d2t), mx.array(t2d)
    cfg["torch_dtype"] = str(weights["fc.weight"].dtype).split(".")[-1]
    cfg.update(extra_config or {})
    with atomic_file(path / "model.safetensors") as tmp:
        mx.save_safetensors(str(tmp), weights, {"format": "pt"})
    write_text_atomic(path / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path


def speculators_config(config: Eagle3Config) -> dict:
    """``config`` as the speculators layout's ``config.json`` (what a read config carried besides, kept)."""
    layer = {k: getattr(config, k) for k in LLAMA_FIELDS if getattr(config, k) is not None}
    layer.update(model_type="llama", num_hidden_layers=1, hidden_act="silu", tie_word_embeddings=False)
    out = {k: v for k, v in config.extra.items() if k not in ("architectures", "model_type")}
    out.update(
        architectures=[SPECULATORS_ARCH],
        speculators_model_type="eagle3",
        draft_vocab_size=config.draft_vocab_size,
        target_hidden_size=config.target_hidden_size,
        norm_before_residual=config.norm_before_residual,
        transformer_layer_config=layer,
    )
    if config.norm_before_fc:
        out["norm_before_fc"] = True
    if config.layer_ids:
        out["eagle_aux_hidden_state_layer_ids"] = list(config.layer_ids)
    return out


def fit_problem(config: Eagle3Config, hidden: int, vocab: int, num_layers: int) -> Optional[str]:
    """Why an EAGLE-3 head of ``config`` cannot draft for a model of these sizes, or None."""
    return config.fit_problem(hidden, vocab, num_layers)
