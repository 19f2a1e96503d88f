import os
import sys
from pathlib import Path

import pytest

# Every step drafts what a test asks for: the live choice (step/governor.py)
# would otherwise run plain decoding wherever drafting loses on this machine,
# and the tests of drafting would test plain decoding. tests/test_governor.py
# and the surfaces' tests turn it back on (always_draft=False, or the variable
# removed for a command they start).
os.environ["MLX_REDRAFTER_ALWAYS_DRAFT"] = "1"

sys.path.insert(0, str(Path(__file__).parent))

# Everything the tests read ships with the repository (no folder beside it).
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "official_redrafter"
# The two evaluation sets the package does not ship (see its README.md).
EVAL_SETS = FIXTURES.parent / "eval_sets"


def pytest_configure(config):
    # `make test` (-n 2 --dist loadfile): xdist hands files out in the order
    # collected below (longest first), not sorted by their number of tests.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)  # after pytest's own reordering within each file
def pytest_collection_modifyitems(items):
    from file_order import longest_first

    longest_first(items)


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


@pytest.fixture(scope="module")
def default_loaded_once(default_model):
    """For a module's in-process commands (``cli([...])``, ``load_runtime``):
    ``load_model("default")`` with no dtype options returns the session's
    ``default_model`` instead of loading the model again (seconds each:
    dequantizing it). Anything else (another model or dtype, another cache
    folder in ``MLX_REDRAFTER_CACHE``) loads for real. Opt in per module:
    ``pytestmark = pytest.mark.usefixtures("default_loaded_once")``."""
    from mlx_redrafter.llm import load as load_module

    real = load_module.load_model
    cache = os.environ.get("MLX_REDRAFTER_CACHE")

    def load_model(spec="default", dtype=None, keep_quantized=None):
        if spec == "default" and dtype is None and keep_quantized is None:
            if os.environ.get("MLX_REDRAFTER_CACHE") == cache:
                return default_model
        return real(spec, dtype, keep_quantized)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(load_module, "load_model", load_model)
        yield default_model


@pytest.fixture(scope="session")
def fixtures_dir():
    """The official ReDrafter fixtures (see their GENERATED_BY.md): part of the
    repository, so a missing folder is an error, never a skip."""
    if not FIXTURES.is_dir():
        pytest.fail(
            f"official fixtures missing at {FIXTURES}: they ship with the repository (git checkout -- tests/fixtures)"
        )
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
