"""mlx-redrafter: ReDrafter speculative decoding for mlx-lm models."""

from .config import DraftConfig, SamplingConfig
from .draft.redrafter import Drafter, DrafterConfig, save_drafter
from .errors import RedrafterError
from .generate import generate, stream_generate
from .hub.load import load_drafter
from .llm.cache import trim_cache
from .llm.load import load_model

__version__ = "0.1.0"
__all__ = [
    "DraftConfig",
    "Drafter",
    "DrafterConfig",
    "RedrafterError",
    "SamplingConfig",
    "generate",
    "load_drafter",
    "load_model",
    "save_drafter",
    "stream_generate",
    "trim_cache",
    "__version__",
]
