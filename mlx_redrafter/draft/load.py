"""``load_drafter``: a drafter by folder or by name.

Apart from :mod:`.drafter` (the model and its files) because finding a
drafter by name reaches the Hub and the converters (:mod:`.hub`), which build
on the model: one module holding both would import itself in a circle.
"""

from __future__ import annotations

from pathlib import Path

from .heads import read_head


def load_drafter(path, dtype=None):
    """Load a drafter: a folder (``config.json`` + ``model.safetensors``); the
    id of a model the drafter store holds a drafter for (``mlx-redrafter
    drafters list``; e.g. one ``make-drafter`` installed) or that a drafter
    ships for (``"default"``, ``"HuggingFaceTB/SmolLM2-135M-Instruct"``); a
    stored drafter's name; or a Hugging Face Hub repo id (``"org/name"``),
    fetched as mlx-lm fetches models (cached; ``HF_HUB_OFFLINE`` respected)
    and kept in the store, a PyTorch-layout repo converted once (see
    :mod:`~mlx_redrafter.draft.hub`).

    ``dtype`` defaults to the LLM policy (float16 on a GPU, float32 on the
    CPU). Parameters are evaluated before returning.

    The folder may hold a ReDrafter drafter (a
    :class:`~mlx_redrafter.draft.drafter.Drafter`) or an EAGLE-3 head in
    either published layout (an :class:`~mlx_redrafter.draft.eagle3.Eagle3Head`;
    the tools bind it to the model they load, ``head.bind(model)`` from Python).
    """
    if isinstance(path, str) and not Path(path).expanduser().exists():
        from .hub import locate

        path = locate(path).path
    return read_head(path, dtype)
