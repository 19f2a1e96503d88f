"""Never slower than plain decoding (issue 55): the defaults against plain
mlx-lm decoding of the same model, in one run, per condition.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 \\
        python bench/never_slower.py --conditions default,q4,draft-model --num-prompts 6 --max-tokens 128

Three modes per prompt, their order rotating from one prompt to the next so
that drift hits all alike:

* ``plain``: ``mlx_lm.stream_generate`` (mlx-lm's own loop, no drafting);
* ``governed``: ``mlx_redrafter.stream_generate`` with the defaults (the
  shipped drafter, lookup, the live choice of step/governor.py);
* ``always``: the same with ``always_draft=True`` (every step drafts: what the
  defaults did before the live choice);
* ``arm:<sources>``: the defaults with the governor pinned to one of its
  other arms (every source but a costly one: ``arm:lookup`` is lookup alone),
  every step: the other fixed settings, so that "the best fixed setting" is
  the best of ``plain``, ``always`` and these.

Conditions: ``default`` (the default model, MT-Bench first turns), ``q4``
(the same model quantized to 4 bits in memory), ``draft-model`` (the default
model with a draft model that does not pay: its own first 8 of 30 layers,
3 tokens), ``long`` and ``longer`` (each prompt after 600 and 1,500 tokens
of earlier context: the other prompts, repeated),
``qwen35-mtp`` (a hybrid at Qwen3.5-0.8B's shape, random weights, its MTP
head and lookup; the step loops timed on token ids, plain being mlx-lm's
``generate_step``).
No calibration is used: the live state of earlier runs (``live-*.json``) is
removed first, so the governed mode starts from nothing; it carries across
the prompts of one run, as across the turns of a chat. ``--after-run``:
the governed mode first decodes ``--num-prompts`` other prompts, untimed,
so that it starts from the state a user's earlier run left (step/keep.py
keeps it across runs).
Reports decoding's tokens per second per mode (the tokens after the first
over their time, summed over prompts: the prompt's prefill is not counted)
and the ratios to plain; writes ``--out`` (JSON) when given.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import mlx.core as mx

CONDITIONS = ("default", "q4", "draft-model", "long", "longer")
LONG = {"long": 600, "longer": 1500}  # tokens of earlier context before each prompt
# Conditions on random weights of a real model's shape (no tokenizer: the step loops are timed on token ids).
SHAPED = ("qwen35-mtp",)


def own_layers(model, n: int = 8):
    """A draft model made of ``model``'s own first ``n`` layers (a copy): one
    that shares its tokenizer and drafts poorly (it does not pay on this CPU)."""
    small = copy.deepcopy(model)
    small.model.layers = small.model.layers[:n]
    return small


def _tokens_per_second(gen) -> tuple:
    """Tokens after the first and the seconds they took: decoding, the prompt's prefill left out."""
    it = iter(gen)
    next(it)
    tic, n = time.perf_counter(), 0
    for _ in it:
        n += 1
    return n, time.perf_counter() - tic


@contextmanager
def pinned(name: Optional[str]):
    """The governor runs arm ``name`` every step (``None``: as it chooses)."""
    from mlx_redrafter.step import governor

    if name is None:
        yield
        return

    def fixed(self):
        self.step += 1
        self.chosen = next(a for a in self.arms if governor.arm_name(a) == name)
        return self.chosen, False

    from mlx_redrafter.step import loop

    # A pinned run neither reads nor keeps the live state: the governed mode's stays its own.
    saved = governor.Governor.choose, loop.opened, loop.kept
    governor.Governor.choose, loop.opened, loop.kept = fixed, lambda key: None, lambda key, state: None
    try:
        yield
    finally:
        governor.Governor.choose, loop.opened, loop.kept = saved


def arms_of_plan(run) -> List[str]:
    """The governor's arms (names) when ``run()`` opens a governed generation."""
    from mlx_redrafter.step import governor

    seen, init = [], governor.Governor.__init__

    def spy(self, *a, **k):
        init(self, *a, **k)
        seen.append([governor.arm_name(x) for x in self.arms])

    governor.Governor.__init__ = spy
    try:
        run()
    finally:
        governor.Governor.__init__ = init
    return seen[0][2:] if seen else []  # past the plan's arm and plain


def measure(modes: dict, prompts, count) -> dict:
    """Each mode on each prompt, the order rotating per prompt; tokens per second and ratios to plain."""
    totals = {m: [0, 0.0] for m in modes}
    names = list(modes)
    for i, p in enumerate(prompts):
        k = i % len(names)
        for m in names[k:] + names[:k]:
            run, arm = modes[m]
            with pinned(arm):
                n, s = count(run(p))
            totals[m][0] += n
            totals[m][1] += s
    tps = {m: n / s for m, (n, s) in totals.items()}
    return {
        "tokens_per_second": tps,
        "ratio": {m: tps[m] / tps["plain"] for m in modes},
        "tokens": {m: totals[m][0] for m in modes},
    }


def _earlier_run(modes: dict, prompts, count) -> None:
    """The governed mode decodes ``prompts``, untimed: the state it keeps is a user's earlier run's."""
    for p in prompts:
        count(modes["governed"][0](p))


def run_condition(name: str, prompts, model, tokenizer, max_tokens: int, earlier=()) -> dict:
    import mlx_lm

    from mlx_redrafter import stream_generate

    extra = {}
    if name == "q4":
        import mlx.nn as nn

        model = copy.deepcopy(model)
        nn.quantize(model, group_size=64, bits=4)
    if name == "draft-model":
        extra = {"draft_model": own_layers(model), "num_draft_tokens": 3}
    if name in LONG:
        filler = []
        for p in prompts:
            filler += p
        prompts = [(filler * 20)[: LONG[name]] + p for p in prompts]

    def governed(p, always=False):
        return stream_generate(model, tokenizer, p, max_tokens=max_tokens, always_draft=always, **extra)

    modes = {
        "plain": (lambda p: mlx_lm.stream_generate(model, tokenizer, p, max_tokens=max_tokens), None),
        "governed": (governed, None),
        "always": (lambda p: governed(p, True), None),
    }
    for arm in arms_of_plan(lambda: _tokens_per_second(governed(prompts[0]))):
        modes[f"arm:{arm}"] = (governed, arm)
    _tokens_per_second(modes["plain"][0](prompts[0]))  # warm up
    _clear_state()
    _earlier_run(modes, earlier, _tokens_per_second)
    return {"condition": name, **measure(modes, prompts, _tokens_per_second)}


def _count(steps, n: int) -> tuple:
    """Tokens of the steps after the first (the prefill's) up to ``n``, and their seconds."""
    next(steps)
    tic, got = time.perf_counter(), 0
    for s in steps:
        got += len(s.tokens) if hasattr(s, "tokens") else 1
        if got >= n:
            break
    steps.close()
    return got, time.perf_counter() - tic


def run_qwen35_mtp(num_prompts: int, max_tokens: int, after_run: bool = False) -> dict:
    """A hybrid at Qwen3.5-0.8B's shape, random weights, with its MTP head
    (random too: its drafts are rejected) and lookup, as the defaults draft
    for a model that ships one (one beam of 2, one lookup beam). Random
    weights fall into loops, which lookup copies: the case of issue 55."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_redrafter.config import DEFAULT_HEAD_LENGTH, DEFAULT_LOOKUP, DraftConfig, SamplingConfig
    from mlx_redrafter.step.dispatch import token_steps
    from mlx_redrafter.step.plan import make_plan

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mtp_cost import build

    model, head = build()
    mx.random.seed(1)
    prompts = [mx.random.randint(0, 248320, (64,)).astype(mx.int32) for _ in range(num_prompts * (1 + after_run))]
    prompts, earlier = prompts[:num_prompts], prompts[num_prompts:]

    def drafted(always: bool):
        draft = DraftConfig(head=head, head_length=DEFAULT_HEAD_LENGTH, lookup=DEFAULT_LOOKUP, always_draft=always)
        return lambda p: token_steps(
            model, p, make_prompt_cache(model), plan=make_plan(model, draft), sampling=SamplingConfig()
        )

    modes = {
        "plain": (lambda p: generate_step(p, model, max_tokens=max_tokens), None),
        "governed": (drafted(False), None),
        "always": (drafted(True), None),
    }
    for arm in arms_of_plan(lambda: _count(drafted(False)(prompts[0]), 2)):
        modes[f"arm:{arm}"] = (drafted(False), arm)
    _count(modes["plain"][0](prompts[0]), 8)  # warm up
    _clear_state()
    _earlier_run(modes, earlier, lambda steps: _count(steps, max_tokens))
    return {"condition": "qwen35-mtp", **measure(modes, prompts, lambda steps: _count(steps, max_tokens))}


def _clear_state() -> None:
    """No live state in memory or on disk: the governed mode starts from nothing."""
    from mlx_redrafter.files import cache_root
    from mlx_redrafter.step import keep

    keep._KEPT.clear()
    for f in (cache_root() / "profiles").glob("live-*.json"):
        f.unlink()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--after-run",
        action="store_true",
        help="The governed mode starts from the state an earlier run on other prompts left (untimed).",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from mlx_redrafter import load_model
    from mlx_redrafter.prompts import first_turn_ids, load_prompt_set

    names = args.conditions.split(",")
    if any(n not in SHAPED for n in names):
        model, tokenizer = load_model(args.model)
        n = args.num_prompts
        prompts = first_turn_ids(tokenizer, load_prompt_set("mt_bench")[: n * (1 + args.after_run)])
        prompts, earlier = prompts[:n], prompts[n:]
    rows = []
    for name in names:
        _clear_state()  # each condition starts from nothing
        if name == "qwen35-mtp":
            row = run_qwen35_mtp(args.num_prompts, args.max_tokens, args.after_run)
        else:
            row = run_condition(name, prompts, model, tokenizer, args.max_tokens, earlier)
        rows.append(row)
        r = row["ratio"]
        best = max(v for m, v in r.items() if m != "governed")
        others = " | ".join(f"{m} {v:.2f}x" for m, v in r.items() if m not in ("plain", "governed"))
        print(
            f"{name}: plain {row['tokens_per_second']['plain']:.1f} tok/s | governed {r['governed']:.2f}x | "
            f"{others} | governed / best fixed {r['governed'] / best:.2f}",
            flush=True,
        )
        mx.clear_cache()
    write_rows(args.out, rows)
    return 0


def write_rows(out: Optional[Path], rows: list) -> None:
    """``--out`` (when given): the command line and the rows measured, as JSON."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
