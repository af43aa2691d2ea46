"""The MCP tools' arguments: out-of-range values refused in the library's words (the CLI's and
HTTP's too), a missing, mistyped or misspelt one in one line; and `show` paging a long
conversation reads each page, not the whole conversation again."""

from __future__ import annotations

import anyio
import pytest
from click.testing import CliRunner
from mcp import Client
from support import write_jsonl

import kvdb
from kvdb.cli.main import main
from kvdb.mcp import build, make_call
from kvdb.storage.sql import Storage

TURNS = [
    {
        "role": "user" if i % 2 == 0 else "assistant",
        "content": f"Turn {i} of the long talk about the harbour ledger. " * 3,
    }
    for i in range(24)
]


@pytest.fixture
def db(tmp_path, tiny_loaded):
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_loaded) as archive:
        archive.ingest(write_jsonl(tmp_path / "long.jsonl", TURNS), keep="tokens,search")
        archive.ingest(write_jsonl(tmp_path / "short.jsonl", TURNS[:2]), keep="tokens,search")
    return path


def calls(db, tiny_model, *asked):
    async def run():
        with kvdb.open(db, model=tiny_model, read_only=True) as archive:
            async with Client(build(make_call(archive))) as client:
                return [await client.call_tool(name, arguments) for name, arguments in asked]

    return anyio.run(run)


def error(result) -> str:
    assert result.is_error, result.content
    [content] = result.content
    assert "\n" not in content.text
    return content.text.removeprefix(f"Error executing tool {content.text.split()[3].rstrip(':')}: ")


def test_out_of_range_arguments_are_refused_as_the_cli_refuses_them(db, tiny_model):
    results = calls(
        db,
        tiny_model,
        ("search", {"query": "harbour", "k": -1}),
        ("search", {"query": "harbour", "k": 0, "semantic": True}),
        ("sessions", {"limit": -1}),
        ("sessions", {"offset": -3}),
        ("show", {"session": "long", "max_tokens": -5}),
        ("show", {"session": "long", "start": -3}),
    )
    assert [error(r) for r in results] == [
        "k must be an integer of at least 1, got -1",
        "k must be an integer of at least 1, got 0",
        "limit must be an integer of at least 1, got -1",
        "offset must be an integer of at least 0, got -3",
        "max_tokens must be an integer of at least 1, got -5",
        "start must be an integer of at least 0, got -3",
    ]
    refused = CliRunner().invoke(
        main, ["--db", str(db), "search", "harbour", "-k", "0"], env={"KVDB_MODEL": tiny_model}
    )
    assert refused.exit_code == 2 and refused.stderr == "kvdb: error: k must be an integer of at least 1, got 0\n"


def test_a_missing_mistyped_or_misspelt_argument_is_one_line(db, tiny_model):
    missing, mistyped, misspelt = calls(
        db, tiny_model, ("search", {}), ("search", {"query": "harbour", "k": "ten"}), ("sessions", {"limt": 5})
    )
    assert error(missing) == "query is required"
    assert error(mistyped).startswith("k: input should be a valid integer") and error(mistyped).endswith("got 'ten'")
    assert error(misspelt) == "unknown argument 'limt'; sessions takes limit, offset, agent, project, since, until"


def test_show_pages_read_their_page_alone(db, tiny_model, monkeypatch):
    with kvdb.open(db, model=tiny_model, read_only=True) as archive:
        handle = archive.session("long")
        whole = archive.turns(handle.session_id)
    assert handle.n_tokens > 3000
    read: list[int] = []
    real = Storage.path_tokens

    def counted(self, path, start=0, end=None):
        tokens = real(self, path, start, end)
        read.append(len(tokens))
        return tokens

    monkeypatch.setattr(Storage, "path_tokens", counted)
    starts = range(0, handle.n_tokens, 100)
    pages = calls(db, tiny_model, *(("show", {"session": "long", "start": s, "max_tokens": 100}) for s in starts))
    assert max(read) < handle.n_tokens / 4  # each page reads near its own 100 tokens, never the whole talk
    for start, page in zip(starts, pages, strict=True):
        end = min(start + 100, handle.n_tokens)
        clipped = [
            (t.role, max(t.start, start), min(t.end, end)) for t in whole if max(t.start, start) < min(t.end, end)
        ]
        assert [(t["role"], t["start"], t["end"]) for t in page.structured_content["turns"]] == clipped
