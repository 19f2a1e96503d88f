"""mlx-redrafter: ReDrafter speculative decoding for mlx-lm models."""

from .errors import RedrafterError
from .models import load_model

__version__ = "0.1.0"
__all__ = ["RedrafterError", "load_model", "__version__"]
