"""``load_drafter``: a drafter by folder or by name.

Apart from :mod:`~mlx_redrafter.draft.redrafter` (the model and its files)
because finding a drafter by name reaches the store, the Hub and the
converters (:mod:`.locate`), which build on the model: the draft sources
import none of drafter distribution.
"""

from __future__ import annotations

from pathlib import Path

from ..draft.eagle3_io import layout_of, read_config_dict, read_eagle3, safetensors_files
from ..draft.kinds import read_head


def load_drafter(path, dtype=None):
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

    The folder may hold a ReDrafter drafter (a
    :class:`~mlx_redrafter.draft.redrafter.Drafter`) or an EAGLE-3 head in
    either published layout (an :class:`~mlx_redrafter.draft.eagle3.Eagle3Head`;
    the tools bind it to the model they load, ``head.bind(model)`` from Python).
    """
    if isinstance(path, str) and not Path(path).expanduser().exists():
        from .locate import locate

        path = locate(path).path
    folder = Path(path).expanduser()
    folder = folder.parent if folder.is_file() else folder
    if (folder / "config.json").is_file() and layout_of(read_config_dict(folder)) and not safetensors_files(folder):
        from .locate import eagle3_tensors  # an EAGLE-3 head in a PyTorch pickle: read safely, never run

        return read_eagle3(folder, dtype, tensors=eagle3_tensors(folder))
    return read_head(path, dtype)
