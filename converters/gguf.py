"""Convert a GGUF file into an ordinary mlx-lm model folder.

The folder holds ``config.json``, ``model.safetensors``, ``tokenizer.json`` and
``tokenizer_config.json`` (with the chat template, BOS and EOS), and plain
``mlx_lm.load(folder)`` opens it.

Tensor types:

* F32 / F16 / BF16 are copied.
* Q4_0, Q4_1 and Q8_0 are exactly MLX's affine quantization with group size
  32 (``w = scale * q + bias``), so their blocks are repacked bit for bit into
  MLX ``(weight, scales, biases)`` triples and the layers stay quantized.
* Every other type (K-quants, Q5_0, ...) is dequantized by the ``gguf``
  package and stored as float16.

Architectures: ``llama`` (llama.cpp's q/k row permutation is undone, so the
model uses mlx-lm's usual non-traditional RoPE) and ``gemma3`` (llama.cpp
stores Gemma's zero-centred norm weights as ``w + 1``; that is undone).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import numpy as np

from ..errors import RedrafterError
from ..files import atomic_folder, cache_root

GROUP_SIZE = 32  # block size of Q4_0 / Q4_1 / Q8_0


# --------------------------------------------------------------------------- reading


@dataclass
class GGUFFile:
    path: Path
    metadata: Dict[str, object]
    tensors: list  # gguf.ReaderTensor

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def arch_value(self, key: str, default=None):
        return self.metadata.get(f"{self.architecture}.{key}", default)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file (memory-mapped) and read its metadata."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise RedrafterError(f"GGUF file not found: {path}", "Check the path, or pass a model folder.")
    try:
        reader = gguf.GGUFReader(str(path))
        metadata = {name: field.contents() for name, field in reader.fields.items()}
        tensors = list(reader.tensors)
    except Exception as e:  # the gguf reader raises many kinds on bad bytes
        raise RedrafterError(
            f"{path} is not a readable GGUF file (truncated or corrupt): {e}",
            "Download or copy the file again.",
        ) from None
    return GGUFFile(path, metadata, tensors)


# --------------------------------------------------------------------------- tensors


def _blocks(t, block_bytes: int) -> np.ndarray:
    """Raw bytes of a block-quantized tensor as ``[rows, n_blocks, block_bytes]``."""
    data = np.asarray(t.data, dtype=np.uint8)
    return data.reshape(data.shape[0], -1, block_bytes)


def _pack4(q: np.ndarray) -> np.ndarray:
    """Pack 4-bit values ``[rows, n]`` into MLX's uint32 layout (element i at bits 4*(i%8))."""
    q = q.astype(np.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return np.ascontiguousarray(packed).view(np.uint32)


def _q4_blocks(t, with_min: bool):
    """Q4_0 / Q4_1 -> (weight, scales, biases). llama.cpp stores element j in the low
    nibble of byte j and element j+16 in the high nibble."""
    head = 4 if with_min else 2
    b = _blocks(t, head + 16)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    qs = b[..., head:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, nb, 32]
    q = q.reshape(q.shape[0], -1)
    if with_min:
        m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0]
    else:
        m = (-8.0 * d.astype(np.float32)).astype(np.float16)  # exact: power-of-two scale
    return _pack4(q), d, m


def _q8_blocks(t):
    """Q8_0 (signed int8 * d) -> MLX 8-bit affine with q + 128 and bias -128 d."""
    b = _blocks(t, 34)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    q = np.ascontiguousarray(q.reshape(q.shape[0], -1))
    return q.view(np.uint32), d, (-128.0 * d.astype(np.float32)).astype(np.float16)


def _tensor_arrays(t) -> Dict[str, np.ndarray]:
    """One GGUF tensor as ``{"weight": ...}`` or a quantized ``weight/scales/biases`` triple."""
    import gguf

    kind = gguf.GGMLQuantizationType(t.tensor_type)
    if kind == gguf.GGMLQuantizationType.Q4_0:
        w, s, b = _q4_blocks(t, with_min=False)
    elif kind == gguf.GGMLQuantizationType.Q4_1:
        w, s, b = _q4_blocks(t, with_min=True)
    elif kind == gguf.GGMLQuantizationType.Q8_0:
        w, s, b = _q8_blocks(t)
    elif kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return {"weight": np.asarray(t.data)}
    elif kind == gguf.GGMLQuantizationType.BF16:
        # numpy has no bfloat16: widen to float32 bit-exactly.
        raw = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
        return {"weight": raw.view(np.float32)}
    else:
        w = gguf.quants.dequantize(np.asarray(t.data), kind)
        return {"weight": w.astype(np.float16)}
    return {"weight": w, "scales": s, "biases": b}


def _unpermute_rows(arrays: Dict[str, np.ndarray], n_head: int) -> Dict[str, np.ndarray]:
    """Undo llama.cpp's q/k permutation (interleaved rotary pairs -> HF's half split).

    It permutes output rows only, and quantization groups run along input
    columns, so it applies to quantized triples exactly.
    """

    def undo(x):
        rows = x.shape[0]
        return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    return {k: undo(v) for k, v in arrays.items()}


# --------------------------------------------------------------------------- architectures

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
_LLAMA_NAMES = {**_LAYER_NAMES, "ffn_norm": "post_attention_layernorm"}
_GEMMA3_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _llama_config(f: GGUFFile) -> dict:
    n_embd = int(f.arch_value("embedding_length"))
    n_head = int(f.arch_value("attention.head_count"))
    names = {t.name for t in f.tensors}
    return {
        "model_type": "llama",
        "hidden_size": n_embd,
        "num_hidden_layers": int(f.arch_value("block_count")),
        "intermediate_size": int(f.arch_value("feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(f.arch_value("attention.head_count_kv", n_head)),
        "head_dim": int(f.arch_value("attention.key_length", n_embd // n_head)),
        "rms_norm_eps": float(f.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": len(f.metadata["tokenizer.ggml.tokens"]),
        "rope_theta": float(f.arch_value("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(f.arch_value("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "rope_traditional": False,
    }


def _gemma3_config(f: GGUFFile) -> dict:
    return {
        "model_type": "gemma3_text",
        "hidden_size": int(f.arch_value("embedding_length")),
        "num_hidden_layers": int(f.arch_value("block_count")),
        "intermediate_size": int(f.arch_value("feed_forward_length")),
        "num_attention_heads": int(f.arch_value("attention.head_count")),
        "num_key_value_heads": int(f.arch_value("attention.head_count_kv")),
        "head_dim": int(f.arch_value("attention.key_length")),
        # llama.cpp scales queries by 1/sqrt(head_dim) for every Gemma 3 size but 27B.
        "query_pre_attn_scalar": int(f.arch_value("attention.key_length")),
        "rms_norm_eps": float(f.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": len(f.metadata["tokenizer.ggml.tokens"]),
        "rope_theta": float(f.arch_value("rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "sliding_window": int(f.arch_value("attention.sliding_window", 512)),
        # Gemma 3 interleaves 5 local layers with 1 global one; llama.cpp hard-codes it too.
        "sliding_window_pattern": 6,
        "max_position_embeddings": int(f.arch_value("context_length", 32768)),
    }


def _llama_tensor(f: GGUFFile, name: str, arrays):
    kind = name.rsplit(".", 2)[-2] if name.startswith("blk.") else ""
    if kind in ("attn_q", "attn_k"):
        heads = "attention.head_count" if kind == "attn_q" else "attention.head_count_kv"
        n_head = int(f.arch_value(heads, f.arch_value("attention.head_count")))
        return _unpermute_rows(arrays, n_head)
    return arrays


def _gemma3_tensor(f: GGUFFile, name: str, arrays):
    if name.endswith("norm.weight"):
        return {"weight": arrays["weight"].astype(np.float32) - 1.0}
    return arrays


@dataclass
class _Arch:
    config: Callable[[GGUFFile], dict]
    layer_names: Dict[str, str]
    fix_tensor: Callable[[GGUFFile, str, Dict[str, np.ndarray]], Dict[str, np.ndarray]]


ARCHITECTURES = {
    "llama": _Arch(_llama_config, _LLAMA_NAMES, _llama_tensor),
    "gemma3": _Arch(_gemma3_config, _GEMMA3_NAMES, _gemma3_tensor),
}


def _mlx_name(arch: _Arch, gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        if kind not in arch.layer_names:
            raise RedrafterError(f"Unexpected GGUF tensor {gguf_name!r}.")
        return f"model.layers.{layer}.{arch.layer_names[kind]}"
    if base not in _GLOBAL_NAMES:
        raise RedrafterError(f"Unexpected GGUF tensor {gguf_name!r}.")
    return _GLOBAL_NAMES[base]


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer(f: GGUFFile):
    """A Hugging Face fast tokenizer rebuilt from the GGUF vocabulary (BPE or SentencePiece)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    md = f.metadata
    tok_dict = {
        name: md[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in md
    }
    backend, _ = convert_gguf_tokenizer(f.architecture, tok_dict)
    tokens = md["tokenizer.ggml.tokens"]

    def special(key):
        i = md.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None else None

    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=special("bos_token_id"),
        eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"),
        pad_token=special("padding_token_id"),
        add_bos_token=add_bos,
        add_eos_token=False,
    )
    if add_bos and special("bos_token_id") is not None:
        # Fast tokenizers add BOS through their post-processor.
        from tokenizers import processors

        bos = special("bos_token_id")
        bos_id = int(md["tokenizer.ggml.bos_token_id"])
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    if "tokenizer.chat_template" in md:
        tok.chat_template = str(md["tokenizer.chat_template"])
    return tok


def _save_tokenizer(tok, dst: Path, f: GGUFFile):
    tok.save_pretrained(str(dst))
    # One source of truth: the chat template lives in tokenizer_config.json.
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    jinja = dst / "chat_template.jinja"
    if tok.chat_template is not None:
        cfg["chat_template"] = tok.chat_template
    if jinja.exists():
        jinja.unlink()
    md = f.metadata
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in md:
            cfg[key] = int(md[f"tokenizer.ggml.{key}"])
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


# --------------------------------------------------------------------------- driver


def convert_gguf(src: str | os.PathLike, dst: str | os.PathLike, progress=None) -> Path:
    """Convert ``src`` (a .gguf file) into the mlx-lm folder ``dst``.

    The folder is written atomically (see :func:`mlx_redrafter.files.atomic_folder`).
    ``progress(done, total)`` is called once per tensor when given.
    """
    import mlx.core as mx

    f = read_gguf(src)
    arch = ARCHITECTURES.get(f.architecture)
    if arch is None:
        raise RedrafterError(
            f"GGUF architecture {f.architecture!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))}).",
            "Convert the original Hugging Face checkpoint with `mlx_lm.convert` instead.",
        )
    config = arch.config(f)
    weights: Dict[str, mx.array] = {}
    quantized = False
    for i, t in enumerate(f.tensors):
        try:
            arrays = arch.fix_tensor(f, t.name, _tensor_arrays(t))
        except (ValueError, TypeError) as e:
            raise RedrafterError(
                f"Tensor {t.name!r} in {f.path} cannot be read ({e}); the file is truncated or corrupt.",
                "Download or copy the file again.",
            ) from None
        name = _mlx_name(arch, t.name)
        for part, arr in arrays.items():
            weights[f"{name}.{part}"] = mx.array(arr)
        quantized |= "scales" in arrays
        if progress:
            progress(i + 1, len(f.tensors))
    if quantized:
        # Per-layer bits (8-bit embedding, 4-bit blocks, ...) are inferred by
        # mlx-lm from the shapes of each layer's scales.
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": 4}
    eos = f.metadata.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        config["eos_token_id"] = int(eos)

    dst = Path(dst)
    with atomic_folder(dst) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, {"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _save_tokenizer(build_tokenizer(f), tmp, f)
    return dst


def cached_conversion(src: str | os.PathLike, cache_dir: Optional[str | os.PathLike] = None) -> Path:
    """The converted folder for ``src``, converting it on first use.

    The cache key is the file's name, size and modification time, so a replaced
    file is converted again.
    """
    src = Path(src).resolve()
    if not src.is_file():
        raise RedrafterError(f"GGUF file not found: {src}", "Check the path.")
    st = src.stat()
    key = f"{src.stem}-{st.st_size:x}-{st.st_mtime_ns:x}"
    dst = Path(cache_dir or cache_root()) / "gguf" / key
    if not (dst / "config.json").exists():
        convert_gguf(src, dst)
    return dst
