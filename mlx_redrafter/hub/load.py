"""``load_drafter``: a drafter by folder or by name.

Apart from :mod:`~mlx_redrafter.draft.redrafter` (the model and its files)
because finding a drafter by name reaches the store, the Hub and the
converters (:mod:`.locate`), which build on the model: the draft sources
import none of drafter distribution.
"""

from __future__ import annotations

from pathlib import Path

from ..draft.redrafter import Drafter, read_drafter


def load_drafter(path, dtype=None) -> Drafter:
    """Load a drafter: a folder (``config.json`` + ``model.safetensors``); the
    id of a model the drafter store holds a drafter for (``mlx-redrafter
    drafters list``; e.g. one ``make-drafter`` installed) or that a drafter
    ships for (``"default"``, ``"HuggingFaceTB/SmolLM2-135M-Instruct"``); a
    stored drafter's name; or a Hugging Face Hub repo id (``"org/name"``),
    fetched as mlx-lm fetches models (cached; ``HF_HUB_OFFLINE`` respected)
    and kept in the store, a PyTorch-layout repo converted once (see
    :mod:`~mlx_redrafter.hub.locate`).

    ``dtype`` defaults to the LLM policy (float16 on a GPU, float32 on the
    CPU). Parameters are evaluated before returning.
    """
    if isinstance(path, str) and not Path(path).expanduser().exists():
        from .locate import locate

        path = locate(path).path
    return read_drafter(path, dtype)
