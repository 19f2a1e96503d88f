"""Benchmark: ``mlx-redrafter serve`` under 1 and 4 concurrent clients,
against the same server with ``--no-draft``, in one run.

    python bench/server.py                      # 8 requests per (clients, server), 64 tokens
    python bench/server.py --requests 4 --max-tokens 32 --clients 1,4

Starts both servers (same model, 127.0.0.1, free ports), then, for each
number of clients, measures the two servers one after the other (which goes
first alternates, so that machine drift hits both alike). Clients are the
official ``openai`` client, streaming, at temperature 0, each sending
MT-Bench first turns. Reports requests per minute (completed requests over
the wall time of the round) and time to first token (from sending the
request to its first text, queueing included), and checks that both servers
gave the same text for every prompt. Writes ``--out`` (JSON) and prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

BENCH_DIR = Path(__file__).resolve().parent
MODES = ("redrafter", "no-draft")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: List[str], log: Path, env: Optional[Dict[str, str]] = None):
    """``(process, base_url)`` of a server that answers /health (``env``: more environment)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "mlx_redrafter.cli", "serve", "--port", str(port), *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server {' '.join(extra)} exited:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.5)


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def compare(flags: Dict[str, List[str]], counts: List[int], measure, warm, logs: Path, envs=None):
    """Start a server for each entry of ``flags`` (``envs[mode]``: more
    environment; ``warm(url)`` once each),
    then yield ``(clients, {mode: measure(url, clients)})`` for each number
    of clients, the servers measured one after the other in an order that
    alternates, so that machine drift hits all alike. The servers are
    always stopped."""
    servers: Dict[str, tuple] = {}
    try:
        for mode, extra in flags.items():
            servers[mode] = start_server(extra, logs / f"{mode}.log", (envs or {}).get(mode))
            warm(servers[mode][1])
        for i, clients in enumerate(counts):
            order = list(flags) if i % 2 == 0 else list(flags)[::-1]
            yield clients, {mode: measure(servers[mode][1], clients) for mode in order}
    finally:
        for proc, _ in servers.values():
            stop_server(proc)


def one_request(client, prompt: str, max_tokens: int) -> dict:
    """Stream one chat completion; its text, TTFT and total time."""
    tic = time.perf_counter()
    ttft, text, stats = None, "", {}
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            if ttft is None:
                ttft = time.perf_counter() - tic
            text += delta
        stats = (chunk.model_extra or {}).get("redrafter") or stats
    return {
        "prompt": prompt,
        "text": text,
        "ttft": ttft,
        "seconds": time.perf_counter() - tic,
        "tokens_per_step": stats.get("tokens_per_step"),
    }


def run_round(url: str, prompts: List[str], clients: int, max_tokens: int) -> dict:
    """``len(prompts)`` requests from ``clients`` concurrent clients."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    tic = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: one_request(client, p, max_tokens), prompts))
    wall = time.perf_counter() - tic
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    return {
        "requests": len(results),
        "wall_s": wall,
        "requests_per_minute": 60 * len(results) / wall,
        "ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "ttft_max_s": ttfts[-1] if ttfts else None,
        "tokens_per_step": statistics.mean(r["tokens_per_step"] or 1.0 for r in results),
        "texts": [r["text"] for r in results],
    }


def mt_bench_prompts(n: int) -> List[str]:
    from mlx_redrafter.prompts import load_prompt_set

    convs = load_prompt_set("mt_bench")
    return [c["turns"][0] for c in convs[:n]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8, help="Requests per (clients, server) round.")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--clients", default="1,4", help="Concurrent clients, e.g. 1,4.")
    ap.add_argument("--server-args", default="", help="Extra flags for both servers, e.g. '--model M'.")
    ap.add_argument("--draft-args", default="", help="Extra flags for the drafting server, e.g. '-W 2 -L 1'.")
    ap.add_argument("--out", type=Path, default=BENCH_DIR / "out" / "server" / "results.json")
    args = ap.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    prompts = mt_bench_prompts(args.requests)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    common = shlex.split(args.server_args) + ["--queue-size", str(max(counts) + 1)]
    flags = {"redrafter": common + shlex.split(args.draft_args), "no-draft": common + ["--no-draft"]}
    rounds = []
    for clients, res in compare(
        flags,
        counts,
        lambda url, c: run_round(url, prompts, c, args.max_tokens),
        lambda url: run_round(url, prompts[:1], 1, 8),
        args.out.parent,
    ):
        rounds.append({"clients": clients, **res, "identical": res["redrafter"]["texts"] == res["no-draft"]["texts"]})
        print(
            f"{clients} clients: "
            + ", ".join(
                f"{m} {res[m]['requests_per_minute']:.2f} req/min, TTFT {res[m]['ttft_median_s']:.2f} s" for m in MODES
            ),
            file=sys.stderr,
            flush=True,
        )
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    args.out.write_text(
        json.dumps({"command": command, "max_tokens": args.max_tokens, "rounds": rounds}, indent=2) + "\n"
    )
    print(f"`{command}`\n")
    print(
        "| clients | server | requests/min | ratio | TTFT median (s) | ratio | TTFT max (s) | tokens/step | same text |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rounds:
        base = r["no-draft"]
        for mode in MODES:
            m = r[mode]
            print(
                f"| {r['clients']} | {mode} | {m['requests_per_minute']:.2f} | "
                f"{m['requests_per_minute'] / base['requests_per_minute']:.2f}x | {m['ttft_median_s']:.2f} | "
                f"{m['ttft_median_s'] / base['ttft_median_s']:.2f}x | {m['ttft_max_s']:.2f} | "
                f"{m['tokens_per_step']:.2f} | {'yes' if r['identical'] else 'NO'} |"
            )


if __name__ == "__main__":
    main()
