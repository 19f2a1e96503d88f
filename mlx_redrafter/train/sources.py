"""Where ``make-drafter``'s prompts come from, and which of them are held out.

Three sources: the ShareGPT prompts shipped with the package (the
default), the user's own file, or ``history``: the prompts that ``chat``
and ``serve`` kept for the model (draft/datastore/use.py), as the exact token ids
the model answered, written to a prompt file in the work folder (it stays
on this machine: a drafter trained on it is marked private).

A slice of the conversations is held out by id
(:func:`~mlx_redrafter.train.examples.is_eval_conversation`): the trainer
never trains on it, and the controller and the verdict are measured on it.
ShareGPT holds out 2% (the trainer's and ``train-controller``'s split); a
user's file or history holds out enough for the verdict. The share is fixed
by a folder's first run, so the split never moves under a rerun.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from ..errors import RedrafterError
from ..files import write_text_atomic
from ..prompts import default_training_prompts, read_conversations, refuse_eval_set
from .examples import is_eval_conversation
from .world import digest

SHAREGPT, HISTORY = "sharegpt", "history"
HELD_OUT = 0.02  # ShareGPT's held-out share
MIN_HELD_OUT = 16  # a user's file or history holds out at least this many conversations ...
MAX_HELD_OUT = 0.25  # ... but never more than this share
HISTORY_FILE = "history-prompts.jsonl"


@dataclass(frozen=True)
class Source:
    label: str  # "sharegpt", "file:NAME" or "history" (META's data.prompts)
    path: Path  # the prompt file distillation reads
    private: bool  # the user's own conversations: never uploaded without asking
    held_out: float  # share of the conversations held out


def source_label(spec: Optional[str]) -> str:
    if spec in (None, SHAREGPT):
        return SHAREGPT
    return HISTORY if spec == HISTORY else f"file:{Path(spec).name}"


def open_source(spec: Optional[str], model_spec: str, tokenizer, out: Path, held_out: Optional[float] = None) -> Source:
    """The prompt file for ``--prompts spec`` (None: ShareGPT), with its held-out
    share (``held_out``: the one a folder's first run fixed)."""
    label = source_label(spec)
    if label == SHAREGPT:
        path = default_training_prompts()
        if path is None:
            raise RedrafterError(
                "The ShareGPT prompts are missing from the package (mlx_redrafter/data).",
                "Reinstall mlx-redrafter, or pass --prompts FILE.jsonl.",
            )
        return Source(label, path, False, HELD_OUT if held_out is None else held_out)
    if label == HISTORY:
        path = write_history_prompts(model_spec, tokenizer, Path(out) / HISTORY_FILE)
    else:
        path = Path(spec).expanduser()
    convs = read_conversations(path)
    refuse_eval_set(path, convs)
    if held_out is None:
        held_out = min(MAX_HELD_OUT, max(HELD_OUT, MIN_HELD_OUT / len(convs)))
    return Source(label, path, label == HISTORY, held_out)


def write_history_prompts(model_spec: str, tokenizer, path: Path) -> Path:
    """The model's history prompts as a prompt file (ids exact, text for the
    eval-set guard and for reading), one conversation per distinct prompt."""
    from ..draft.datastore.use import history_prompts

    seen, lines = set(), []
    for ids in history_prompts(model_spec):
        cid = "h" + digest(json.dumps(ids))
        if cid in seen:
            continue
        seen.add(cid)
        text = tokenizer.decode(ids).strip() or f"({len(ids)} tokens)"
        lines.append(json.dumps({"id": cid, "turns": [text], "prompt_ids": ids}))
    if not lines:
        raise RedrafterError(
            f"The model {model_spec} has no history: chat and serve keep it (unless --no-history).",
            "Chat with the model (or serve it) first, or use the default prompts or --prompts FILE.",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def held_out_conversations(source: Source, seed: int = 0) -> List[dict]:
    """The held-out conversations, in a fixed shuffled order."""
    held = [c for c in read_conversations(source.path) if is_eval_conversation(c["id"], source.held_out)]
    random.Random(seed).shuffle(held)
    return held
