"""The step loop of a batch of rows, each drafting its own tree (issue 57).

:class:`BatchSteps` decodes several sequences together (``serve``'s
concurrent requests). Each step every row drafts as a row alone does in
the read-then-build schedule (its plan's sources, step/drafts.py: the
device's rows read with the step, then the host's), the batch's width is chosen against what the whole
batch's forward costs (step/batch_budget.py), every row's tree is verified
in one forward (step/batch_verify.py), each row accepts its own prefix with
the single row's acceptance, and each row's cache keeps exactly its own
accepted tokens (llm/batch_cache.py). One host read per step serves every
row. Rows join (:meth:`BatchSteps.add`: a prompt prefilled alone, or a
sequence that decoded elsewhere so far) and leave (:meth:`BatchSteps.remove`)
between two steps.

What stays a row's own: its sampling (greedy, or the exact sampling walk on
its own random key), its grammar (drafts pruned and every node masked by
its own matcher, step/grammar.py; forced tokens join as a row), and, for a
row that does not draft, its own sampler (``serve``'s seeded rows, whose
samples are plain decoding's with that seed). Sources with caches of their
own (an MTP or EAGLE-3 head, a draft model, a DFlash drafter) are each
row's own, with caches of their own beside the batch's (step/batch_row.py):
they catch up on each step's accepted tokens and draft after its read,
every row's rows brought to the host in one more read.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..config import DraftConfig
from ..llm.batch_cache import (
    Ragged,
    advance_rows,
    align_rows,
    drop_rows,
    extract_row,
    fit_rows,
    join_rows,
    path_columns,
    place_paths,
    take_row_states,
)
from ..llm.cache import target_size, trim_cache
from ..llm.parts import hidden_size, model_parts
from ..llm.recurrent import cache_length, recurrent_leaves
from .accept import Accepted
from .batch_budget import BatchCost, SourceRates, choose_width, cut_rows, ranked_nodes, unique_prefixes
from .batch_governors import new_governor
from .batch_row import BatchRow, RowPlan, propose_rows
from .batch_verify import RowTree, accept_row, draw, padded_paths, stack_trees, verify_batch
from .curve import builtin_curve
from .drafts import Drafts, costly_names, fused_layers, source_names
from .governor import Governor, mode_of
from .grammar import apply_mask, packed_masks, tree_masks, unpack_masks
from .plan import make_plan
from .protocol import StepRead, StepStats, StepTokens, host_read, prefill, step_read
from .tree import count_rows, pack


def _sink(drafts: Drafts, tokens: List[int]):
    """What a prompt's prefill calls with each chunk's hidden states: the row's stateful sources catch up on them."""

    def sink(start: int, hidden: mx.array) -> None:
        drafts.entered(tokens[start : start + hidden.shape[0]], hidden)

    return sink


@dataclass
class _Launched:
    """A step launched (lazy): the rows' trees, the batch of them, each row's
    acceptance, the hidden states, whether it is
    plain (every row's next token alone, written in place), and else the
    accepted paths' keys and values to move into place once read."""

    trees: List[RowTree]
    bt: object
    accs: List[Accepted]
    hidden: mx.array
    plain: bool
    columns: list  # not plain: each attention layer's keys and values of the rows' accepted paths
    tokens: Optional[mx.array] = None  # plain: every row's next token, ``[B]`` (the step's whole read)
    queued: bool = False


class BatchSteps:
    """Sequences decoded together with a draft tree each (see the module doc).

    ``draft`` says what drafts (the runtime's; the batch's plan leaves its
    controller out), ``curve`` prices the batch's
    forward until its steps are timed (step/batch_budget.py ``BatchCost``,
    keyed by rows and width; ``live=False``: by the curve alone).
    :attr:`rows` are in the batch's order;
    :meth:`step` returns one :class:`StepTokens` per row, in that order;
    after it, :attr:`last_width` is the width its trees were padded to, :attr:`tokens`
    what it emitted, and :attr:`verified` and :attr:`accepted` count its
    draft nodes by source.

    Whether the batch drafts at all is chosen live, as for a sequence alone
    (step/governor.py): one :class:`~mlx_redrafter.step.governor.Governor`
    per number of rows measures the batch's tokens per second with every
    source drafting, with none (plain batched decoding: no source is asked,
    so nothing of drafting is paid) and with the host sources alone, and
    each step's rows are proposed under the best (``live=False`` or
    ``always_draft``: every step drafts). A number of rows not seen before
    starts from the nearest one measured, the first from what requests alone
    learned (step/batch_governors.py).
    """

    def __init__(self, model, draft: DraftConfig, curve=None, live: bool = True):
        self.model, self.size = model, target_size(model)
        self.plan = make_plan(model, draft, batched=True)
        self.curve = curve if curve is not None else (draft.curve or builtin_curve())
        layers = fused_layers(self.plan.sources)
        self.embed, self.backbone, self.lm_head = model_parts(model, layers or None)
        self.width = hidden_size(model)
        self.context_width = self.width * (1 + len(layers))
        self.cache: list = []
        self.ragged = Ragged()
        self.rows: List[BatchRow] = []
        self.rates = SourceRates()
        self.cost = BatchCost(self.curve)
        self.live = live  # False: priced by the curve alone (no timing: the same widths every run)
        self.governed = live and self.plan.governed and self.plan.drafting
        self.names = source_names(self.plan.sources)
        self.governors: Dict[int, Governor] = {}  # by the batch's rows: a batch's cost depends on them
        # (arm, probing, rows) the next trees were proposed under (None: ungoverned)
        self.arm: Optional[Tuple[frozenset, bool, int]] = None
        self.ahead: Optional[_Launched] = None  # a plain step launched before the last one was read
        self.queued_steps = 0  # steps that were launched before the one before them was read
        self.syncs = 0
        self.last_width = 1  # the width of the last step's trees
        self.tokens = 0  # the last step's tokens, all rows together
        self.verified: Counter = Counter()  # the last step's draft nodes verified, by source
        self.accepted: Counter = Counter()  # ... and accepted

    def __len__(self) -> int:
        return len(self.rows)

    # ------------------------------------------------------------------ rows joining and leaving

    def add(self, cache, tokens: Sequence[int], plan: RowPlan, history: Sequence[int] = (), g0=None, reply=()):
        """A row joins: ``cache`` (a single row's: the model's caches, then
        maybe its stateful sources', as a prompt cache keeps them) holds
        ``history``; ``tokens`` follow it. ``g0=None``: ``tokens`` end
        a prompt, whose logits give the row's first token; returns ``(row,
        its first StepTokens)``. Else ``g0`` is the row's next token (already
        emitted), ``tokens`` the known ones before it that ``cache`` lacks,
        ``reply`` the reply so far, ending with ``g0`` (a grammar's parse
        takes it in); returns ``(row, None)``."""
        tic = time.perf_counter()
        self._unqueue()
        history, tokens, first = list(history), list(tokens), g0 is None
        kept, cache = cache[self.size :], cache[: self.size]  # its sources' caches after the model's
        matcher = plan.grammar.matcher() if plan.grammar is not None else None
        row, taken = BatchRow(plan, None, matcher), []
        if plan.drafts and self.plan.drafting:
            greedy = plan.sampling.greedy
            row.drafts = Drafts(
                self.plan.sources, self.model, self.embed, self.width, history + tokens, False, greedy, False
            )
            taken = row.open_caches(kept)
            if self.arm is not None:  # it joins under the arm the others' next trees are proposed under
                row.drafts.on = [n in self.arm[0] for n in self.names]
        stateful = row.stateful
        if first or tokens or (history and trim_cache(cache + taken, len(history) - 1)):
            if not (first or tokens):  # re-feed the last cached token: its context
                tokens, history = history[-1:], history[:-1]
            sink = _sink(row.drafts, tokens) if stateful else None
            logits, context = prefill(self.backbone, self.lm_head, cache, mx.array(tokens, mx.int32), sink=sink)
        else:  # a cache that cannot be trimmed: the first drafts come from no context (they are only rejected)
            context = mx.zeros((self.context_width,), mx.float32)
            if stateful and history:
                if taken:  # the kept hold the last token already: new ones, fed it from no context
                    row.open_caches()
                row.drafts.entered(history[-1:], context[None])
            elif stateful:  # nothing known before g0: a head has no state to draft from, the row decodes plainly
                row.drafts = None
        if first:
            g0 = self._first_token(row, logits if matcher is None else apply_mask(logits, matcher.mask()))
        g0 = g0 if isinstance(g0, mx.array) else mx.array(g0, mx.int32)
        pending = row.drafts.early_reads(g0, context, True) if row.drafts is not None else []
        vals = host_read(g0, *pending)
        row.g0 = vals[0]
        if matcher is not None:
            for t in [row.g0] if first else list(reply):
                if not matcher.is_done():
                    matcher.consume(t)
        propose_rows([row], [replace(StepRead.alone(row.g0), rest=vals[1:])])
        self.cache = join_rows(self.cache, self.ragged, [cache], [cache_length(cache) or 0])
        self.rows.append(row)
        if not first:
            return row, None
        return row, StepTokens([row.g0], [False], StepStats(0, 0, 1, time.perf_counter() - tic, 1))

    def _first_token(self, row: BatchRow, logits: mx.array) -> mx.array:
        """The token after a prompt (lazy): the row's sampler's, else its own draw."""
        if row.plan.sampler is not None:
            lp = logits[None] - mx.logsumexp(logits, axis=-1, keepdims=True)
            return row.plan.sampler(lp).reshape(()).astype(mx.int32)
        return draw(logits, row.plan.sampling, row.next_key())

    def remove(self, row: BatchRow) -> list:
        """``row`` leaves: its own caches (holding every token but its next one,
        :attr:`BatchRow.g0`), its stateful sources' after the model's."""
        self._unqueue()
        b = self.rows.index(row)
        cache = extract_row(self.cache, self.ragged, b)
        keep = [i for i in range(len(self.rows)) if i != b]
        drop_rows(self.cache, self.ragged, keep)
        self.rows.pop(b)
        if not self.rows:
            self.cache = []
        return cache + row.carried

    # ------------------------------------------------------------------ a step

    def _plan_width(self) -> int:
        """Cut every row's rows to the batch's width (step/batch_budget.py); the width."""
        ranked = [ranked_nodes(r.rows, r.sources, self.rates) for r in self.rows]
        width = choose_width(ranked, self.cost)
        for row, nodes in zip(self.rows, ranked):
            if len(nodes) <= width - 1:
                continue
            keep = {prefix for prefix, _ in nodes[: width - 1]}
            row.rows = cut_rows(row.rows, keep)
        return width

    def _row_tree(self, row: BatchRow):
        """``(RowTree, grammar masks or None)`` of a row's next tree."""
        g0 = mx.array(row.g0, mx.int32)
        rows, masks = row.rows, None
        if row.matcher is not None:
            rows, words = tree_masks(row.matcher, rows or [[]])
            row.rows = rows
            vocab = row.plan.grammar.vocab_size
        n_nodes = count_rows(rows) if rows else 0
        if n_nodes == 0:
            if row.matcher is not None:
                masks = unpack_masks(words[:1], vocab)
            return RowTree(g0), masks
        beams = mx.array(rows, mx.int32)
        tree = pack(beams, n_nodes, g0, padded=True)
        if row.matcher is not None:
            masks = packed_masks(words, beams, tree.node_index, tree.size, vocab)
        return RowTree(g0, tree, beams), masks

    def _accept(self, row: BatchRow, rt: RowTree, logits: mx.array, masks) -> Accepted:
        plan = row.plan
        if plan.sampler is not None and rt.tree is None:  # its own sampler, on mlx-lm's logprobs
            lg = logits[:1] if masks is None else apply_mask(logits[:1], masks)
            lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
            zero = mx.array(0, mx.int32)
            return Accepted(zero, zero, mx.zeros((1,), mx.int32), zero, plan.sampler(lp).reshape(()).astype(mx.int32))
        return accept_row(rt, logits, plan.sampling, row.next_key(), masks)

    def step(self) -> List[StepTokens]:
        """One step of every row: each row's accepted drafts and its own next token."""
        tic = time.perf_counter()
        self.verified, self.accepted = Counter(), Counter()
        now, self.ahead = self.ahead or self._launch(), None
        self.queued_steps += now.queued
        self.last_width = now.bt.width
        ran, self.arm = self.arm, self._next_arm()
        pending = [
            row.drafts.early_reads(acc.next_token, now.hidden[b, acc.last], True) if row.drafts else []
            for b, (row, acc) in enumerate(zip(self.rows, now.accs))
        ]
        # A plain step with nothing proposed early reads its tokens as they are (no new op).
        short = now.plain and not any(pending)
        read, sizes = (now.tokens, None) if short else self._read(now, pending)
        if now.columns:  # evaluated with the read: the buffers are then written in place
            mx.async_eval(*[a for pair in now.columns for a in pair])
        if self._can_queue(now):
            # The next step is a plain one too: queue it now, behind this step's read,
            # so that the device computes it while the host reads and emits this one.
            # Its graph is built first, while the device still finishes this step:
            # MLX's CPU stream holds a few ops queued at most (``async_eval`` returns
            # only when the rest are done), so time the host spends between two
            # submissions is time the device waits.
            self.ahead = self._launch(now)
            mx.async_eval(read)
            mx.async_eval(self.ahead.tokens)
        vals = host_read(read)
        self.syncs += 1
        parsed = [StepRead.alone(v) for v in vals] if short else self._parse(vals, now, sizes)
        if not now.plain:  # a plain step's one token a row is in place already
            place_paths(self.cache, self.ragged, now.columns, [1 + r.n for r in parsed])
        for b, (row, read) in enumerate(zip(self.rows, parsed)):
            if row.stateful:
                row.entered(now.hidden[b], read)
        out = [self._emit(row, rt, read, tic) for row, rt, read in zip(self.rows, now.trees, parsed)]
        if propose_rows(self.rows, parsed):  # the stateful sources' rows: the step's second read
            self.syncs += 1
            for st in out:
                st.stats.host_syncs = self.syncs
        self.tokens = sum(len(st.tokens) for st in out)
        return self.timed(out, now.bt.width, ran, time.perf_counter() - tic)

    @staticmethod
    def _read(now: "_Launched", pending: List[list]) -> Tuple[mx.array, List[int]]:
        """The step's one read (each row's acceptance, its accepted row, then
        what its early sources need) and each row's share of it."""
        reads, sizes = [], []
        for rt, acc, early in zip(now.trees, now.accs, pending):
            beam = rt.beams[acc.beam] if rt.tree is not None else mx.zeros((0,), mx.int32)
            parts = [step_read(acc, beam), *early]
            reads += parts
            sizes.append(sum(p.size for p in parts))
        return mx.concatenate([a.reshape(-1).astype(mx.int32) for a in reads]), sizes

    @staticmethod
    def _parse(vals: List[int], now: "_Launched", sizes: List[int]) -> List[StepRead]:
        """Each row's :class:`StepRead` of :meth:`_read`'s values."""
        parsed, at = [], 0
        for rt, size in zip(now.trees, sizes):
            parsed.append(StepRead.parse(vals[at : at + size], rt.depth))
            at += size
        return parsed

    def _launch(self, after: Optional["_Launched"] = None) -> "_Launched":
        """A step's verify and acceptance, lazily: every row's tree (its
        rows cut to the batch's width), or, ``after`` a plain step whose
        tokens are not read yet, each row's next token alone (a plain step
        queued ahead: :meth:`_can_queue`)."""
        if after is None:
            self._plan_width()
            built = [self._row_tree(row) for row in self.rows]
        else:
            built = [(RowTree(a.next_token), None) for a in after.accs]
            for row in self.rows:  # the queued step's draws take the rows' next keys: kept to undo it
                row.saved_key = row.plan.key
        trees = [rt for rt, _ in built]
        plain = all(rt.tree is None and masks is None for rt, masks in built)
        if plain:  # one token a row: written where every row ends, it needs no move after
            align_rows(self.cache, self.ragged)
        bt = stack_trees(trees)
        start = self.ragged.end  # the trees go right after the longest row
        logits, hidden = verify_batch(self.model, self.backbone, self.lm_head, self.cache, bt, self.ragged)
        accs = [self._accept(row, rt, logits[b], masks) for b, (row, (rt, masks)) in enumerate(zip(self.rows, built))]
        take_row_states(self.cache, mx.stack([b * bt.width + a.last for b, a in enumerate(accs)]))
        columns = []
        if plain:  # each row keeps its one token, known before the read
            advance_rows(self.cache, self.ragged)
        else:  # each row's accepted path, moved into place once read
            columns = path_columns(self.cache, start, padded_paths(accs, 1 + max(rt.depth for rt in trees)))
        tokens = mx.stack([a.next_token for a in accs]).astype(mx.int32) if plain else None
        return _Launched(trees, bt, accs, hidden, plain, columns, tokens, queued=after is not None)

    def _can_queue(self, now: "_Launched") -> bool:
        """Whether the next step can be launched before this one is read: this
        one and the next are plain (the governor parked drafting, no row has a
        grammar), so nothing of the next depends on what the host reads; the
        model has no recurrent layers, and no row draws with a sampler of its
        own (a queued step is undone, when rows join or leave first, by
        forgetting its one cached token and giving its keys back: a seeded
        row's sampler keeps its key to itself)."""
        return (
            now.plain
            and self.arm is not None
            and not self.arm[0]
            and all(row.matcher is None and (row.plan.sampler is None or row.plan.sampling.greedy) for row in self.rows)
            and not recurrent_leaves(self.cache)
        )

    def _unqueue(self) -> None:
        """Undo a step queued ahead (rows join or leave before it is read):
        its token leaves every row's cache and its draws' keys come back."""
        if self.ahead is None:
            return
        self.ahead = None
        self.ragged.lengths = [n - 1 for n in self.ragged.lengths]
        fit_rows(self.cache, self.ragged)
        for row in self.rows:
            row.plan.key = row.saved_key

    def timed(self, out: List[StepTokens], width: int, ran, seconds: float) -> List[StepTokens]:
        """A step of trees ``width`` wide, proposed under ``ran`` (the
        governor's ``(arm, probing, rows)``; None: ungoverned), took
        ``seconds``: the batch's cost and its governor learn from it."""
        if self.live:
            self.cost.observe(len(out), width, seconds)
        if ran is not None:
            self._ran(ran, out, seconds)
        return out

    # ------------------------------------------------------------------ the live choice

    def _next_arm(self) -> Optional[Tuple[frozenset, bool, int]]:
        """The governor's arm for the trees the rows propose now (they are
        verified next step): only its sources are asked. None: ungoverned."""
        if not self.governed or not self.rows:
            return None
        n = len(self.rows)
        if n not in self.governors:
            costly = costly_names(self.names, self.plan.sources)
            self.governors[n] = new_governor(self.model, self.names, costly, self.governors, self.curve, n)
        gov = self.governors[n]
        if self.arm is None or self.arm[2] != n:  # rows joined or left: its next step is not one of a run
            gov.prev = None
        arm, probing = gov.choose()
        on = [name in arm for name in self.names]
        for row in self.rows:
            if row.drafts is not None:
                row.drafts.on = on
        return arm, probing, n

    def _ran(self, ran: Tuple[frozenset, bool, int], out: List[StepTokens], seconds: float) -> None:
        """The step just run verified trees proposed under ``ran``: its
        governor learns the batch's tokens and seconds (not when rows joined
        or left since: the step is another batch's), and each row's stats
        say what it ran."""
        arm, probing, rows = ran
        if rows == len(out):
            self.governors[rows].ran(arm, self.tokens, seconds, probing)
        for st in out:
            st.stats.mode, st.stats.plain_rate = mode_of(arm, probing), self.governors[rows].plain_rate

    def _emit(self, row: BatchRow, rt: RowTree, read: StepRead, tic: float) -> StepTokens:
        """Row ``row``'s tokens of the step just read; its next tree's rows."""
        row.steps += 1
        tokens, drafted = read.emitted, [True] * read.n + [False]
        source = row.sources[read.beam] if read.n else ""
        if rt.tree is not None:
            self.rates.observe(row.rows, row.sources, read.row[: read.n])
            self.verified.update(source for _, source in unique_prefixes(row.rows, row.sources))
        if row.matcher is not None:
            eos = set(row.plan.grammar.eos_ids)
            for i, t in enumerate(tokens):
                row.matcher.consume(t)
                if t in eos:
                    tokens, drafted = tokens[: i + 1], drafted[: i + 1]
                    break
        if read.n:
            self.accepted[source] += sum(drafted)
        stats = StepStats(
            row.steps, sum(drafted), rt.size, time.perf_counter() - tic, self.syncs, read.beam, rt.depth, source
        )
        row.g0 = tokens[-1]
        return StepTokens(tokens, drafted, stats)
