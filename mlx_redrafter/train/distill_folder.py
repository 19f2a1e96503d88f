"""Where a distillation run writes: this rank's part of the data folder
(``rank-R/`` under ``mlx.launch``), its manifest resumed or started (what must
match to resume), this rank's share of the conversations, the writer that
keeps finished replies as shards, and the merged manifest once every rank
finished. The shards' format is :mod:`~mlx_redrafter.train.shards`'s;
``cfg`` is the run's :class:`~mlx_redrafter.train.distill.DistillConfig`."""

from __future__ import annotations

import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

from ..errors import RedrafterError
from .shards import Manifest, Sequence, write_shard
from .world import World


def part_folder(out: Path, w: World) -> Path:
    """Where this rank writes: the data folder itself for one process,
    ``rank-R/`` inside it when the run is spread over several."""
    return out if w.size == 1 else out / f"rank-{w.rank}"


def open_manifest(folder: Path, model_spec, prompts_path: Path, cfg, w: World) -> Manifest:
    """This rank's manifest: resumed if the folder holds one from the same
    model, prompts and world size, else a new one. Errors are decided by
    all ranks together."""
    error, manifest = None, None
    try:
        manifest = Manifest.load(folder)
        # Rank 0 also checks the merged manifest of an earlier distributed run.
        top = Manifest.load(folder.parent) if w.size > 1 and w.rank == 0 else None
        for m, where in ((manifest, folder), (top, folder.parent)):
            if m is None:
                continue
            if m.model != str(model_spec) or m.prompts != str(prompts_path.resolve()):
                raise RedrafterError(
                    f"{where} holds data distilled from {m.model} on {m.prompts}.",
                    "Resume with the same --model and --prompts, or pick a new --out.",
                )
            for key, before in FORMAT_KEYS.items():  # they decide what the shards hold
                had, now = m.config.get(key, before), getattr(cfg, key)
                if had != now:
                    raise RedrafterError(
                        f"{where} holds shards distilled with {key}={had}, this run asks for {key}={now}.",
                        f"Resume with the same --{key.replace('_', '-')}, or pick a new --out.",
                    )
            if m.world_size != w.size:
                raise RedrafterError(
                    f"{where} was distilled by {m.world_size} process(es), "
                    f"this run has {w.size}: the prompt shares would differ.",
                    f"Resume with `mlx.launch -n {m.world_size}` (or without mlx.launch for 1), or pick a new --out.",
                )
    except RedrafterError as e:
        error = e
    w.check(error)
    return manifest or Manifest(str(model_spec), str(prompts_path.resolve()), asdict(cfg), world_size=w.size)


# Settings that decide the shards' arrays, which every run into a folder must
# share, with their values in manifests written before the setting existed.
FORMAT_KEYS = {"top_k": 0, "feature_layers": [], "prompt_positions": False}


def my_share(convs: list, done: set, cfg, w: World) -> list:
    """This rank's conversations still to answer: every ``size``-th prompt
    from index ``rank``, so that a rerun gives each rank the same share;
    ``max_conversations`` is split between the ranks."""
    share = [c for i, c in enumerate(convs) if i % w.size == w.rank]
    todo = [c for c in share if c["id"] not in done]
    random.Random(cfg.seed).shuffle(todo)
    if cfg.max_conversations is not None:
        cap = cfg.max_conversations // w.size + (w.rank < cfg.max_conversations % w.size)
        todo = todo[: max(0, cap - len(done))]
    return todo


def merge_parts(out: Path, manifest: Manifest, w: World) -> Manifest:
    """Once every rank finished, rank 0 writes the data folder's manifest:
    every rank's shards (paths inside ``rank-R/``) and counts."""
    if w.size == 1:
        return manifest
    parts = w.gather_json(manifest.__dict__)
    merged = Manifest(manifest.model, manifest.prompts, manifest.config, world_size=w.size)
    for rank, part in enumerate(parts):
        merged.shards += [f"rank-{rank}/{name}" for name in part["shards"]]
        merged.done += part["done"]
        merged.sequences += part["sequences"]
        merged.tokens += part["tokens"]
        merged.prompt_tokens += part.get("prompt_tokens", 0)
        merged.elapsed = max(merged.elapsed, part["elapsed"])
        merged.runs += [{**r, "rank": rank} for r in part["runs"]]
    if w.rank == 0:
        merged.save(out)
    return merged


class ShardWriter:
    """Collects finished replies and writes them as shards, with the manifest
    (resumable: ``flush`` saves what is finished so far)."""

    def __init__(self, folder: Path, manifest: Manifest, cfg):
        self.folder, self.manifest, self.cfg = folder, manifest, cfg
        self.pending: List[Sequence] = []
        self.pending_done: List[str] = []
        self.open_turns = {}  # conv id -> replies still to come
        self.start = time.perf_counter()
        self.base_elapsed = manifest.elapsed
        self.run = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "sequences": 0,
            "tokens": 0,
            "prompt_tokens": 0,
            "seconds": 0.0,
        }
        manifest.runs.append(self.run)

    def flush(self) -> None:
        manifest, run, pending = self.manifest, self.run, self.pending
        if pending:
            name = write_shard(self.folder, len(manifest.shards), pending)
            manifest.shards.append(name)
            added = sum(len(s.tokens) - s.reply_start for s in pending)
            lead = sum(s.reply_start for s in pending)
            manifest.sequences += len(pending)
            manifest.tokens += added
            manifest.prompt_tokens += lead
            run["sequences"] += len(pending)
            run["tokens"] += added
            run["prompt_tokens"] += lead
        manifest.done.extend(self.pending_done)
        manifest.elapsed = self.base_elapsed + time.perf_counter() - self.start
        run["seconds"] = round(time.perf_counter() - self.start, 1)
        manifest.save(self.folder)
        self.pending, self.pending_done = [], []

    def on_done(self, seq: Optional[Sequence], conv) -> None:
        """A finished reply of ``conv`` (None: a turn too long for max_prompt_tokens, no more turns come)."""
        cid = conv["id"]
        if seq is None:
            self.pending_done.append(cid)
            self.open_turns.pop(cid, None)
            return
        if seq.turn == 0:
            self.open_turns[cid] = min(self.cfg.turns, len(conv["turns"]))
        self.pending.append(seq)
        self.open_turns[cid] -= 1
        if self.open_turns[cid] == 0:
            self.pending_done.append(cid)
            del self.open_turns[cid]
        if len(self.pending) >= self.cfg.shard_sequences:
            self.flush()

    def deadline(self) -> Optional[float]:
        """The budget covers every run into this folder, so a rerun of a finished
        job does nothing and an interrupted one only uses what is left."""
        cfg = self.cfg
        return None if cfg.minutes is None else self.start + 60 * cfg.minutes - self.base_elapsed


def check_share(convs: list, cfg, w: World) -> None:
    available = len(convs) if cfg.max_conversations is None else min(len(convs), cfg.max_conversations)
    if available < w.size:
        raise RedrafterError(
            f"{w.size} processes but only {available} conversation(s) to answer: some ranks would have nothing to do.",
            "Launch fewer processes (mlx.launch -n), or give more prompts / a larger --max-conversations.",
        )
