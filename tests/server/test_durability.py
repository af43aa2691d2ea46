"""A reply sent is never lost: the exchange is in the journal before the reply's last bytes,
and a server killed with SIGKILL right after a reply archives it on its next start, from where
the next turn resumes exactly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest

from kvdb.services.journal import Journal

pytestmark = pytest.mark.slow  # a server killed with -9

KVDB = Path(sys.executable).with_name("kvdb")
HELLO = [{"role": "user", "content": "Where do the ships go?"}]


def _start(db: Path, model: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [KVDB, "--db", db, "serve", "--model", model, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"kvdb serve exited: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "kvdb serve did not answer within 120 s"
        try:
            httpx2.get(f"{url}/health", timeout=1)
            return proc, url
        except httpx2.HTTPError:
            time.sleep(0.1)


def _wait_empty(journal: Journal) -> None:
    deadline = time.monotonic() + 30
    while journal.pending():
        assert time.monotonic() < deadline, f"the journal still holds {journal.pending()}"
        time.sleep(0.05)


def test_kill_9_right_after_a_reply_loses_nothing(serve, tmp_path, tiny_model):
    db = tmp_path / "serve.duckdb"
    proc, url = _start(db, tiny_model)
    response = httpx2.post(
        f"{url}/v1/chat/completions",
        json={"model": "kvdb", "messages": HELLO, "max_tokens": 6, "temperature": 0},
        timeout=60,
    )
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert response.status_code == 200, response.text
    journal = Journal(db.with_name(db.name + ".serve"))
    left = len(journal.pending())  # 1 when the kill came before the archiver's commit, else 0: nothing in between

    running = serve(db=db)  # the restart (in this process: it has the model loaded already)
    [archived] = running.wait_archived(1)
    turn_two = [
        *HELLO,
        {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And back?"},
    ]
    told = running.chat(turn_two).to_dict()[
        "kvdb"
    ]  # a chat sent whole, past its first turn: it joins the conversation it extends
    assert told == {
        "restored": "exact",
        "cached_tokens": archived["n_tokens"],
        "approximate": False,
        "fidelity": None,
        "conversation_id": None,
    }, f"journal entries at the kill: {left}"
    _wait_empty(journal)


def test_entries_left_in_the_journal_are_archived_on_start(serve, tmp_path):
    db = tmp_path / "serve.duckdb"
    exchange = [*HELLO, {"role": "assistant", "content": "To the harbour."}]
    journal = Journal(db.with_name(db.name + ".serve"))
    journal.write({"kind": "messages", "content": exchange, "name": "left over"})
    journal.write({"kind": "text", "content": "a text exchange, left over", "name": "text left over"})
    running = serve(db=db)
    assert {s["name"] for s in running.wait_archived(2)} == {"left over", "text left over"}
    _wait_empty(journal)
    [archived] = [s for s in running.get("/api/sessions")["sessions"] if s["name"] == "left over"]
    next_turn = running.chat([*exchange, {"role": "user", "content": "And then?"}])
    assert next_turn.to_dict()["kvdb"]["cached_tokens"] == archived["n_tokens"]
