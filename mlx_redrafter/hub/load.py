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
from ..errors import RedrafterError


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
    refuse_non_drafter(folder)
    if (folder / "config.json").is_file() and layout_of(read_config_dict(folder)) and not safetensors_files(folder):
        from .locate import eagle3_tensors  # an EAGLE-3 head in a PyTorch pickle: read safely, never run

        return read_eagle3(folder, dtype, tensors=eagle3_tensors(folder))
    return read_head(path, dtype)


def refuse_non_drafter(folder: Path) -> None:
    """A folder given as a drafter that holds something else, said as what
    it is with where it goes: a model's split MTP head (``--mtp``, ``mtp=``),
    or a model (``--model``; its own MTP head, if its checkpoint ships one).
    A folder of neither kind (a drafter, an EAGLE-3 head) passes."""
    from ..draft.dflash_io import layout_of as dflash_layout
    from ..draft.mtp_load import SPLIT_TYPES, find_mtp

    if not (folder / "config.json").is_file():
        return
    config = read_config_dict(folder)
    kind = config.get("model_type")
    if kind in SPLIT_TYPES:
        raise RedrafterError(
            f"{folder} is a split MTP folder ({kind}: a model's own multi-token-prediction head), not a drafter.",
            f"Give it as the MTP head: --mtp {folder} (mtp= from Python), beside the --model it belongs to.",
        )
    if layout_of(config) or dflash_layout(config) or not ("num_hidden_layers" in config or "text_config" in config):
        return  # an EAGLE-3 head or a DFlash drafter (their layer configs are a model's), or a drafter's config
    mtp = find_mtp(folder)
    also = f" Its checkpoint ships an MTP head, which drafts for it by default (or --mtp {folder})." if mtp else ""
    raise RedrafterError(
        f"{folder} is a model ({kind or 'an mlx-lm folder'}), not a drafter.",
        f"Load it with --model {folder}.{also} A drafter is a folder make-drafter writes (config.json with "
        "exit_dim and num_draft_layers), a name from `mlx-redrafter drafters list`, or a Hub repo.",
    )
