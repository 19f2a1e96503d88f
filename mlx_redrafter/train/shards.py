"""Distillation shards: what the LLM said and the hidden states that said it.

A data folder holds ``progress.json`` (the manifest) and ``shard-NNNNN.safetensors``
files. Each shard concatenates sequences: ``tokens [T]`` (int32) and
``hidden [T, h]`` (float16), where ``hidden[i]`` is the LLM's post-norm hidden
state that produced ``tokens[i]``; ``offsets [n+1]`` delimit sequences.
Optional per-token arrays, aligned the same way: ``topk_ids [T, k]`` (int32)
and ``topk_logits [T, k]`` (float32), the LLM's top-k next-token logits at the
position that produced ``tokens[i]`` (soft targets), and ``features
[T, n*h]`` (float16), the outputs of intermediate layers (feature fusion).

The manifest counts what the folder holds and lists every run that added to
it (``runs``), so a second run accumulates and never redoes a conversation.

Shards are written to a temporary name and renamed, and the manifest is
rewritten atomically after each shard, so an interrupted run loses nothing
that was reported written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..errors import RedrafterError
from ..files import atomic_file, write_json_atomic

MANIFEST = "progress.json"


@dataclass
class Sequence:
    conv_id: str
    turn: int
    prompt_len: int
    tokens: List[int]
    hidden: np.ndarray  # [len(tokens), h] float16
    extra: dict = field(default_factory=dict)  # name -> [len(tokens), ...] (see the module docstring)
    reply_start: int = 0  # tokens before this are the prompt's (distill --prompt-positions)


@dataclass
class Manifest:
    model: str
    prompts: str
    config: dict
    shards: List[str] = field(default_factory=list)
    done: List[str] = field(default_factory=list)  # conversation ids fully answered
    sequences: int = 0
    tokens: int = 0  # reply tokens
    prompt_tokens: int = 0  # prompt positions kept besides them
    elapsed: float = 0.0
    world_size: int = 1  # processes that wrote it (their shards are in rank-R/ when more than 1)
    runs: List[dict] = field(default_factory=list)  # one record per run: when, how long, what it added

    @classmethod
    def load(cls, folder: Path) -> "Manifest | None":
        path = Path(folder) / MANIFEST
        if not path.is_file():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise RedrafterError(f"{path} is corrupt: {e}", "Delete the folder or pick a new --out.") from None

    def save(self, folder: Path) -> None:
        write_json_atomic(Path(folder) / MANIFEST, self.__dict__, indent=1)


def write_shard(folder: Path, index: int, seqs: List[Sequence]) -> str:
    """Write sequences as one shard (atomically) and return its file name."""
    name = f"shard-{index:05d}.safetensors"
    tokens = np.concatenate([np.asarray(s.tokens, np.int32) for s in seqs])
    hidden = np.concatenate([s.hidden for s in seqs]).astype(np.float16)
    offsets = np.cumsum([0] + [len(s.tokens) for s in seqs]).astype(np.int32)
    extra = {name: np.concatenate([s.extra[name] for s in seqs]) for name in seqs[0].extra}
    meta = {
        "ids": json.dumps([s.conv_id for s in seqs]),
        "turns": json.dumps([s.turn for s in seqs]),
        "prompt_len": json.dumps([s.prompt_len for s in seqs]),
        "reply_start": json.dumps([s.reply_start for s in seqs]),
    }
    with atomic_file(Path(folder) / name) as tmp:
        arrays = {"tokens": mx.array(tokens), "hidden": mx.array(hidden), "offsets": mx.array(offsets)}
        arrays.update({name: mx.array(v) for name, v in extra.items()})
        mx.save_safetensors(str(tmp), arrays, meta)
    return name


@dataclass
class Corpus:
    """All shards of a data folder, concatenated in memory."""

    tokens: np.ndarray  # [T] int32
    hidden: np.ndarray  # [T, h] float16
    offsets: np.ndarray  # [n+1]
    ids: List[str]
    extra: dict = field(default_factory=dict)  # optional per-token arrays every shard holds
    feature_layers: List[int] = field(default_factory=list)  # the layers behind extra["features"]
    reply: Optional[np.ndarray] = None  # [T] bool: the position is in a reply (not a prompt); None = all are

    @property
    def soft_targets(self) -> bool:
        return "topk_ids" in self.extra and "topk_logits" in self.extra

    @property
    def hidden_size(self) -> int:
        return self.hidden.shape[1]


def read_corpus(folder) -> Corpus:
    folder = Path(folder)
    manifest = Manifest.load(folder)
    if manifest is None or not manifest.shards:
        raise RedrafterError(
            f"No distillation data in {folder}.",
            "Run `mlx-redrafter distill --out DIR` first and pass that DIR as --data.",
        )
    tokens, hidden, offsets, ids, extra, starts = [], [], [0], [], [], []
    for name in manifest.shards:
        try:
            arrays, meta = mx.load(str(folder / name), return_metadata=True)
            ids.extend(json.loads(meta["ids"]))
            starts.extend(json.loads(meta.get("reply_start", "null")) or [0] * len(json.loads(meta["ids"])))
            tokens.append(np.array(arrays.pop("tokens")))
            hidden.append(np.array(arrays.pop("hidden")))
            base = offsets[-1]
            offsets.extend((np.array(arrays.pop("offsets"))[1:] + base).tolist())
        except Exception as e:
            raise RedrafterError(
                f"Shard {folder / name} cannot be read: {e}", "Delete it from progress.json and rerun distill."
            ) from None
        extra.append(arrays)
    # Optional arrays count only when every shard has them (a folder may mix runs).
    names = set.intersection(*(set(a) for a in extra))
    offsets = np.asarray(offsets)
    reply = np.ones(offsets[-1], bool)
    for a, start in zip(offsets[:-1], starts):
        reply[a : a + start] = False
    return Corpus(
        np.concatenate(tokens),
        np.concatenate(hidden),
        offsets,
        ids,
        {n: np.concatenate([np.array(a[n]) for a in extra]) for n in sorted(names)},
        list(manifest.config.get("feature_layers", [])),
        reply,
    )
