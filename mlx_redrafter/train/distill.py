"""Self-distillation data: the LLM answers training prompts greedily, and we keep
its tokens and the hidden states that produced them.

Generation is batched with continuous refill: finished rows leave the batch
(``BatchKVCache.filter``) and new prompts are prefilled and merged in
(``BatchKVCache.extend``), so the batch stays full. Finished replies go to
resumable shards (see :mod:`.shards`).
"""

from __future__ import annotations

import json
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..errors import RedrafterError
from ..llm.parts import hidden_size, model_parts
from ..prompts import chat_prompt_ids, conversation_ids, read_conversations, refuse_eval_set
from .shards import Manifest, Sequence, write_shard
from .world import World, digest, model_fingerprint, world


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
    # Soft targets: the LLM's top-k logits at each position (0 = none).
    top_k: int = 16
    # Intermediate layers whose hidden states are kept for feature fusion
    # (see llm/parts.py); empty = the last layer only.
    feature_layers: List[int] = field(default_factory=list)
    # Also keep the prompt's positions: the hidden states and top-k logits
    # that the prefill computes anyway (the LLM's predictions of the user's
    # text, teacher-forced), several times cheaper per position than decoding.
    prompt_positions: bool = True
    # Copy each position's hidden state to the host (the drafter's training
    # data); False when only the tokens are wanted (``datastore build``).
    keep_hidden: bool = True
    # First turns as the user's text alone, without a template or role lines:
    # how a base model (no chat template) is prompted. Prompts recorded as
    # token ids (history) are fed as they are either way.
    raw: bool = False


@dataclass
class _Row:
    conv: dict
    turn: int
    messages: list
    prompt_len: int
    tokens: List[int] = field(default_factory=list)
    hidden: List[np.ndarray] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # name -> per-token arrays (soft targets, features)
    lead: Optional[dict] = None  # the prompt's positions: "tokens" and the arrays, stacked
    seen: set = field(default_factory=set)  # LOOP_NGRAM-grams of the reply so far
    repeat_run: int = 0  # consecutive tokens that closed an already-seen n-gram

    def add(self, token: int, hidden: np.ndarray, extra: Optional[dict] = None) -> None:
        self.tokens.append(token)
        self.hidden.append(hidden)
        for name, value in (extra or {}).items():
            self.extra.setdefault(name, []).append(value)
        if len(self.tokens) >= LOOP_NGRAM:
            gram = tuple(self.tokens[-LOOP_NGRAM:])
            self.repeat_run = self.repeat_run + 1 if gram in self.seen else 0
            self.seen.add(gram)


LOOP_NGRAM = 6


def sequence(row: _Row) -> Sequence:
    """What a finished row writes: its prompt's positions (when kept), then its reply's."""
    extra = {n: np.stack(v) for n, v in row.extra.items()}
    hidden, tokens, start = np.stack(row.hidden), list(row.tokens), 0
    if row.lead is not None:
        start = len(row.lead["tokens"])
        tokens = list(row.lead["tokens"]) + tokens
        hidden = np.concatenate([row.lead["hidden"], hidden])
        extra = {n: np.concatenate([row.lead[n], v]) for n, v in extra.items()}
    return Sequence(row.conv["id"], row.turn, row.prompt_len, tokens, hidden, extra, reply_start=start)


def _messages(conv, turn, history, system):
    msgs = ([{"role": "system", "content": system}] if system else []) + list(history)
    return msgs + [{"role": "user", "content": conv["turns"][turn]}]


class Distiller:
    """Continuous-batching greedy generation that records hidden states
    (and, per :class:`DistillConfig`, soft targets and intermediate layers)."""

    def __init__(self, model, tokenizer, cfg: DistillConfig):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        # With feature layers the backbone also returns their outputs, before the last state.
        self.embed, self.backbone, self.head = model_parts(model, cfg.feature_layers)
        self.width = hidden_size(model)
        self.eos = set(tokenizer.eos_token_ids)
        self.rows: List[_Row] = []
        self.cache = None
        self.next_tokens = None
        self.skipped = 0

    def encode(self, messages) -> List[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def prompt_ids(self, conv: dict, turn: int, messages) -> List[int]:
        """A turn's prompt: a first turn's recorded ids or raw text when it
        has them (:func:`~mlx_redrafter.prompts.conversation_ids`), else the template's."""
        if turn == 0 and (conv.get("ids") or self.cfg.raw):
            return conversation_ids(self.tokenizer, conv, self.cfg.raw)
        return self.encode(messages)

    def _forward(self, tokens: mx.array, cache, every: bool = False):
        """The batch's next tokens and what a row keeps of this position
        (of every position with ``every``, batch 1), as numpy arrays: one
        host transfer per decode step."""
        wide = self.backbone(tokens, cache=cache)
        wide = wide[0] if every else wide[:, -1]
        hidden = wide[..., -self.width :]
        logits = self.head(hidden)
        nxt = mx.argmax(logits[-1:] if every else logits, axis=-1).astype(mx.int32)
        out = {"hidden": hidden.astype(mx.float16)} if self.cfg.keep_hidden else {}
        k = self.cfg.top_k
        if k:
            # The top-k of the distribution that produced each token (its
            # argmax is the token itself), for training on soft targets. Their
            # logits, not probabilities: training renormalizes over the ids in
            # its draft vocabulary anyway, and a softmax over the full
            # vocabulary costs more on the CPU than the rest of this.
            top = mx.argpartition(logits, -k, axis=-1)[:, -k:].astype(mx.int32)
            out["topk_ids"], out["topk_logits"] = top, mx.take_along_axis(logits, top, axis=-1).astype(mx.float32)
        if self.cfg.feature_layers:
            out["features"] = wide[..., : -self.width].astype(mx.float16)
        mx.eval(nxt, out)
        return nxt, {name: np.array(v) for name, v in out.items()}

    @staticmethod
    def _keep(row: _Row, token: int, arrays: dict, i: int) -> None:
        hidden = arrays["hidden"][i] if "hidden" in arrays else None
        row.add(token, hidden, {n: v[i] for n, v in arrays.items() if n != "hidden"})

    def _prefill(self, items) -> None:
        """Prefill new rows and merge them into the running batch.

        Each prompt is prefilled alone (left-padding prompts of different
        lengths to one width wastes most of a batched prefill on padding);
        the group is merged into the running batch with one ``extend``,
        which copies the whole cache.
        """
        group, firsts = None, []
        for conv, turn, msgs in items:
            prompt = self.prompt_ids(conv, turn, msgs)
            # Each layer's own cache, then its batch form (a BatchKVCache, or a
            # hybrid layer's ArraysCache), as mlx-lm's batch generation merges them.
            cache = make_prompt_cache(self.model)
            first, arrays = self._forward(mx.array([prompt], dtype=mx.int32), cache, every=self.cfg.prompt_positions)
            cache = [c.merge([c]) for c in cache]
            row = _Row(conv, turn, msgs, len(prompt))
            if self.cfg.prompt_positions:
                # Position j predicts prompt[j + 1]: the sequence starts with
                # the prompt's own tokens from the second on.
                row.lead = {"tokens": prompt[1:], **{n: v[:-1] for n, v in arrays.items()}}
                arrays = {n: v[-1:] for n, v in arrays.items()}
            self._keep(row, first.item(), arrays, 0)
            self.rows.append(row)
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
        nxt, arrays = self._forward(self.next_tokens[:, None], self.cache)
        for i, (r, t) in enumerate(zip(self.rows, nxt.tolist())):
            self._keep(r, t, arrays, i)
        self.next_tokens = nxt
        return done

    def run(self, queue: deque, on_done, should_stop, draining=None) -> None:
        """Generate until the queue is empty or ``should_stop()``; once
        ``draining()``, no new prompt starts and the run ends when the replies
        under way have finished (none of their work is thrown away)."""
        B = self.cfg.batch_size
        while not should_stop():
            drain = draining is not None and draining()
            if not self.rows and (drain or not queue):
                break
            if queue and not drain and len(self.rows) <= B - max(1, B // 6):
                items = []
                while queue and len(self.rows) + len(items) < B:
                    conv, turn, history = queue.popleft()
                    msgs = _messages(conv, turn, history, self.cfg.system)
                    if len(self.prompt_ids(conv, turn, msgs)) > self.cfg.max_prompt_tokens:
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


def part_folder(out: Path, w: World) -> Path:
    """Where this rank writes: the data folder itself for one process,
    ``rank-R/`` inside it when the run is spread over several."""
    return out if w.size == 1 else out / f"rank-{w.rank}"


def _open_manifest(folder: Path, model_spec, prompts_path: Path, cfg: DistillConfig, w: World) -> Manifest:
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


def _my_share(convs: list, done: set, cfg: DistillConfig, w: World) -> list:
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


def _merge_parts(out: Path, manifest: Manifest, w: World) -> Manifest:
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


class _ShardWriter:
    """Collects finished replies and writes them as shards, with the manifest
    (resumable: ``flush`` saves what is finished so far)."""

    def __init__(self, folder: Path, manifest: Manifest, cfg: DistillConfig):
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

    def on_done(self, row, conv) -> None:
        cid = conv["id"]
        if row is None:  # a turn too long for max_prompt_tokens: no more turns come
            self.pending_done.append(cid)
            self.open_turns.pop(cid, None)
            return
        if row.turn == 0:
            self.open_turns[cid] = min(self.cfg.turns, len(conv["turns"]))
        self.pending.append(sequence(row))
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


def _check_share(convs: list, cfg: DistillConfig, w: World) -> None:
    available = len(convs) if cfg.max_conversations is None else min(len(convs), cfg.max_conversations)
    if available < w.size:
        raise RedrafterError(
            f"{w.size} processes but only {available} conversation(s) to answer: some ranks would have nothing to do.",
            "Launch fewer processes (mlx.launch -n), or give more prompts / a larger --max-conversations.",
        )


def distill(
    model_spec: str,
    prompts_path,
    out,
    cfg: DistillConfig,
    model=None,
    tokenizer=None,
    progress=None,
    stop=None,
    drain=None,
) -> Manifest:
    """Answer training prompts with the LLM and write resumable shards to ``out``.

    Under ``mlx.launch`` each rank answers its share of the prompts into
    ``out/rank-R/`` and rank 0 writes ``out/progress.json`` for all of them
    once every rank finished; the returned manifest is that merged one.
    ``progress(manifest, running_tokens)`` is called after every decode step
    with this rank's own manifest; ``stop(replies)``, when given, is asked
    after it with the number of replies this run finished (written or about
    to be) and ends the run when true (``make-drafter`` ends distillation
    when the rates it measures say the budget's share is spent);
    ``drain(replies)``, likewise: once true, no new prompt starts and the run
    ends when the replies under way finish.
    Ctrl-C (KeyboardInterrupt) writes the finished replies before re-raising.
    """
    from ..llm.load import load_model

    w = world()
    prompts_path = Path(prompts_path)
    convs = read_conversations(prompts_path)
    refuse_eval_set(prompts_path, convs)
    out = Path(out)
    folder = part_folder(out, w)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = _open_manifest(folder, model_spec, prompts_path, cfg, w)
    if model is None:
        model, tokenizer = load_model(model_spec)
    w.agree(
        {
            "model": model_fingerprint(model),
            "prompt file": digest(prompts_path.read_bytes()),
            "distill settings": digest(json.dumps(asdict(cfg), sort_keys=True)),
        }
    )
    _check_share(convs, cfg, w)
    queue = deque((c, 0, []) for c in _my_share(convs, set(manifest.done), cfg, w))
    distiller = Distiller(model, tokenizer, cfg)
    writer = _ShardWriter(folder, manifest, cfg)
    deadline = writer.deadline()

    def finished() -> int:
        return writer.run["sequences"] + len(writer.pending)

    def should_stop():
        if progress:
            progress(manifest, sum(len(s.tokens) for s in writer.pending) + sum(len(r.tokens) for r in distiller.rows))
        if stop is not None and stop(finished()):
            return True
        return deadline is not None and time.perf_counter() > deadline

    try:
        distiller.run(queue, writer.on_done, should_stop, drain and (lambda: drain(finished())))
    finally:
        # Replies of conversations still open are kept; the conversation is
        # redone from its first turn on resume only if it never completed.
        writer.flush()
    return _merge_parts(out, manifest, w)
