"""The verify-cost curve c(N): what verifying N tokens costs over one plain step.

Drafting pays only when the tokens a tree is expected to add beat what its
extra tokens cost, and that cost depends on the device, the model and its
dtype: on this 2-core CPU it is steep and not monotonic (a jump from 3 to 4
tokens, 8 tokens cheaper than 7), on an Apple GPU nearly flat. So it is
measured at every size, never fitted.

:func:`~mlx_redrafter.tuning.calibrate.measure_curve` times the LLM's forward (and head) over ``N`` new tokens
with a tree mask after a realistic cached context, for ``N = 1..16``, the
sizes interleaved in a fresh random order each round and pipelined like the
generation loop (the next call queued before the last is read), and keeps
each size's median over the rounds, as a ratio to ``N = 1`` (the model's own
one-token call, i.e. a plain decoding step). It fits in ``budget_s`` seconds.

The same calibration times plain batched decoding (``serve`` decodes
concurrent requests together) at :data:`BATCH_SIZES`: ``batch_gains`` are
the aggregate tokens/s at each batch size over one sequence's
(:meth:`CostCurve.batch_gain`; the built-in ones when none was measured).

Curves are stored next to the tuned profiles (``cache_root()/profiles``),
keyed by device, model and dtype/quantization; :func:`curve_for` loads this
device's curve or falls back to :data:`BUILTIN_COSTS` (flagged ``builtin``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

from ..files import cache_root, write_json_atomic

CURVE_VERSION = 1
MAX_SIZE = 16
BUCKET_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)  # select.BUCKETS (the sizes a calibration times first)
CONTEXT_TOKENS = 220  # the cached context each timed call attends to (as the built-in curve was measured)
LONG_CONTEXT_TOKENS = 1024  # the second context a calibration measures (attention makes long contexts steeper)
MAX_CONTEXT_STRETCH = 3.0  # CostCurve.at extrapolates at most this many times the measured context gap
# Measured on a 2-core Linux CPU, BLIS, SmolLM2-135M float32, 2026-12-01
# (docs/tuning.md, 'Measured facts the code is built on'): a synchronous
# forward after 220 tokens of context, median of 15 calls. Sizes 9, 11 and 13-15 were not measured; the built-in
# curve interpolates them linearly between their measured neighbours.
BUILTIN_MEASURED = {
    1: 1.00,
    2: 1.07,
    3: 1.19,
    4: 1.51,
    5: 1.57,
    6: 1.65,
    7: 1.80,
    8: 1.62,
    10: 1.79,
    12: 2.02,
    16: 2.52,
}
BUILTIN_SOURCE = (
    "built-in: measured on a 2-core Linux CPU with BLIS, SmolLM2-135M float32 "
    "(docs/tuning.md); sizes 9, 11, 13-15 interpolated"
)


def _interpolated(measured) -> Tuple[float, ...]:
    """c(N) for N = 1..MAX_SIZE from the measured sizes (linear between them)."""
    known = sorted(measured)
    return tuple(float(np.interp(n, known, [measured[k] for k in known])) for n in range(1, MAX_SIZE + 1))


BUILTIN_COSTS = _interpolated(BUILTIN_MEASURED)
# The same curve after 1024 cached tokens: BUILTIN_MEASURED times the ratio
# of c(N) after 1024 tokens to c(N) after 220, both measured pipelined in one
# run (tuning/calibrate.py, 240 s, 15 rounds, quiet machine, 2026-12-01;
# bench/results/curve/): 2-3 tokens cost the same, 4-16 about 10-35% more.
BUILTIN_LONG_MEASURED = {1: 1.00, 2: 1.06, 3: 1.19, 4: 1.65, 6: 1.89, 8: 1.86, 12: 2.76, 16: 2.89}
BATCH_SIZES = (1, 2, 4, 8)  # the batch sizes a calibration times (``serve --max-batch`` defaults to the largest)
# Batched greedy decoding measured on a 2-core Linux CPU, BLIS, SmolLM2-135M
# float32, ~64 tokens of context, BatchKVCache (docs/tuning.md, as above):
# 13 tokens/s at batch 1, 59 at 8, 85 at 16, 92 at 32, 113 at 64; as a gain
# over batch 1, the sizes between interpolated linearly.
BUILTIN_BATCH_MEASURED = {1: 13.0, 8: 59.0, 16: 85.0, 32: 92.0, 64: 113.0}
BUILTIN_BATCH_SOURCE = (
    "built-in: batched greedy decoding measured on a 2-core Linux CPU with BLIS, "
    "SmolLM2-135M float32 (docs/tuning.md); sizes 2-7 interpolated"
)


@dataclass
class CostCurve:
    """``costs[N - 1]`` = c(N), verify cost of N tokens over one plain step (c(1) = 1)."""

    costs: Tuple[float, ...]
    device: str = ""
    model: str = ""
    variant: str = ""  # dtype, or quantization + dtype: "float32", "q4g64-float32"
    base_ms: float = 0.0  # the N = 1 step it is relative to (0 for the built-in curve)
    builtin: bool = False  # True: not measured on this device (BUILTIN_COSTS)
    source: str = ""
    rounds: int = 0
    measured: Tuple[int, ...] = field(default=())  # the sizes timed (the others are interpolated)
    context: int = CONTEXT_TOKENS  # the cached tokens ``costs`` were measured after
    long_costs: Tuple[float, ...] = field(default=())  # c(N) after ``long_context`` tokens (empty: not measured)
    long_context: int = 0
    batch_sizes: Tuple[int, ...] = field(default=())  # batch sizes timed (empty: not measured, the built-in gains)
    batch_gains: Tuple[float, ...] = field(default=())  # aggregate tokens/s at each batch size over batch 1

    def batch_gain(self, n: int) -> float:
        """Aggregate tokens/s of plain decoding ``n`` sequences together, over
        decoding one: measured, else :func:`builtin_batch` for this variant;
        linear between the sizes timed, flat past the largest (never a guess
        that more rows pay more than measured)."""
        sizes, gains = (self.batch_sizes, self.batch_gains) if self.batch_sizes else builtin_batch(self.variant)
        return float(np.interp(n, sizes, gains))

    def at(self, context: int) -> "CostCurve":
        """The curve after ``context`` cached tokens: linear in the context
        between the two measured ones (attention's cost grows with it), past
        the long one extrapolated up to :data:`MAX_CONTEXT_STRETCH` gaps; at
        or below the short one, ``costs`` as measured. Without a long curve,
        ``self``."""
        if not self.long_costs or self.long_context <= self.context or context <= self.context:
            return self
        t = min((context - self.context) / (self.long_context - self.context), MAX_CONTEXT_STRETCH)
        costs = tuple(max(1.0, a + t * (b - a)) for a, b in zip(self.costs, self.long_costs))
        return replace(self, costs=costs, context=int(context), long_costs=(), long_context=0)

    def __call__(self, n: int) -> float:
        """c(n); past the measured sizes, the last slope continues (sizes are capped by buckets anyway)."""
        if n < 1:
            raise ValueError(f"a verified tree holds at least g0 (got {n} tokens)")
        m = len(self.costs)
        if n <= m:
            return self.costs[n - 1]
        slope = self.costs[-1] - self.costs[-2] if m > 1 else 0.0
        return self.costs[-1] + slope * (n - m)

    @property
    def max_size(self) -> int:
        return len(self.costs)

    def to_dict(self) -> dict:
        return {"version": CURVE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "CostCurve":
        if data.get("version") != CURVE_VERSION:
            raise ValueError(f"cost curve version {data.get('version')!r}, expected {CURVE_VERSION}")
        data = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        data["costs"] = tuple(float(c) for c in data["costs"])
        data["measured"] = tuple(int(n) for n in data.get("measured", ()))
        data["long_costs"] = tuple(float(c) for c in data.get("long_costs", ()))
        data["batch_sizes"] = tuple(int(n) for n in data.get("batch_sizes", ()))
        data["batch_gains"] = tuple(float(g) for g in data.get("batch_gains", ()))
        return cls(**data)


# The same CPU, the default model quantized to 4 bits (``nn.quantize``, group
# 64), pipelined bursts after 220 tokens (tuning/calibrate.py, budget 90 s,
# 2 rounds, 2026-12-01, quiet machine, 141 ms at N=1): the quantized matmul
# over N rows costs about N single-row ones here, so no draft pays
# (bench/RESULTS.md section 18).
BUILTIN_QUANTIZED_MEASURED = {
    1: 1.00,
    2: 2.09,
    3: 2.97,
    4: 3.88,
    5: 4.85,
    6: 5.82,
    7: 6.89,
    8: 7.91,
    9: 8.84,
    10: 9.82,
    11: 10.92,
    12: 11.58,
    13: 12.99,
    14: 13.56,
    15: 14.51,
    16: 15.32,
}
BUILTIN_QUANTIZED_SOURCE = (
    "built-in: measured on a 2-core Linux CPU with BLIS, SmolLM2-135M quantized to 4 bits (group 64)"
)


def builtin_curve(variant: str = "") -> CostCurve:
    """The curve measured on this project's CPU, for a device with none of
    its own: the quantized model's for a quantized ``variant``
    (:func:`model_variant`, e.g. ``"q4g64-float32"``), else the float one's."""
    if variant.startswith("q"):
        return CostCurve(
            _interpolated(BUILTIN_QUANTIZED_MEASURED), variant=variant, builtin=True, source=BUILTIN_QUANTIZED_SOURCE
        )
    return CostCurve(
        BUILTIN_COSTS,
        builtin=True,
        source=BUILTIN_SOURCE,
        long_costs=_interpolated(BUILTIN_LONG_MEASURED),
        long_context=LONG_CONTEXT_TOKENS,
    )


def builtin_batch(variant: str = "") -> Tuple[Tuple[int, ...], Tuple[float, ...]]:
    """``(sizes, gains)`` of batched decoding for a device with no measured
    batch curve. Float models: :data:`BUILTIN_BATCH_MEASURED`. A quantized
    ``variant``: n / c(n) of the quantized verify-cost curve (a quantized
    matmul over n rows costs about n single-row ones on this CPU, see
    docs/tuning.md's measured facts, so batching gains about nothing)."""
    if variant.startswith("q"):
        sizes = tuple(sorted(BUILTIN_QUANTIZED_MEASURED))
        return sizes, tuple(n / BUILTIN_QUANTIZED_MEASURED[n] for n in sizes)
    sizes = tuple(sorted(BUILTIN_BATCH_MEASURED))
    return sizes, tuple(BUILTIN_BATCH_MEASURED[n] / BUILTIN_BATCH_MEASURED[1] for n in sizes)


def default_tree(model) -> str:
    """The tree a generation uses when the caller names none: ``"auto"`` for
    a quantized model, ``"fixed"`` otherwise. Measured on this CPU in one
    quiet run (bench/RESULTS.md section 18): the 4-bit default model ran at
    1.02x of plain decoding with ``auto`` (which falls back to plain decoding
    there) and 0.51x with ``fixed``; float32 at 1.08x and 1.14x."""
    from ..config import DEFAULT_TREE

    return "auto" if model_variant(model).startswith("q") else DEFAULT_TREE


# --------------------------------------------------------------------------- keys


def model_variant(model) -> str:
    """The model's dtype, prefixed by its quantization: ``float32``, ``q4g64-float16``."""
    from mlx.utils import tree_flatten

    # The dtype of the float weights (quantized weights are packed integers).
    floats = [v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    dtype = str(floats[0] if floats else mx.float32).split(".")[-1]
    quant = sorted({(m.bits, m.group_size) for _, m in model.named_modules() if hasattr(m, "bits")})
    return "".join(f"q{b}g{g}-" for b, g in quant) + dtype


def model_identity(model, model_spec: Optional[str] = None) -> str:
    """What a curve is keyed by besides the device: the spec the model was
    loaded from (as profiles key it), else its architecture and size."""
    from mlx.utils import tree_flatten

    from ..profiles import model_id

    spec = model_spec or getattr(model, "redrafter_spec", None)
    if spec:
        return model_id(spec)
    args = getattr(model, "args", None)
    size = sum(v.size for _, v in tree_flatten(model.parameters()))
    return f"{getattr(args, 'model_type', type(model).__name__)}:{size}"


def curve_key(model, model_spec: Optional[str] = None) -> Tuple[str, str, str]:
    from ..profiles import device_id

    return device_id(), model_identity(model, model_spec), model_variant(model)


def curve_path(model, model_spec: Optional[str] = None):
    """``cache_root()/profiles/curve-<digest>.json``, beside the tuned profiles."""
    digest = hashlib.sha256(json.dumps(list(curve_key(model, model_spec))).encode()).hexdigest()[:16]
    return cache_root() / "profiles" / f"curve-{digest}.json"


def save_curve(curve: CostCurve, model, model_spec: Optional[str] = None):
    """Write ``curve`` (atomically) where :func:`load_curve` finds it; returns the path."""
    path = curve_path(model, model_spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, curve.to_dict())
    return path


def load_curve(model, model_spec: Optional[str] = None) -> Optional[CostCurve]:
    """This device's stored curve for ``model``, or None (none, unreadable, or another version)."""
    path = curve_path(model, model_spec)
    if not path.is_file():
        return None
    try:
        return CostCurve.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValueError, TypeError, KeyError):
        return None


def curve_for(model, model_spec: Optional[str] = None) -> CostCurve:
    """The measured curve of this device + model + dtype, else the built-in one."""
    return load_curve(model, model_spec) or builtin_curve(model_variant(model))


def format_curve(curve: CostCurve) -> str:
    """Two lines for ``doctor``: where the curve comes from, then c(N) by size."""
    if curve.builtin:
        head = f"verify cost c(N) ({curve.source})"
    else:
        head = (
            f"verify cost c(N), measured: {curve.model} {curve.variant} on {curve.device}, "
            f"{curve.base_ms:.1f} ms at N=1, {curve.rounds} rounds"
        )
    guessed = set(range(1, curve.max_size + 1)) - set(curve.measured) if curve.measured else set()
    sizes = "  ".join(f"{n}:{'~' if n in guessed else ''}{c:.2f}" for n, c in enumerate(curve.costs, start=1))
    note = "  (~ interpolated)" if guessed else ""
    text = f"{head}{note}\n  after {curve.context} tokens: {sizes}"
    if curve.long_costs:
        timed = [n for n in BUCKET_SIZES if n <= len(curve.long_costs)]
        text += f"\n  after {curve.long_context} tokens: " + "  ".join(
            f"{n}:{curve.long_costs[n - 1]:.2f}" for n in timed
        )
    where = "measured" if curve.batch_sizes else BUILTIN_BATCH_SOURCE
    sizes = curve.batch_sizes or BATCH_SIZES
    gains = "  ".join(f"{n}:{curve.batch_gain(n):.2f}" for n in sizes)
    return f"{text}\nbatched decoding, tokens/s over one sequence ({where}):\n  batch {gains}"
