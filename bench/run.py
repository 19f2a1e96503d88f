"""Benchmark: ReDrafter against plain mlx-lm decoding on MT-Bench (8
categories, both turns), Spec-Bench's six tasks and an AlpacaEval subset.

    python bench/run.py --quick   # `make bench`: 1 conversation per category, 64 tokens
    python bench/run.py           # `make bench-full`: every prompt, 256 tokens (hours on a CPU)

Reports, per category: speedup and tokens per step; per-token latency
p50/p95/p99 and time to first token; the peak memory of drafting against
plain decoding. Writes into ``--out`` (default ``bench/out/quick`` or
``bench/out/full``):

* ``report.md``: the tables, the machine and the exact command;
* ``results.json``: the same numbers, machine-readable;
* ``answers/<set>/redrafter.jsonl`` and ``answers/<set>/baseline.jsonl``:
  Spec-Bench's answer format (question_id, category, choices[0]: turns,
  decoding_steps, new_tokens, wall_time, accept_lengths), so that
  Spec-Bench's ``evaluation/speed.py`` can read them.

Generation is greedy; the second MT-Bench turn includes the model's own
first answer. Plain decoding and ReDrafter alternate which goes first from
one conversation to the next, so that machine drift hits both alike. The
measuring core is the sweep's (``mlx_redrafter.tuning.measure``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from mlx_redrafter.errors import RedrafterError

BENCH_DIR = Path(__file__).resolve().parent
SETS = ("mt_bench", "spec_bench", "alpaca_eval")
# Spec-Bench reports its MT-Bench questions as one task, "mt_bench".
MT_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
MODES = ("baseline", "redrafter")


@dataclass
class BenchConfig:
    """What one benchmark run measures (``--quick`` presets in :func:`parse_args`)."""

    sets: List[str] = field(default_factory=lambda: list(SETS))
    per_category: Optional[int] = None  # conversations per category; None = all
    alpaca_per_category: int = 20  # AlpacaEval is a subset even in the full run
    max_tokens: int = 256
    quick: bool = False
    temp: float = 0.0  # > 0: both modes sample (distribution-exact for ReDrafter)
    top_p: float = 0.0
    seed: int = 0  # with temp > 0, every turn of both modes starts from the same seed


# --------------------------------------------------------------------------- prompts


def task_of(set_name: str, category: str) -> str:
    """The category a result is reported under."""
    if set_name == "spec_bench" and category in MT_CATEGORIES:
        return "mt_bench"
    return category or "all"


def select(set_name: str, conversations: List[dict], cfg: BenchConfig) -> List[dict]:
    """The first ``n`` conversations of every reported category."""
    n = cfg.per_category
    if set_name == "alpaca_eval":
        n = min(n or cfg.alpaca_per_category, cfg.alpaca_per_category)
    counts: Dict[str, int] = {}
    out = []
    for c in conversations:
        t = task_of(set_name, c["category"])
        if n is None or counts.get(t, 0) < n:
            counts[t] = counts.get(t, 0) + 1
            out.append(c)
    return out


def set_name_of(spec: str) -> str:
    return spec if spec in SETS else Path(spec).stem


# --------------------------------------------------------------------------- running


@dataclass
class Turn:
    prompt_tokens: int
    text: str
    new_tokens: int
    steps: int  # decode steps (after the first token)
    wall_time: float  # prefill + decode, seconds (Spec-Bench's wall_time)
    decode_time: float
    ttft: float
    accept_lengths: List[int]  # tokens emitted per decode step
    latencies: List[float]  # per-token latency, seconds
    peak_memory: int  # bytes


def run_conversation(session, conv: dict, draft, cfg: "BenchConfig", eos_ids) -> List[Turn]:
    """Answer every user turn, each one with the model's own earlier answers
    in the context, drafting as ``draft`` says (a ``DraftConfig``; one that
    drafts nothing is plain decoding). Stops early when a turn no longer fits
    the context."""
    from mlx_redrafter.llm.parts import context_limit
    from mlx_redrafter.prompts import chat_prompt_ids
    from mlx_redrafter.tuning.measure import measure

    max_tokens = cfg.max_tokens
    limit = context_limit(session.model)
    tree = 1 + session.beam_width * session.beam_length + session.lookup * draft.lookup_length
    messages, turns = [], []
    for text in conv["turns"]:
        messages.append({"role": "user", "content": text})
        ids = chat_prompt_ids(session.tokenizer, messages)
        if limit and len(ids) + max_tokens + tree > limit:
            break
        if cfg.temp > 0:
            mx.random.seed(cfg.seed + len(turns))
        run = measure(
            session.model, ids, draft=draft, max_tokens=max_tokens, eos_ids=eos_ids, temp=cfg.temp, top_p=cfg.top_p
        )
        answer = session.tokenizer.decode(run.tokens)
        messages.append({"role": "assistant", "content": answer})
        turns.append(
            Turn(
                len(ids),
                answer,
                len(run.tokens),
                len(run.step_tokens()),
                run.wall_time,
                run.decode_time,
                run.ttft,
                [n for n, _ in run.step_tokens()],
                run.token_latencies(),
                run.peak_memory,
            )
        )
    return turns


def run_set(session, set_name: str, conversations: List[dict], cfg: BenchConfig, eos_ids, progress) -> List[dict]:
    """Both modes on every conversation, alternating which goes first."""
    from mlx_redrafter.config import DraftConfig

    drafts = {"baseline": DraftConfig(), "redrafter": session.draft}
    records = []
    for i, conv in enumerate(conversations):
        order = MODES if i % 2 == 0 else MODES[::-1]
        rec = {"id": conv["id"], "category": conv["category"], "task": task_of(set_name, conv["category"])}
        for mode in order:
            rec[mode] = run_conversation(session, conv, drafts[mode], cfg, eos_ids)
            progress()
        # Turns that did not fit the model's context (the same for both modes).
        rec["skipped_turns"] = len(conv["turns"]) - len(rec["redrafter"])
        records.append(rec)
    return records


# --------------------------------------------------------------------------- summaries


def _pct(values: List[float], q: float) -> Optional[float]:
    return float(np.percentile(values, q)) if values else None


def summarize(records: List[dict]) -> dict:
    """Speedup, tokens per step, latency and memory over ``records``."""
    out = {"conversations": len(records), "skipped_turns": sum(r["skipped_turns"] for r in records)}
    for mode in MODES:
        turns = [t for r in records for t in r[mode]]
        tokens = sum(t.new_tokens for t in turns)
        wall = sum(t.wall_time for t in turns)
        decode_tokens = sum(max(t.new_tokens - 1, 0) for t in turns)
        decode = sum(t.decode_time for t in turns)
        lat = [x for t in turns for x in t.latencies]
        out[mode] = {
            "turns": len(turns),
            "new_tokens": tokens,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "decode_tokens_per_s": decode_tokens / decode if decode > 0 else 0.0,
            "tokens_per_step": float(np.mean([n for t in turns for n in t.accept_lengths]))
            if turns and any(t.accept_lengths for t in turns)
            else 0.0,
            "ttft_p50_s": _pct([t.ttft for t in turns], 50),
            "ttft_p95_s": _pct([t.ttft for t in turns], 95),
            "latency_p50_s": _pct(lat, 50),
            "latency_p95_s": _pct(lat, 95),
            "latency_p99_s": _pct(lat, 99),
            "peak_memory_gb": max((t.peak_memory for t in turns), default=0) / 1e9,
        }
    b, r = out["baseline"], out["redrafter"]
    # Spec-Bench's speedup: tokens over wall time, prefill included.
    out["speedup"] = r["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else None
    out["decode_speedup"] = r["decode_tokens_per_s"] / b["decode_tokens_per_s"] if b["decode_tokens_per_s"] else None
    out["memory_overhead_gb"] = r["peak_memory_gb"] - b["peak_memory_gb"]
    return out


def summarize_set(records: List[dict]) -> dict:
    tasks = list(dict.fromkeys(r["task"] for r in records))
    return {
        "by_category": {t: summarize([r for r in records if r["task"] == t]) for t in tasks},
        "overall": summarize(records),
    }


# --------------------------------------------------------------------------- outputs


def spec_bench_answers(records: List[dict], mode: str, model_id: str) -> List[dict]:
    """Spec-Bench's answer-file records (one per question)."""
    out = []
    for r in records:
        turns = r[mode]
        qid = int(r["id"]) if str(r["id"]).isdigit() else r["id"]
        out.append(
            {
                "question_id": qid,
                "category": r["category"],
                "answer_id": f"{qid}-{mode}",
                "model_id": model_id,
                "choices": [
                    {
                        "index": 0,
                        "turns": [t.text for t in turns],
                        "decoding_steps": [t.steps for t in turns],
                        "new_tokens": [t.new_tokens for t in turns],
                        "wall_time": [t.wall_time for t in turns],
                        "accept_lengths": [n for t in turns for n in t.accept_lengths],
                    }
                ],
                "tstamp": time.time(),
            }
        )
    return out


def write_jsonl(path: Path, rows: List[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _f(v, fmt="{:.2f}", unit="") -> str:
    return "-" if v is None else fmt.format(v) + unit


def _ms(v) -> str:
    return "-" if v is None else f"{1000 * v:.1f}"


def markdown_report(results: dict) -> str:
    """The report: one table per prompt set, then latency and memory."""
    c, m = results["config"], results["machine"]
    lines = [
        f"# mlx-redrafter benchmark ({'quick' if c['quick'] else 'full'})",
        "",
        f"- command: `{results['command']}`",
        f"- date: {results['date']}",
        f"- model: {c['model']}, drafter: {c['drafter']}, W={c['beam_width']} L={c['beam_length']} "
        f"({c['shape_source']}), "
        f"lookup beams: {c.get('lookup', 0)}",
        f"- greedy, max {c['max_tokens']} new tokens per turn, dtype {m.get('default_dtype')}",
        f"- machine: {m.get('machine')}, {m.get('cpu_count')} cores, device {m.get('device')}, BLAS {m.get('blas')}, "
        f"mlx {m.get('mlx')}, mlx-lm {m.get('mlx_lm')}",
        "",
        "Speedup = (new tokens / wall time, prefill included) of ReDrafter over plain mlx-lm decoding, "
        "as Spec-Bench computes it; decode speedup leaves the prefill out. Tokens per step = tokens "
        "emitted per ReDrafter step (accepted drafts + 1).",
        "",
    ]
    for set_name, s in results["sets"].items():
        lines += [
            f"## {set_name}",
            "",
            "| category | conv. | turns | tokens | plain tok/s | ReDrafter tok/s | "
            "speedup | decode speedup | tokens/step |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rows = list(s["by_category"].items()) + [("**overall**", s["overall"])]
        for name, v in rows:
            b, r = v["baseline"], v["redrafter"]
            lines.append(
                f"| {name} | {v['conversations']} | {r['turns']} | {r['new_tokens']} | "
                f"{_f(b['tokens_per_s'], '{:.1f}')} | "
                f"{_f(r['tokens_per_s'], '{:.1f}')} | {_f(v['speedup'], unit='x')} | "
                f"{_f(v['decode_speedup'], unit='x')} | "
                f"{_f(r['tokens_per_step'] or None)} |"
            )
        lines.append("")
        skipped = [(n, v["skipped_turns"]) for n, v in s["by_category"].items() if v["skipped_turns"]]
        if skipped:
            lines += [
                "Left out (prompt + max tokens exceed the model's context): "
                + ", ".join(f"{n} {k} turns" for n, k in skipped)
                + ".",
                "",
            ]
    a = results["all"]
    lines += [
        "## Latency and memory (all sets)",
        "",
        "| | TTFT p50 ms | TTFT p95 ms | per-token p50 ms | p95 ms | p99 ms | peak memory GB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, label in (("baseline", "plain mlx-lm"), ("redrafter", "ReDrafter")):
        v = a[mode]
        lines.append(
            f"| {label} | {_ms(v['ttft_p50_s'])} | {_ms(v['ttft_p95_s'])} | {_ms(v['latency_p50_s'])} | "
            f"{_ms(v['latency_p95_s'])} | {_ms(v['latency_p99_s'])} | {v['peak_memory_gb']:.3f} |"
        )
    lines += [
        "",
        f"Memory overhead of drafting: {a['memory_overhead_gb'] * 1000:.1f} MB of peak memory.",
        "Per-token latency: each step's time shared by the tokens it emitted.",
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="1 conversation per category, 64 tokens (make bench).")
    p.add_argument("--model", default="default", help="'default', an mlx-lm folder, a Hub id or a .gguf.")
    p.add_argument(
        "--drafter",
        default=None,
        help="Drafter folder (default: the one shipped for the model); 'none' with --lookup: lookup drafts only.",
    )
    p.add_argument(
        "--lookup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Lookup drafts beside the drafter's (default: the tuned profile, else on).",
    )
    p.add_argument("-W", "--beam-width", type=int, default=None, help="Default: the tuned profile, else 2.")
    p.add_argument("-L", "--beam-length", type=int, default=None, help="Default: the tuned profile, else 4.")
    p.add_argument(
        "--sets", default=",".join(SETS), help="Comma-separated: mt_bench, spec_bench, alpaca_eval or files."
    )
    p.add_argument(
        "--per-category", type=int, default=None, help="Conversations per category (default: all; 1 with --quick)."
    )
    p.add_argument("--alpaca-per-category", type=int, default=20, help="AlpacaEval subset size per category.")
    p.add_argument("--max-tokens", type=int, default=None, help="New tokens per turn (default 256; 64 with --quick).")
    p.add_argument("--temp", type=float, default=0.0, help="Sampling temperature (0 = greedy).")
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--adaptive", action="store_true", help="Use the drafter's trained depth controller.")
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", type=Path, default=None, help="Output folder (default: bench/out/quick or bench/out/full).")
    args = p.parse_args(argv)
    cfg = BenchConfig(
        sets=[s.strip() for s in args.sets.split(",") if s.strip()],
        per_category=args.per_category if args.per_category is not None else (1 if args.quick else None),
        alpaca_per_category=args.alpaca_per_category,
        max_tokens=args.max_tokens if args.max_tokens is not None else (64 if args.quick else 256),
        quick=args.quick,
        temp=args.temp,
        top_p=args.top_p,
        seed=args.seed,
    )
    if not cfg.sets:
        raise RedrafterError("--sets is empty.", f"Use e.g. --sets {','.join(SETS)}.")
    if cfg.max_tokens < 1 or (cfg.per_category is not None and cfg.per_category < 1) or cfg.alpaca_per_category < 1:
        raise RedrafterError("--max-tokens, --per-category and --alpaca-per-category must be at least 1.")
    out = args.out or BENCH_DIR / "out" / ("quick" if args.quick else "full")
    return args, cfg, out


def run(argv=None) -> Path:
    """Run the benchmark; return the report's path."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from mlx_redrafter.doctor import report
    from mlx_redrafter.prompts import load_prompt_set
    from mlx_redrafter.runtime import load_runtime, resolve_drafter_path, wants_no_drafter
    from mlx_redrafter.tuning.measure import warm_up

    argv = list(sys.argv[1:] if argv is None else argv)
    args, cfg, out = parse_args(argv)
    console = Console(stderr=True)
    chosen = {set_name_of(spec): select(set_name_of(spec), load_prompt_set(spec), cfg) for spec in cfg.sets}
    no_drafter = wants_no_drafter(args.drafter)
    if no_drafter and not args.lookup:
        raise RedrafterError("--drafter none leaves nothing to benchmark.", "Add --lookup (lookup drafts only).")
    drafter_path = args.drafter if no_drafter else resolve_drafter_path(args.model, args.drafter)
    s = load_runtime(
        args.model,
        str(drafter_path),
        beam_width=args.beam_width,
        beam_length=args.beam_length,
        dtype=args.dtype,
        adaptive=args.adaptive,
        lookup=args.lookup,
    )
    s.announce(console)
    eos = sorted(s.tokenizer.eos_token_ids)
    first = chat_ids_of(s, next(iter(chosen.values()))[0])
    warm_up(s.model, first, s.draft)
    total = sum(2 * len(c) for c in chosen.values())
    records = {}
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("bench", total=total)
        for name, convs in chosen.items():
            bar.update(task, description=name)
            records[name] = run_set(s, name, convs, cfg, eos, lambda: bar.advance(task))
    results = {
        "command": "python bench/run.py " + " ".join(shlex.quote(a) for a in argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": {
            **asdict(cfg),
            "model": args.model,
            "drafter": str(drafter_path),
            "beam_width": s.beam_width,
            "beam_length": s.beam_length,
            "shape_source": s.shape_origin,
            "adaptive": args.adaptive,
            "lookup": s.lookup,
        },
        "machine": report(),
        "sets": {name: summarize_set(recs) for name, recs in records.items()},
        "all": summarize([r for recs in records.values() for r in recs]),
    }
    out.mkdir(parents=True, exist_ok=True)
    model_id = Path(str(args.model)).name
    for name, recs in records.items():
        write_jsonl(
            out / "answers" / name / "baseline.jsonl", spec_bench_answers(recs, "baseline", f"{model_id}-vanilla")
        )
        write_jsonl(
            out / "answers" / name / "redrafter.jsonl",
            spec_bench_answers(recs, "redrafter", f"{model_id}-redrafter-W{s.beam_width}-L{s.beam_length}"),
        )
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    path = out / "report.md"
    path.write_text(markdown_report(results))
    console.print(f"wrote {path}, {out / 'results.json'} and {out / 'answers'}/")
    return path


def chat_ids_of(session, conv: dict) -> List[int]:
    from mlx_redrafter.prompts import first_turn_ids

    return first_turn_ids(session.tokenizer, [conv])[0]


def main(argv=None) -> int:
    """Entry point: user errors print one message, no traceback, exit 1."""
    try:
        path = run(argv)
    except RedrafterError as e:
        print(f"Error: {e.problem}", file=sys.stderr)
        if e.fix:
            print(f"Fix: {e.fix}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        return 130
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
