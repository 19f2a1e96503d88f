"""Self-distillation data: the LLM answers training prompts greedily, and we keep
its tokens and the hidden states that produced them.

Generation is batched with continuous refill: finished rows leave the batch
(``BatchKVCache.filter``) and new prompts are prefilled and merged in
(``BatchKVCache.extend``), so the batch stays full. Finished replies go to
resumable shards (see :mod:`.shards`), written by :mod:`.distill_folder`.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..llm.parts import hidden_size, model_parts
from ..prompts import chat_prompt_ids, conversation_ids, read_conversations, refuse_eval_set
from .distill_folder import ShardWriter, check_share, merge_parts, my_share, open_manifest, part_folder
from .shards import Manifest, Sequence
from .world import digest, model_fingerprint, world


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
    manifest = open_manifest(folder, model_spec, prompts_path, cfg, w)
    if model is None:
        model, tokenizer = load_model(model_spec)
    w.agree(
        {
            "model": model_fingerprint(model),
            "prompt file": digest(prompts_path.read_bytes()),
            "distill settings": digest(json.dumps(asdict(cfg), sort_keys=True)),
        }
    )
    check_share(convs, cfg, w)
    queue = deque((c, 0, []) for c in my_share(convs, set(manifest.done), cfg, w))
    distiller = Distiller(model, tokenizer, cfg)
    writer = ShardWriter(folder, manifest, cfg)
    deadline = writer.deadline()

    def keep(row, conv):  # a finished row (None: its conversation ends here) into the writer
        writer.on_done(None if row is None else sequence(row), conv)

    def finished() -> int:
        return writer.run["sequences"] + len(writer.pending)

    def should_stop():
        if progress:
            progress(manifest, sum(len(s.tokens) for s in writer.pending) + sum(len(r.tokens) for r in distiller.rows))
        if stop is not None and stop(finished()):
            return True
        return deadline is not None and time.perf_counter() > deadline

    try:
        distiller.run(queue, keep, should_stop, drain and (lambda: drain(finished())))
    finally:
        # Replies of conversations still open are kept; the conversation is
        # redone from its first turn on resume only if it never completed.
        writer.flush()
    return merge_parts(out, manifest, w)
