"""Oversized requests against ``mlx-redrafter serve`` (issue 47): how long a
40 MB chat request takes to be refused, how long ``/health`` takes to answer
meanwhile, and the server's resident memory before, during and after.

    python bench/oversized.py                              # the default body bound: a 413, the body unread
    python bench/oversized.py --max-body-bytes 64MB        # read and parsed: refused before tokenizing
    python bench/oversized.py --mb 0.6 --max-body-bytes 64MB   # under the early bound: tokenized, then refused
    python bench/oversized.py --mb 10 --rounds 3 --out bench/results/oversized.json
    python bench/oversized.py --rounds 1 --long-words 2000   # then a long prompt that fits: what MLX keeps

Starts one server (the default model, ``--no-draft``: no drafter to load;
127.0.0.1, a free port, stopped at the end) with the flags given, sends one
small chat request (so the RSS before includes a served request's buffers),
then, ``--rounds`` times, one chat request whose message is ``--mb``
megabytes of words, while a thread asks ``/health`` every 50 ms and reads the
server's RSS (``ps``). It reports each round's status, error code and time
to answer, ``/health``'s latencies during it (the slowest, the median), and
the RSS before, the highest seen during, right after and 2 s after; then
that a small chat request still gets its answer. ``--long-words N``: then
one request whose prompt is N words (it fits the context), with the RSS and
MLX's memory (``/health``: arrays alive, its buffer cache) before and after.
Prints JSON (and writes it to ``--out``). Linux and macOS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server import start_server, stop_server  # noqa: E402  (bench/server.py: servers on free ports)

SMALL = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}


def rss_mb(pid: int) -> float:
    """The resident memory of process ``pid``, in MB (``ps``: Linux and macOS)."""
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True, check=True)
    return round(int(out.stdout.split()[0]) / 1024, 1)


def big_body(mb: float) -> bytes:
    """A chat request whose one message is ``mb`` megabytes of words."""
    words = "word " * int(mb * 1e6 / 5)
    return json.dumps({"messages": [{"role": "user", "content": words}], "max_tokens": 8}).encode()


class Watch(threading.Thread):
    """Asks ``/health`` every 50 ms and reads the server's RSS until stopped."""

    def __init__(self, url: str, pid: int):
        super().__init__(daemon=True)
        self.url, self.pid, self.stop = url, pid, threading.Event()
        self.latencies: List[float] = []
        self.peak_mb = 0.0

    def run(self) -> None:
        with httpx.Client(timeout=600) as http:
            while not self.stop.is_set():
                t = time.perf_counter()
                http.get(self.url + "/health").raise_for_status()
                self.latencies.append(time.perf_counter() - t)
                self.peak_mb = max(self.peak_mb, rss_mb(self.pid))
                self.stop.wait(0.05)


def one_round(url: str, pid: int, body: bytes) -> dict:
    before = rss_mb(pid)
    watch = Watch(url, pid)
    watch.start()
    time.sleep(0.2)  # a few /health answers before the request, so the slowest is measured from the start
    t = time.perf_counter()
    r = httpx.post(
        url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=900
    )
    seconds = time.perf_counter() - t
    after = rss_mb(pid)
    watch.stop.set()
    watch.join()
    time.sleep(2)
    error = r.json().get("error", {}) if r.status_code != 200 else {}
    return {
        "status": r.status_code,
        "code": error.get("code"),
        "seconds_to_answer": round(seconds, 2),
        "health_answers": len(watch.latencies),
        "health_slowest_ms": round(max(watch.latencies) * 1000, 1),
        "health_median_ms": round(statistics.median(watch.latencies) * 1000, 1),
        "rss_mb": {"before": before, "peak": max(watch.peak_mb, after), "after": after, "after_2s": rss_mb(pid)},
    }


def long_prompt(url: str, pid: int, words: int) -> dict:
    """One request whose prompt is ``words`` words: the RSS and MLX's memory before and after."""
    before = {"rss_mb": rss_mb(pid), **httpx.get(url + "/health", timeout=30).json()["memory"]}
    body = {"messages": [{"role": "user", "content": "word " * words}], "max_tokens": 8}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=1800)
    time.sleep(2)
    after = {"rss_mb": rss_mb(pid), **httpx.get(url + "/health", timeout=30).json()["memory"]}
    return {"status": r.status_code, "usage": r.json().get("usage"), "before": before, "after": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=40.0, help="megabytes of words in the oversized message")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-body-bytes", default=None, help="passed to serve (default: its own)")
    ap.add_argument("--long-words", type=int, default=0, help="then a prompt of this many words that fits")
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    flags = ["--model", args.model, "--no-draft", "--no-ui", "--max-tokens", "8"]
    flags += ["--max-body-bytes", args.max_body_bytes] if args.max_body_bytes else []
    log = Path("/tmp") / f"oversized-{int(time.time())}.log"
    proc, url = start_server(flags, log)
    try:
        httpx.post(url + "/v1/chat/completions", json=SMALL, timeout=300).raise_for_status()
        body = big_body(args.mb)
        rounds = [one_round(url, proc.pid, body) for _ in range(args.rounds)]
        small = httpx.post(url + "/v1/chat/completions", json=SMALL, timeout=300)
        memory = httpx.get(url + "/health", timeout=30).json()["memory"]
        long = long_prompt(url, proc.pid, args.long_words) if args.long_words else None
    finally:
        stop_server(proc)
    out = {
        "flags": flags,
        "body_bytes": len(body),
        "rounds": rounds,
        "small_request_after": small.status_code,
        "mlx_memory": memory,
        "long_prompt": long,
    }
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
