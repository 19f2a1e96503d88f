"""What a governed generation learned, carried to the next one.

The governor's rates and waits (step/governor.py) and the live cost
(step/live_cost.py) of one generation start the next one with the same
model, dtype, device and sources: the next chat turn, the next ``serve``
request (in memory), the next run (on disk, beside the tuned profiles:
``cache_root()/profiles/live-<digest>.json``). A new run on a busier machine
starts from them and corrects them within a few steps.
"""

from __future__ import annotations

import json
from typing import Dict, Optional, Sequence, Tuple

from .live_cost import load_state, save_state

_KEPT: Dict[Tuple[str, ...], dict] = {}  # this process's latest state per key


def live_key(model, names: Sequence[str]) -> Tuple[str, ...]:
    """(device, model, dtype or quantization, the sources' names): what the state is kept by."""
    key = getattr(model, "_redrafter_live_key", None)
    if key is None:
        from .curve import curve_key

        key = curve_key(model)
        try:
            object.__setattr__(model, "_redrafter_live_key", key)
        except (AttributeError, TypeError):  # a model that takes no attributes: computed each time
            pass
    return tuple(key) + (json.dumps(sorted(names)),)


def opened(key: Tuple[str, ...]) -> Optional[dict]:
    """The state kept for ``key``: this process's, else the last run's on disk, else None."""
    if key in _KEPT:
        return _KEPT[key]
    found = load_state(key)
    if found is not None:
        _KEPT[key] = found
    return found


def kept(key: Tuple[str, ...], state: dict) -> None:
    """Keep ``state`` for the next generation with ``key`` (in memory and on disk)."""
    _KEPT[key] = state
    try:
        save_state(key, state)
    except OSError:  # a read-only cache folder: the state lives as long as the process
        pass
