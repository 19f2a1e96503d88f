"""Tiny random models and drafters built in code (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
from mlx_lm.utils import _get_classes

from mlx_redrafter.draft.beam import Beams
from mlx_redrafter.draft.redrafter import Drafter, DrafterConfig
from mlx_redrafter.generate import generate_tokens
from mlx_redrafter.step.dispatch import redrafter_steps

VOCAB = 97
HIDDEN = 64

TINY_CONFIGS = {
    "llama": dict(
        model_type="llama",
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "phi3": dict(
        model_type="phi3",
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        partial_rotary_factor=0.5,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        rope_scaling={"type": "longrope", "long_factor": [1.5] * 4, "short_factor": [1.0] * 4},
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        sliding_window=8,
        sliding_window_pattern=2,
        query_pre_attn_scalar=32,
        max_position_embeddings=512,
    ),
}


def tiny_model(kind: str, seed: int = 0, scale: float = 4.0, **config_changes):
    """A random mlx-lm model of the given type, float32, parameters evaluated
    (``config_changes``: e.g. ``vocab_size=`` for a given tokenizer).

    Weights are scaled up so that logits are peaked and the argmax margins
    are far above float32 rounding.
    """
    config = {**TINY_CONFIGS[kind], **config_changes}
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    if kind == "gemma3_text":
        model.sanitize({})  # ties the embedding like a checkpoint without lm_head
    from mlx.utils import tree_map

    model.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def random_drafter(hidden: int = HIDDEN, vocab: int = VOCAB, seed: int = 1, **kw) -> Drafter:
    mx.random.seed(seed)
    d = Drafter(DrafterConfig(vocab_size=vocab, hidden_size=hidden, **kw))
    mx.eval(d.parameters())
    return d


class OracleDrafter:
    """Proposes the model's own greedy continuation, found by matching the
    context vector against the hidden states of a plain run.

    Beam 0 is the true continuation (corrupted at its last position at
    irregular steps, so that acceptance lengths vary); beam ``w > 0`` agrees with
    it for its first ``L - w`` tokens, so beams share prefixes and dedup,
    partial acceptance and every compaction length get exercised. Everything
    is lazy, like a real drafter.

    ``inner``: a real :class:`Drafter` (a random one: it is never right) whose
    beam search runs each step (fused features and all: its ``config`` is
    this drafter's) and gives every beam but the first, which is the truth.
    The tree then mixes the real drafter's beams with one that is accepted.

    ``prompt`` may be a list of prompts (one drafter that knows each one's
    reply: a server's several requests); ``replies``: the continuation of each
    (e.g. plain decoding's under a grammar) instead of plain greedy decoding's.
    """

    def __init__(self, model, prompt, max_tokens: int, length: int, inner: Optional[Drafter] = None, replies=None):
        from mlx_redrafter.llm.parts import model_parts

        embed, backbone, head = model_parts(model)
        many = bool(len(prompt)) and not isinstance(prompt[0], int)
        hidden, nexts, last = [], [], []
        for i, p in enumerate(prompt if many else [prompt]):
            p = list(p)
            tokens = replies[i] if replies else generate_tokens(model, p, max_tokens=max_tokens + length + 2)[0]
            full = mx.array(p + list(tokens), dtype=mx.int32)
            hidden.append(backbone(full[None])[0][len(p) - 1 : -1])  # hidden[i] produced full[len(p) + i]
            nexts.append(full[len(p) :])  # next[i] = token produced by hidden[i]
            start = sum(n.shape[0] for n in nexts[:-1])
            last.append(mx.full((len(tokens),), start + len(tokens) - 1, dtype=mx.int32))  # where a reply ends
        self.hidden, self.next, self.last = mx.concatenate(hidden), mx.concatenate(nexts), mx.concatenate(last)
        mx.eval(self.hidden, self.next, self.last)
        self.vocab = int(embed.weight.shape[0])
        self.config = SimpleNamespace(hidden_size=int(self.hidden.shape[-1]), vocab_size=self.vocab)
        self.inner = inner
        if inner is not None:
            self.config = inner.config

    def draft(self, embed, context, g0, width, length, warp=False, confidences=0):
        if self.inner is not None:
            real = self.inner.draft(embed, context, g0, width, length, warp=warp, confidences=confidences)
            mine = self.draft_truth(context[..., -self.hidden.shape[-1] :], width, length, confidences)
            rows = mx.concatenate([mine.tokens[:1], real.tokens[1:]])  # deterministic rows: no draft logprobs
            conf = None if not confidences else mx.concatenate([mine.confidences[:1], real.confidences[1:]])
            return Beams(rows, real.scores, confidences=conf)
        return self.draft_truth(context, width, length, confidences)

    def draft_truth(self, context, width, length, confidences=0):
        """The beams described above, from the context alone."""
        d = ((self.hidden - context[None]) ** 2).sum(-1)
        pos = mx.argmin(d).astype(mx.int32)  # hidden[pos] produced g0 = next[pos]
        idx = mx.minimum(pos + 1 + mx.arange(length), self.last[pos])
        beams = mx.stack(self.rows(pos, self.next[idx], width, length)).astype(mx.int32)
        conf = None
        if confidences:
            # Confident where the draft is the model's own token, unsure elsewhere.
            right = (beams == self.next[idx][None, :]).astype(mx.float32)
            top1 = 0.2 + 0.7 * right
            rest = mx.broadcast_to(((1 - top1) / confidences)[..., None], (*beams.shape, confidences - 1))
            conf = mx.concatenate([top1[..., None], rest], axis=-1)
        return Beams(beams, mx.zeros((width,)), confidences=conf)

    def rows(self, pos, truth, width: int, length: int):
        """The ``width`` rows of a step whose true continuation is ``truth [length]``
        (``pos``: the step's place in the reply, a device scalar)."""
        corrupt_last = ((pos * 37 + 11) % 7) < 3  # irregular, so every run length occurs
        truth = mx.where(corrupt_last & (mx.arange(length) == length - 1), (truth + 1) % self.vocab, truth)
        rows = []
        for w in range(width):
            keep = mx.arange(length) < (length - w)
            rows.append(mx.where(keep, truth, (truth + 1 + w) % self.vocab))
        return rows


class AnywhereOracle(OracleDrafter):
    """:class:`OracleDrafter` with the true continuation at a random row among
    wrong ones, so that the accepted node is anywhere in its depth (not always
    the first, as beam 0 of the plain oracle is).

    Each step (seeded by ``seed`` and the step's place in the reply, so runs
    are deterministic) the truth sits at row ``k`` and is right for its first
    ``cut`` tokens, ``cut`` in ``0..L``: accepted whole, in part or not at all.
    Every other row is right for fewer tokens than ``cut`` (none when
    ``cut`` is 0), then wrong: never a prefix of the truth, never accepted as far.
    """

    def __init__(self, model, prompt, max_tokens: int, length: int, seed: int = 0, **kw):
        import numpy as np

        super().__init__(model, prompt, max_tokens, length, **kw)
        # Per place in the reply: the truth's row, its cut and the other rows' (random, not periodic).
        self.draws = mx.array(np.random.default_rng(seed).integers(0, 1 << 20, (self.next.shape[0], 2 + 8)), mx.int32)

    def rows(self, pos, truth, width: int, length: int):
        draw, j = self.draws[pos], mx.arange(length)
        row, cut = draw[0] % width, draw[1] % (length + 1)
        rows = []
        for w in range(width):
            shorter = draw[2 + w % 8] % mx.maximum(cut, 1)  # below cut (0 when cut is 0)
            keep = mx.where(row == w, cut, shorter)
            rows.append(mx.where(j < keep, truth, (truth + 1 + w) % self.vocab))
        return rows


class DecoyHead:
    """A layer head (or a draft model's head) whose depth-1 distribution ranks
    ``decoy`` first, one nat above its own best: its own best draft is then
    its second beam, not its first. Everything else is the head's own."""

    def __init__(self, head, decoy: int):
        object.__setattr__(self, "inner", head)
        object.__setattr__(self, "decoy", decoy)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, tokens, features, cache, first: bool = True, last: bool = False):
        logits, hidden = self.inner(tokens, features, cache, first, last=last)
        if first:  # a catch-up call: its last position is depth 1's distribution
            top = logits.max(axis=-1, keepdims=True)
            logits = mx.where(mx.arange(logits.shape[-1]) == self.decoy, top + 1, logits)
        return logits, hidden


def misleading_history(sequence, start: int, vocab: int = VOCAB, seed: int = 0):
    """A lookup context (tokens before the prompt) under which, where
    ``sequence`` (prompt and reply) continues at an even position ``q`` from
    ``start`` on, lookup's first row is wrong and its second right for 0 to 4
    tokens (seeded): the 3-token suffix before ``q`` was last followed by a
    wrong token, the 2-token one by the sequence (lookup proposes the longest
    match first, then a shorter one's continuation: draft/lookup.py). At odd
    positions its first row is right for a token or two."""
    import random

    rng, s, out = random.Random(seed), list(sequence), []
    for q in range(max(start, 3) + max(start, 3) % 2, len(s), 2):
        out += [s[q - 3], s[q - 2], s[q - 1], (s[q] + 1) % vocab]  # the longest match: wrong
        out += [(s[q - 3] + 1) % vocab, s[q - 2], s[q - 1]] + s[q : q + rng.randint(0, 4)]  # a shorter one: right
    return out


# --------------------------------------------------------------------------- exactness under drafting

# stream_generate's keywords that say how to draft: the plain baseline drops them.
DRAFTING = ("drafter", "beam_width", "beam_length", "lookup", "lookup_context", "controller", "warp", "draft")
DRAFTING += ("datastore", "tree", "mtp", "mtp_depth", "draft_model", "num_draft_tokens")


def accepted_drafts(responses, source=None) -> int:
    """Drafted tokens among ``stream_generate``'s ``responses`` (only those of
    ``source`` when given: ``"drafter"``, ``"lookup"``, ``"datastore"`` or a new
    source's name, as its steps report it in ``stats.source``)."""
    return sum(1 for r in responses if r.from_draft and (source is None or r.stats.source == source))


def accepted_in_steps(stats, n_tokens: int, source=None) -> int:
    """Drafted tokens among the first ``n_tokens`` emitted by steps with these
    :class:`StepStats` (``generate_tokens``' or ``run_steps``'): a step emits its
    accepted drafts, then the LLM's own token; drafts past ``n_tokens`` do not count."""
    left, n = n_tokens, 0
    for s in stats:
        drafts = min(s.accepted, left)
        n += drafts if source is None or s.source == source else 0
        left -= s.accepted + 1
        if left <= 0:
            break
    return n


def _check_min(min_accepted: int) -> None:
    if min_accepted < 1:
        raise ValueError("min_accepted must be at least 1: equality with no draft accepted shows nothing")


def plain_responses(model, tokenizer, prompt, **kw):
    """``stream_generate`` with no drafter, no lookup and no MTP head (explicitly:
    ``drafter``'s default would pick the store's, ``mtp``'s the head a model's
    checkpoint ships), checked to have verified no draft."""
    from mlx_redrafter.generate import stream_generate

    kw = {**kw, "prompt_cache": kw["prompt_cache"]() if callable(kw.get("prompt_cache")) else kw.get("prompt_cache")}
    rs = list(stream_generate(model, tokenizer, prompt, drafter=None, lookup=False, mtp=None, **kw))
    assert not any(r.from_draft or r.stats.tree_size > 1 for r in rs), "the plain baseline drafted"
    return rs


def assert_exact_under_drafting(model, tokenizer, prompt, *, min_accepted: int, source=None, **drafted):
    """The first law, shown to be tested: ``stream_generate(model, tokenizer,
    prompt, **drafted)`` yields plain greedy decoding's tokens, and accepted
    at least ``min_accepted`` drafted tokens (from ``source`` when given:
    ``"drafter"``, ``"lookup"``, ``"datastore"``, or a new source's name in
    ``stats.source``). Returns the drafted run's responses.

    ``drafted``: any of ``stream_generate``'s keywords (``drafter=``,
    ``draft=DraftConfig(...)``, ``lookup=``, ``datastore=``, ``grammar=``,
    ``stop=``, ``max_tokens=`` ...). The plain run gets the same keywords
    minus the drafting ones (``DRAFTING``), with ``drafter=None, lookup=False,
    mtp=None`` (so a grammar or a stop string applies to both). ``prompt_cache``: a
    callable that makes a fresh cache (each run gets its own). Greedy only:
    sampling with drafts is exact in distribution, not token for token
    (check those runs' acceptance with :func:`accepted_drafts`).

    Use a drafter that is right by construction (:class:`OracleDrafter`,
    :func:`bigram_drafter` on a :func:`bigram_model`, lookup on a repeating
    prompt): a random one is never accepted, and equality then shows nothing.
    """
    from mlx_redrafter.generate import stream_generate

    _check_min(min_accepted)
    sampling = drafted.get("sampling")
    if drafted.get("temp", 0) or (sampling is not None and sampling.temp):
        raise ValueError("greedy only: sampling with drafts equals plain decoding in distribution")
    if "prompt_cache" in drafted and not callable(drafted["prompt_cache"]):
        raise ValueError("prompt_cache: pass a callable that makes a fresh cache (each run needs its own)")
    plain = plain_responses(model, tokenizer, prompt, **{k: v for k, v in drafted.items() if k not in DRAFTING})
    if callable(drafted.get("prompt_cache")):
        drafted["prompt_cache"] = drafted["prompt_cache"]()
    got = list(stream_generate(model, tokenizer, prompt, **drafted))
    assert [r.token for r in got] == [r.token for r in plain], "drafting changed the greedy output"
    assert "".join(r.text for r in got) == "".join(r.text for r in plain)
    assert got[-1].finish_reason == plain[-1].finish_reason
    n = accepted_drafts(got, source)
    assert n >= min_accepted, f"{n} drafted tokens accepted{f' from {source}' if source else ''}, want {min_accepted}"
    return got


def assert_tokens_exact(
    model, prompt, draft, *, min_accepted: int, source=None, max_tokens: int = 32, plain=None, **kw
):
    """:func:`assert_exact_under_drafting` on token ids, without a tokenizer
    (``generate_tokens``): ``draft`` (a ``DraftConfig``) gives plain greedy
    decoding's ``max_tokens`` tokens and accepted ``min_accepted`` drafted
    tokens (from ``source`` when given). ``plain``: those tokens, when a
    fixture already decoded them (``generate_tokens`` with no ``draft``).
    ``kw``: ``generate_tokens``' other keywords (``eos_ids``; ``prompt_cache``
    as a callable that makes a fresh one). Returns ``(tokens, step stats)``."""
    _check_min(min_accepted)
    caches = kw.pop("prompt_cache", None)
    fresh = (lambda: caches()) if callable(caches) else (lambda: None)
    ref = plain
    if ref is None:
        ref, ref_stats = generate_tokens(model, prompt, max_tokens=max_tokens, prompt_cache=fresh(), **kw)
        assert all(s.tree_size == 1 for s in ref_stats), "the plain baseline drafted"
    got, stats = generate_tokens(model, prompt, draft=draft, max_tokens=max_tokens, prompt_cache=fresh(), **kw)
    assert got == ref, "drafting changed the greedy output"
    n = accepted_in_steps(stats, len(got), source)
    assert n >= min_accepted, f"{n} drafted tokens accepted{f' from {source}' if source else ''}, want {min_accepted}"
    return got, stats


def drafted_share(stderr: str) -> float:
    """The share of tokens from drafts a command printed (``"40% from drafts"``)."""
    import re

    shares = re.findall(r"(\d+)% from drafts", stderr)
    assert shares, f"no '% from drafts' in:\n{stderr}"
    return int(shares[-1]) / 100


# --------------------------------------------------------------------------- a model a saved drafter can predict

# The context's weight in bigram_model: small enough that the bigram drafter is
# mostly right, large enough that it is sometimes wrong (partial acceptance).
BIGRAM_CONTEXT = 0.02


def bigram_model(seed: int = 0, **config_changes):
    """A tiny llama whose next token mostly follows from the last one: its
    attention and MLP outputs are scaled down to ``BIGRAM_CONTEXT``, its
    embeddings are centred, and the special tokens (``SPECIALS``: EOS among
    them) are never its argmax. :func:`bigram_drafter` predicts it.
    ``config_changes``: e.g. ``num_hidden_layers=4``."""
    model = tiny_model("llama", seed=seed, **config_changes)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * BIGRAM_CONTEXT
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * BIGRAM_CONTEXT
    e = model.model.embed_tokens.weight
    model.model.embed_tokens.weight = e - e.mean(-1, keepdims=True)
    w = model.lm_head.weight
    model.lm_head.weight = mx.concatenate([mx.zeros((len(SPECIALS), w.shape[1])), w[len(SPECIALS) :]])
    mx.eval(model.parameters())
    return model


def bigram_drafter(model) -> Drafter:
    """A real (saveable) drafter, right by construction on :func:`bigram_model`:
    with no hidden layer, ``rnn_w = I`` and ``rnn_u = 0`` with a bias of 30,
    its state is ``silu(e + 30) = e + 30`` for the last token's embedding ``e``,
    and its head ``[0 | W P]`` (``W``: the model's ``lm_head``, ``P`` removes the
    mean, which the centred embeddings lack) gives ``W e``: the model's logits
    up to the positive factor of its RMS norm, without the context."""
    h = HIDDEN
    d = Drafter(DrafterConfig(vocab_size=VOCAB, hidden_size=h, num_draft_layers=0))
    d.rnn_w.weight = mx.eye(h)
    d.rnn_u.weight = mx.zeros((h, h))
    d.rnn_u.bias = mx.full((h,), 30.0)
    centre = mx.eye(h) - mx.ones((h, h)) / h
    d.lm_head[-1].weight = mx.concatenate([mx.zeros((VOCAB, h)), model.lm_head.weight @ centre], axis=1)
    mx.eval(d.parameters())
    return d


def prompts(n: int, vocab: int = VOCAB, seed: int = 3, length: int = 6):
    mx.random.seed(seed)
    return [mx.random.randint(0, vocab, (length + i,)).tolist() for i in range(n)]


def run_steps(model, p, draft, n: int, cache=None, history=()):
    """The first ``n`` tokens of the step loop, its stats, and its cache after
    close. ``history``: the lookup context before the prompt."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = cache if cache is not None else make_prompt_cache(model)
    steps = redrafter_steps(model, mx.array(p, mx.int32), cache, draft=draft, history=history)
    out, stats = [], []
    for s in steps:
        out += s.tokens
        stats.append(s.stats)
        if len(out) >= n:
            break
    steps.close()
    return out[:n], stats, cache


# --------------------------------------------------------------------------- on disk, for the commands


def cli(args) -> int:
    """``mlx-redrafter ARGS``: its exit code (typer ends a successful command with SystemExit)."""
    from mlx_redrafter.cli import main

    try:
        return main(args)
    except SystemExit as e:
        return e.code or 0


def squeeze(text: str) -> str:
    return "".join(text.split())


SPECIALS = ["<unk>", "<eos>", "<user>", "<assistant>"]


def save_tiny_folder(path, seed: int = 0, kind: str = "llama", bigram: bool = False, **config_changes):
    """A tiny model (a llama, or a hybrid family of tests/hybrids.py) as an
    mlx-lm folder, with a word-level tokenizer (``w0 w1 ...``), an EOS token
    and a chat template, all built here (another ``seed``: another copy of the
    same model, same family; ``bigram``: the llama :func:`bigram_model`, which
    :func:`save_bigram_drafter` predicts; ``config_changes``: a llama's, e.g.
    ``num_hidden_layers=4``)."""
    from pathlib import Path

    from hybrids import HYBRID_CONFIGS, tiny_hybrid
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hybrid = kind in HYBRID_CONFIGS
    if hybrid:
        model = tiny_hybrid(kind, seed=seed)
    else:
        model = (bigram_model if bigram else lambda s, **c: tiny_model(kind, seed=s, **c))(seed, **config_changes)
    save_model(path, model)
    config = HYBRID_CONFIGS[kind] if hybrid else {**TINY_CONFIGS[kind], **config_changes}
    save_config(dict(config), path / "config.json")
    words = SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(SPECIALS)
    if hybrid:  # transformers rebuilds some families' tokenizers as byte-level BPE: added words keep their ids
        tok.add_tokens(words[len(SPECIALS) :])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    fast.save_pretrained(path)
    return path


def save_random_drafter(path, seed: int = 1, **kw):
    from mlx_redrafter import save_drafter

    return save_drafter(random_drafter(seed=seed, **kw), path)


def save_bigram_drafter(path, seed: int = 0):
    """:func:`bigram_drafter` for ``save_tiny_folder(..., seed, bigram=True)``, saved to ``path``."""
    from mlx_redrafter import save_drafter

    return save_drafter(bigram_drafter(bigram_model(seed)), path)


def byte_tokenizer(folder, chat_template=None, special_tokens=()):
    """mlx-lm's tokenizer wrapper, loaded as mlx-lm loads a model's, over a
    byte-level BPE built here (256 byte tokens, then ``</s>`` as EOS and the
    ``special_tokens``) and saved to ``folder``, with ``chat_template`` if given."""
    from mlx_lm.tokenizer_utils import load
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="</s>",
        chat_template=chat_template,
        additional_special_tokens=list(special_tokens),
    ).save_pretrained(folder)
    return load(folder)


def bpe_tokenizer(folder, texts, vocab_size: int = 1024, chat_template=None):
    """A byte-level BPE trained here on ``texts`` (about four characters a
    token on them, and every string encodable), with ``</s>`` as EOS and
    ``chat_template``, saved to ``folder``: for tiny models given long real
    prompts (the agents' recorded requests). Its size: ``len(tokenizer)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", chat_template=chat_template)
    fast.save_pretrained(folder)
    return fast


AGENT_RECORDINGS = Path(__file__).parent / "fixtures" / "agents"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def agent_model_folder(root, kind: str, layers: int = 1, **config):
    """A tiny ``kind`` model (``layers`` layers) as an mlx-lm folder under
    ``root``, with a byte-level BPE trained on the agents' recorded requests
    (tests/fixtures/agents) and a ChatML template: its prompts are as long as
    the agents' real ones (about 12k tokens), and with one layer a prefill
    costs next to nothing. ``config``: overrides (``max_position_embeddings``)."""
    from mlx_lm.utils import save_config, save_model

    folder = Path(root) / kind
    folder.mkdir()
    texts = [p.read_text() for p in sorted(AGENT_RECORDINGS.glob("*.json"))]
    vocab = len(bpe_tokenizer(folder, texts, 8192, CHATML))
    config = dict(TINY_CONFIGS[kind], vocab_size=vocab, num_hidden_layers=layers, **config)
    save_model(folder, tiny_model(kind, **config))
    save_config(config, folder / "config.json")
    return folder


def engine_metrics():
    """``(Metrics, engine)``: the server's ``/metrics`` over a stand-in engine
    with nothing queued or cached; ``engine.listeners[0](result)`` counts a
    finished generation as the worker thread would."""
    from mlx_redrafter.serve.metrics import Metrics

    queue = SimpleNamespace(
        status=lambda: {"waiting": 0, "running": 0, "active": 0},
        step_listeners=[],
        shed_listeners=[],
        decoder=SimpleNamespace(batch_listeners=[]),
    )
    engine = SimpleNamespace(cache=SimpleNamespace(entries=0, nbytes=0), queue=queue, listeners=[])
    return Metrics(engine), engine
