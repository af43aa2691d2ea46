"""Gemini CLI: JSONL sessions (rewrites, rewinds, $set), legacy JSON sessions, checkpoints,
logs.json, notices as side events, bad lines, and detection against look-alikes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdb.errors import EmptyTranscript, TranscriptError
from kvdb.transcripts import iter_transcripts, read_transcripts
from kvdb.transcripts.formats import log_format, session_format

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "exports" / "gemini-cli"
HEADER = {
    "sessionId": "s-1",
    "projectHash": "9da8",
    "startTime": "2026-04-23T12:52:52Z",
    "lastUpdated": "2026-04-23T12:52:52Z",
    "kind": "main",
}


def user(record_id: str, text: str) -> dict:
    return {"id": record_id, "timestamp": "t", "type": "user", "content": [{"text": text}]}


def gemini(record_id: str, text: str, **extra) -> dict:
    return {"id": record_id, "timestamp": "t", "type": "gemini", "content": text, "model": "gemini-3", **extra}


def write(tmp_path: Path, *records, name: str = "session.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(
        "".join(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) + "\n" for r in records),
        encoding="utf-8",
    )
    return path


def read(path: Path):
    skipped: list[dict] = []
    return list(iter_transcripts(path, skipped=skipped)), skipped


def test_a_session_with_thoughts_tool_calls_and_their_results(tmp_path):
    call = {
        "id": "call-1",
        "name": "run_shell_command",
        "args": {"command": "ls -F"},
        "result": [
            {"functionResponse": {"id": "call-1", "name": "run_shell_command", "response": {"output": "README.md"}}}
        ],
        "status": "success",
        "description": "List the project's files",
        "resultDisplay": "README.md",
    }
    path = write(
        tmp_path,
        HEADER,
        user("u1", "Say hello and list files."),
        gemini(
            "g1",
            "",
            thoughts=[{"subject": "Listing", "description": "I will run ls.", "timestamp": "t"}],
            toolCalls=[call],
        ),
        {"$set": {"lastUpdated": "t2", "summary": "Listing the files"}},
        gemini("g2", "Hello! One file."),
    )
    [session], skipped = read(path)
    assert (
        skipped == []
        and session.name == "s-1"
        and session.metadata
        == {
            "format": "gemini-cli",
            "id": "s-1",
            "kind": "main",
            "title": "Listing the files",  # its summary: the session id names it, not in a list
            "side": {
                "events": [{"type": "toolCall description", "text": "List the project's files"}],
                "title": ["Listing the files"],
            },
            # the header's startTime (kvdb.transcripts.stamps); "t" and "t2" are no times
            "started": "2026-04-23T12:52:52",
            "ended": "2026-04-23T12:52:52",
        }
    )
    assert [m["role"] for m in session.messages] == ["user", "assistant", "tool", "assistant"]
    reply = session.messages[1]
    assert reply["thinking"] == "Listing\nI will run ls." and reply["tool_calls"] == [
        {"id": "call-1", "name": "run_shell_command", "arguments": '{"command": "ls -F"}'}
    ]
    assert session.messages[2] == {
        "role": "tool",
        "content": "README.md",
        "tool_call_id": "call-1",
        "name": "run_shell_command",
    }


def test_a_rewritten_record_counts_once_where_it_first_stood_with_its_last_content(tmp_path):
    path = write(tmp_path, HEADER, user("u1", "Hi"), gemini("g1", ""), gemini("g1", "Hello there."), user("u2", "Bye"))
    [session], _ = read(path)
    assert [m["content"] for m in session.messages] == ["Hi", "Hello there.", "Bye"]


def test_a_rewind_keeps_the_tail_it_dropped_as_a_branch(tmp_path):
    path = write(
        tmp_path,
        HEADER,
        user("u1", "Write a poem"),
        gemini("g1", "Roses are red."),
        user("u2", "Make it longer"),
        gemini("g2", "Roses are red, violets are blue."),
        {"$rewindTo": "u2"},
        user("u3", "Make it shorter"),
        gemini("g3", "Roses."),
    )
    main, branch = read(path)[0]
    assert [m["content"] for m in main.messages] == ["Write a poem", "Roses are red.", "Make it shorter", "Roses."]
    assert branch.name == "s-1 [branch 2]" and branch.metadata["branch"] == 2
    assert [m["content"] for m in branch.messages] == [
        "Write a poem",
        "Roses are red.",
        "Make it longer",
        "Roses are red, violets are blue.",
    ]


def test_a_message_list_a_set_replaces_is_kept_as_a_branch(tmp_path):
    path = write(
        tmp_path,
        HEADER,
        user("u1", "Long output please"),
        gemini("g1", "A very long answer"),
        {"$set": {"messages": [user("u1", "Long output please"), gemini("g1", "[masked]")]}},
    )
    main, branch = read(path)[0]
    assert main.messages[-1]["content"] == "[masked]" and branch.messages[-1]["content"] == "A very long answer"


def test_notices_and_what_the_ui_displayed_instead_are_side_events(tmp_path):
    path = write(
        tmp_path,
        HEADER,
        {"id": "i1", "timestamp": "t", "type": "info", "content": "Empty GEMINI.md created."},
        dict(user("u1", "Analyse this project ..."), displayContent=[{"text": "/init"}]),
        gemini("g1", "Done."),
        {"id": "w1", "timestamp": "t", "type": "warning", "content": "Request cancelled."},
    )
    [session], _ = read(path)
    assert [m["content"] for m in session.messages] == ["Analyse this project ...", "Done."]
    assert session.metadata["side"]["events"] == [
        {"type": "info", "text": "Empty GEMINI.md created."},
        {"type": "displayContent", "text": "/init"},
        {"type": "warning", "text": "Request cancelled."},
    ]


def test_a_session_of_a_header_alone_is_empty_not_an_error(tmp_path):
    with pytest.raises(EmptyTranscript):
        read_transcripts(write(tmp_path, HEADER, {"$set": {"lastUpdated": "t"}}))


def test_a_bad_line_is_skipped_and_named(tmp_path):
    path = write(
        tmp_path,
        HEADER,
        user("u1", "Hi"),
        "{oops\n",
        {"$rewindTo": "nowhere"},
        {"id": "g1", "type": "gemini", "content": 7},
        gemini("g2", "Hello."),
    )
    [session], skipped = read(path)
    assert [s["line"] for s in skipped] == [3, 4, 5]
    assert "nowhere" in skipped[1]["reason"] and "content" in skipped[2]["reason"]
    assert [m["content"] for m in session.messages] == ["Hi", "Hello."]
    with pytest.raises(TranscriptError) as caught:
        read_transcripts(path)
    assert caught.value.line == 3


def test_the_legacy_json_session_is_one_object_with_its_messages():
    [session] = read_transcripts(FIXTURES / "vct-legacy-session-2025-10-11.json")
    assert session.name == "d6f69999-62cc-4d41-8de4-9a85fc1531b8" and session.metadata["format"] == "gemini-cli"
    assert session.messages[0]["role"] == "user" and any(m.get("thinking") for m in session.messages)


def test_a_chat_save_checkpoint_and_its_legacy_bare_list(tmp_path):
    [saved] = read_transcripts(FIXTURES / "synthetic-checkpoint-tag.json")
    assert [m["role"] for m in saved.messages] == ["user", "user", "assistant", "tool", "assistant"]
    assert (
        saved.messages[2]["thinking"].startswith("SYNTHETIC: **Reading the README**")
        and saved.messages[2]["tool_calls"][0]["name"] == "read_file"
    )
    assert (
        saved.messages[3]["name"] == "read_file" and saved.messages[3]["content"] == "SYNTHETIC: # Project\nA README."
    )
    bare = tmp_path / "checkpoint-old.json"
    bare.write_text(
        json.dumps(json.loads((FIXTURES / "synthetic-checkpoint-tag.json").read_text())["history"]), encoding="utf-8"
    )
    [old] = read_transcripts(bare)
    assert old.messages == saved.messages and old.name == "checkpoint-old"


def test_a_restore_checkpoint_reads_its_client_history():
    [session] = read_transcripts(FIXTURES / "synthetic-restore-checkpoint.json")
    assert session.metadata["id"] == "00000000-0000-4000-8000-00000000000a########1"
    assert (
        session.messages[-1]["tool_calls"][0]["name"] == "replace" and "side" not in session.metadata
    )  # the checkpointed call is the last one


def test_logs_json_is_a_session_of_prompts_per_session_id():
    first, second = read_transcripts(FIXTURES / "synthetic-logs.json")
    assert first.name == "00000000-0000-4000-8000-00000000000a" and [m["content"] for m in first.messages] == [
        "SYNTHETIC: read README.md and summarise it",
        "/chat save tag",
    ]
    assert second.name == "00000000-0000-4000-8000-00000000000b" and len(second.messages) == 1


def test_detection_tells_gemini_from_claude_code_and_openai_messages():
    assert log_format(HEADER).name == "gemini-cli"
    assert log_format(user("u1", "hi")).name == "gemini-cli"
    claude = {
        "type": "user",
        "uuid": "u1",
        "parentUuid": None,
        "sessionId": "s-1",
        "message": {"role": "user", "content": "hi"},
    }
    assert log_format(claude).name == "claude-code"
    assert log_format({"type": "summary", "summary": "A title", "leafUuid": "u1"}).name == "claude-code"
    assert log_format({"role": "user", "content": "hi"}).name == "messages"
    assert session_format({"sessionId": "s-1", "projectHash": "x", "messages": []}).name == "gemini-cli"
    assert (
        session_format({"sessionId": "s-1", "messages": [{"id": "m", "type": "user", "content": "hi"}]}).name
        == "gemini-cli"
    )
    assert session_format({"id": "c1", "messages": [{"role": "user", "content": "hi"}]}).name == "messages"
    assert session_format({"sessionId": "s-1", "messages": [{"role": "user", "content": "hi"}]}).name == "messages"
    assert log_format({"role": "model", "parts": [{"text": "hi"}]}).name == "gemini-cli"
    assert log_format({"role": "assistant", "content": "hi", "parts": []}).name == "messages"


def test_every_fixture_reads_without_skipping():
    for path in sorted(p for p in FIXTURES.iterdir() if p.suffix in (".json", ".jsonl")):
        sessions, skipped = read(path)
        assert sessions and skipped == [], path.name
        assert all(s.metadata["format"] == "gemini-cli" for s in sessions)
