"""Self-distillation data: the LLM answers training prompts greedily, and we keep
its tokens and the hidden states that produced them.

Generation is batched with continuous refill: finished rows leave the batch
(``BatchKVCache.filter``) and new prompts are prefilled and merged in
(``BatchKVCache.extend``), so the batch stays full. Finished replies go to
resumable shards (see :mod:`.shards`).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from ..errors import RedrafterError
from ..models import model_parts
from ..prompts import chat_prompt_ids, read_conversations, refuse_eval_set
from .shards import Manifest, Sequence, write_shard


@dataclass
class DistillConfig:
    turns: int = 1  # user turns answered per conversation (1 = first turns only)
    batch_size: int = 48
    max_new_tokens: int = 192
    max_prompt_tokens: int = 384  # longer conversations are skipped
    minutes: Optional[float] = None  # total budget over all (resumed) runs into the folder
    max_conversations: Optional[int] = None
    shard_sequences: int = 64
    # End a reply once this many tokens in a row repeat its own earlier text:
    # small models loop, and a loop teaches the drafter nothing new (0 = off).
    stop_loops: int = 12
    system: Optional[str] = None
    seed: int = 0


@dataclass
class _Row:
    conv: dict
    turn: int
    messages: list
    prompt_len: int
    tokens: List[int] = field(default_factory=list)
    hidden: List[np.ndarray] = field(default_factory=list)
    seen: set = field(default_factory=set)  # LOOP_NGRAM-grams of the reply so far
    repeat_run: int = 0  # consecutive tokens that closed an already-seen n-gram

    def add(self, token: int, hidden: np.ndarray) -> None:
        self.tokens.append(token)
        self.hidden.append(hidden)
        if len(self.tokens) >= LOOP_NGRAM:
            gram = tuple(self.tokens[-LOOP_NGRAM:])
            self.repeat_run = self.repeat_run + 1 if gram in self.seen else 0
            self.seen.add(gram)


LOOP_NGRAM = 6


def _messages(conv, turn, history, system):
    msgs = ([{"role": "system", "content": system}] if system else []) + list(history)
    return msgs + [{"role": "user", "content": conv["turns"][turn]}]


class Distiller:
    """Continuous-batching greedy generation that records hidden states."""

    def __init__(self, model, tokenizer, cfg: DistillConfig):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.embed, self.backbone, self.head = model_parts(model)
        self.eos = set(tokenizer.eos_token_ids)
        self.rows: List[_Row] = []
        self.cache = None
        self.next_tokens = None
        self.skipped = 0

    def encode(self, messages) -> List[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def _prefill(self, items) -> None:
        """Prefill new rows and merge them into the running batch.

        Each prompt is prefilled alone (left-padding prompts of different
        lengths to one width wastes most of a batched prefill on padding);
        the group is merged into the running batch with one ``extend``,
        which copies the whole cache.
        """
        group, firsts = None, []
        for conv, turn, msgs in items:
            prompt = self.encode(msgs)
            cache = [BatchKVCache([0]) for _ in self.model.layers]
            hidden = self.backbone(mx.array([prompt], dtype=mx.int32), cache=cache)[:, -1]
            first = mx.argmax(self.head(hidden), axis=-1).astype(mx.int32)
            mx.eval(first, hidden)
            self.rows.append(_Row(conv, turn, msgs, len(prompt), first.tolist(), [np.array(hidden[0].astype(mx.float16))]))
            firsts.append(first)
            if group is None:
                group = cache
            else:
                for mine, new in zip(group, cache):
                    mine.extend(new)
        first = mx.concatenate(firsts)
        if self.cache is None:
            self.cache, self.next_tokens = group, first
        else:
            for mine, new in zip(self.cache, group):
                mine.extend(new)
            self.next_tokens = mx.concatenate([self.next_tokens, first])

    def _finished(self, row: _Row) -> bool:
        looping = self.cfg.stop_loops and row.repeat_run >= self.cfg.stop_loops
        return row.tokens[-1] in self.eos or len(row.tokens) >= self.cfg.max_new_tokens or looping

    def step(self) -> List[_Row]:
        """One decode step for the whole batch; returns the rows that finished."""
        done = [r for r in self.rows if self._finished(r)]
        keep = [i for i, r in enumerate(self.rows) if not self._finished(r)]
        if done:
            self.rows = [self.rows[i] for i in keep]
            if not keep:
                self.cache, self.next_tokens = None, None
                return done
            idx = mx.array(keep)
            for c in self.cache:
                c.filter(idx)
            self.next_tokens = self.next_tokens[idx]
        hidden = self.backbone(self.next_tokens[:, None], cache=self.cache)[:, 0]
        nxt = mx.argmax(self.head(hidden), axis=-1).astype(mx.int32)
        mx.eval(nxt, hidden)
        hid = np.array(hidden.astype(mx.float16))
        for r, t, h in zip(self.rows, nxt.tolist(), hid):
            r.add(t, h)
        self.next_tokens = nxt
        return done

    def run(self, queue: deque, on_done, should_stop) -> None:
        """Generate until the queue is empty or ``should_stop()``."""
        B = self.cfg.batch_size
        while (queue or self.rows) and not should_stop():
            if queue and len(self.rows) <= B - max(1, B // 6):
                items = []
                while queue and len(self.rows) + len(items) < B:
                    conv, turn, history = queue.popleft()
                    msgs = _messages(conv, turn, history, self.cfg.system)
                    if len(self.encode(msgs)) > self.cfg.max_prompt_tokens:
                        self.skipped += 1
                        on_done(None, conv)  # the conversation ends here
                        continue
                    items.append((conv, turn, msgs))
                if items:
                    self._prefill(items)
            for row in self.step():
                on_done(row, row.conv)
                if row.turn + 1 < min(self.cfg.turns, len(row.conv["turns"])):
                    reply = self.tokenizer.decode([t for t in row.tokens if t not in self.eos])
                    history = [m for m in row.messages if m["role"] != "system"]
                    history.append({"role": "assistant", "content": reply})
                    queue.appendleft((row.conv, row.turn + 1, history))


def distill(model_spec: str, prompts_path, out, cfg: DistillConfig, model=None, tokenizer=None, progress=None) -> Manifest:
    """Answer training prompts with the LLM and write resumable shards to ``out``.

    ``progress(manifest, running_tokens)`` is called after every decode step.
    Ctrl-C (KeyboardInterrupt) writes the finished replies before re-raising.
    """
    from ..models import load_model

    prompts_path = Path(prompts_path)
    convs = read_conversations(prompts_path)
    refuse_eval_set(prompts_path, convs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.load(out)
    if manifest is None:
        manifest = Manifest(str(model_spec), str(prompts_path.resolve()), asdict(cfg))
    elif manifest.model != str(model_spec) or manifest.prompts != str(prompts_path.resolve()):
        raise RedrafterError(
            f"{out} holds data distilled from {manifest.model} on {manifest.prompts}.",
            "Resume with the same --model and --prompts, or pick a new --out.",
        )
    if model is None:
        model, tokenizer = load_model(model_spec)

    done = set(manifest.done)
    todo = [c for c in convs if c["id"] not in done]
    random.Random(cfg.seed).shuffle(todo)
    if cfg.max_conversations is not None:
        todo = todo[: max(0, cfg.max_conversations - len(done))]
    queue = deque((c, 0, []) for c in todo)
    distiller = Distiller(model, tokenizer, cfg)
    pending: List[Sequence] = []
    pending_done: List[str] = []
    open_turns = {}  # conv id -> replies still to come
    start = time.perf_counter()
    base_elapsed = manifest.elapsed

    def flush():
        nonlocal pending, pending_done
        if pending:
            name = write_shard(out, len(manifest.shards), pending)
            manifest.shards.append(name)
            manifest.sequences += len(pending)
            manifest.tokens += sum(len(s.tokens) for s in pending)
        manifest.done.extend(pending_done)
        manifest.elapsed = base_elapsed + time.perf_counter() - start
        manifest.save(out)
        pending, pending_done = [], []

    def on_done(row, conv):
        cid = conv["id"]
        if row is None:  # a turn too long for max_prompt_tokens: no more turns come
            pending_done.append(cid)
            open_turns.pop(cid, None)
            return
        if row.turn == 0:
            open_turns[cid] = min(cfg.turns, len(conv["turns"]))
        pending.append(Sequence(cid, row.turn, row.prompt_len, row.tokens, np.stack(row.hidden)))
        open_turns[cid] -= 1
        if open_turns[cid] == 0:
            pending_done.append(cid)
            del open_turns[cid]
        if len(pending) >= cfg.shard_sequences:
            flush()

    # The budget covers every run into this folder, so a rerun of a finished
    # job does nothing and an interrupted one only uses what is left.
    deadline = None if cfg.minutes is None else start + 60 * cfg.minutes - base_elapsed

    def should_stop():
        if progress:
            progress(manifest, sum(len(s.tokens) for s in pending) + sum(len(r.tokens) for r in distiller.rows))
        return deadline is not None and time.perf_counter() > deadline

    try:
        distiller.run(queue, on_done, should_stop)
    finally:
        # Replies of conversations still open are kept; the conversation is
        # redone from its first turn on resume only if it never completed.
        flush()
    return manifest
