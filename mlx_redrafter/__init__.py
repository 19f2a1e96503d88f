"""mlx-redrafter: ReDrafter speculative decoding for mlx-lm models."""

from .drafter import Drafter, DrafterConfig, load_drafter, save_drafter
from .errors import RedrafterError
from .generate import generate, stream_generate
from .models import load_model

__version__ = "0.1.0"
__all__ = [
    "Drafter",
    "DrafterConfig",
    "RedrafterError",
    "generate",
    "load_drafter",
    "load_model",
    "save_drafter",
    "stream_generate",
    "__version__",
]
