"""The ReDrafter draft head (apple/ml-recurrent-drafter), in MLX.

An official checkpoint folder (``config.json`` + ``model.safetensors``) loads
unchanged: same config fields, same state-dict keys:

* ``lm_head.{i}.linear.weight/bias`` for the ``num_draft_layers`` ResBlocks
  and ``lm_head.{n}.weight`` for the final projection (no bias);
* ``rnn_u.weight/bias`` and ``rnn_w.weight`` when ``rnn`` is true;
* ``input_proj.weight/bias`` when ``exit_dim != 2 * hidden_size``.

The drafter has no embedding table: it reads the LLM's input embedding.

Extension (an optional config field whose default keeps official checkpoints
as they are): ``draft_vocab_size``. The final projection then predicts over a
stored subset of token ids (``draft_vocab``, saved as the extra tensor
``draft_vocab`` in the safetensors file), which makes the head, the most
expensive part of a draft step, several times cheaper.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import RedrafterError
from ..files import atomic_file, write_text_atomic

MODEL_TYPE = "recurrent_drafting_drafter"


@dataclass
class DrafterConfig:
    """Official fields first; ``draft_vocab_size`` is our extension."""

    vocab_size: int
    hidden_size: int
    exit_dim: Optional[int] = None  # official default: 2 * hidden_size
    num_draft_layers: int = 2
    rnn: bool = True
    num_lookback_tokens: int = -1  # official, unused
    draft_vocab_size: Optional[int] = None  # extension: reduced draft vocabulary
    # Extension: LLM layers whose hidden states are fused into the context
    # (EAGLE-3 style, see llm/parts.py); None = the last layer's alone (official).
    feature_layers: Optional[List[int]] = None
    model_type: str = field(default=MODEL_TYPE)

    def __post_init__(self):
        if self.exit_dim is None:
            self.exit_dim = 2 * self.hidden_size

    @property
    def head_size(self) -> int:
        """Number of logits the final projection produces."""
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        names = {f.name for f in fields(cls)}
        missing = [k for k in ("vocab_size", "hidden_size") if k not in d]
        if missing:
            raise RedrafterError(
                f"Drafter config.json lacks {', '.join(missing)}.",
                "Use a config.json written by the official code or by mlx-redrafter.",
            )
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        d = asdict(self)
        for ext in ("draft_vocab_size", "feature_layers"):
            if d[ext] is None:
                del d[ext]  # official checkpoints stay byte-for-byte official
        return d


class ResBlock(nn.Module):
    """``x + SiLU(linear(x))`` (official ``ResBlock``)."""

    def __init__(self, dims: int):
        super().__init__()
        self.linear = nn.Linear(dims, dims)

    def __call__(self, x):
        return x + nn.silu(self.linear(x))


class Drafter(nn.Module):
    """Recurrent draft head.

    ``s_t = SiLU(rnn_w(emb[g_{t-1}]) + rnn_u(s_{t-1}))`` (or ``emb + s`` without
    the RNN) and logits ``= lm_head(concat[c, s_t])``, where ``c`` is the
    LLM's last post-norm hidden state.
    """

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        h, e = config.hidden_size, config.exit_dim
        if e != 2 * h:
            self.input_proj = nn.Linear(2 * h, e)
        self.lm_head = [ResBlock(e) for _ in range(config.num_draft_layers)]
        self.lm_head.append(nn.Linear(e, config.head_size, bias=False))
        if config.rnn:
            self.rnn_u = nn.Linear(h, h)
            self.rnn_w = nn.Linear(h, h, bias=False)
        if config.feature_layers:
            self.fuse = nn.Linear((len(config.feature_layers) + 1) * h, h, bias=False)
        if config.draft_vocab_size:
            # Token ids of the head's outputs: data, not a trainable parameter.
            self.draft_vocab = mx.arange(config.draft_vocab_size, dtype=mx.int32)
            self.freeze(keys=["draft_vocab"], recurse=False)

    def context(self, hidden: mx.array) -> mx.array:
        """The context ``c`` from what the LLM gives: its last post-norm hidden
        state ``[..., h]``, or with ``feature_layers`` the fused
        ``[..., (n+1)*h]`` of those layers' outputs followed by it."""
        if "fuse" not in self:
            return hidden
        from ..llm.parts import rms_each

        h = self.config.hidden_size
        feats = rms_each(hidden[..., :-h], h).astype(hidden.dtype)
        return self.fuse(mx.concatenate([feats, hidden[..., -h:]], axis=-1))

    @property
    def context_size(self) -> int:
        """Width of the hidden vector the LLM side must supply."""
        return (len(self.config.feature_layers or []) + 1) * self.config.hidden_size

    def state_step(self, state: mx.array, token_emb: mx.array) -> mx.array:
        """Next recurrent state from the previous one and the embedding of the last token."""
        if self.config.rnn:
            return nn.silu(self.rnn_w(token_emb) + self.rnn_u(state))
        return token_emb + state

    def logits(self, context: mx.array, state: mx.array) -> mx.array:
        """Draft logits over the head's vocabulary (``draft_vocab`` ids when reduced)."""
        context = mx.broadcast_to(context, (*state.shape[:-1], context.shape[-1]))
        x = mx.concatenate([context, state], axis=-1)
        if "input_proj" in self:
            x = self.input_proj(x)
        for layer in self.lm_head:
            x = layer(x)
        return x

    def token_ids(self, head_index: mx.array) -> mx.array:
        """Map head indices to LLM token ids."""
        if self.config.draft_vocab_size:
            return self.draft_vocab[head_index]
        return head_index

    def draft(self, embed, context, g0, width: int, length: int, warp: bool = False, confidences: int = 0):
        """Beam-search ``width`` drafts of ``length`` tokens (see :mod:`.beam`)."""
        from .beam import beam_search

        return beam_search(self, embed, context, g0, width, length, warp=warp, confidences=confidences)

    def __call__(self, context: mx.array, embeddings: mx.array) -> mx.array:
        """Teacher-forced unroll: ``embeddings [..., T, h]`` of ``g_0..g_{T-1}``
        -> logits ``[..., T, V]`` for ``g_1..g_T``, with ``context [..., h]``."""
        state = mx.zeros_like(embeddings[..., 0, :])
        out = []
        for t in range(embeddings.shape[-2]):
            state = self.state_step(state, embeddings[..., t, :])
            out.append(self.logits(context, state))
        return mx.stack(out, axis=-2)

    def num_params(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.size for k, v in tree_flatten(self.parameters()) if k != "draft_vocab")


# --------------------------------------------------------------------------- I/O


def read_config(path: Path) -> DrafterConfig:
    """The :class:`DrafterConfig` of a drafter folder, with a clear error."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise RedrafterError(
            f"No config.json in {path}.",
            "A drafter folder holds config.json and model.safetensors "
            "(use `mlx-redrafter convert` for PyTorch checkpoints).",
        )
    try:
        return DrafterConfig.from_dict(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError as e:
        raise RedrafterError(f"{cfg_file} is not valid JSON: {e}") from None


def check_weights(config: DrafterConfig, weights: dict, source: str = "drafter") -> None:
    """Raise a clear error for missing / unexpected keys and wrong shapes."""
    from mlx.utils import tree_flatten

    expected = dict(tree_flatten(Drafter(config).parameters()))
    missing = sorted(set(expected) - set(weights))
    unknown = sorted(set(weights) - set(expected))
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing keys: {', '.join(missing)}")
        if unknown:
            parts.append(f"unknown keys: {', '.join(unknown)}")
        raise RedrafterError(
            f"The {source} weights do not match its config.json ({'; '.join(parts)}).",
            "Check that config.json (num_draft_layers, rnn, exit_dim, draft_vocab_size) belongs to these weights.",
        )
    for k, v in expected.items():
        if tuple(weights[k].shape) != tuple(v.shape):
            raise RedrafterError(
                f"Drafter weight {k} has shape {tuple(weights[k].shape)} but config.json implies {tuple(v.shape)}.",
                "Check hidden_size, exit_dim, vocab_size and draft_vocab_size in config.json.",
            )


def load_safetensors(path, fix: str) -> dict:
    """The arrays of a safetensors file; a clear error (with ``fix``) when it is truncated or corrupt."""
    try:
        return mx.load(str(path))
    except Exception as e:
        raise RedrafterError(f"{path} cannot be read (truncated or corrupt): {e}", fix) from None


# The drafters installed with the package, by the model names they serve: the
# default model answers to "default" and to its Hub ids.
SHIPPED_DRAFTERS = {
    "default": "smollm2-135m-instruct",
    "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m-instruct",
    "mlx-community/SmolLM2-135M-Instruct": "smollm2-135m-instruct",
}


def shipped_drafter_path(model_spec: str) -> Optional[Path]:
    """The drafter installed with the package for ``model_spec``, if any."""
    name = SHIPPED_DRAFTERS.get(model_spec)
    if name is None:
        return None
    path = Path(__file__).resolve().parent.parent / "drafters" / name
    return path if (path / "config.json").exists() else None


def read_drafter(path, dtype=None) -> Drafter:
    """Read the drafter in folder ``path`` (``config.json`` +
    ``model.safetensors``; a file in it also names it). ``dtype`` defaults to
    the LLM policy (float16 on a GPU, float32 on the CPU). Parameters are
    evaluated before returning. :func:`~mlx_redrafter.hub.load.load_drafter`
    also takes names (a model's, the store's, a Hub repo's)."""
    from ..llm.load import default_dtype, parse_dtype

    path = Path(path).expanduser()
    if not path.exists():
        raise RedrafterError(
            f"Drafter path does not exist: {path}",
            "Give a drafter folder (config.json + model.safetensors), or 'default' for the drafter "
            "shipped with the default model.",
        )
    if path.is_file():
        path = path.parent
    config = read_config(path)
    st = path / "model.safetensors"
    if not st.is_file():
        if (path / "pytorch_model.bin").exists() or list(path.glob("*.safetensors.index.json")):
            raise RedrafterError(
                f"{path} holds a PyTorch-format drafter.",
                f"Convert it first: mlx-redrafter convert {path} OUT_DIR",
            )
        raise RedrafterError(f"No model.safetensors in {path}.")
    weights = load_safetensors(st, "Restore or re-create the drafter.")
    check_weights(config, weights, f"drafter in {path}")
    drafter = Drafter(config)
    drafter.load_weights(list(weights.items()))
    dtype = parse_dtype(dtype) or default_dtype()
    drafter.set_dtype(dtype)  # draft_vocab is integer and keeps its dtype
    mx.eval(drafter.parameters())
    drafter.source_path = path  # keys the tuned profile of the library's default shape
    return drafter


def save_drafter(drafter: Drafter, path, dtype=None, extra_config: Optional[dict] = None) -> Path:
    """Save ``config.json`` + ``model.safetensors`` with the official key names."""
    from mlx.utils import tree_flatten

    from ..llm.load import parse_dtype

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = parse_dtype(dtype)
    weights = {}
    for k, v in tree_flatten(drafter.parameters()):
        if dtype is not None and mx.issubdtype(v.dtype, mx.floating):
            v = v.astype(dtype)
        weights[k] = v
    cfg = drafter.config.to_dict()
    some_float = next(v for v in weights.values() if mx.issubdtype(v.dtype, mx.floating))
    cfg["torch_dtype"] = str(some_float.dtype).split(".")[-1]
    cfg["architectures"] = ["Drafter"]
    cfg.update(extra_config or {})
    with atomic_file(path / "model.safetensors") as tmp:
        mx.save_safetensors(str(tmp), weights, {"format": "pt"})
    write_text_atomic(path / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path


FIT_FIX = (
    "Use a drafter trained for this model (`mlx-redrafter make-drafter --model` with the model's id or folder "
    "makes one), or load the model it was trained for."
)


def fit_problem(config: DrafterConfig, hidden: int, vocab: int, num_layers: int) -> Optional[str]:
    """Why a drafter of ``config`` cannot draft for a model of these sizes
    (hidden size, embedding rows, layer count), or None when it fits."""
    if config.hidden_size != hidden:
        return f"The drafter's hidden_size is {config.hidden_size} but the model's is {hidden}."
    if config.vocab_size != vocab:
        return f"The drafter's vocab_size is {config.vocab_size} but the model's embedding has {vocab} rows."
    layers = getattr(config, "feature_layers", None)
    if layers and max(layers) >= num_layers:
        return f"The drafter fuses features of layers {layers} but the model has {num_layers} layers."
    return None


def check_fits(drafter, model) -> None:
    """Raise when the drafter was made for another LLM (hidden size or
    vocabulary); a layer head (EAGLE-3) that fits is bound to the model."""
    from ..llm.identity import model_dims

    dims = model_dims(model)
    own = getattr(drafter.config, "fit_problem", None)  # a head kind's own rule (draft/kinds.py)
    problem = None if dims is None else (own(*dims) if own else fit_problem(drafter.config, *dims))
    if problem:
        raise RedrafterError(problem, FIT_FIX)
    if hasattr(drafter, "bind"):
        drafter.bind(model)
