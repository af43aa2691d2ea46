"""Codex CLI rollouts: both forms, no text twice, compaction windows, side events, bad lines, detection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdb.errors import TranscriptError
from kvdb.transcripts import iter_transcripts, read_transcripts
from kvdb.transcripts.formats import log_format, session_format

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "exports" / "codex-cli"
META = {
    "timestamp": "t",
    "type": "session_meta",
    "payload": {"id": "thread-1", "cwd": "/repo", "base_instructions": {"text": "You are Codex."}},
}


def envelope(kind: str, payload: dict) -> dict:
    return {"timestamp": "2025-09-19T09:02:12Z", "type": kind, "payload": payload}


def item(payload: dict) -> dict:
    return envelope("response_item", payload)


def event(payload: dict) -> dict:
    return envelope("event_msg", payload)


def said(role: str, text: str) -> dict:
    return item(
        {
            "type": "message",
            "role": role,
            "content": [{"type": "input_text" if role == "user" else "output_text", "text": text}],
        }
    )


def write(tmp_path: Path, *records, name: str = "rollout.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def read(path: Path):
    skipped: list[dict] = []
    return list(iter_transcripts(path, skipped=skipped)), skipped


def everything(session) -> str:
    return json.dumps([session.messages, session.metadata.get("side", {})], ensure_ascii=False)


def test_the_envelope_form_is_one_session_named_by_its_thread_with_instructions_as_the_system_turn(tmp_path):
    path = write(
        tmp_path,
        META,
        envelope("turn_context", {"cwd": "/repo", "model": "gpt-5", "approval_policy": "never", "summary": "auto"}),
        said("user", "List the files"),
        item(
            {
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "**Listing**"}],
                "encrypted_content": "opaque",
            }
        ),
        item({"type": "function_call", "name": "shell", "arguments": '{"command":["ls"]}', "call_id": "c1"}),
        item({"type": "function_call_output", "call_id": "c1", "output": "a.txt\nb.txt"}),
        said("assistant", "Two files."),
    )
    [session], skipped = read(path)
    assert skipped == [] and session.name == "thread-1"
    assert (
        session.metadata["format"] == "codex-cli"
        and session.metadata["model"] == "gpt-5"
        and session.metadata["cwd"] == "/repo"
    )
    roles = [m["role"] for m in session.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert session.messages[0]["content"] == "You are Codex."
    assert session.messages[2]["thinking"] == "**Listing**" and session.messages[2]["tool_calls"][0]["name"] == "shell"
    assert session.messages[3] == {"role": "tool", "content": "a.txt\nb.txt", "tool_call_id": "c1", "name": "shell"}


def test_the_older_form_a_header_then_bare_items_and_state_markers(tmp_path):
    [session], skipped = read(FIXTURES / "synthetic-legacy-rollout-2025-05.jsonl")
    assert skipped == [] and session.name == "00000000-0000-4000-8000-000000000001"
    assert session.messages[0]["role"] == "system" and "AGENTS.md" in session.messages[0]["content"]
    calls = [call for m in session.messages for call in m.get("tool_calls", ())]
    assert [c["name"] for c in calls] == ["local_shell", "shell"]
    assert json.loads(calls[0]["arguments"])["command"] == [
        "ls",
        "-la",
    ]  # a local shell call is a call with its command, not a placeholder
    assert session.messages[-1] == {"role": "assistant", "content": "SYNTHETIC: There are two files, a.txt and b.txt."}
    assert session.dropped == {}


def test_event_messages_that_repeat_the_items_are_not_kept_twice_and_the_rest_are_side_events(tmp_path):
    path = write(
        tmp_path,
        META,
        event({"type": "user_message", "message": "List the files", "images": []}),
        said("user", "List the files"),
        event({"type": "agent_message", "message": "Two files."}),  # written before the item it repeats
        event(
            {
                "type": "token_count",
                "info": {"total_token_usage": {"input_tokens": 5}},
                "rate_limits": {"plan_type": "pro"},
            }
        ),
        said("assistant", "Two files."),
        event({"type": "task_complete", "turn_id": "t1", "last_agent_message": "Two files."}),
        event({"type": "error", "message": "stream disconnected before completion"}),
        event({"type": "agent_message", "message": "Shown in the UI only"}),
        event({"type": "thread_name_updated", "thread_id": "thread-1", "thread_name": "Listing files"}),
    )
    [session], _ = read(path)
    text = everything(session)
    for once in ("List the files", "Two files."):
        assert text.count(once) == 1, once
    side = session.metadata["side"]
    assert side["events"] == [
        {"type": "error", "text": "stream disconnected before completion"},
        {"type": "agent_message", "text": "Shown in the UI only"},
    ]
    assert side["title"] == ["Listing files"]


def test_command_output_the_model_was_not_given_is_a_side_event(tmp_path):
    path = write(
        tmp_path,
        META,
        said("user", "Run it"),
        item({"type": "function_call", "name": "shell", "arguments": "{}", "call_id": "c1"}),
        item({"type": "function_call_output", "call_id": "c1", "output": "Exit code: 0\nOutput:\nok\n"}),
        event(
            {"type": "exec_command_end", "call_id": "c1", "aggregated_output": "ok\n", "stdout": "ok\n", "exit_code": 0}
        ),
        item({"type": "function_call", "name": "shell", "arguments": "{}", "call_id": "c2"}),
        item({"type": "function_call_output", "call_id": "c2", "output": "aborted"}),
        event({"type": "exec_command_end", "call_id": "c2", "aggregated_output": "partial output\n", "exit_code": 1}),
    )
    [session], _ = read(path)
    assert session.metadata["side"]["events"] == [{"type": "exec_command_end", "text": "partial output\n"}]


def test_a_compaction_starts_a_window_of_its_own_from_the_replacement_history(tmp_path):
    path = write(
        tmp_path,
        META,
        said("user", "First task"),
        said("assistant", "Done with the first."),
        envelope(
            "compacted",
            {
                "message": "",
                "replacement_history": [
                    said("user", "First task")["payload"],
                    said("user", "Summary: the first is done")["payload"],
                ],
            },
        ),
        said("user", "Second task"),
    )
    first, second = read(path)[0]
    assert first.name == "thread-1" and second.name == "thread-1 [window 2]" and second.metadata["window"] == 2
    assert [m["content"] for m in second.messages] == ["First task", "Summary: the first is done", "Second task"]


def test_items_without_text_are_counted_placeholders_and_hosted_calls_keep_their_action(tmp_path):
    path = write(
        tmp_path,
        META,
        item(
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Draw and search"},
                    {"type": "input_image", "image_url": "data:..."},
                ],
            }
        ),
        item({"type": "web_search_call", "status": "completed", "action": {"type": "search", "query": "kv caches"}}),
        item(
            {
                "type": "image_generation_call",
                "id": "ig1",
                "status": "completed",
                "revised_prompt": "a cache",
                "result": "iVBOR...",
            }
        ),
        item({"type": "ghost_snapshot", "ghost_commit": {"id": "abc"}}),
    )
    [session], _ = read(path)
    assert session.dropped == {"image": 1, "generated image": 1}
    assert "[image not archived]" in session.messages[1]["content"]
    assert "kv caches" in session.messages[2]["tool_calls"][0]["arguments"]
    assert "a cache" in everything(session)


def test_a_bad_line_is_skipped_and_named(tmp_path):
    path = write(
        tmp_path,
        META,
        said("user", "Hello"),
        "{not json\n",
        item({"type": "message", "role": "user", "content": 42}),
        said("assistant", "Hi."),
    )
    [session], skipped = read(path)
    assert [s["line"] for s in skipped] == [3, 4] and "content" in skipped[1]["reason"]
    assert [m["content"] for m in session.messages] == ["You are Codex.", "Hello", "Hi."]
    with pytest.raises(TranscriptError) as caught:
        read_transcripts(path)
    assert caught.value.line == 3


def test_detection_tells_a_rollout_from_claude_code_events_and_responses_items():
    assert log_format(META).name == "codex-cli"
    assert log_format({"id": "x", "timestamp": "2025-05-07T17:24:21Z", "instructions": "be brief"}).name == "codex-cli"
    assert (
        log_format(
            {
                "type": "user",
                "uuid": "u1",
                "parentUuid": None,
                "sessionId": "s",
                "message": {"role": "user", "content": "hi"},
            }
        ).name
        == "claude-code"
    )
    bare = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    assert log_format(bare).name == "messages"  # a bare Responses item opens no rollout: only the header does
    assert log_format({"id": "x", "timestamp": "t", "title": "a chat"}) is None  # a header has only the header's keys
    assert session_format({"instructions": "x", "input": "hi"}).name == "openai-responses"


def test_every_fixture_reads_without_skipping():
    for path in sorted(FIXTURES.glob("*.jsonl")):
        sessions, skipped = read(path)
        assert sessions and skipped == [], path.name
        assert all(s.metadata["format"] == "codex-cli" for s in sessions)


def test_the_2025_instructions_are_a_system_turn_unless_the_first_item_repeats_them(tmp_path):
    meta = envelope("session_meta", {"id": "thread-2", "instructions": "Use uv run."})
    injected = said("user", "<user_instructions>\n\nUse uv run.\n\n</user_instructions>")
    [repeated], _ = read(write(tmp_path, meta, injected, said("user", "Test it"), name="a.jsonl"))
    assert [m["role"] for m in repeated.messages] == ["user", "user"] and everything(repeated).count("Use uv run.") == 1
    [sent], _ = read(write(tmp_path, meta, said("user", "Test it"), name="b.jsonl"))
    assert sent.messages[0] == {"role": "system", "content": "Use uv run."}
    refused = item({"type": "message", "role": "user", "content": 42})
    [alone], skipped = read(
        write(tmp_path, meta, refused, name="c.jsonl")
    )  # a refused item leaves no trace, and the instructions stay
    assert alone.messages == ({"role": "system", "content": "Use uv run."},) and [s["line"] for s in skipped] == [2]
