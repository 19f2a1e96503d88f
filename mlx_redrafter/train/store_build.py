"""``mlx-redrafter datastore build``: the model answers training prompts
greedily, in batches, and its replies become a datastore (issue 28).

It is the training-free counterpart of distilling and training a drafter:
the batched greedy decoding is :class:`~mlx_redrafter.train.distill.Distiller`'s
(without the hidden states). The store is saved every ``save_every`` replies
and when the run ends, by its budget, its prompts or Ctrl-C, so nothing
finished is lost; the prompts already answered are kept beside it
(``<store>.done.json``) and a rerun resumes after them. Evaluation sets are
refused (:func:`~mlx_redrafter.prompts.refuse_eval_set`).
"""

from __future__ import annotations

import json
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..draft.datastore.index import MAX_TOKENS, Datastore, default_path, model_key
from ..errors import RedrafterError
from ..files import write_json_atomic
from ..prompts import read_conversations, refuse_eval_set
from .distill import DistillConfig, Distiller


@dataclass
class BuildConfig:
    minutes: Optional[float] = None  # this run's budget (None: every prompt)
    batch_size: int = 16
    max_new_tokens: int = 192
    max_prompt_tokens: int = 384
    max_conversations: Optional[int] = None  # prompts answered in all, over resumed runs
    max_tokens: int = MAX_TOKENS  # the store's bound
    save_every: int = 32  # replies between saves
    seed: int = 0


@dataclass
class BuildReport:
    path: Path
    replies: int  # answered in this run
    sequences: int  # in the store
    tokens: int  # in the store
    seconds: float


def _done_path(path: Path) -> Path:
    return path.with_name(path.name + ".done.json")


def _read_done(path: Path, prompts: Path) -> set:
    """Prompt ids answered by earlier runs into ``path`` from the same prompts."""
    try:
        data = json.loads(_done_path(path).read_text())
    except (OSError, ValueError):
        return set()
    return set(data.get("done", [])) if data.get("prompts") == str(prompts.resolve()) else set()


def _queue(convs, done: set, cfg: BuildConfig) -> deque:
    todo = [c for c in convs if c["id"] not in done]
    random.Random(cfg.seed).shuffle(todo)
    if cfg.max_conversations is not None:
        todo = todo[: max(0, cfg.max_conversations - len(done))]
    return deque((c, 0, []) for c in todo)


def build_store(
    model_spec,
    prompts_path,
    cfg: BuildConfig = BuildConfig(),
    out=None,
    model=None,
    tokenizer=None,
    progress: Optional[Callable[[int, int, int], None]] = None,
) -> BuildReport:
    """Answer the first turns of ``prompts_path`` with the model and add the
    replies to the store at ``out`` (default: the model's built store).
    ``progress(answered, to_answer, store_tokens)`` follows each reply.
    Ctrl-C saves what was built before re-raising."""
    prompts_path = Path(prompts_path)
    convs = read_conversations(prompts_path)
    refuse_eval_set(prompts_path, convs)
    path = Path(out) if out is not None else default_path(model_spec, "built")
    store = Datastore.open(path, model_key(model_spec), max_tokens=cfg.max_tokens)
    len(store)  # a corrupt or foreign file is refused now, before the slow load
    done = _read_done(path, prompts_path)
    queue = _queue(convs, done, cfg)
    total = len(queue)
    if model is None:
        from ..llm.load import load_model

        model, tokenizer = load_model(model_spec)
    distiller = Distiller(
        model,
        tokenizer,
        DistillConfig(
            batch_size=cfg.batch_size,
            max_new_tokens=cfg.max_new_tokens,
            max_prompt_tokens=cfg.max_prompt_tokens,
            top_k=0,
            prompt_positions=False,
            keep_hidden=False,
        ),
    )
    eos, state = set(tokenizer.eos_token_ids), {"replies": 0, "unsaved": 0}
    start = time.perf_counter()
    deadline = None if cfg.minutes is None else start + 60 * cfg.minutes

    def save():
        store.save(path)
        write_json_atomic(_done_path(path), {"prompts": str(prompts_path.resolve()), "done": sorted(done)})
        state["unsaved"] = 0

    def on_done(row, conv):
        done.add(conv["id"])
        if row is not None:
            store.add([t for t in row.tokens if t not in eos])
            state["replies"] += 1
        state["unsaved"] += 1
        if state["unsaved"] >= cfg.save_every:
            save()
        if progress is not None:
            progress(state["replies"], total, store.tokens)

    try:
        distiller.run(queue, on_done, lambda: deadline is not None and time.perf_counter() > deadline)
    finally:
        save()
    return BuildReport(path, state["replies"], len(store), store.tokens, time.perf_counter() - start)


def check_build_args(minutes: Optional[float], batch_size: int, max_new_tokens: int) -> None:
    """Refuse out-of-range ``datastore build`` flags before the slow load."""
    if minutes is not None and minutes <= 0:
        raise RedrafterError(f"--minutes must be positive (got {minutes}).")
    if batch_size < 1 or max_new_tokens < 1:
        raise RedrafterError(
            f"--batch-size and --max-new-tokens must be at least 1 (got {batch_size}, {max_new_tokens})."
        )
