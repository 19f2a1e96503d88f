"""Tiny random models and drafters built in code (nothing is downloaded)."""

from __future__ import annotations

from types import SimpleNamespace

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
    """

    def __init__(self, model, prompt, max_tokens: int, length: int):
        from mlx_redrafter.llm.parts import model_parts

        embed, backbone, head = model_parts(model)
        tokens, _ = generate_tokens(model, prompt, max_tokens=max_tokens + length + 2)
        full = mx.array(list(prompt) + tokens, dtype=mx.int32)
        hidden = backbone(full[None])[0]  # [T, h]
        self.hidden = hidden[len(prompt) - 1 :]  # hidden[i] produced full[len(prompt) + i]
        self.next = full[len(prompt) :]  # next[i] = token produced by hidden[i]
        mx.eval(self.hidden, self.next)
        self.vocab = int(embed.weight.shape[0])
        self.config = SimpleNamespace(hidden_size=int(hidden.shape[-1]), vocab_size=self.vocab)

    def draft(self, embed, context, g0, width, length, warp=False, confidences=0):
        d = ((self.hidden - context[None]) ** 2).sum(-1)
        pos = mx.argmin(d)  # hidden[pos] produced g0 = next[pos]
        idx = mx.minimum(pos + 1 + mx.arange(length), self.next.shape[0] - 1)
        truth = self.next[idx]
        corrupt_last = ((pos * 37 + 11) % 7) < 3  # irregular, so every run length occurs
        truth = mx.where(corrupt_last & (mx.arange(length) == length - 1), (truth + 1) % self.vocab, truth)
        rows = []
        for w in range(width):
            keep = mx.arange(length) < (length - w)
            rows.append(mx.where(keep, truth, (truth + 1 + w) % self.vocab))
        beams = mx.stack(rows).astype(mx.int32)
        conf = None
        if confidences:
            # Confident where the draft is the model's own token, unsure elsewhere.
            right = (beams == self.next[idx][None, :]).astype(mx.float32)
            top1 = 0.2 + 0.7 * right
            rest = mx.broadcast_to(((1 - top1) / confidences)[..., None], (*beams.shape, confidences - 1))
            conf = mx.concatenate([top1[..., None], rest], axis=-1)
        return Beams(beams, mx.zeros((width,)), confidences=conf)


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


def save_tiny_folder(path, seed: int = 0, kind: str = "llama"):
    """A tiny model (a llama, or a hybrid family of tests/hybrids.py) as an
    mlx-lm folder, with a word-level tokenizer (``w0 w1 ...``), an EOS token
    and a chat template, all built here (another ``seed``: another copy of the
    same model, same family)."""
    from pathlib import Path

    from hybrids import HYBRID_CONFIGS, tiny_hybrid
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hybrid = kind in HYBRID_CONFIGS
    save_model(path, tiny_hybrid(kind, seed=seed) if hybrid else tiny_model(kind, seed=seed))
    save_config(dict(HYBRID_CONFIGS[kind] if hybrid else TINY_CONFIGS[kind]), path / "config.json")
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
