"""What a loaded model is, for what is kept per model (the drafter store,
hub/store.py): its name, a fingerprint of this exact copy, and its family.

Two copies of one model (4-bit and 8-bit, a GGUF and an mlx-community
folder) share a *family*: architecture, widths, layer count and vocabulary,
which are what a drafter must fit. The *fingerprint* tells the copies apart.
When :func:`~mlx_redrafter.llm.load.load_model` loaded the model it is read
from the model's files (the config and a sample of every weights file), so
the dtype policy applied at load (dequantizing on the CPU, float16 on a GPU)
does not change it; a model built in code gets one from its weights. Both
are cheap: nothing reads a whole weight.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

# What "default" (the embedded SmolLM2-135M-Instruct) is called on the Hub.
DEFAULT_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Bytes read from each end of a weights file's data for its fingerprint.
SAMPLE_BYTES = 1 << 16
# The config fields two copies of one model share (quantization aside).
FAMILY_FIELDS = ("model_type", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")


@dataclass(frozen=True)
class ModelIdentity:
    """A model as the drafter store keys it.

    ``id``: its name (a Hub id as given, ``"default"`` as the default model's
    Hub id, a local folder or GGUF file by its name); ``fingerprint``: this
    exact copy (config and weights); ``family``: what every copy of the model
    shares across quantizations and dtypes; ``hidden_size``, ``vocab_size``
    and ``num_layers``: what a drafter must fit.
    """

    id: str
    fingerprint: str
    family: str
    hidden_size: int
    vocab_size: int
    num_layers: int = 0

    @property
    def short(self) -> str:
        """The fingerprint's first 8 characters, for listings."""
        return self.fingerprint[:8]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Optional["ModelIdentity"]:
        """The identity a drafter's metadata records, or None when it records none."""
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in (d or {}).items() if k in names})
        except TypeError:  # a field is missing: not a full identity
            return None


def digest(*parts) -> str:
    """A short stable hash of strings, bytes and numpy arrays."""
    h = hashlib.sha256()
    for p in parts:
        h.update(
            p
            if isinstance(p, bytes)
            else np.ascontiguousarray(p).tobytes()
            if isinstance(p, np.ndarray)
            else str(p).encode()
        )
        h.update(b"\0")
    return h.hexdigest()[:16]


def weights_fingerprint(model) -> str:
    """Names, shapes, dtypes and the first and last values of every weight:
    cheap (no pass over the weights) and exact (no float reduction whose
    rounding could differ between machines)."""
    from mlx.utils import tree_flatten

    parts = []
    for name, w in sorted(tree_flatten(model.parameters())):
        flat = w.reshape(-1)
        ends = mx.concatenate([flat[:64], flat[-64:]]).view(mx.uint8) if flat.size else flat
        parts += [name, tuple(w.shape), str(w.dtype), np.array(ends)]
    return digest(*parts)


def files_fingerprint(folder) -> str:
    """The config and every safetensors file's header plus the first and last
    ``SAMPLE_BYTES`` of its data: this copy of the model as stored on disk."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    parts = [json.dumps(config, sort_keys=True)]
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = fh.read(n)
            size = f.stat().st_size - 8 - n
            head = fh.read(min(SAMPLE_BYTES, size))
            fh.seek(max(8 + n, f.stat().st_size - SAMPLE_BYTES))
            parts += [f.name, header, head, fh.read()]
    return digest(*parts)


def model_dims(model) -> Optional[Tuple[int, int, int]]:
    """``(hidden_size, vocab_size, num_layers)`` as a drafter must fit them,
    read from the input embedding (None for an embedding without a weight,
    or a model ReDrafter cannot split: plain decoding still runs it)."""
    from ..errors import RedrafterError
    from .parts import backbone_of, model_parts

    try:
        embed, _, _ = model_parts(model)
    except RedrafterError:
        return None
    if "weight" not in embed:  # nothing to compare with: e.g. a custom embedding module
        return None
    vocab, hidden = embed.weight.shape[0], embed.weight.shape[-1]
    if "scales" in embed:  # quantized: packed columns
        hidden = embed.scales.shape[-1] * embed.group_size
    layers = len(backbone_of(model)[0].layers)
    return int(hidden), int(vocab), layers


def model_family(model, dims) -> str:
    """The digest of what all copies of the model share (not its quantization or dtype)."""
    from .parts import text_args

    args = text_args(model)
    kind = (
        getattr(getattr(model, "args", None), "model_type", None)
        or getattr(model, "model_type", None)
        or type(model).__module__
    )
    shared = {k: getattr(args, k, None) for k in FAMILY_FIELDS}
    shared["model_type"] = kind
    return digest(json.dumps(shared, sort_keys=True, default=str), *dims)


def model_name(spec: Optional[str]) -> Optional[str]:
    """A readable name for a model spec: ``"default"`` as its Hub id, a Hub
    snapshot folder as ``org/name``, another folder or file by its name, a
    Hub id as it is."""
    if not spec:
        return None
    if spec == "default":
        return DEFAULT_NAME
    path = Path(spec).expanduser()
    if not path.exists():
        return spec
    path = path.resolve()
    parts = path.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--") :].replace("--", "/", 1)
    return path.stem if path.is_file() else path.name


def model_identity(model, model_spec: Optional[str] = None, fingerprint: Optional[str] = None) -> ModelIdentity:
    """The :class:`ModelIdentity` of ``model``, cached on it (a second call costs nothing).

    ``model_spec``: what it was loaded from (default: what
    :func:`~mlx_redrafter.llm.load.load_model` recorded); ``fingerprint``:
    the digest of its files (load_model gives it), else one of its weights.
    """
    known = getattr(model, "redrafter_identity", None)
    if isinstance(known, ModelIdentity):
        return known
    dims = model_dims(model) or (0, 0, 0)
    spec = model_spec or getattr(model, "redrafter_spec", None)
    family = model_family(model, dims)
    name = model_name(spec) or f"{getattr(getattr(model, 'args', None), 'model_type', 'model')}-{dims[2]}x{dims[0]}"
    identity = ModelIdentity(name, fingerprint or weights_fingerprint(model), family, *dims)
    model.redrafter_identity = identity  # a plain attribute: not a parameter of the model
    return identity
