"""`kvdb mcp` driven by the official `mcp` client over stdio, as an agent drives it: the tools
listed with their schemas, each called, results the same `to_dict()` records as `--json`, errors
as tool errors with the library's message, `continue` offered only with --allow-continue."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from support import write_jsonl

import kvdb

KVDB = str(Path(sys.executable).with_name("kvdb"))
TALK = [
    {"role": "user", "content": "Where does the keeper keep the harbour ledger?"},
    {"role": "assistant", "content": "In the lamp room, beside the harbour lights."},
]
MORE = [
    {"role": "user", "content": "Who reads the harbour ledger?"},
    {"role": "assistant", "content": "The harbour master, each morning."},
]


@pytest.fixture
def db(tmp_path, tiny_loaded) -> Path:
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_loaded) as archive:
        archive.ingest(write_jsonl(tmp_path / "repo" / "talk.jsonl", TALK), keep="tokens,search")
        archive.ingest(write_jsonl(tmp_path / "repo" / "talk.jsonl", TALK + MORE), keep="tokens,search")
        archive.ingest(
            text="".join(f"The harbour ledger was lost at sea, page {i}.\n" for i in range(150)),
            name="long",
            keep="tokens,search",
        )  # past the tiny model's context: two parts
    return path


def session_calls(db: Path, tiny_model: str, calls, *flags: str):
    """Run ``calls(session)`` against `kvdb --db DB mcp FLAGS` over stdio; its result."""

    async def main():
        server = StdioServerParameters(
            command=KVDB,
            args=["--db", str(db), "mcp", *flags],
            env={"KVDB_MODEL": tiny_model, "PATH": str(Path(KVDB).parent)},
        )
        async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            return await calls(session)

    return anyio.run(main)


def structured(result) -> dict:
    assert not result.is_error, result.content
    return json.loads(result.content[0].text)


def test_tools_are_listed_with_schemas_and_continue_only_when_allowed(db, tiny_model):
    async def listed(session):
        return (await session.list_tools()).tools

    tools = {t.name: t for t in session_calls(db, tiny_model, listed)}
    assert sorted(tools) == ["search", "sessions", "show"]
    assert (
        tools["search"].input_schema["required"] == ["query"]
        and "project" in tools["search"].input_schema["properties"]
    )
    assert all(len(t.description) > 80 for t in tools.values())
    allowed = {t.name for t in session_calls(db, tiny_model, listed, "--allow-continue")}
    assert allowed == {"search", "sessions", "show", "continue"}


def test_each_tool_answers_with_the_records_of_the_json_output(db, tiny_model, tmp_path):
    async def calls(session):
        return [
            await session.call_tool("sessions", {}),
            await session.call_tool("search", {"query": "harbour ledger"}),
            await session.call_tool("search", {"query": "harbour ledger", "project": str(tmp_path / "repo")}),
            await session.call_tool("show", {"session": "long", "max_tokens": 100}),
            await session.call_tool("show", {"session": "talk@v1"}),
            await session.call_tool("show", {"session": "no such thing"}),
            await session.call_tool("search", {"query": "harbour", "since": "yesterday"}),
            await session.call_tool("continue", {"session": "talk", "prompt": "And at night?", "max_new_tokens": 4}),
        ]

    listed, found, scoped, long, first, missing, bad_day, continued = session_calls(
        db, tiny_model, calls, "--allow-continue"
    )
    with kvdb.open(db, model=tiny_model, read_only=True) as archive:
        assert structured(listed) == {"conversations": [c.to_dict() for c in archive.conversations()], "total": 2}
        assert structured(found)["hits"] == [h.to_dict() for h in archive.search("harbour ledger")]
        assert [h["title"] for h in structured(scoped)["hits"]] == ["talk"]
        page = structured(long)
        assert page["end"] == 100 and page["next_start"] == 100 and "start=100" in page["note"]
        assert page["turns"] == [t.to_dict() for t in archive.turns("long", 0, 100)]
        last = archive.session("long").part
        assert (
            page["earlier_part"] == last["follows"]
            and archive.session(last["follows"]).part["number"] == last["number"] - 1 >= 1
        )
        v1 = structured(first)
        assert v1["session"]["session_id"] == archive.session("talk@v1").session_id and "next_start" not in v1
        assert [t["text"] for t in v1["turns"] if t["role"] in ("user", "assistant")] == [m["content"] for m in TALK]
    assert missing.is_error and "no session matches 'no such thing'" in missing.content[0].text
    assert bad_day.is_error and "YYYY-MM-DD" in bad_day.content[0].text
    answer = structured(continued)
    assert answer["model"] == tiny_model and answer["restored"]["mode"] == "exact" and isinstance(answer["text"], str)


def test_a_writer_works_between_the_calls_of_a_running_server(db, tiny_model, tiny_loaded):
    """The server holds the archive file only during a call: `kvdb watch` or `kvdb ingest` write
    in between, and the next call sees what they wrote."""

    async def calls(session):
        before = await session.call_tool("search", {"query": "lighthouse keeper"})
        with kvdb.open(db, model=tiny_loaded) as writer:  # would wait, then fail, were the file held
            writer.ingest(text="The lighthouse keeper wrote it down.", name="later", keep="tokens,search")
        return before, await session.call_tool("search", {"query": "lighthouse keeper"})

    before, after = session_calls(db, tiny_model, calls)
    assert structured(before)["hits"] == [] and [h["title"] for h in structured(after)["hits"]] == ["later"]


def test_ctrl_c_stops_the_server_at_once_with_its_stdin_still_open(db, tiny_model):
    """An agent stops its servers with SIGINT (Claude Code sends SIGTERM 100 ms later)."""
    server = subprocess.Popen(
        [KVDB, "--db", str(db), "mcp"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"KVDB_MODEL": tiny_model, "PATH": str(Path(KVDB).parent)},
    )
    assert server.stdin is not None and server.stdout is not None
    hello = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}},
    }
    server.stdin.write((json.dumps(hello) + "\n").encode())
    server.stdin.flush()
    assert json.loads(server.stdout.readline())["result"]["serverInfo"]["name"]  # serving
    server.send_signal(signal.SIGINT)
    try:
        assert server.wait(timeout=5) == 130
    finally:
        server.kill()
