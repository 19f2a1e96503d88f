"""The verify-cost curve c(N): what verifying N tokens costs over one plain step.

Drafting pays only when the tokens a tree is expected to add beat what its
extra tokens cost, and that cost depends on the device, the model and its
dtype: on this 2-core CPU it is steep and not monotonic (a jump from 3 to 4
tokens, 8 tokens cheaper than 7), on an Apple GPU nearly flat. So it is
measured at every size, never fitted.

:func:`measure_curve` times the LLM's forward (and head) over ``N`` new tokens
with a tree mask after a realistic cached context, for ``N = 1..16``, the
sizes interleaved in a fresh random order each round and pipelined like the
generation loop (the next call queued before the last is read), and keeps
each size's median over the rounds, as a ratio to ``N = 1`` (the model's own
one-token call, i.e. a plain decoding step). It fits in ``budget_s`` seconds.

Curves are stored next to the tuned profiles (``cache_root()/profiles``),
keyed by device, model and dtype/quantization; :func:`curve_for` loads this
device's curve or falls back to :data:`BUILTIN_COSTS` (flagged ``builtin``).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from .files import cache_root, write_json_atomic

CURVE_VERSION = 1
MAX_SIZE = 16
BASE_REPEATS = 3  # N = 1 bursts per round
CONTEXT_TOKENS = 220  # the cached context each timed call attends to (DESIGN.md sections 9-10)
# Measured here (DESIGN.md section 10, 2026-12-01): a 2-core Linux CPU, BLIS,
# SmolLM2-135M float32, synchronous forward after 220 tokens of context,
# median of 15 calls. Sizes 9, 11 and 13-15 were not measured; the built-in
# curve interpolates them linearly between their measured neighbours.
BUILTIN_MEASURED = {1: 1.00, 2: 1.07, 3: 1.19, 4: 1.51, 5: 1.57, 6: 1.65, 7: 1.80, 8: 1.62,
                    10: 1.79, 12: 2.02, 16: 2.52}
BUILTIN_SOURCE = ("built-in: measured on a 2-core Linux CPU with BLIS, SmolLM2-135M float32 "
                  "(DESIGN.md section 10); sizes 9, 11, 13-15 interpolated")


def _builtin_costs() -> Tuple[float, ...]:
    known = sorted(BUILTIN_MEASURED)
    return tuple(float(np.interp(n, known, [BUILTIN_MEASURED[k] for k in known])) for n in range(1, MAX_SIZE + 1))


BUILTIN_COSTS = _builtin_costs()


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
        return cls(**data)


def builtin_curve() -> CostCurve:
    """The curve measured on this project's CPU, for a device with none of its own."""
    return CostCurve(BUILTIN_COSTS, builtin=True, source=BUILTIN_SOURCE)


# --------------------------------------------------------------------------- keys


def model_variant(model) -> str:
    """The model's dtype, prefixed by its quantization: ``float32``, ``q4g64-float16``."""
    from .cost import model_dtype

    dtype = str(model_dtype(model)).split(".")[-1]
    quant = sorted({(m.bits, m.group_size) for _, m in model.named_modules() if hasattr(m, "bits")})
    return "".join(f"q{b}g{g}-" for b, g in quant) + dtype


def model_identity(model, model_spec: Optional[str] = None) -> str:
    """What a curve is keyed by besides the device: the spec the model was
    loaded from (as profiles key it), else its architecture and size."""
    from mlx.utils import tree_flatten

    from .profiles import _model_id

    spec = model_spec or getattr(model, "redrafter_spec", None)
    if spec:
        return _model_id(spec)
    args = getattr(model, "args", None)
    size = sum(v.size for _, v in tree_flatten(model.parameters()))
    return f"{getattr(args, 'model_type', type(model).__name__)}:{size}"


def curve_key(model, model_spec: Optional[str] = None) -> Tuple[str, str, str]:
    from .profiles import device_id

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
    return load_curve(model, model_spec) or builtin_curve()


def format_curve(curve: CostCurve) -> str:
    """Two lines for ``doctor``: where the curve comes from, then c(N) by size."""
    if curve.builtin:
        head = f"verify cost c(N) ({curve.source})"
    else:
        head = (f"verify cost c(N), measured: {curve.model} {curve.variant} on {curve.device}, "
                f"{curve.base_ms:.1f} ms at N=1, {curve.rounds} rounds")
    guessed = set(range(1, curve.max_size + 1)) - set(curve.measured) if curve.measured else set()
    sizes = "  ".join(f"{n}:{'~' if n in guessed else ''}{c:.2f}" for n, c in enumerate(curve.costs, start=1))
    note = "  (~ interpolated)" if guessed else ""
    return f"{head}{note}\n  {sizes}"


# --------------------------------------------------------------------------- measuring


def _tree_for(n: int):
    """A tree of ``n`` tokens shaped like the loop's: g0, then rows of up to 4 tokens."""
    from .tree import Tree, layout

    tokens = mx.arange(n, dtype=mx.int32) % 100 + 1
    if n == 1:
        return Tree(tokens, mx.zeros((1,), mx.int32), None, None, mx.ones((1, 1), mx.bool_))
    rows, left = [], n - 1
    while left > 0:
        rows.append(min(4, left))
        left -= rows[-1]
    lay = layout(tuple(rows))
    return Tree(tokens, lay.depth, lay.parent, lay.node_index, lay.mask)


class _Timer:
    """Pipelined forwards over ``n`` tokens, like the loop: build the next
    call, queue it, then wait for the last. The call left in flight at the
    end of a burst is waited for by the next burst's first, untimed wait,
    so no burst drains the device and none pays for another's shape."""

    def __init__(self, model, backbone, head, cache, rewind):
        self.model, self.backbone, self.head, self.cache, self.rewind = model, backbone, head, cache, rewind
        self.pending = None

    def call(self, n: int, tree) -> mx.array:
        from .verify import tree_hooks

        tokens = tree.tokens[None]
        if n == 1:
            hidden = self.backbone(tokens, cache=self.cache)[0]
        else:
            with tree_hooks(self.model, self.cache, tree):
                hidden = self.backbone(tokens, cache=self.cache)[0]
        out = mx.argmax(self.head(hidden), axis=-1).astype(mx.int32)
        self.rewind()
        return out

    def burst(self, n: int, calls: int) -> float:
        """Mean seconds per call over ``calls`` timed calls of size ``n``."""
        tree = _tree_for(n)
        times = []
        for i in range(calls + 1):
            tic = time.perf_counter()
            following = self.call(n, tree)
            mx.async_eval(following)
            if self.pending is not None:
                self.pending.tolist()
            self.pending = following
            if i:  # the first wait is for the previous burst's call
                times.append(time.perf_counter() - tic)
        return float(np.mean(times)) if times else 0.0

    def drain(self) -> None:
        if self.pending is not None:
            self.pending.tolist()
        self.pending = None


def _context_cache(model, backbone, tokens: int):
    """A cache holding ``tokens`` positions, and a function that rewinds it
    there. Only the length matters to the timing, so the keys and values
    are random rows after one real token: no prefill (a 4-bit model on a
    CPU would spend most of the budget on it)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(backbone(mx.array([[1]]), cache=cache))
    for c in cache:
        b, h, _, d = c.keys.shape
        rows = mx.random.normal((b, h, tokens - 1, d)).astype(c.keys.dtype)
        c.update_and_fetch(rows, rows)
        mx.eval(c.keys, c.values)
    offsets = [c.offset for c in cache]

    def rewind():
        for c, o in zip(cache, offsets):
            c.offset = o

    return cache, rewind


def _sample_order(sizes) -> list:
    """Bucket sizes first (tree_select.BUCKETS), so a slow device that runs
    out of budget has measured the sizes the selection uses."""
    first = [n for n in (1, 2, 3, 4, 6, 8, 12, 16) if n in sizes]
    return first + [n for n in sizes if n not in first]


def _fill(sizes, ratios: Dict[int, float]) -> Tuple[float, ...]:
    """c(N) at every size: measured where there is one, else interpolated
    linearly between measured sizes (past the last, its slope continues;
    with N = 1 alone, c(N) = N, which makes drafting never pay)."""
    known = sorted(ratios)
    if len(known) == 1:
        return tuple(float(n) for n in sizes)
    out = []
    for n in sizes:
        if n in ratios:
            out.append(ratios[n])
        elif n > known[-1]:
            slope = (ratios[known[-1]] - ratios[known[-2]]) / (known[-1] - known[-2])
            out.append(ratios[known[-1]] + max(slope, 0.0) * (n - known[-1]))
        else:
            out.append(float(np.interp(n, known, [ratios[k] for k in known])))
    return tuple(out)


def measure_curve(model, model_spec: Optional[str] = None, max_size: int = MAX_SIZE, budget_s: float = 30.0,
                  calls: int = 2, max_rounds: int = 15, context: int = CONTEXT_TOKENS, seed: int = 0) -> CostCurve:
    """Measure c(N) for ``N = 1..max_size`` in at most about ``budget_s`` seconds.

    Each round times a short pipelined burst of every size, in a new random
    order (so drift and other processes on the machine hit every size
    alike), with ``BASE_REPEATS`` bursts of N = 1. c(N) is the median over
    rounds of each size's time divided by that round's N = 1 time (the
    median of its N = 1 bursts, so one disturbed burst does not skew a
    round). No burst starts that would end past the budget: on a slow
    device the sizes never timed are interpolated (``CostCurve.measured``
    lists those that were).
    """
    from .models import model_parts
    from .verify import install_tree_hooks

    if max_size < 1:
        raise ValueError(f"max_size must be at least 1 (got {max_size})")
    sizes = list(range(1, max_size + 1))
    install_tree_hooks(model)
    _, backbone, head = model_parts(model)
    cache, rewind = _context_cache(model, backbone, context)
    rng = random.Random(seed)
    timer = _Timer(model, backbone, head, cache, rewind)
    deadline = time.perf_counter() + budget_s
    guess: Dict[int, float] = {}  # seconds per call, from the first call of each shape

    def fits(n: int, k: int) -> bool:
        # An untimed size is guessed from the largest timed one, scaled by size (as a quantized CPU model grows).
        top = max(guess, default=None)
        per_call = guess[n] if n in guess else (guess[top] * n / top if top else 0.0)
        return time.perf_counter() + per_call * k < deadline

    for n in _sample_order(sizes):  # first calls of every shape: kernels and allocations
        if not fits(n, 2):
            break
        tic = time.perf_counter()
        timer.burst(n, 0)
        timer.drain()
        guess[n] = time.perf_counter() - tic
    raw: Dict[int, list] = {n: [] for n in guess}
    rounds = 0
    while rounds < max_rounds and 1 in guess:
        order = [n for n in guess if n != 1] + [1] * BASE_REPEATS
        rng.shuffle(order)
        times: Dict[int, list] = {}
        for n in order:
            if fits(n, calls + 1):
                times.setdefault(n, []).append(timer.burst(n, calls))
        if 1 not in times or len(times) == 1:
            break
        base = float(np.median(times.pop(1)))
        for n, t in times.items():
            raw[n].append(t[0] / base)
        raw[1].append(base)
        rounds += 1
    timer.drain()
    ratios = {1: 1.0, **{n: float(np.median(r)) for n, r in raw.items() if n != 1 and r}}
    device, ident, variant = curve_key(model, model_spec)
    base_ms = 1000 * float(np.median(raw[1])) if raw.get(1) else 1000 * guess.get(1, 0.0)
    return CostCurve(_fill(sizes, ratios), device, ident, variant, base_ms=base_ms,
                     source=f"measured {time.strftime('%Y-%m-%d %H:%M')}, {rounds} rounds of {calls} calls",
                     rounds=rounds, measured=tuple(sorted(ratios)))
