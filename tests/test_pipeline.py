"""The build-ahead schedule (the default): same tokens as the read-then-build
schedule and plain decoding, an ordinary cache afterwards, laid-out trees,
late lookup, and one place where the step loop reads the device.

Mutations seen caught here (bench/mutations.py): C8 (the accepted path read
from the first beam: lookup rows are accepted after the drafter's)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import OracleDrafter, accepted_in_steps, generate_tokens, prompts, random_drafter, run_steps, tiny_model
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache, make_prompt_cache

from mlx_redrafter.config import DraftConfig
from mlx_redrafter.llm import cache as kv
from mlx_redrafter.step.dispatch import redrafter_steps
from mlx_redrafter.step.plan import AHEAD, make_plan
from mlx_redrafter.step.source import line_up
from mlx_redrafter.step.tree import PAD, layout, merged_parent

N = 24


def both(draft):
    return [DraftConfig(**{**draft.__dict__, "pipelined": p}) for p in (True, False)]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "phi3"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (2, 3), (1, 5)], ids=lambda s: f"W{s[0]}L{s[1]}")
@pytest.mark.parametrize("lookup", [0, 1])
def test_pipelined_equals_synchronous_and_plain(kind, shape, lookup):
    model = tiny_model(kind)
    p = prompts(1)[0]
    ref, _ = generate_tokens(model, p, max_tokens=N)
    oracle = OracleDrafter(model, p, N, shape[1])  # accepts runs of every length
    fast, slow = both(DraftConfig(oracle, *shape, lookup=lookup))
    got, stats, _ = run_steps(model, p, fast, N)
    assert got == ref and accepted_in_steps(stats, N) >= 4
    got_slow, stats_slow, _ = run_steps(model, p, slow, N)
    assert got_slow == ref and accepted_in_steps(stats_slow, N) >= 4
    # Unpacked trees: every row has its own nodes.
    rows = shape[0] * shape[1]
    assert all(s.tree_size in {1 + rows + k * fast.lookup_length for k in range(lookup + 1)} for s in stats[1:])
    assert all(s.host_syncs == s.step + 1 for s in stats)


def test_lookup_only_copies_a_repeated_reply():
    """Late lookup still copies: the history holds this very reply."""
    model = tiny_model("llama")
    p = prompts(1)[0]
    ref, _ = generate_tokens(model, p, max_tokens=30)
    cache = make_prompt_cache(model)
    steps = redrafter_steps(model, mx.array(p), cache, draft=DraftConfig(lookup=1), history=p + ref)
    out, accepted = [], 0
    for s in steps:
        out += s.tokens
        accepted += s.stats.accepted
        if len(out) >= 30:
            break
    steps.close()
    assert out[:30] == ref and accepted >= 20


def two_head_llama():
    """A tiny llama whose head size (32) suits an 8-bit quantized cache."""
    from helpers import TINY_CONFIGS

    TINY_CONFIGS["llama_q"] = dict(TINY_CONFIGS["llama"], num_attention_heads=2, num_key_value_heads=1)
    try:
        return tiny_model("llama_q")
    finally:
        del TINY_CONFIGS["llama_q"]


@pytest.mark.parametrize("quantized", [False, True], ids=["kv", "quantized"])
def test_cache_after_close_holds_the_real_tokens(quantized):
    """The holes are squeezed out when the loop ends: the cache equals one
    filled with the prompt and the accepted tokens, and a next turn on it
    equals plain decoding of the whole text."""
    model = two_head_llama()

    def fresh():
        cache = make_prompt_cache(model)
        return [QuantizedKVCache(group_size=32, bits=8) for _ in cache] if quantized else cache

    p = prompts(1)[0]
    draft = DraftConfig(OracleDrafter(model, p, 40, 3), 2, 3)
    tokens, stats, cache = run_steps(model, p, draft, n=40, cache=fresh())
    emitted = sum(1 + s.accepted for s in stats[1:])  # the last g0 is not cached yet
    assert sum(s.accepted for s in stats) > 5
    assert cache[0].offset == len(p) + emitted
    if not quantized:
        full = fresh()
        model(mx.array(p + tokens[:emitted])[None], cache=full)
        for a, b in zip(cache, full):
            n = b.offset
            assert mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-4)
            assert mx.allclose(a.values[..., :n, :], b.values[..., :n, :], atol=1e-4)
    more = [5, 6, 7]
    whole = p + tokens[:emitted] + more
    ref, _ = generate_tokens(model, whole, max_tokens=12, prompt_cache=fresh())
    # The next turn drafts from an oracle that knows its reply (after the whole text).
    got, stats, _ = run_steps(model, more, DraftConfig(OracleDrafter(model, whole, 12, 3), 2, 3), n=12, cache=cache)
    assert got == ref and accepted_in_steps(stats, 12) >= 2


def test_compaction_during_a_long_run(monkeypatch):
    """Holes squeezed out mid-run (every few steps here) change no token."""
    monkeypatch.setattr(kv, "COMPACT_HOLES", 3)
    calls = []
    compact = kv.HoleyCache.compact
    monkeypatch.setattr(kv.HoleyCache, "compact", lambda self, **kw: calls.append(kw) or compact(self, **kw))
    model = tiny_model("qwen3")
    p = prompts(2)[1]
    ref, _ = generate_tokens(model, p, max_tokens=40)
    got, stats, cache = run_steps(model, p, DraftConfig(OracleDrafter(model, p, 40, 3), 2, 3), 40)
    assert got == ref and accepted_in_steps(stats, 40) >= 8
    assert cache[0].offset == len(p) + sum(1 + s.accepted for s in stats[1:])
    assert len(calls) > 3 and calls[-1] == {"drop_unread": True}


def test_the_synchronous_loop_serves_what_cannot_pipeline():
    model = tiny_model("llama")
    d = random_drafter()
    plain = make_prompt_cache(model)

    def can_pipeline(cache, draft, timings=False, on=model):
        return make_plan(on, draft, timings=timings, cache=cache).schedule == AHEAD

    assert can_pipeline(plain, DraftConfig(d))
    assert not can_pipeline(plain, DraftConfig(d), timings=True)
    assert not can_pipeline(plain, DraftConfig(d, controller=object()))
    rotating = [RotatingKVCache(max_size=64) for _ in plain]
    assert not can_pipeline(rotating, DraftConfig(d))
    assert can_pipeline([QuantizedKVCache() for _ in plain], DraftConfig(d))
    # Wide, deep beams share prefixes: packed (synchronous) verifies fewer nodes.
    assert not can_pipeline(plain, DraftConfig(d, 4, 5))
    assert can_pipeline(plain, DraftConfig(d, 1, 5)) and can_pipeline(plain, DraftConfig(d, 6, 1))
    assert can_pipeline(plain, DraftConfig(None, 4, 5, lookup=1))
    # Gemma's sliding-window layers have rotating caches: the synchronous loop, still exact.
    gemma = tiny_model("gemma3_text")
    p = prompts(1)[0]
    ref, _ = generate_tokens(gemma, p, max_tokens=N)
    assert not can_pipeline(gemma.make_cache(), DraftConfig(d), on=gemma)
    got, stats, _ = run_steps(gemma, p, DraftConfig(OracleDrafter(gemma, p, N, 3), 2, 3), N)
    assert got == ref and accepted_in_steps(stats, N) >= 4


def test_sampling_walks_the_merged_tree():
    """Rows that repeat an earlier row's prefix hang under the first row's nodes."""
    beams = mx.array([[4, 5, 6], [4, 5, 7], [4, 8, PAD]])
    lay = layout((3, 3, 2))
    assert lay.node_index.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 0]]
    assert lay.parent.tolist() == [0, 0, 1, 2, 0, 4, 5, 0, 7]
    # Node 6 (7 after 4 5) hangs under node 2 (row 0's 5); node 8 (8 after 4) under node 1.
    assert merged_parent(lay, beams).tolist() == [0, 0, 1, 2, 0, 1, 2, 0, 1]
    mask = lay.mask.astype(mx.int32).tolist()
    assert mask[6] == [1, 0, 0, 0, 1, 1, 1, 0, 0] and mask[8] == [1, 0, 0, 0, 0, 0, 0, 1, 1]


def test_line_up_late_lookup():
    # The host read up to g0 = 9 and proposed "1 2 3 4 5 6" after it (length 2, depth 3: 2 + 3 + 1).
    props = mx.array([[1, 2, 3, 4, 5, 6], [1, 7, 3, 4, 5, 6]])
    row = mx.array([1, 2, 8])
    # The step in flight accepted 2 drafts (1 2) and then the LLM said 3.
    got = line_up(props, row, mx.array(2), mx.array(3), 2)
    assert got.tolist() == [[4, 5], [PAD, PAD]]
    # Nothing accepted, the LLM said 1: both proposals line up.
    assert line_up(props, row, mx.array(0), mx.array(1), 2).tolist() == [[2, 3], [7, 3]]
    # The LLM disagreed at once.
    assert line_up(props, row, mx.array(0), mx.array(2), 2).tolist() == [[PAD, PAD], [PAD, PAD]]


# --------------------------------------------------------------------------- the one sync

LOOP_FUNCTIONS = [
    ("mlx_redrafter.step.dispatch", "token_steps"),
    ("mlx_redrafter.step.dispatch", "redrafter_steps"),
    ("mlx_redrafter.step.loop", None),
    ("mlx_redrafter.step.build", None),
    ("mlx_redrafter.step.source", None),
    ("mlx_redrafter.step.plan", None),
    ("mlx_redrafter.step.sources.redrafter", None),
    ("mlx_redrafter.step.sources.chain", None),
    ("mlx_redrafter.step.sources.lookup", None),
    ("mlx_redrafter.step.sources.datastore", None),
    ("mlx_redrafter.step.sources.host", None),
    ("mlx_redrafter.step.sources.forced", None),
    ("mlx_redrafter.draft.head", None),
    ("mlx_redrafter.draft.chain", None),
    ("mlx_redrafter.step.auto", None),
    ("mlx_redrafter.step.accept", None),
    ("mlx_redrafter.step.verify", None),
    ("mlx_redrafter.draft.beam", None),
    ("mlx_redrafter.llm.cache", None),
    ("mlx_redrafter.step.mixers", None),  # the recurrent layers' tree hooks
    ("mlx_redrafter.llm.recurrent", None),
]


def host_reads(source: str):
    """``(line, what)`` of every device-to-host read in ``source``."""
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("item", "tolist") and not node.args:
            found.append((node.lineno, f".{f.attr}()"))
        elif (
            isinstance(f, ast.Attribute)
            and f.attr in ("array", "asarray")
            and getattr(f.value, "id", "") in ("np", "numpy")
        ):
            found.append((node.lineno, f"np.{f.attr}"))
        elif isinstance(f, ast.Name) and f.id in ("int", "float", "bool") and node.args:
            arg = node.args[0]
            if not isinstance(arg, (ast.Constant, ast.BinOp)) and not (
                isinstance(arg, ast.Call) and getattr(arg.func, "id", "") == "len"
            ):
                found.append((node.lineno, f"{f.id}()"))
    return found


def test_the_host_read_finder_finds_them():
    bad = """
    def f(a, b, c):
        x = a.item()
        y = b.tolist()
        z = np.array(c)
        w = int(a[0])
        v = float(b.sum())
    """
    assert [w for _, w in host_reads(bad)] == [".item()", ".tolist()", "np.array", "int()", "float()"]
    good = "def g(xs, n):\n    return int(3), len(xs), float(n * 2), mx.array(xs), xs.tolist(1)\n"
    assert host_reads(good) == []


@pytest.mark.parametrize("module, name", LOOP_FUNCTIONS)
def test_the_step_loop_reads_the_device_only_in_host_read(module, name):
    import importlib

    mod = importlib.import_module(module)
    obj = getattr(mod, name) if name else mod
    found = host_reads(inspect.getsource(obj))
    assert not found, f"{module}.{name or ''}: host reads outside steps.host_read: {found}"


def test_host_read_is_the_only_sync_of_steps_py():
    from mlx_redrafter.step import protocol as steps

    source = Path(steps.__file__).read_text()
    reads = host_reads(source)
    assert [w for _, w in reads] == [".tolist()", ".tolist()"]  # both in host_read
    lines = inspect.getsourcelines(steps.host_read)
    first, last = lines[1], lines[1] + len(lines[0])
    assert all(first <= line < last for line, _ in reads)


def test_a_layout_cached_by_one_thread_is_used_by_another():
    """The server's worker thread reuses the layouts a caller's thread made:
    MLX's streams are per thread, so a cached lazy array would fail there
    ("There is no Stream(cpu, 0) in current thread")."""
    import threading

    from mlx_redrafter.step.tree import layout

    lay, errors = layout((3, 2, 1, 1)), []

    def use():
        try:
            mx.eval(lay.mask.astype(mx.float32).sum() + lay.depth.sum() + lay.node_index.sum())
        except RuntimeError as e:
            errors.append(e)

    worker = threading.Thread(target=use)
    worker.start()
    worker.join()
    assert not errors, errors
