"""A screenshot of the chat page mid-reply (the README's picture).

Starts ``mlx-redrafter serve`` on a free port (or uses ``--url``), opens the
page in headless Chromium (Debian's ``chromium``, driven by Playwright), has
one short exchange, sends a second message and saves the page while that
reply streams:

    python bench/screenshot_ui.py            # -> bench/results/ui.png
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

OUT = Path(__file__).parent / "results" / "ui.png"
FIRST = "Write a short poem about the sea."
SECOND = "Now explain in a few sentences, with a Python code example, how to reverse a list."


@contextmanager
def server(url: str | None):
    """The base URL of a server; one started here is always stopped."""
    if url:
        yield url
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mlx_redrafter.cli", "serve", "--port", str(port), "--max-tokens", "200"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start (exit code {proc.poll()})")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def shoot(base: str, out: Path, width: int, height: int) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height}, device_scale_factor=1)
            page.goto(base + "/")
            page.click("#settings summary")
            page.fill("#max-tokens", "60")
            page.click("#settings summary")
            page.fill("#input", FIRST)
            page.press("#input", "Enter")
            page.wait_for_selector('.msg.assistant[data-state="done"]', timeout=300_000)
            page.click("#settings summary")
            page.fill("#max-tokens", "200")
            page.click("#settings summary")
            page.fill("#input", SECOND)
            page.press("#input", "Enter")
            # Mid-reply: a few lines streamed, the reply not finished.
            page.wait_for_function(
                "() => { const m = document.querySelectorAll('.msg.assistant');"
                " const last = m[m.length - 1]; return m.length === 2 &&"
                " last.dataset.state === 'streaming' && last.innerText.length > 250; }",
                timeout=300_000,
            )
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out))
            page.click("#stop")
        finally:
            browser.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--width", type=int, default=900)
    ap.add_argument("--height", type=int, default=760)
    args = ap.parse_args()
    with server(args.url) as base:
        shoot(base, args.out, args.width, args.height)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
