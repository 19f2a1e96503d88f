"""Load and disconnects on ``mlx-redrafter serve`` (loopback only, bounded),
and its throughput under concurrent clients before and after batching.

    python bench/server_load.py                        # 8 clients, 200 requests, 16 tokens each
    python bench/server_load.py --requests 40 --clients 4
    python bench/server_load.py --throughput           # 1, 2, 4, 8 clients, --max-batch 1 against batching
    python bench/server_load.py --throughput --client-counts 1,2 --rounds 1 --max-tokens 8   # a smoke run
    python bench/server_load.py --throughput --modes plain,today,trees   # issue 57: batched drafting

``--throughput`` starts a server for each of ``--modes`` (default
``before,after``): "before" (``--max-batch 1``: one request at a time, each
drafted, as serve was before batching), "after" (``--max-batch`` as given,
default 8: concurrent requests decoded together where that pays, with the
server's defaults), "plain" (``--no-draft``: batched plain decoding, nothing
drafts), "today" (``--no-batch-drafts``: a request alone drafts, a batch
decodes plainly, as serve was before issue 57, and its default again since
section 34's quiet run), "trees" (``--batch-drafts``: every row of a
batch drafts, issue 57, where the batch's governor finds it pays) and
"trees-always" (the same with ``MLX_REDRAFTER_ALWAYS_DRAFT=1``: every
step drafts, whatever it costs). For each number
of clients, each server in turn (the order alternating), every client sends
``--rounds`` greedy chat requests one after another (MT-Bench first turns,
``--max-tokens`` each). It reports aggregate tokens/s (completion tokens
over the round's wall time), each mode's ratio to the first, the p50/p95
latency of a request (sent to answered, queueing included) and, from
``/metrics``, the tokens a drafting batch's step emitted and the draft
tokens it accepted over those it verified; it checks that every server gave
the same text for every request, and prints a Markdown table for
bench/RESULTS.md (JSON to ``--out``).

Without ``--throughput``:

Starts one server (default model and shipped drafter, 127.0.0.1, a free
port) and, while it loads, ``mlx-redrafter generate --temp 0`` on each
prompt: the greedy references. After a warm-up, ``--clients`` threads send
``--requests`` mixed requests: the OpenAI chat route, Ollama's
``/api/chat`` and ``/api/generate``, Anthropic's ``/v1/messages`` and
OpenAI's ``/v1/responses``, streamed and not, greedy or sampled (seeded
where the API has a seed), some with tools (Ollama's with a history that makes the default
model call one), and some (``--disconnect``) that hang up at a random point
(a streamed one after a random number of lines, a whole one after a random
wait). It checks that every request that stayed connected got a complete,
well-formed answer, that every greedy answer equals the command line's, that
the queue drains to 0, and that the server's RSS does not keep growing: the
requests go in two halves, and the RSS after the second is within 10% of
the RSS after the first (a leak grows with every request; the batch's and
the prompt cache's buffers reach their working size in the first half, which
a short warm-up does not show). Prints JSON; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server import compare, mt_bench_prompts, start_server, stop_server  # noqa: E402  (bench/server.py: servers on free ports)

PROMPTS = [
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "Give me three tips for learning to cook.",
    "Explain what a prime number is.",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


# The same tool in Anthropic's and the Responses API's shapes.
ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}
APIS = ["openai", "ollama_chat", "ollama_generate", "anthropic", "responses"]
# Anthropic's stop_reason and the Responses API's status in OpenAI's finish_reason words.
STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}


def _call(city: str) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": city}}}],
    }


TOOL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    _call("Paris"),
    {"role": "user", "content": "Weather in Rome?"},
    _call("Rome"),
    {"role": "user", "content": "Weather in London?"},
]


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux /proc)."""
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def references(max_tokens: int) -> Dict[str, subprocess.Popen]:
    cmd = [sys.executable, "-m", "mlx_redrafter.cli", "generate", "--temp", "0", "-n", str(max_tokens), "-p"]
    return {p: subprocess.Popen(cmd + [p], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in PROMPTS}


# --------------------------------------------------------------------------- one request


def plan(rng: random.Random, max_tokens: int, disconnect: float) -> dict:
    """A random request: route, streamed or not, greedy or not, tools, hang-up."""
    api = rng.choice(APIS)
    tools = api != "ollama_generate" and rng.random() < 0.15
    greedy = tools or rng.random() < 0.7
    return {
        "api": api,
        "stream": rng.random() < 0.5,
        "tools": tools,
        "greedy": greedy,
        "prompt": rng.choice(PROMPTS),
        "seed": rng.randrange(1000),
        "max_tokens": 40 if tools else max_tokens,
        "hang_up": rng.random() < disconnect,
        "after_lines": rng.randrange(1, 8),
        "after_s": rng.uniform(0.05, 1.5),
    }


def body(p: dict) -> tuple:
    """``(path, json)`` of a planned request."""
    sampling = {"temperature": 0} if p["greedy"] else {"temperature": 0.8, "seed": p["seed"]}
    messages = TOOL_HISTORY if p["tools"] and p["api"] == "ollama_chat" else [{"role": "user", "content": p["prompt"]}]
    if p["api"] in ("anthropic", "responses"):
        return _agent_body(p, messages, {"temperature": sampling["temperature"]})  # these APIs have no seed
    if p["api"] == "openai":
        b = {"messages": messages, "max_tokens": p["max_tokens"], "stream": p["stream"], **sampling}
        return "/v1/chat/completions", {**b, **({"tools": [WEATHER]} if p["tools"] else {})}
    options = {"num_predict": p["max_tokens"], **sampling}
    if p["api"] == "ollama_generate":
        return "/api/generate", {"model": "default", "prompt": p["prompt"], "stream": p["stream"], "options": options}
    b = {"model": "default", "messages": messages, "stream": p["stream"], "options": options}
    return "/api/chat", {**b, **({"tools": [WEATHER]} if p["tools"] else {})}


def _agent_body(p: dict, messages: List[dict], sampling: dict) -> tuple:
    if p["api"] == "anthropic":
        b = {"model": "default", "messages": messages, "max_tokens": p["max_tokens"], "stream": p["stream"], **sampling}
        return "/v1/messages", {**b, **({"tools": [ANTHROPIC_WEATHER]} if p["tools"] else {})}
    b = {"model": "default", "input": messages, "max_output_tokens": p["max_tokens"], "stream": p["stream"], **sampling}
    return "/v1/responses", {**b, **({"tools": [FLAT_WEATHER]} if p["tools"] else {})}


def send(url: str, p: dict) -> dict:
    """Run one planned request; what came back, parsed."""
    path, b = body(p)
    timeout = httpx.Timeout(600, read=p["after_s"]) if p["hang_up"] and not p["stream"] else 600
    lines: List[str] = []
    try:
        with httpx.stream("POST", url + path, json=b, timeout=timeout) as r:
            for text in r.iter_lines():
                if text:
                    lines.append(text)
                if p["hang_up"] and p["stream"] and len(lines) >= p["after_lines"]:
                    return {"hung_up": True}  # leaving the block closes the connection mid-reply
            status = r.status_code
    except httpx.ReadTimeout:
        if p["hang_up"]:
            return {"hung_up": True}
        raise
    return {"hung_up": False, "status": status, "lines": lines}


# --------------------------------------------------------------------------- checks


def answer(p: dict, got: dict) -> dict:
    """``{"text", "calls", "finish"}`` of a complete answer; raises ValueError when malformed."""
    if got["status"] != 200:
        raise ValueError(f"status {got['status']}: {got['lines'][:1]}")
    sse = p["api"] in ("openai", "anthropic", "responses")
    if sse and not p["stream"]:
        objs = [json.loads("\n".join(got["lines"]))]
    else:  # server-sent events (their data lines) or NDJSON: one object a line
        objs = [
            json.loads(x[len("data: ") :]) if sse else json.loads(x)
            for x in got["lines"]
            if x != "data: [DONE]" and not x.startswith("event: ")
        ]
    if p["api"] == "openai":
        return _openai(p, objs, got["lines"])
    if p["api"] == "anthropic":
        return _anthropic(p, objs)
    if p["api"] == "responses":
        return _responses(p, objs)
    if not objs[-1].get("done") or any(o.get("done") for o in objs[:-1]) or any("error" in o for o in objs):
        raise ValueError(f"not one final object: {objs[-1]}")
    key = "response" if p["api"] == "ollama_generate" else "message"
    pick = (lambda o: o[key]) if key == "response" else (lambda o: o[key]["content"])
    calls = [c["function"]["name"] for o in objs if key == "message" for c in o[key].get("tool_calls") or []]
    return {
        "text": "".join(pick(o) for o in objs),
        "calls": calls,
        "finish": objs[-1]["done_reason"],
        "tokens": objs[-1]["eval_count"],
    }


def _openai(p: dict, objs: List[dict], lines: List[str]) -> dict:
    if not p["stream"]:
        (o,) = objs
        choice = o["choices"][0]
        calls = [c["function"]["name"] for c in choice["message"].get("tool_calls") or []]
        return {
            "text": choice["message"]["content"] or "",
            "calls": calls,
            "finish": choice["finish_reason"],
            "tokens": o["usage"]["completion_tokens"],
        }
    if lines[-1] != "data: [DONE]" or any("error" in o for o in objs):
        raise ValueError(f"the stream did not end with [DONE]: {lines[-2:]}")
    deltas = [o["choices"][0] for o in objs if o.get("choices")]
    calls = [c["function"]["name"] for d in deltas for c in d["delta"].get("tool_calls") or []]
    text = "".join(d["delta"].get("content") or "" for d in deltas)
    return {"text": text, "calls": calls, "finish": deltas[-1]["finish_reason"], "tokens": None}


def _anthropic(p: dict, objs: List[dict]) -> dict:
    if not p["stream"]:
        (o,) = objs
        text = "".join(b["text"] for b in o["content"] if b["type"] == "text")
        calls = [b["name"] for b in o["content"] if b["type"] == "tool_use"]
        return {
            "text": text,
            "calls": calls,
            "finish": STOP_REASONS[o["stop_reason"]],
            "tokens": o["usage"]["output_tokens"],
        }
    kinds = [o["type"] for o in objs]
    if kinds[0] != "message_start" or kinds[-1] != "message_stop" or "error" in kinds:
        raise ValueError(f"not message_start ... message_stop: {kinds[:2]} ... {kinds[-2:]}")
    text = "".join(o["delta"]["text"] for o in objs if o["type"] == "content_block_delta" and "text" in o["delta"])
    calls = [
        o["content_block"]["name"]
        for o in objs
        if o["type"] == "content_block_start" and o["content_block"]["type"] == "tool_use"
    ]
    end = objs[-2]
    return {
        "text": text,
        "calls": calls,
        "finish": STOP_REASONS[end["delta"]["stop_reason"]],
        "tokens": end["usage"]["output_tokens"],
    }


def _responses(p: dict, objs: List[dict]) -> dict:
    if p["stream"]:
        if [o["sequence_number"] for o in objs] != list(range(len(objs))):
            raise ValueError("sequence_number is not 0, 1, 2, ...")
        if objs[-1]["type"] not in ("response.completed", "response.incomplete"):
            raise ValueError(f"the stream ended with {objs[-1]['type']}")
        streamed = "".join(o["delta"] for o in objs if o["type"] == "response.output_text.delta")
        objs = [objs[-1]["response"]]
    (o,) = objs
    text = "".join(c["text"] for i in o["output"] if i["type"] == "message" for c in i["content"])
    if p["stream"] and streamed != text:
        raise ValueError("the streamed deltas are not the final response's text")
    calls = [i["name"] for i in o["output"] if i["type"] == "function_call"]
    finish = "length" if o["status"] == "incomplete" else "tool_calls" if calls else "stop"
    return {"text": text, "calls": calls, "finish": finish, "tokens": o["usage"]["output_tokens"]}


def check(p: dict, got: dict, refs: Dict[str, str]) -> Optional[str]:
    """None when the answer is complete and well-formed (and greedy-exact), else why not."""
    try:
        a = answer(p, got)
    except (ValueError, KeyError, IndexError, TypeError, json.JSONDecodeError) as e:
        return f"malformed: {type(e).__name__}: {e}"
    if a["finish"] not in ("stop", "length", "tool_calls"):
        return f"finish {a['finish']!r}"
    if "<tool_call>" in a["text"]:
        return "a tool-call marker in the content"
    if p["tools"] and p["api"] == "ollama_chat" and a["calls"] != ["get_weather"]:
        return f"expected a get_weather call, got {a['calls']} / {a['text']!r}"
    if p["greedy"] and not p["tools"] and a["text"] != refs[p["prompt"]]:
        return f"greedy reply {a['text']!r} != generate's {refs[p['prompt']]!r}"
    return None


# --------------------------------------------------------------------------- the run


def wait_idle(url: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        q = httpx.get(url + "/health", timeout=10).json()["queue"]
        if (q["waiting"] == 0 and not q["running"]) or time.monotonic() > deadline:
            return q
        time.sleep(0.2)


def run(args) -> dict:
    refs_procs = references(args.max_tokens)
    proc, url = start_server(["--max-tokens", str(args.max_tokens), "--queue-size", "64", "--no-ui"], Path(args.log))
    try:
        refs = {}
        for prompt, ref in refs_procs.items():
            out, err = ref.communicate(timeout=600)
            assert ref.returncode == 0, err
            refs[prompt] = out[:-1]
        rng = random.Random(args.seed)
        warm = [plan(rng, args.max_tokens, 0.0) for _ in range(args.warmup)]
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(lambda p: send(url, p), warm))
        wait_idle(url)
        rss = [rss_bytes(proc.pid)]
        plans = [plan(rng, args.max_tokens, args.disconnect) for _ in range(args.requests)]
        half = len(plans) // 2
        results, wall = [], 0.0
        for part in (plans[:half], plans[half:]):
            tic = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                results += list(pool.map(lambda p: send(url, p), part))
            wall += time.perf_counter() - tic
            queue = wait_idle(url)
            rss.append(rss_bytes(proc.pid))
        memory = httpx.get(url + "/health", timeout=10).json().get("memory")
    finally:
        stop_server(proc)
    return summary(plans, results, refs, queue, rss, memory, wall, args)


def summary(plans, results, refs, queue, rss, memory, wall, args) -> dict:
    connected = [(p, g) for p, g in zip(plans, results) if not g["hung_up"]]
    failures = [
        f"{p['api']} stream={p['stream']} tools={p['tools']}: {why}" for p, g in connected if (why := check(p, g, refs))
    ]
    kinds: Dict[str, int] = {}
    for p in plans:
        k = f"{p['api']}{' stream' if p['stream'] else ''}{' tools' if p['tools'] else ''}"
        kinds[k] = kinds.get(k, 0) + 1
    out = {
        "requests": len(plans),
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "hung_up": len(plans) - len(connected),
        "connected": len(connected),
        "greedy_checked": sum(p["greedy"] and not p["tools"] for p, _ in connected),
        "with_tools": sum(p["tools"] for p in plans),
        "failures": failures,
        "wall_s": round(wall, 1),
        "requests_per_min": round(60 * len(plans) / wall, 1),
        "queue_after": queue,
        "rss_mb": {
            "after_warmup": round(rss[0] / 2**20, 1),
            "after_first_half": round(rss[1] / 2**20, 1),
            "after_run": round(rss[2] / 2**20, 1),
        },
        "rss_change_second_half": round(rss[2] / rss[1] - 1, 4),
        "mlx_memory_after": memory,
        "kinds": kinds,
    }
    out["ok"] = (
        not failures and queue["waiting"] == 0 and not queue["running"] and abs(out["rss_change_second_half"]) <= 0.10
    )
    return out


# --------------------------------------------------------------------------- throughput, before and after batching


def _timed_chat(url: str, prompt: str, max_tokens: int) -> dict:
    tic = time.perf_counter()
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=3600,
        json={"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0},
    )
    r.raise_for_status()
    o = r.json()
    return {
        "text": o["choices"][0]["message"]["content"],
        "tokens": o["usage"]["completion_tokens"],
        "seconds": time.perf_counter() - tic,
    }


def load_round(url: str, prompts: List[str], clients: int, rounds: int, max_tokens: int) -> dict:
    """``clients`` concurrent clients, each sending ``rounds`` requests in turn."""

    def client(i: int) -> List[dict]:
        return [_timed_chat(url, prompts[(i + k * clients) % len(prompts)], max_tokens) for k in range(rounds)]

    before = batch_counts(url)
    tic = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        per_client = list(pool.map(client, range(clients)))
    wall = time.perf_counter() - tic
    after = batch_counts(url)
    results = [r for rs in per_client for r in rs]
    latencies = sorted(r["seconds"] for r in results)
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    batch = {k: after[k] - before[k] for k in after}
    return {
        "tokens": sum(r["tokens"] for r in results),
        "wall_s": wall,
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "p50_s": pick(0.5),
        "p95_s": pick(0.95),
        "batch_steps": batch["steps"],
        "batch_tokens_per_step": batch["tokens"] / batch["steps"] if batch["steps"] else None,
        "batch_acceptance": batch["accepted"] / batch["verified"] if batch["verified"] else None,
        "texts": [r["text"] for r in results],
    }


def batch_counts(url: str) -> Dict[str, float]:
    """The drafting batch's counters on ``/metrics`` (0 where the server has none)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {"steps": 0.0, "tokens": 0.0, "accepted": 0.0, "verified": 0.0}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == "redrafter_batch_tokens_per_step_count":
            out["steps"] = float(value)
        elif name == "redrafter_batch_tokens_per_step_sum":
            out["tokens"] = float(value)
        elif name.startswith("redrafter_batch_draft_tokens_accepted_total{"):
            out["accepted"] += float(value)
        elif name.startswith("redrafter_batch_draft_tokens_verified_total{"):
            out["verified"] += float(value)
    return out


# The servers --throughput compares, by name (each also gets --queue-size, --max-tokens and --no-ui).
MODES = {
    "before": lambda args: ["--max-batch", "1"],  # one request at a time, each drafted
    "after": lambda args: ["--max-batch", str(args.max_batch)],  # the defaults
    "plain": lambda args: ["--max-batch", str(args.max_batch), "--no-draft"],  # batched plain decoding
    "today": lambda args: ["--max-batch", str(args.max_batch), "--no-batch-drafts"],  # before issue 57
    "trees": lambda args: ["--max-batch", str(args.max_batch), "--batch-drafts"],  # every row drafts (issue 57)
    # ... every step, whatever it costs (no live choice: as before the batch's governor)
    "trees-always": lambda args: ["--max-batch", str(args.max_batch), "--batch-drafts"],
}
ENVS = {"trees-always": {"MLX_REDRAFTER_ALWAYS_DRAFT": "1"}}  # more environment of a mode's server


def throughput(args) -> dict:
    counts = [int(c) for c in args.client_counts.split(",")]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or len(modes) < 2:
        raise SystemExit(f"--modes: give two or more of {', '.join(MODES)} (got {args.modes!r})")
    prompts = mt_bench_prompts(max(counts) * args.rounds)
    queue = ["--queue-size", str(max(counts) + 1), "--max-tokens", str(args.max_tokens), "--no-ui"]
    flags = {m: queue + MODES[m](args) for m in modes}
    rounds = []
    for clients, res in compare(
        flags,
        counts,
        lambda url, c: load_round(url, prompts, c, args.rounds, args.max_tokens),
        lambda url: load_round(url, prompts[:1], 1, 1, 8),
        args.out.parent,
        {m: ENVS[m] for m in modes if m in ENVS},
    ):
        texts = [res[m]["texts"] for m in modes]
        rounds.append({"clients": clients, **res, "identical": all(t == texts[0] for t in texts)})
        print(
            f"{clients} clients: " + ", ".join(f"{m} {res[m]['tokens_per_s']:.1f} tok/s" for m in modes),
            file=sys.stderr,
            flush=True,
        )
    return {
        "command": "python " + " ".join(sys.argv),
        "modes": modes,
        "max_tokens": args.max_tokens,
        "rounds_per_client": args.rounds,
        "max_batch": args.max_batch,
        "rounds": rounds,
    }


def throughput_table(out: dict) -> str:
    modes = out.get("modes", ["before", "after"])
    first = modes[0]
    head = ["clients"] + [f"{m}: tokens/s" for m in modes] + [f"{m} / {first}" for m in modes[1:]]
    head += [f"{m}: p50 / p95 latency (s)" for m in modes]
    head += ["drafting batch: tokens/step, accepted/verified", "same text"]
    rows = [f"`{out['command']}`", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in out["rounds"]:
        cells = [str(r["clients"])] + [f"{r[m]['tokens_per_s']:.1f}" for m in modes]
        cells += [f"{r[m]['tokens_per_s'] / r[first]['tokens_per_s']:.2f}x" for m in modes[1:]]
        cells += [f"{r[m]['p50_s']:.1f} / {r[m]['p95_s']:.1f}" for m in modes]
        drafting = [m for m in modes if r[m].get("batch_tokens_per_step")]
        cells.append(
            "; ".join(f"{m} {r[m]['batch_tokens_per_step']:.2f}, {r[m]['batch_acceptance'] or 0:.2f}" for m in drafting)
            or "-"
        )
        cells.append("yes" if r["identical"] else "NO")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=None, help="Tokens per reply (default 16; --throughput: 64).")
    ap.add_argument("--disconnect", type=float, default=0.15, help="Share of requests that hang up.")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default="/tmp/mlx-redrafter-server-load.log")
    ap.add_argument(
        "--throughput", action="store_true", help="Aggregate tokens/s and latency, before and after batching."
    )
    ap.add_argument("--client-counts", default="1,2,4,8", help="--throughput: the numbers of concurrent clients.")
    ap.add_argument("--rounds", type=int, default=4, help="--throughput: requests each client sends in turn.")
    ap.add_argument("--max-batch", type=int, default=8, help="--throughput: the batching servers' --max-batch.")
    ap.add_argument("--modes", default="before,after", help=f"--throughput: the servers compared ({', '.join(MODES)}).")
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "out" / "server_load" / "results.json"
    )
    args = ap.parse_args()
    if args.throughput:
        args.max_tokens = args.max_tokens or 64
        args.out.parent.mkdir(parents=True, exist_ok=True)  # the servers' logs go there too
        out = throughput(args)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        print(throughput_table(out))
        sys.exit(0 if all(r["identical"] for r in out["rounds"]) else 1)
    args.max_tokens = args.max_tokens or 16
    out = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
