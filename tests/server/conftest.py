"""What the server's tests share: the tiny model loaded once, and `kvdb serve`'s app run in this
process by uvicorn on a free port (a subprocess only where a test must kill it)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest
import uvicorn
from openai import OpenAI

import kvdb
from kvdb.server import create_app
from kvdb.serving import Engine


@dataclass
class Running:
    url: str
    db: Path
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        """As on SIGTERM: uvicorn drains, the engine closes (the archiver finishes its entry)."""
        if not self.thread.is_alive():
            return
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not stop"

    def openai(self, api_key: str = "no key needed") -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def chat(self, messages: list[dict], **options):
        """A greedy chat completion of 8 tokens with the official client (``options`` override)."""
        return self.openai().chat.completions.create(
            model="kvdb", messages=messages, **({"max_tokens": 8, "temperature": 0} | options)
        )

    def http(self, **headers) -> httpx2.Client:
        return httpx2.Client(base_url=self.url, headers=headers, timeout=60)

    def get(self, path: str, **params) -> dict:
        with self.http() as client:
            response = client.get(path, params=params)
        assert response.status_code == 200, response.text
        return response.json()

    def wait_archived(self, sessions: int) -> list[dict]:
        """The archive's sessions (every version of each conversation) once it holds ``sessions`` of
        them (the archiver works after the reply)."""
        deadline = time.monotonic() + 30
        while len(listed := self.get("/api/sessions", versions=1)["sessions"]) < sessions:
            assert time.monotonic() < deadline, f"{len(listed)} sessions archived after 30 s, expected {sessions}"
            time.sleep(0.05)
        return listed


def _start(
    db: Path, loaded, api_key: str | None = None, max_body_bytes: int = 2**16, upstream=None, **engine_options
) -> Running:
    """``upstream``: a ``kvdb.server.upstream.Upstream`` to forward completions to."""
    app = create_app(
        Engine(kvdb.open(db, model=loaded), **engine_options),
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        upstream=upstream,
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return Running(f"http://127.0.0.1:{sock.getsockname()[1]}", db, server, thread)


@pytest.fixture(scope="session")
def start_server(tiny_loaded):
    """``start_server(db, **options)``: a server over an archive, which the caller stops."""
    return lambda db, **options: _start(db, tiny_loaded, **options)


@pytest.fixture
def serve(tmp_path, start_server):
    """Start a server over an archive (default ``tmp_path/serve.duckdb``); all are stopped after the test."""
    servers = []

    def start(db: Path | None = None, **options) -> Running:
        servers.append(start_server(db or tmp_path / "serve.duckdb", **options))
        return servers[-1]

    yield start
    for running in servers:
        running.stop()
