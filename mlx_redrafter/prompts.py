"""Prompt sets: the evaluation sets shipped with the package, user files, and
the guard that keeps evaluation prompts out of training.

A conversation is ``{"id", "category", "turns": [user messages]}``; one
recorded from ``chat`` or ``serve`` (``make-drafter --prompts history``) also
holds ``"ids"``, its first prompt's exact token ids.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from .errors import RedrafterError
from .llm.text import encode_prompt

DATA = Path(__file__).parent / "data"
PROMPT_SETS = {
    "mt_bench": DATA / "mt_bench.jsonl",
    "spec_bench": DATA / "spec_bench.jsonl",
    "alpaca_eval": DATA / "alpaca_eval.jsonl",
}
FINGERPRINTS = DATA / "eval_fingerprints.json"
# ShareGPT V3 user turns (licenses/ShareGPT.md), the default training prompts.
SHAREGPT = DATA / "sharegpt_train_prompts.jsonl.gz"
# Evaluation sets by file or folder name, as their upstreams name them.
EVAL_NAME = re.compile(r"mt[_-]?bench|spec[_-]?bench|alpaca[_-]?eval|gsm8k|grade[_-]school|human[_-]?eval", re.I)
TEXT_FIELDS = ("turns", "prompt", "instruction", "question", "text")


def _open(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _json_line(line: str, number: int):
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise json.JSONDecodeError(f"line {number}: {e.msg}", e.doc, e.pos) from None


def _conversation(record, index: int) -> Optional[dict]:
    """A conversation, or None for a record that holds no usable prompt
    (not an object, no text field, or turns that are not all text)."""
    if isinstance(record, str):
        return {"id": str(index), "category": "", "turns": [record]} if record.strip() else None
    if not isinstance(record, dict):
        return None
    for key in TEXT_FIELDS:
        value = record.get(key)
        if value:
            turns = value if isinstance(value, list) else [value]
            if not all(isinstance(t, str) and t.strip() for t in turns):
                return None
            cid = record.get("id", record.get("question_id", record.get("task_id", index)))
            category = record.get("category", record.get("dataset", ""))
            conv = {"id": str(cid), "category": str(category), "turns": [str(t) for t in turns]}
            ids = record.get("prompt_ids")
            if isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids):
                conv["ids"] = ids
            return conv
    return None


def read_conversations(path) -> List[dict]:
    """Conversations from a ``.jsonl`` (optionally ``.gz``), ``.json`` list or ``.txt`` file.

    JSON records need one of the fields ``turns`` (a list of user messages),
    ``prompt``, ``instruction``, ``question`` or ``text``; a ``.txt`` file has
    one prompt per line.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise RedrafterError(f"Prompt file does not exist: {path}", "Check the path.")
    try:
        with _open(path) as f:
            if path.suffix == ".json":
                records: Iterable = json.load(f)
            elif path.suffix == ".txt":
                records = [line.rstrip("\n") for line in f if line.strip()]
            else:
                records = [_json_line(line, n) for n, line in enumerate(f, 1) if line.strip()]
        convs = [c for i, r in enumerate(records) if (c := _conversation(r, i)) is not None]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, EOFError) as e:
        raise RedrafterError(
            f"Cannot read prompts from {path}: {e}", "Use a JSONL file with a 'turns' or 'prompt' field per line."
        ) from None
    if not convs:
        raise RedrafterError(
            f"No prompts found in {path}.",
            f"Each line needs one of the fields: {', '.join(TEXT_FIELDS)}.",
        )
    seen = set()
    for c in convs:  # resumable runs track conversations by id
        if c["id"] in seen:
            raise RedrafterError(
                f"{path}: the id {c['id']!r} appears more than once.",
                "Give every conversation its own id (or drop the ids).",
            )
        seen.add(c["id"])
    return convs


def load_prompt_set(name_or_path: str) -> List[dict]:
    """A shipped set (``mt_bench``, ``spec_bench``, ``alpaca_eval``) or a file."""
    if name_or_path in PROMPT_SETS:
        return read_conversations(PROMPT_SETS[name_or_path])
    path = Path(name_or_path).expanduser()
    if path.exists():
        return read_conversations(path)
    raise RedrafterError(
        f"Unknown prompt set {name_or_path!r}.",
        f"Use one of {', '.join(PROMPT_SETS)} or a path to a JSONL file.",
    )


def select_conversations(conversations: List[dict], n: Optional[int]) -> List[dict]:
    """The first ``n`` conversations taken round-robin over categories, so
    that a few prompts still cover every kind of task (MT-Bench lists its
    categories in blocks)."""
    if n is None or n >= len(conversations):
        return list(conversations)
    if n < 1:
        raise RedrafterError(f"--num-prompts must be at least 1 (got {n}).")
    by_cat: Dict[str, List[dict]] = {}
    for c in conversations:
        by_cat.setdefault(c.get("category", ""), []).append(c)
    queues = list(by_cat.values())
    out: List[dict] = []
    i = 0
    while len(out) < n:
        q = queues[i % len(queues)]
        k = i // len(queues)
        if k < len(q):
            out.append(q[k])
        i += 1
    return out


# --------------------------------------------------------------------------- chat templating
# One templating path for chat, generate, sweep/bench and distillation: the
# drafter is trained on exactly the ids that inference and benchmarks feed.


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer (mlx-lm's wrapper or a Hugging Face one) has a chat template."""
    flag = getattr(tokenizer, "has_chat_template", None)
    return bool(flag) if flag is not None else getattr(tokenizer, "chat_template", None) is not None


def build_messages(system: Optional[str], exchanges: Sequence[tuple], user: Optional[str] = None) -> List[dict]:
    """Chat-template messages: the system message, ``(user, assistant)``
    exchanges, then the pending user message."""
    messages = [{"role": "system", "content": system}] if system else []
    for u, a in exchanges:
        messages += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    if user is not None:
        messages.append({"role": "user", "content": user})
    return messages


def render_messages(tokenizer, messages: List[dict]) -> str:
    """The prompt text for ``messages``, ending where the assistant speaks.

    Models without a chat template get plain ``role: content`` lines.
    """
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines + ["assistant:"])


def chat_prompt_ids(tokenizer, messages: List[dict]) -> List[int]:
    """Token ids of ``messages`` (:func:`render_messages`), encoded as
    ``generate`` encodes a prompt string."""
    return list(encode_prompt(tokenizer, render_messages(tokenizer, messages)))


def first_turn_ids(tokenizer, conversations: List[dict]) -> List[List[int]]:
    """The first user turn of every conversation, templated."""
    return [chat_prompt_ids(tokenizer, build_messages(None, [], c["turns"][0])) for c in conversations]


def conversation_ids(tokenizer, conv: dict, raw: bool = False) -> List[int]:
    """The first prompt of ``conv`` as token ids: the exact ``ids`` it was
    recorded with (history), else its first turn as the text itself when
    ``raw`` (a base model continues text, as ``generate`` feeds it), else
    templated (:func:`first_turn_ids`)."""
    if conv.get("ids"):
        return list(conv["ids"])
    if raw:
        return list(encode_prompt(tokenizer, conv["turns"][0]))
    return first_turn_ids(tokenizer, [conv])[0]


# --------------------------------------------------------------------------- eval-set guard


def fingerprint(text: str) -> str:
    """Identity of a prompt up to case and whitespace."""
    norm = " ".join(text.lower().split())
    return hashlib.sha1(norm.encode("utf-8")).hexdigest()[:16]


def build_fingerprints(files: Dict[str, Path]) -> Dict[str, List[str]]:
    """Fingerprints of every prompt of each evaluation set, from ``{name: file}``
    (how ``data/eval_fingerprints.json`` was made from MT-Bench, Spec-Bench,
    AlpacaEval, GSM8K test and HumanEval; a test rebuilds it)."""
    out = {}
    for name, path in files.items():
        prints = {fingerprint(t) for c in read_conversations(path) for t in c["turns"]}
        out[name] = sorted(prints)
    return out


def _known_fingerprints() -> Dict[str, str]:
    data = json.loads(FINGERPRINTS.read_text())
    return {fp: name for name, prints in data.items() for fp in prints}


def refuse_eval_set(path, conversations: Optional[List[dict]] = None) -> None:
    """Raise if ``path`` is (or contains prompts of) an evaluation set.

    Drafters are trained on ShareGPT only: training on MT-Bench, Spec-Bench,
    AlpacaEval, GSM8K test or HumanEval would inflate every benchmark.
    """
    path = Path(path)
    # The file and its folder only: a clone under ~/humaneval-work/ is no eval set.
    if EVAL_NAME.search("/".join(path.parts[-2:])):
        raise RedrafterError(
            f"{path} looks like an evaluation set (MT-Bench, Spec-Bench, AlpacaEval, GSM8K or HumanEval).",
            "Train on ShareGPT prompts (the default) or your own data, never on evaluation prompts.",
        )
    known = _known_fingerprints()
    convs = conversations if conversations is not None else read_conversations(path)
    hits: Dict[str, int] = {}
    for c in convs:
        for t in c["turns"]:
            name = known.get(fingerprint(t))
            if name:
                hits[name] = hits.get(name, 0) + 1
    if hits:
        found = ", ".join(f"{n} ({k} prompts)" for n, k in sorted(hits.items()))
        raise RedrafterError(
            f"{path} contains evaluation prompts: {found}.",
            "Remove them; drafters must never be trained on evaluation sets.",
        )


def default_training_prompts() -> Optional[Path]:
    """The ShareGPT training prompts shipped in the package, if installed with it."""
    return SHAREGPT if SHAREGPT.is_file() else None
