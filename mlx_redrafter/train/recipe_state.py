"""``make-drafter``'s work folder: its state file, and what a run reports as it goes.

``OUT/make-drafter.json`` records what every run into the folder did: the
model and prompts it is for, the settings its first run fixed, the rates it
measured, the seconds each stage spent (all runs together: the budget is a
total) and which stages are finished, and for what. It is rewritten
atomically whenever a stage finishes or is interrupted, so Ctrl-C keeps
everything done so far and a rerun of the same command continues.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import RedrafterError
from ..files import cache_root, write_json_atomic
from ..profiles import model_id
from .world import digest

STATE = "make-drafter.json"
FORMAT = 1
STAGES = ("distill", "train", "controller", "calibrate", "verdict", "install")


@dataclass
class Status:
    """One update of the progress display."""

    stage: str
    fraction: Optional[float] = None  # of the stage, 0..1 (None: unknown)
    stage_eta: Optional[float] = None  # seconds
    total_eta: Optional[float] = None  # seconds, this stage and the ones after it
    info: str = ""
    line: Optional[str] = None  # a line to print once (a stage's result)


def default_out(model_spec: str, prompts_label: str) -> Path:
    """``cache_root()/make-drafter/<model>-<digest>``: one folder per model and
    prompt source, so that the same command finds its folder again."""
    from ..hub.store import slug

    key = model_id(model_spec)
    name = Path(key).stem if Path(key).exists() else key
    return cache_root() / "make-drafter" / f"{slug(name)}-{digest(key, prompts_label)[:8]}"


class State:
    """The state file of a work folder (see the module docstring)."""

    def __init__(self, path: Path, data: dict):
        self.path, self.data = path, data

    @classmethod
    def open(cls, out: Path, model_spec: str, prompts_label: str) -> "State":
        """The folder's state, or a new one; a folder made for another model
        or prompt source is refused (before any slow work)."""
        path = Path(out) / STATE
        if not path.is_file():
            return cls(
                path,
                {
                    "format": FORMAT,
                    "model": model_id(model_spec),
                    "prompts": prompts_label,
                    "seconds": {},
                    "last": {},
                    "done": {},
                    "runs": [],
                },
            )
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise RedrafterError(
                f"{path} is corrupt: {e}", "Delete it (the data and drafter stay) or pick a new --out."
            ) from None
        if data.get("model") != model_id(model_spec) or data.get("prompts") != prompts_label:
            raise RedrafterError(
                f"{out} holds a make-drafter run for {data.get('model')} on {data.get('prompts')} prompts.",
                "Rerun with that --model and --prompts, or pick another --out.",
            )
        return cls(path, data)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.data, indent=1)

    def __getitem__(self, key):
        return self.data.get(key)

    def __setitem__(self, key, value) -> None:
        self.data[key] = value

    def pin(self, key: str, values: dict, overrides: dict) -> dict:
        """The settings ``key`` of the folder's first run (``values`` on a new
        folder); ``overrides`` that differ from them are refused, since the
        data and the drafter in the folder were made with them."""
        pinned = self.data.setdefault(key, values)
        changed = {k: v for k, v in overrides.items() if k in pinned and pinned[k] != v}
        if changed:
            raise RedrafterError(
                f"{self.path.parent} was made with {key} settings "
                f"{ ({k: pinned[k] for k in changed}) }, not {changed}.",
                "Rerun with the folder's settings, or pick another --out.",
            )
        return pinned

    def spent(self) -> float:
        """Seconds spent by every stage of every run into the folder."""
        return float(sum(self.data["seconds"].values()))

    def finished(self, stage: str, key) -> bool:
        """Whether ``stage`` finished for ``key``: a budget in seconds (the
        data stages: finished for that budget or a larger one), else what it
        finished for must equal ``key`` (the drafter it measured)."""
        done = self.data["done"].get(stage)
        if isinstance(key, float):
            return isinstance(done, (int, float)) and done >= key
        return done is not None and done == key

    def finish(self, stage: str, key) -> None:
        self.data["done"][stage] = key
        self.save()

    @contextmanager
    def timed(self, stage: str):
        """Count the block's seconds against ``stage`` (also when interrupted)
        and save; ``last[stage]``: the seconds of its last uninterrupted run."""
        tic, ok = time.perf_counter(), False
        try:
            yield
            ok = True
        finally:
            seconds = time.perf_counter() - tic
            self.data["seconds"][stage] = self.data["seconds"].get(stage, 0.0) + seconds
            if ok:
                self.data["last"][stage] = seconds
            self.save()


def positions(m) -> int:
    """Training positions a data folder holds: reply tokens and prompt positions."""
    return 0 if m is None else m.tokens + m.prompt_tokens
