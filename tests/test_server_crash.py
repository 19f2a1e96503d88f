"""Killing ``mlx-redrafter serve`` (SIGKILL) in the middle of streamed
replies, on both APIs, then starting it again on the same port: the clients
see a broken stream (never a reply that looks complete), whether mid-reply
or waiting in the queue, the new server
works, and nothing the server wrote to disk (its cache folder,
``$MLX_REDRAFTER_CACHE``, and its working folder) is left half-written."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from ui_servers import Server

LONG = "Count from 1 to 500, separated by commas."


def _stream_until_killed(url: str, body: dict, started: threading.Event, out: dict) -> None:
    """Read a streamed reply; ``out``: the lines read and the error that ended it."""
    out["lines"], out["error"] = [], None
    try:
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            for text in r.iter_lines():
                if text:
                    out["lines"].append(text)
                if len(out["lines"]) >= 3:
                    started.set()
    except httpx.HTTPError as e:
        out["error"] = e
    finally:
        started.set()


def _half_written(folder: Path) -> list:
    """Files and folders an interrupted atomic write would leave (files.py's
    temporary siblings), and JSON files that do not parse."""
    bad = []
    for p in folder.rglob("*"):
        if p.name.startswith((".partial-", ".tmp")) or (p.is_dir() and p.name.startswith(".")):
            bad.append(p)
        elif p.suffix == ".json":
            try:
                json.loads(p.read_text())
            except (ValueError, UnicodeDecodeError):
                bad.append(p)
    return bad


def _seeded_cache(cache: Path) -> None:
    """``cache`` with the default model already converted (a copy of the
    session cache's conversion): the server starts without the seconds of
    converting the GGUF, which it does before it serves, long before a kill."""
    import shutil

    from mlx_redrafter.llm.load import resolve_model_path

    converted = resolve_model_path("default")  # converted into the session cache, once per worker
    shutil.copytree(converted, cache / "gguf" / converted.name)


def test_sigkill_mid_stream_then_restart(tmp_path):
    cache, work = tmp_path / "cache", tmp_path / "work"
    cache.mkdir()
    work.mkdir()
    _seeded_cache(cache)
    env = {**os.environ, "MLX_REDRAFTER_CACHE": str(cache)}
    args = ["--max-tokens", "400", "--no-ui", "--max-batch", "1"]  # one at a time: the second request waits
    first = Server(args, tmp_path / "serve.log", env=env, cwd=work)
    try:
        streams = {
            "openai": (
                first.url + "/v1/chat/completions",
                {"messages": [{"role": "user", "content": LONG}], "stream": True, "temperature": 0},
            ),
            "ollama": (first.url + "/api/chat", {"model": "default", "messages": [{"role": "user", "content": LONG}]}),
        }
        # The OpenAI stream is mid-reply; the Ollama one waits in the queue behind it.
        results, threads = {name: {} for name in streams}, []
        for name, (url, body) in streams.items():
            started = threading.Event()
            t = threading.Thread(target=_stream_until_killed, args=(url, body, started, results[name]), daemon=True)
            t.start()
            threads.append(t)
            if name == "openai":
                assert started.wait(300), "the stream did not start"
        deadline = time.monotonic() + 60
        while first.health()["queue"]["waiting"] < 1:
            assert time.monotonic() < deadline, "the second request never reached the queue"
            time.sleep(0.1)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
        for t in threads:
            t.join(60)
    finally:
        first.stop()
    assert first.proc.returncode == -signal.SIGKILL
    for name, out in results.items():
        assert out["error"] is not None, f"the {name} stream ended cleanly after a SIGKILL: {out['lines'][-2:]}"
        assert not any("[DONE]" in x or '"done": true' in x for x in out["lines"])
    assert len(results["openai"]["lines"]) >= 3
    assert _half_written(cache) == [] and _half_written(work) == []

    second = Server(args, tmp_path / "serve.log", port=first.port, env=env, cwd=work)
    try:
        r = httpx.post(
            second.url + "/v1/chat/completions",
            timeout=300,
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        r = httpx.post(
            second.url + "/api/generate",
            timeout=300,
            json={"model": "default", "prompt": "Hi", "stream": False, "options": {"num_predict": 4}},
        )
        assert r.status_code == 200 and r.json()["done"]
        assert second.health()["queue"]["waiting"] == 0
    finally:
        second.stop()
    assert _half_written(cache) == [] and _half_written(work) == []


def test_profiles_are_written_atomically(tmp_path, monkeypatch):
    """The one file the run commands write under the cache folder: a failed
    write keeps the previous profile whole."""
    from mlx_redrafter import profiles

    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "model.safetensors").write_bytes(b"weights")  # the profile's key reads its size and time
    path = profiles.save_profile("default", drafter, 2, 3)
    before = path.read_text()

    class Boom(Exception):
        pass

    def crash(self, *a, **kw):  # a write that dies halfway: half the text, then an error
        Path.write_bytes(self, before[: len(before) // 2].encode())
        raise Boom

    monkeypatch.setattr(Path, "write_text", crash)
    with pytest.raises(Boom):
        profiles.save_profile("default", drafter, 4, 4)
    monkeypatch.undo()
    assert path.read_text() == before and _half_written(tmp_path) == []
