"""`kvdb serve --upstream`: a proxy in front of a real upstream process on loopback (a second
`kvdb serve`, with an API key of its own), driven by the official openai client. Replies come back
unchanged, streamed and not, errors included; each exchange is archived as a conversation turn
that records the upstream's model; an upstream that cannot be reached is a 502 of one line; a
failed archive write fails no reply and is tried again from the journal.

llama.cpp's server (``llama-cpp-python[server]``) is not tested: PyPI serves it here as a source
distribution only (no wheel), which compiles llama.cpp at install.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
import openai
import pytest
from click.testing import CliRunner
from openai import OpenAI

import kvdb
from kvdb.archive import Archive
from kvdb.server.upstream import Upstream

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("proxy"),
]  # two server processes, started once a worker (``pair``)

KVDB = Path(sys.executable).with_name("kvdb")
KEY = "upstream-secret"
MODEL = "upstream-model"  # what the requests name: a `kvdb serve` upstream answers with the model asked for


@dataclass
class Pair:
    upstream: str
    proxy: str
    proxy_db: Path

    def client(self, url: str, key: str = KEY) -> OpenAI:
        return OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)

    def direct(self) -> OpenAI:
        return self.client(self.upstream)

    def proxied(self) -> OpenAI:
        return self.client(self.proxy, "the proxy needs no key")

    def archived(self, url: str, **params) -> list[dict]:
        response = httpx2.get(
            f"{url}/api/sessions", params=params, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        )
        assert response.status_code == 200, response.text
        return response.json()["sessions"]

    def wait_archived(self, url: str, text: str) -> dict:
        """The session of ``url``'s archive whose text holds ``text`` (archived after the reply)."""
        deadline = time.monotonic() + 30
        while True:
            response = httpx2.get(
                f"{url}/api/search",
                params={"q": text, "case_sensitive": 1},
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=30,
            )
            assert response.status_code == 200, response.text
            if hits := response.json()["hits"]:
                return hits[0]
            assert time.monotonic() < deadline, f"{text!r} was not archived by {url} within 30 s"
            time.sleep(0.05)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"kvdb serve exited: {proc.stderr.read() if proc.stderr else ''}"
        assert time.monotonic() < deadline, "kvdb serve did not answer within 120 s"
        try:
            httpx2.get(f"{url}/health", timeout=1)
            return
        except httpx2.HTTPError:
            time.sleep(0.1)


@pytest.fixture(scope="session")
def pair(tmp_path_factory, tiny_model):
    """An upstream `kvdb serve` (API key KEY) and a `kvdb serve --upstream` in front of it, both
    over the tiny model, started at once; stopped with SIGTERM (killed past 30 s) after the run.
    Once a worker: a module's fixture started them again whenever the worker ran another
    module's tests between two of these."""
    folder = tmp_path_factory.mktemp("proxy")
    env = {k: v for k, v in os.environ.items() if k not in ("KVDB_DB", "KVDB_MODEL", "KVDB_API_KEY")} | {
        "KVDB_EMBEDDER": tiny_model,
        "UPSTREAM_KEY": KEY,
    }
    up, front = _port(), _port()
    upstream = f"http://127.0.0.1:{up}"
    serve = [str(KVDB), "--db"]
    procs = [
        subprocess.Popen(
            [*serve, str(folder / "up.duckdb"), "serve", "--model", tiny_model, "--port", str(up), "--api-key", KEY],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        ),
        subprocess.Popen(
            [
                *serve,
                str(folder / "proxy.duckdb"),
                "serve",
                "--model",
                tiny_model,
                "--port",
                str(front),
                "--upstream",
                f"{upstream}/v1",
                "--upstream-key-env",
                "UPSTREAM_KEY",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        ),
    ]
    try:
        _wait(procs[0], upstream)
        _wait(procs[1], f"http://127.0.0.1:{front}")
        yield Pair(upstream, f"http://127.0.0.1:{front}", folder / "proxy.duckdb")
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stderr:
                proc.stderr.close()


def _shape(value):
    """A JSON value's keys, all the way down (lists by their first item): what the fields are, not their values."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


def test_chat_and_text_completions_come_back_unchanged_and_are_archived(pair):
    question = [{"role": "user", "content": "Where do the ferries of Lisbon go?"}]
    asked = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    direct = (
        pair.direct()
        .chat.completions.create(messages=[{"role": "user", "content": "A direct question."}], **asked)
        .to_dict()
    )
    proxied = pair.proxied().chat.completions.create(messages=question, **asked).to_dict()
    assert _shape(proxied) == _shape(direct) and proxied["model"] == MODEL and proxied["id"].startswith("chatcmpl-")
    reply = proxied["choices"][0]["message"]["content"]

    # the text is exact on both sides: the upstream archived the reply it sent, the proxy the reply it relayed
    mine, theirs = (
        pair.wait_archived(pair.proxy, "ferries of Lisbon"),
        pair.wait_archived(pair.upstream, "ferries of Lisbon"),
    )
    for url, hit in ((pair.proxy, mine), (pair.upstream, theirs)):
        shown = httpx2.get(
            f"{url}/api/sessions/{hit['session_id']}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        ).json()
        assert [t["text"] for t in shown["turns"] if t["role"] == "assistant"][-1].startswith(
            reply
        ) and reply  # the template may close the turn after it
    [session] = [s for s in pair.archived(pair.proxy, versions=1) if s["session_id"] == mine["session_id"]]
    assert session["upstream"] == {"model": MODEL, "same_model": False} and session["source"] == "<messages>"

    # the next turn, sent whole, joins the conversation: a second version of it
    turn_two = [
        *question,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And the trams of Porto?"},
    ]
    pair.proxied().chat.completions.create(messages=turn_two, **asked)
    pair.wait_archived(pair.proxy, "trams of Porto")
    [conversation] = [c for c in pair.archived(pair.proxy) if c["conversation_id"] == mine["conversation_id"]]
    assert (
        conversation["versions"] == 2
        and conversation["upstream"] == {"model": MODEL, "same_model": False}
        and conversation["agent"] == "messages"
    )

    text = pair.proxied().completions.create(prompt="Once upon a midnight dreary,", **asked).to_dict()
    assert _shape(text) == _shape(pair.direct().completions.create(prompt="Some text", **asked).to_dict())
    pair.wait_archived(pair.proxy, "midnight dreary," + text["choices"][0]["text"])


def test_streams_come_back_chunk_for_chunk(pair):
    asked = {
        "model": MODEL,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    direct = [
        c.to_dict()
        for c in pair.direct().chat.completions.create(
            messages=[{"role": "user", "content": "Direct stream."}], **asked
        )
    ]
    proxied = [
        c.to_dict()
        for c in pair.proxied().chat.completions.create(
            messages=[{"role": "user", "content": "Which bridge is oldest?"}], **asked
        )
    ]
    # the same fields: the role's chunk, text chunks (as many as the text's pieces), the finish's and the usage's
    middle = {json.dumps(_shape(c), sort_keys=True) for c in proxied[1:-2]} | {
        json.dumps(_shape(c), sort_keys=True) for c in direct[1:-2]
    }
    assert [_shape(c) for c in proxied[:1] + proxied[-2:]] == [_shape(c) for c in direct[:1] + direct[-2:]] and len(
        middle
    ) <= 1
    assert len({c["id"] for c in proxied}) == 1 and proxied[-1]["usage"]["completion_tokens"] == 5
    reply = "".join(c["choices"][0]["delta"].get("content") or "" for c in proxied if c["choices"])
    pair.wait_archived(pair.proxy, "Which bridge is oldest?" if not reply else reply)

    with httpx2.stream(
        "POST",
        f"{pair.proxy}/v1/completions",
        json={"prompt": "Raw bytes,", "max_tokens": 3, "temperature": 0, "stream": True, "model": MODEL},
        timeout=60,
    ) as raw:
        assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
        body = b"".join(raw.iter_bytes())
    events = [line for line in body.split(b"\n\n") if line]
    assert events[-1] == b"data: [DONE]" and all(e.startswith(b"data: ") for e in events)
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1] if json.loads(e[6:])["choices"])
    pair.wait_archived(pair.proxy, "Raw bytes," + text)


def test_errors_and_models_are_the_upstreams(pair):
    errors = []
    for request in (
        {"messages": [{"role": "user", "content": "hi"}], "n": 2},  # refused by the upstream: 400
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 10**6,
            "stream": True,
        },  # over its context, streamed: 400 before any chunk
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
    ):
        direct = httpx2.post(
            f"{pair.upstream}/v1/chat/completions", json=request, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        )
        proxied = httpx2.post(f"{pair.proxy}/v1/chat/completions", json=request, timeout=30)
        assert (proxied.status_code, proxied.json()) == (
            direct.status_code,
            direct.json(),
        ) and direct.status_code == 400
        errors.append(direct.json()["error"])
    with pytest.raises(openai.BadRequestError) as refused:
        pair.proxied().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    assert refused.value.body == errors[0] and "n must be 1" in errors[0]["message"]
    not_json = httpx2.post(f"{pair.proxy}/v1/completions", content=b"{not json", timeout=30)
    assert (
        not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    )  # the upstream's own message

    assert pair.proxied().models.list().to_dict() == pair.direct().models.list().to_dict()
    missing = httpx2.get(f"{pair.proxy}/v1/models/no-such-model", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert (
        httpx2.post(
            f"{pair.proxy}/v1/chat/completions", json={"messages": [], "kvdb": {"session": "x"}}, timeout=30
        ).status_code
        == 400
    )


def test_an_upstream_not_reachable_is_a_502_of_one_line(serve, tmp_path):
    running = serve(upstream=Upstream(f"http://127.0.0.1:{_port()}/v1"))
    with pytest.raises(openai.APIStatusError) as failed:
        running.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert failed.value.status_code == 502
    error = failed.value.body
    assert isinstance(error, dict) and error["code"] == "upstream_unreachable" and "\n" not in error["message"]
    assert error["message"].startswith("cannot reach the upstream http://127.0.0.1:")


def test_a_failed_archive_write_fails_no_reply_and_is_tried_again(pair, serve, tmp_path, monkeypatch, caplog):
    """In this process, so that the archive can be made to fail once; the client's own key goes
    to the upstream (this proxy has no key of either)."""
    failures = []
    ingest = Archive.ingest

    def failing_once(self, *args, **kwargs):
        if not failures:
            failures.append(kwargs.get("name"))
            raise OSError(28, "No space left on device")
        return ingest(self, *args, **kwargs)

    monkeypatch.setattr(Archive, "ingest", failing_once)
    running = serve(upstream=Upstream(f"{pair.upstream}/v1", pass_authorization=True))
    with caplog.at_level(logging.ERROR, logger="kvdb.serve"):
        reply = running.openai(api_key=KEY).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Is the disk full?"}], max_tokens=4
        )
        assert reply.choices[0].finish_reason in ("length", "stop")
        [archived] = running.wait_archived(1)  # tried again after a second
    assert failures == ["Is the disk full?"] and archived["upstream"] == {"model": MODEL, "same_model": False}
    assert any("failed; it stays in the journal, tried again in 1 s" in r.getMessage() for r in caplog.records)
    with pytest.raises(openai.AuthenticationError):  # the client's key is the upstream's to judge
        running.openai(api_key="wrong").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )

    # an upstream that names this archive's model (a `kvdb serve` upstream echoes the model asked for)
    # is archived as its own replies are
    [local] = [
        m["id"] for m in running.openai(api_key=KEY).models.list().to_dict()["data"] if m["id"] != "all-MiniLM-L6-v2"
    ]
    running.openai(api_key=KEY).chat.completions.create(
        model=local, messages=[{"role": "user", "content": "The same model?"}], max_tokens=4
    )
    running.wait_archived(2)
    running.stop()

    with kvdb.open(running.db, read_only=True) as archive:
        upstreams = {c.title: c.latest.upstream for c in archive.conversations()}
    assert upstreams == {
        "Is the disk full?": {"model": MODEL, "same_model": False},
        "The same model?": {"model": local, "same_model": True},
    }


def test_sessions_says_which_upstream_and_that_no_kv_was_kept(tmp_path, tiny_model):
    from kvdb.cli.main import main

    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as archive:
        archive.ingest(
            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            upstream={"model": "gpt-x", "same_model": False},
        )
    listed = CliRunner().invoke(main, ["--db", str(tmp_path / "a.duckdb"), "sessions"])
    assert listed.exit_code == 0 and "[via gpt-x: local tokenizer's tokens, no KV]" in listed.output


def test_the_options_are_refused_in_one_line(tmp_path, monkeypatch):
    from kvdb.cli.main import main

    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    db = str(tmp_path / "a.duckdb")
    unset = CliRunner().invoke(
        main, ["--db", db, "serve", "--upstream", "http://127.0.0.1:9/v1", "--upstream-key-env", "NO_SUCH_KEY"]
    )
    assert unset.exit_code == 2 and "NO_SUCH_KEY is not set" in unset.output
    bad = CliRunner().invoke(main, ["--db", db, "serve", "--upstream", "ftp://example.org"])
    assert bad.exit_code == 2 and "--upstream must be an http:// or https:// URL" in bad.output
    assert not (tmp_path / "a.duckdb").exists()  # refused before the archive or the model is opened
