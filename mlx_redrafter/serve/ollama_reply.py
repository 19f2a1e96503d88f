"""What the Ollama routes answer: the model's description (``/api/tags``,
``/api/show``, ``/api/ps``) and the objects of one reply, streamed as NDJSON
lines or whole.

The shapes are Ollama's (``ollama``'s ``ListResponse``, ``ShowResponse``,
``ProcessResponse``, ``ChatResponse``, ``GenerateResponse``). Durations are
nanoseconds, as Ollama's: ``prompt_eval_duration`` is the prefill of the
prompt tokens not reused from the cache, ``eval_duration`` the generation,
``total_duration`` from the request's arrival to its last token, and
``load_duration`` 0 (the model is loaded once, when the server starts).
``prompt_eval_count`` counts the whole prompt (what a client shows as
context used), cache hits included.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from ..llm.parts import context_limit
from .engine import Engine, Result
from .streaming import reply_events
from .tool_calls import ToolCall, ToolCallStream, ollama_message, ollama_tool_call
from .tools import Rendered, tool_format

# Ollama's names for unquantized weights.
_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def now() -> str:
    """RFC 3339 time in UTC, as Ollama writes ``created_at``."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# --------------------------------------------------------------------------- the model


@dataclass
class ModelFacts:
    """What the Ollama routes say about the served model (measured once)."""

    name: str
    size: int  # bytes of weights
    parameters: int
    family: str
    quantization: str
    context_length: Optional[int]
    tool_format: str
    modified_at: str = field(default_factory=now)

    @classmethod
    def of(cls, engine: Engine) -> "ModelFacts":
        model = engine.rt.model
        leaves = [v for _, v in tree_flatten(model.parameters())]
        args = getattr(model, "args", None)
        # Quantized layers (mlx's QuantizedLinear, QuantizedEmbedding) say their bits.
        quant = next((m.bits for _, m in model.named_modules() if isinstance(getattr(m, "bits", None), int)), None)
        floats = [str(v.dtype).rsplit(".", 1)[-1] for v in leaves if mx.issubdtype(v.dtype, mx.floating)]
        dtype = _DTYPES.get(floats[0], floats[0].upper()) if floats else ""
        name = engine.model_id if ":" in engine.model_id else engine.model_id + ":latest"
        return cls(
            name,
            sum(v.nbytes for v in leaves),
            sum(v.size for v in leaves),
            str(getattr(args, "model_type", "") or ""),
            f"Q{quant}" if quant else dtype,
            context_limit(model),
            tool_format(engine.rt.tokenizer).name,
        )

    @property
    def digest(self) -> str:
        # Ollama's digest names a manifest; ours names what is served.
        return hashlib.sha256(self.name.encode()).hexdigest()

    def details(self) -> dict:
        return {
            "parent_model": "",
            "format": "mlx",
            "family": self.family,
            "families": [self.family],
            "parameter_size": _short(self.parameters),
            "quantization_level": self.quantization,
        }

    def tag(self) -> dict:
        """One entry of ``/api/tags``."""
        return {
            "name": self.name,
            "model": self.name,
            "modified_at": self.modified_at,
            "size": self.size,
            "digest": self.digest,
            "details": self.details(),
        }

    def running(self) -> dict:
        """One entry of ``/api/ps``: loaded for as long as the server runs."""
        forever = (datetime.now(timezone.utc) + timedelta(days=365)).isoformat().replace("+00:00", "Z")
        on_gpu = mx.default_device().type == mx.DeviceType.gpu
        return {
            **self.tag(),
            "expires_at": forever,
            "size_vram": self.size if on_gpu else 0,
            "context_length": self.context_length,
        }

    def show(self, engine: Engine) -> dict:
        """``/api/show``: details, context length, and tool support (every
        model: its template's format or the generic one)."""
        arch = self.family or "model"
        info = {
            "general.architecture": arch,
            "general.parameter_count": self.parameters,
            f"{arch}.context_length": self.context_length,
            "redrafter.tool_format": self.tool_format,
            "redrafter.drafter": str(engine.rt.drafter_path) if engine.rt.drafter_path else None,
        }
        template = getattr(engine.rt.tokenizer, "chat_template", None)
        params = f"temperature {engine.sampling.temp}\nnum_predict {engine.max_tokens}"
        return {
            "modelfile": f"FROM {engine.model_id}\n",
            "parameters": params,
            "template": template if isinstance(template, str) else "",
            "license": "",
            "details": self.details(),
            "model_info": info,
            "capabilities": ["completion", "tools"],
            "modified_at": self.modified_at,
        }


def _short(n: int) -> str:
    """135000000 -> "135M", as Ollama writes parameter sizes."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


# --------------------------------------------------------------------------- one reply


class OllamaReply:
    """The objects of one ``/api/chat`` (``chat=True``) or ``/api/generate``
    reply. ``rendered``: the prompt with its tools (chat only; its tool
    calls are parsed out of the text when tools were rendered)."""

    def __init__(self, engine: Engine, chat: bool, rendered: Optional[Rendered] = None):
        self.engine, self.chat = engine, chat
        self.start = time.perf_counter()
        self.tools: Optional[ToolCallStream] = rendered.stream() if rendered is not None and rendered.tools else None
        self.content: List[str] = []
        self.calls: List[ToolCall] = []

    def _head(self) -> dict:
        return {"model": self.engine.model_id, "created_at": now()}

    def _body(self, text: str, calls=()) -> dict:
        if not self.chat:
            return {"response": text}
        msg = {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = [ollama_tool_call(c) for c in calls]
        return {"message": msg}

    def pieces(self, text: str, end: bool = False) -> List[dict]:
        """The streamed objects for the next ``text`` (``end``: the reply is
        over, flush what the tool parser held back)."""
        out = []
        for e in reply_events(self.tools, text, end):
            if isinstance(e, ToolCall):
                self.calls.append(e)
                out.append({**self._head(), **self._body("", [e]), "done": False})
            else:
                self.content.append(e)
                out.append({**self._head(), **self._body(e), "done": False})
        return out

    def final(self, res: Result, streamed: bool) -> dict:
        """The last object (streamed) or the whole reply, with the counts."""
        if streamed:
            body = self._body("")
        elif self.chat:
            body = {"message": ollama_message("".join(self.content), self.calls)}
        else:
            body = {"response": "".join(self.content)}
        return {
            **self._head(),
            **body,
            "done": True,
            "done_reason": res.finish_reason or "stop",
            **self.counts(res),
            "redrafter": self.engine.stats(res),
        }

    def counts(self, res: Result) -> dict:
        total = time.perf_counter() - self.start
        last = res.tally.last
        prefilled = res.prompt_tokens - res.reused_tokens
        prompt_s = prefilled / last.prompt_tps if last is not None and last.prompt_tps > 0 else 0.0
        n = res.completion_tokens
        eval_s = n / last.generation_tps if last is not None and last.generation_tps > 0 else total - prompt_s
        ns = lambda s: max(int(s * 1e9), 0)  # noqa: E731
        return {
            "total_duration": ns(total),
            "load_duration": 0,
            "prompt_eval_count": res.prompt_tokens,
            "prompt_eval_duration": ns(prompt_s),
            "eval_count": n,
            "eval_duration": ns(eval_s),
        }

    def loaded(self) -> dict:
        """Ollama's answer to a request with nothing to generate: the model is loaded."""
        return {**self._head(), **self._body(""), "done": True, "done_reason": "load"}


def line(obj: dict) -> str:
    """One NDJSON line."""
    return json.dumps(obj, ensure_ascii=False) + "\n"
