"""The kinds of draft head a drafter folder may hold, and what differs by kind:
its config, whether it fits a model, and reading it.

* ``redrafter``: the recurrent ReDrafter head (draft/redrafter.py), this
  project's and the official layout;
* ``eagle3``: an EAGLE-3 head (draft/eagle3.py) in either published layout
  (draft/eagle3_io.py);
* ``dflash``: a DFlash block drafter (draft/dflash.py) in either published
  layout (draft/dflash_io.py).

The drafter store, the Hub and ``load_drafter`` go through here, so that a
folder of either kind installs, is found for its model and loads the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .dflash import KIND as DFLASH
from .dflash import DFlashConfig
from .dflash_io import config_from_dict as dflash_config
from .dflash_io import layout_of as dflash_layout
from .dflash_io import read_dflash
from .eagle3 import KIND as EAGLE3
from .eagle3 import Eagle3Config
from .eagle3_io import config_from_dict, layout_of, read_config_dict, read_eagle3
from .redrafter import fit_problem as redrafter_fit_problem
from .redrafter import read_config, read_drafter

REDRAFTER = "redrafter"
KINDS = (REDRAFTER, EAGLE3, DFLASH)


def kind_of(path) -> str:
    """The kind of head in folder ``path`` (from its ``config.json``)."""
    d = read_config_dict(Path(path))
    if dflash_layout(d):
        return DFLASH
    return EAGLE3 if layout_of(d) else REDRAFTER


def read_head_config(path):
    """The config of the head in folder ``path``: a :class:`DrafterConfig` or an :class:`Eagle3Config`."""
    path = Path(path)
    kind = kind_of(path)
    if kind == DFLASH:
        return dflash_config(read_config_dict(path), str(path / "config.json"))
    if kind == EAGLE3:
        return config_from_dict(read_config_dict(path), str(path / "config.json"))
    return read_config(path)


def head_fit_problem(config, hidden: int, vocab: int, num_layers: int) -> Optional[str]:
    """Why a head of ``config`` (either kind) cannot draft for a model of these sizes, or None."""
    if isinstance(config, (Eagle3Config, DFlashConfig)):
        return config.fit_problem(hidden, vocab, num_layers)
    return redrafter_fit_problem(config, hidden, vocab, num_layers)


def read_head(path, dtype=None):
    """The head in folder ``path``, of whichever kind (an EAGLE-3 head still needs ``bind(model)``)."""
    path = Path(path).expanduser()
    folder = path.parent if path.is_file() else path
    kind = kind_of(folder) if folder.is_dir() and (folder / "config.json").is_file() else REDRAFTER
    if kind == DFLASH:
        return read_dflash(folder, dtype)
    if kind == EAGLE3:
        return read_eagle3(folder, dtype)
    return read_drafter(path, dtype)
