"""Grammar-constrained decoding (JSON Schema, any JSON, llguidance grammars).

The engine is llguidance (used by llama.cpp and vLLM): it compiles a JSON
Schema in about a millisecond, computes a token mask in 10-70 microseconds on
a 49k vocabulary, and forks and rolls back its matcher, which tree walking
needs. The plain constrained reference is :func:`grammar_logits_processor`
(an mlx-lm logits processor). Under speculative decoding the mask of every
tree node depends only on the tokens on its path, not on the logits, so the
host computes all of them (:func:`tree_masks`) before the verify call's
result is needed, prunes the drafts the grammar rejects, and acceptance runs
unchanged on the device over masked logits (:func:`accept_constrained`):
the masked argmax when greedy, the masked target distribution when
sampling. No logits are read to the host.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..errors import RedrafterError
from ..llm.parts import text_args
from .accept import Accepted, accept_greedy, accept_sampling
from .tree import PAD

ANY_JSON = {"type": "object"}  # spec "json": any JSON object, as OpenAI's json_object mode
_LLTOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (the Hugging Face bridge)
    except ImportError as e:
        raise RedrafterError(
            "Structured output needs the llguidance package, which is not installed.",
            "Run `pip install llguidance`.",
        ) from e
    return llguidance


def _ll_tokenizer(tokenizer):
    """The llguidance tokenizer of an mlx-lm / Hugging Face tokenizer (cached:
    building one takes about a second), or ``tokenizer`` if it is one."""
    llg = _llguidance()
    if isinstance(tokenizer, llg.LLTokenizer):
        return tokenizer
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper wraps it
    cached = _LLTOKENIZERS.get(hf)
    if cached is not None:
        return cached
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
    try:
        ll = llg.hf.from_tokenizer(hf, eos_token=eos)
    except ValueError as e:
        raise RedrafterError(
            f"Structured output cannot use this tokenizer: {e}.",
            "Use a model with a fast (tokenizer.json) Hugging Face tokenizer.",
        ) from e
    _LLTOKENIZERS[hf] = ll
    return ll


def special_token(tokenizer, text: str):
    """The id of the special token spelled ``text`` (one that a grammar names
    as ``<[id]>``, since its bytes never match a string literal), or None
    when ``text`` is ordinary text for ``tokenizer``."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        return None  # text (checked first: building the llguidance tokenizer takes a second)
    return ids[0] if _ll_tokenizer(tokenizer).is_special_token(ids[0]) else None


@dataclass
class Grammar:
    """A grammar compiled for one tokenizer; :meth:`matcher` starts a parse.

    ``vocab_size`` is the width of the masks: the model's vocabulary, which
    may be larger than the tokenizer's (padded embeddings; those ids are
    never allowed).
    """

    tokenizer: object  # llguidance.LLTokenizer
    definition: str  # the llguidance grammar (JSON text)
    vocab_size: int

    def matcher(self) -> "Matcher":
        return Matcher(self)

    @property
    def eos_ids(self) -> List[int]:
        return list(self.tokenizer.eos_tokens)


def _definition(spec) -> str:
    llg = _llguidance()
    if isinstance(spec, dict):
        try:
            return llg.LLMatcher.grammar_from_json_schema(spec)
        except (TypeError, ValueError) as e:  # e.g. a value JSON cannot hold
            raise RedrafterError(f"Invalid JSON Schema: {e}.", "Give a JSON Schema made of JSON values.") from e
    if spec == "json":
        return llg.LLMatcher.grammar_from_json_schema(ANY_JSON)
    if isinstance(spec, str):
        return spec  # an llguidance grammar (Lark, or its JSON form), e.g. from llguidance.grammar_from
    raise RedrafterError(
        f"Unknown grammar {str(spec)[:80]!r}.",
        'Give a JSON Schema (a dict), "json" for any JSON object, or an llguidance grammar '
        '(e.g. llguidance.grammar_from("lark", text)).',
    )


def check_grammar(spec, tokenizer=None) -> str:
    """The llguidance grammar of ``spec`` (see :func:`compile_grammar`),
    validated; without a ``tokenizer`` (an llguidance one) it checks the
    schema alone, before any model is loaded. An invalid schema or an
    unsupported feature raises :class:`RedrafterError` naming it."""
    llg = _llguidance()
    definition = _definition(spec)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(definition, tokenizer)
    if is_error:
        what = "JSON Schema" if isinstance(spec, dict) or spec == "json" else "grammar"
        raise RedrafterError(
            f"Invalid {what}: {'; '.join(m.strip() for m in messages)}.",
            f"Fix the {what}; supported JSON Schema features: "
            "https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md",
        )
    return definition


def compile_grammar(tokenizer, spec, vocab_size: int = None) -> Grammar:
    """Compile ``spec`` for ``tokenizer`` (mlx-lm, Hugging Face or llguidance).

    ``spec``: a JSON Schema (dict), ``"json"`` (any JSON object), an
    llguidance grammar string (Lark, or the JSON of ``llguidance.grammar_from``),
    or a :class:`Grammar` (returned as is).
    ``vocab_size``: the model's vocabulary (default: the tokenizer's).
    An invalid schema or an unsupported feature raises :class:`RedrafterError`
    naming it.
    """
    if isinstance(spec, Grammar):
        return spec
    ll = _ll_tokenizer(tokenizer)
    return Grammar(ll, check_grammar(spec, ll), int(vocab_size or ll.vocab_size))


def compile_for_model(model, tokenizer, spec) -> Grammar:
    """:func:`compile_grammar` with the masks as wide as ``model``'s vocabulary
    (mlx-lm models say it in ``args.vocab_size``; else the tokenizer's)."""
    return compile_grammar(tokenizer, spec, getattr(text_args(model), "vocab_size", None))


class Matcher:
    """The parse state of one output: masks, consumption, rollback, forks."""

    def __init__(self, grammar: Grammar, inner=None):
        self.grammar = grammar
        self.inner = inner if inner is not None else _llguidance().LLMatcher(grammar.tokenizer, grammar.definition)
        if self.inner.is_error():
            raise RedrafterError(f"The grammar failed to start: {self.inner.get_error()}")
        self.words = (grammar.tokenizer.vocab_size + 31) // 32

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (cheap: no mask is computed)."""
        if not 0 <= token < self.grammar.tokenizer.vocab_size:
            return False
        if self.inner.is_stopped():  # complete: llguidance takes EOS but does not validate it
            return token in self.grammar.eos_ids
        return self.inner.validate_tokens([token]) == 1

    def consume(self, token: int) -> int:
        """Advance by one token; a token the grammar rejects raises (and changes
        nothing). Returns the steps :meth:`rollback` needs to undo it: 0 for
        EOS after a complete output (llguidance does not count it)."""
        if not self.allows(token):
            raise RedrafterError(f"Token {token} is not allowed by the grammar here.")
        stopped = self.inner.is_stopped()
        self.inner.consume_token(token)
        return 0 if stopped else 1

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""
        if n and not self.inner.rollback(n):
            raise RedrafterError(f"The grammar matcher cannot roll back {n} tokens: {self.inner.get_error()}")

    def is_done(self) -> bool:
        """The output is complete: nothing but EOS may follow (or EOS was consumed)."""
        return self.inner.is_stopped()

    def is_accepting(self) -> bool:
        """The output so far is a complete match (it may still continue)."""
        return self.inner.is_accepting()

    def forced_tokens(self) -> List[int]:
        """Tokens the grammar forces next (llguidance's fast-forward tokens)."""
        return [] if self.is_done() else list(self.inner.compute_ff_tokens())

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed-token bitmask (bit ``t % 32`` of word ``t // 32``)
        into ``out`` (int32, C-contiguous); a finished parse allows EOS only."""
        if self.inner.is_stopped():
            out[:] = 0
            bits = out.view(np.uint32)
            for t in self.grammar.eos_ids:
                bits[t // 32] |= np.uint32(1 << (t % 32))
            return
        self.inner.unsafe_compute_mask_ptr(out.ctypes.data, out.size * out.itemsize)

    def bitmask(self) -> np.ndarray:
        out = np.zeros((self.words,), np.int32)
        self.fill_bitmask(out)
        return out

    def mask(self) -> mx.array:
        """``[vocab_size]`` bool: the tokens allowed next, over the model's vocabulary."""
        return unpack_masks(self.bitmask()[None], self.grammar.vocab_size)[0]


# --------------------------------------------------------------------------- masks on the device


def unpack_masks(words, vocab_size: int) -> mx.array:
    """``[R, ceil(V_tok/32)]`` int32 bitmasks -> ``[R, vocab_size]`` bool, on the
    device (the upload is 32x smaller than a bool row). Ids past the
    tokenizer's vocabulary are never allowed."""
    w = mx.array(words) if not isinstance(words, mx.array) else words
    bits = (mx.right_shift(w[:, :, None], mx.arange(32, dtype=mx.int32)) & 1).astype(mx.bool_)
    bits = bits.reshape(w.shape[0], -1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return mx.concatenate([bits, mx.zeros((w.shape[0], vocab_size - bits.shape[1]), mx.bool_)], axis=1)


def apply_mask(logits: mx.array, mask: mx.array) -> mx.array:
    """Logits with the disallowed tokens at ``-inf``."""
    return mx.where(mask, logits, mx.array(-float("inf"), logits.dtype))


def grammar_logits_processor(grammar: Grammar, start: Optional[int] = None):
    """An mlx-lm logits processor ``(tokens, logits) -> logits`` that masks
    every step with ``grammar``: plain constrained decoding, the reference
    of the speculative loop. One processor serves one generation: its first
    call sees the prompt; later calls consume the tokens generated since
    (``start``: the prompt's length, when the first call already holds
    generated tokens after it)."""
    matcher = grammar.matcher()
    seen = start

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal seen
        if seen is not None:
            for t in tokens[seen:].tolist():
                if not matcher.is_done():  # after EOS nothing is emitted
                    matcher.consume(t)
        seen = tokens.size
        return apply_mask(logits, matcher.mask())

    return process


# --------------------------------------------------------------------------- draft trees


def tree_masks(matcher: Matcher, rows: Sequence[Sequence[int]]) -> Tuple[List[List[int]], np.ndarray]:
    """Prune draft rows by the grammar and compute the mask of every node.

    ``matcher`` stands after ``g0`` (the tree's root) and is left there.
    Each row is cut before its first token the grammar rejects (and after
    an EOS: nothing follows it). Returns ``(rows, words)``: the kept rows
    (``PAD``-padded to the longest) and ``words [1 + W*L, ceil(V_tok/32)]``,
    the root's bitmask, then row ``w``'s node ``j`` at ``1 + w*L + j``.
    Shared prefixes are computed once.
    """
    eos = set(matcher.grammar.eos_ids)
    root = matcher.bitmask()
    kept, node_words, done = [], [], {}
    for row in rows:
        good, undo, mine = 0, 0, []
        for t in row:
            if t < 0 or not matcher.allows(t):
                break
            undo += matcher.consume(t)
            good += 1
            prefix = tuple(row[:good])
            if prefix not in done:
                done[prefix] = matcher.bitmask()
            mine.append(done[prefix])
            if t in eos:
                break
        matcher.rollback(undo)
        kept.append(list(row[:good]))
        node_words.append(mine)
    length = max([len(r) for r in kept] + [1])
    words = np.zeros((1 + len(kept) * length, matcher.words), np.int32)
    words[0] = root
    for w, mine in enumerate(node_words):
        for j, m in enumerate(mine):
            words[1 + w * length + j] = m
    return [r + [PAD] * (length - len(r)) for r in kept], words


def packed_masks(words: np.ndarray, beams: mx.array, node_index: mx.array, size: int, vocab_size: int) -> mx.array:
    """``[size, vocab_size]`` bool masks in the packed tree's node order.

    ``words`` as :func:`tree_masks` returns them; rows that share a prefix
    map to the same node and carry the same mask, so the scatter's choice
    among them does not matter. Padding goes to a dropped slot.
    """
    w = mx.array(words)
    target = mx.where(beams >= 0, node_index, size).reshape(-1)
    out = mx.zeros((size + 1, w.shape[1]), mx.int32)
    out[target] = w[1:]
    out[0] = w[0]
    return unpack_masks(out[:size], vocab_size)


def accept_constrained(beams: mx.array, tree, logits: mx.array, masks: mx.array, sampling) -> Accepted:
    """Acceptance over the verified tree under the grammar (lazy, no sync).

    Every node's logits are masked with its own grammar state, then the
    unconstrained acceptance runs unchanged: greedy keeps drafts equal to
    the masked argmax; sampling walks siblings with the residual
    renormalized over the masked target distribution (the rule of
    :func:`~mlx_redrafter.step.accept.accept_sampling`),
    so the output is exactly plain constrained decoding's.
    """
    masked = apply_mask(logits, masks)
    if sampling.greedy:
        return accept_greedy(beams, tree.node_index, masked)
    return accept_sampling(beams, tree, masked, sampling)


class GrammarMask:
    """A grammar as a mask on the read-then-build step (step/loop.py).

    The matcher stands after every token emitted: the first token is drawn
    from the root's masked logits (:meth:`root`); each step the host prunes
    the rows by the grammar and computes every node's mask (:meth:`prune`,
    :meth:`masks`), the tree is packed and accepted over masked logits, and
    the matcher takes the step's tokens, which end after the grammar's EOS
    (:meth:`consume`, :meth:`ended`). Its forced tokens join the tree as a
    row (:meth:`source`, step/sources/forced.py)."""

    def __init__(self, grammar: Grammar):
        self.grammar, self.matcher, self.eos = grammar, grammar.matcher(), set(grammar.eos_ids)

    def root(self, logits: mx.array) -> mx.array:
        return apply_mask(logits, self.matcher.mask())

    def source(self):
        from .sources.forced import ForcedSource

        return ForcedSource(self.matcher)

    def prune(self, cands):
        """``(candidates, words)``: the rows cut before their first token the
        grammar rejects (every row on the host), and :func:`tree_masks`' words."""
        from .build import Candidates
        from .source import Rows

        rows, labels, priors = cands.host_rows(), cands.labels, []
        for b in cands.blocks:
            priors += [b.prior] * len(b.lengths)
        kept, words = tree_masks(self.matcher, rows)
        lengths = [sum(1 for t in r if t >= 0) for r in kept]
        blocks = [
            Rows(mx.array([r], mx.int32), (n,), label, prior, host=[r[:n]])
            for r, n, label, prior in zip(kept, lengths, labels, priors)
        ]
        return Candidates(blocks), words

    def accept(self, built, logits: mx.array, masks: mx.array, sampling) -> Accepted:
        """Acceptance over ``built`` with every node's logits masked (:func:`accept_constrained`)."""
        from .build import alone

        if built.size == 1:
            return alone(apply_mask(logits, masks), sampling)
        return accept_constrained(built.beams, built.walk_tree(), logits, masks, sampling)

    def masks(self, words: np.ndarray, built) -> mx.array:
        """``[size, V]`` the mask of every node of the packed tree ``built``."""
        vocab = self.grammar.vocab_size
        if built.size == 1:
            return unpack_masks(words[:1], vocab)
        return packed_masks(words, built.beams, built.node_index, built.size, vocab)

    def consume(self, out):
        """Advance the matcher over a step's tokens; cut them after an EOS (drafts past it are not output)."""
        for i, t in enumerate(out.tokens):
            self.matcher.consume(t)  # raises if acceptance ever let a masked token through
            if t in self.eos:
                out.tokens, out.from_draft = out.tokens[: i + 1], out.from_draft[: i + 1]
                out.stats.accepted = sum(out.from_draft)
                break
        return out

    def ended(self, out) -> bool:
        return out.tokens[-1] in self.eos
