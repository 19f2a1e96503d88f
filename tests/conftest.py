import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FIXTURES = SHARED / "fixtures" / "official_redrafter"


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Converted models and profiles go to a per-session cache, unless the
    user points MLX_REDRAFTER_TEST_CACHE at a persistent one (faster reruns)."""
    root = os.environ.get("MLX_REDRAFTER_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
    old = os.environ.get("MLX_REDRAFTER_CACHE")
    os.environ["MLX_REDRAFTER_CACHE"] = root
    yield Path(root)
    if old is None:
        os.environ.pop("MLX_REDRAFTER_CACHE", None)
    else:
        os.environ["MLX_REDRAFTER_CACHE"] = old


@pytest.fixture(scope="session")
def default_model(_isolated_cache):
    from mlx_redrafter import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def fixtures_dir():
    if not FIXTURES.is_dir():
        pytest.skip(f"official fixtures not found at {FIXTURES}")
    return FIXTURES


@pytest.fixture(scope="module")
def ref(fixtures_dir):
    """The official reference outputs (see its reference.md)."""
    import numpy as np

    return np.load(fixtures_dir / "reference.npz")


@pytest.fixture(scope="module")
def embed(fixtures_dir):
    """The fixture LLM's input embedding, for drafters run without the LLM."""
    import mlx.core as mx
    import mlx.nn as nn

    weights = mx.load(str(fixtures_dir / "llm" / "model.safetensors"))
    e = nn.Embedding(*weights["model.embed_tokens.weight"].shape)
    e.weight = weights["model.embed_tokens.weight"]
    return e
