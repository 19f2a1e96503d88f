"""What Claude Code and Codex CLI send, recorded: ``python bench/record_agents.py DIR``
(or ``python bench/agents.py --record DIR``, which runs this).

A logging server records every request (method, path, query, headers,
body) and answers in the API's own stream events with a canned reply: a
line of text, or, when the conversation asks to read ``notes.txt`` and has
no tool result yet, one tool call (Claude Code's ``Read``, Codex's
``exec_command``), so that the tool's result comes back in the next
request. In front of it each client runs a first turn, a second
(``--continue`` / ``resume --last``) and a tool round trip. The requests are
written as tests/fixtures/agents holds them, ``CLIENT_turn1.json``,
``CLIENT_turn2.json`` and ``CLIENT_tool_result.json``, with Claude Code's
``device_id`` (a hash naming the machine) zeroed; nothing else is changed.
"""

from __future__ import annotations

import json
import re
import tempfile
import threading
import time
import uuid
from pathlib import Path

from agents import Clients, claude, codex, free_port
from fastapi import FastAPI, Request  # at module level: FastAPI resolves the handler's annotations here
from fastapi.responses import JSONResponse, StreamingResponse

TEXT = "Hello there, how are you?"
ASK_TOOL = "Read notes.txt and tell me what it says."


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def anthropic_events(model: str, path: str = ""):
    """A canned reply in Anthropic's events: TEXT, or a Read call of ``path``."""
    usage = {"input_tokens": 10, "output_tokens": 6, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    message = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": model}
    message.update(content=[], stop_reason=None, stop_sequence=None, usage=usage)
    yield _sse("message_start", {"type": "message_start", "message": message})
    if path:
        block = {"type": "tool_use", "id": "toolu_01abc", "name": "Read", "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps({"file_path": path})}
    else:
        block, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": TEXT}
    yield _sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block})
    yield _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
    yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
    stop = {"stop_reason": "tool_use" if path else "end_turn", "stop_sequence": None}
    yield _sse("message_delta", {"type": "message_delta", "delta": stop, "usage": usage})
    yield _sse("message_stop", {"type": "message_stop"})


def responses_events(model: str, tool: bool = False):
    """A canned reply in the Responses API's events: TEXT, or an exec_command call."""
    seq = iter(range(100))
    base = {"id": "resp_" + uuid.uuid4().hex[:24], "object": "response", "created_at": int(time.time())}
    base.update(model=model, output=[], status="in_progress")

    def ev(kind, **data):
        return _sse(kind, {"type": kind, **data, "sequence_number": next(seq)})

    yield ev("response.created", response=base)
    if tool:
        args = json.dumps({"cmd": "cat notes.txt"})
        item = {"id": "fc_1", "type": "function_call", "call_id": "call_abc", "name": "exec_command", "arguments": ""}
        done = {**item, "arguments": args, "status": "completed"}
        yield ev("response.output_item.added", output_index=0, item={**item, "status": "in_progress"})
        yield ev("response.function_call_arguments.delta", item_id="fc_1", output_index=0, delta=args)
        yield ev("response.function_call_arguments.done", item_id="fc_1", output_index=0, arguments=args)
    else:
        item = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
        done = {**item, "status": "completed", "content": [{"type": "output_text", "text": TEXT, "annotations": []}]}
        yield ev("response.output_item.added", output_index=0, item={**item, "status": "in_progress"})
        yield ev("response.output_text.delta", item_id="msg_1", output_index=0, content_index=0, delta=TEXT)
    yield ev("response.output_item.done", output_index=0, item=done)
    usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 6}
    usage.update(output_tokens_details={"reasoning_tokens": 0}, total_tokens=16)
    yield ev("response.completed", response={**base, "status": "completed", "output": [done], "usage": usage})


def logging_app(log: list, notes: Path):
    """The recording server's app: every request into ``log``, canned replies out."""
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST", "HEAD"])
    async def anything(path: str, request: Request):
        raw = await request.body()
        body = json.loads(raw) if raw else None
        headers = {k: v for k, v in request.headers.items() if k not in ("host", "content-length")}
        log.append({"method": request.method, "path": "/" + path, "query": request.url.query, "headers": headers})
        log[-1]["body"] = body
        model = body.get("model", "") if isinstance(body, dict) else ""
        history = json.dumps((body or {}).get("messages") or (body or {}).get("input") or "")
        tool = ASK_TOOL in history and "tool_result" not in history and "function_call_output" not in history
        if path == "v1/messages":
            events = anthropic_events(model, str(notes) if tool else "")
        elif path == "v1/responses":
            events = responses_events(model, tool)
        else:
            return JSONResponse({"error": {"message": f"/{path} is not recorded"}}, status_code=404)
        return StreamingResponse(events, media_type="text/event-stream")

    return app


def record(clients: Clients, out: Path) -> None:
    """Two turns and a tool round trip of each client against the recording server; their requests into ``out``."""
    import uvicorn

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for d in ("work", "claude", "claude-tool", "codex", "codex-tool"):
            (tmp / d).mkdir()
        notes = tmp / "work" / "notes.txt"
        notes.write_text("remember the milk\n")
        log: list = []
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(logging_app(log, notes), port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        try:
            for name, run in (("claude_code", claude), ("codex", codex)):
                home = "claude" if run is claude else "codex"
                start = len(log)
                for turn, prompt in enumerate(("Say hello in five words.", "And now in three words.")):
                    run(clients, url, "gemma-3-270m", prompt, tmp / "work", tmp / home, resume=turn > 0)
                run(clients, url, "gemma-3-270m", ASK_TOOL, tmp / "work", tmp / f"{home}-tool")
                names = ("turn1", "turn2", None, "tool_result")  # the tool round trip's first request: a turn 1 again
                for request, kind in zip(log[start:], names):
                    if kind is not None:
                        _write(out / f"{name}_{kind}.json", request)
        finally:
            server.should_exit = True


def _write(path: Path, request: dict) -> None:
    text = json.dumps(request, indent=1, ensure_ascii=False)
    text = re.sub(r'(device_id\\+":\\+")([0-9a-f]{64})', lambda m: m[1] + "0" * 64, text)
    path.write_text(text + "\n")


def main(argv=None) -> int:
    import argparse

    from agents import install_clients

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="The folder the requests are written to (tests/fixtures/agents).")
    args = ap.parse_args(argv)
    record(install_clients(), args.out)
    return 0


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
