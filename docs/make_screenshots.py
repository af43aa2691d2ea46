"""The screenshots of `kvdb serve`'s page: docs/page-1440.png and docs/page-390.png. Run by hand:

    .venv/bin/python docs/make_screenshots.py

It ingests a few of examples/transcripts/ (a chat, a coding agent's log with tool calls, an export
of two conversations) into a temporary archive with the embedded default model (SmolLM2; `make
install` installs it), starts `kvdb serve` over it with an API key, and drives the page in Debian's
Chromium (/usr/bin/chromium, as tests/server/test_page.py does): at 1,440 px a search by meaning, a
conversation opened and continued (the reply streamed, with how its start was restored under it);
at 390 px the coding agent's conversation, its tool calls folded. Replies are kept to 48 tokens, so
the whole run takes about a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import expect, sync_playwright

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
KVDB = Path(sys.executable).with_name("kvdb")
TRANSCRIPTS = ["chat.jsonl", "claude-code.jsonl", "sessions.jsonl"]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEY = "screenshot-key"
MAX_TOKENS = 48
REPLY_MS = 180_000  # the first reply restores its conversation first


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"kvdb serve exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as res:
                if res.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"kvdb serve did not answer {url}/health in {seconds:.0f} s")


def short_replies(route) -> None:
    """Replies of MAX_TOKENS tokens, greedy: the screenshots are the same from run to run."""
    body = route.request.post_data_json | {"max_tokens": MAX_TOKENS, "temperature": 0}
    route.continue_(post_data=json.dumps(body))


def keyed_page(browser, width: int, height: int, url: str):
    context = browser.new_context(viewport={"width": width, "height": height}, device_scale_factor=1)
    page = context.new_page()
    page.route("**/v1/chat/completions", short_replies)
    page.goto(url)
    page.fill("#api-key", KEY)
    page.click("#key-form button")
    return context, page


def show_list(page) -> None:
    if page.locator("#list-toggle").is_visible() and page.get_attribute("#list-toggle", "aria-expanded") != "true":
        page.click("#list-toggle")
    page.get_by_test_id("conversation").first.wait_for()


def shoot(url: str) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context, page = keyed_page(browser, 1440, 900, url)
            show_list(page)
            page.check("#search-meaning")
            page.fill("#search-q", "why is a planet so bright")
            page.click("#search-form button[type=submit]")
            page.get_by_test_id("hit").first.wait_for()
            page.get_by_test_id("conversation").filter(has_text="chat").first.click()
            page.get_by_test_id("turn").first.wait_for()
            page.fill("#prompt", "Thanks! And how do I avoid it next time?")
            page.keyboard.press("Enter")
            expect(page.get_by_test_id("restored")).to_have_count(1, timeout=REPLY_MS)
            page.wait_for_timeout(300)
            page.screenshot(path=str(DOCS / "page-1440.png"))
            context.close()

            context, page = keyed_page(browser, 390, 844, url)
            show_list(page)
            page.get_by_test_id("conversation").filter(has_text="test").first.click()
            page.get_by_test_id("turn").first.wait_for()
            page.locator("#chat").evaluate("node => node.scrollIntoView()")
            page.screenshot(path=str(DOCS / "page-390.png"))
            context.close()
        finally:
            browser.close()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvdb-screenshots-") as tmp:
        folder = Path(tmp) / "transcripts"
        folder.mkdir()
        for name in TRANSCRIPTS:
            shutil.copy(REPO / "examples" / "transcripts" / name, folder / name)
        db = Path(tmp) / "page.duckdb"
        env = {k: v for k, v in os.environ.items() if k not in ("KVDB_MODEL", "KVDB_EMBEDDER", "KVDB_API_KEY")}
        subprocess.run([str(KVDB), "--db", str(db), "ingest", str(folder)], check=True, env=env)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([str(KVDB), "--db", str(db), "serve", "--port", str(port), "--api-key", KEY], env=env)
        try:
            wait_healthy(url, server)
            shoot(url)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    print(f"wrote {DOCS / 'page-1440.png'} and {DOCS / 'page-390.png'}")


if __name__ == "__main__":
    main()
