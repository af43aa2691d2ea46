"""Claude Code logs read whole: what is no turn stays as a side field, sub-agents and side
chains are sessions of their own, and a bad line never splits a conversation."""

from __future__ import annotations

import json

import pytest
from support import REPO, write

from kvdb.errors import EmptyTranscript, TranscriptError
from kvdb.transcripts import iter_transcripts, read_transcripts
from kvdb.transcripts.formats.claude_code import ClaudeCode, EventLog
from kvdb.transcripts.messages import Invalid

FIXTURES = REPO / "tests" / "fixtures" / "exports" / "claude-code"


def event(uuid, parent, role, content, session="s1", **extra):
    return {
        "parentUuid": parent,
        "type": role,
        "message": {"role": role, "content": content},
        "uuid": uuid,
        "sessionId": session,
        **extra,
    }


def jsonl(*rows) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def lenient(path):
    skipped: list[dict] = []
    return list(iter_transcripts(path, skipped=skipped)), skipped


def contents(session) -> list[str]:
    return [m["content"] for m in session.messages]


def side(session) -> dict:
    return session.metadata.get("side", {})


def test_a_summary_names_its_session_and_every_other_summary_and_title_is_kept(tmp_path):
    path = write(
        tmp_path / "log.jsonl",
        jsonl(
            {"type": "summary", "summary": "Fixing the build", "leafUuid": "a1"},
            {"type": "summary", "summary": "An older session", "leafUuid": "elsewhere"},
            event("u1", None, "user", "why does it fail?"),
            event("a1", "u1", "assistant", "a typo"),
            {"type": "custom-title", "sessionId": "s1", "customTitle": "Build fix"},
            {"type": "ai-title", "sessionId": "s1", "aiTitle": "Typo in the build"},
            {"type": "last-prompt", "sessionId": "s1", "lastPrompt": "why does it fail?", "leafUuid": "u1"},
        ),
    )
    [session] = read_transcripts(path)
    assert session.name == "Fixing the build"
    assert side(session) == {
        "title": ["Build fix", "Typo in the build"],
        "summaries": ["An older session"],
        "events": [{"type": "last-prompt lastPrompt", "text": "why does it fail?"}],
    }
    assert session.dropped == {}


def test_system_attachment_and_hook_records_are_side_events_not_turns_and_only_textless_ones_count(tmp_path):
    path = write(
        tmp_path / "log.jsonl",
        jsonl(
            {"type": "file-history-snapshot", "messageId": "m", "snapshot": {}},
            event("u1", None, "user", "run it"),
            {
                "parentUuid": "u1",
                "type": "progress",
                "uuid": "p1",
                "sessionId": "s1",
                "data": {"type": "hook_progress", "hookEvent": "PostToolUse", "command": "./hook.sh"},
            },
            {
                "parentUuid": "p1",
                "type": "attachment",
                "uuid": "t1",
                "sessionId": "s1",
                "attachment": {"type": "hook_success", "stdout": "hook said hi", "stderr": "", "exitCode": 0},
            },
            {
                "parentUuid": "t1",
                "type": "system",
                "subtype": "local_command",
                "uuid": "x1",
                "sessionId": "s1",
                "content": "<local-command-stdout>done</local-command-stdout>",
            },
            {
                "parentUuid": "x1",
                "type": "system",
                "subtype": "turn_duration",
                "uuid": "x2",
                "sessionId": "s1",
                "durationMs": 5,
            },
            event("a1", "x2", "assistant", "ran"),
            {"type": "permission-mode", "permissionMode": "default", "sessionId": "s1"},
        ),
    )
    [session] = read_transcripts(path)
    assert contents(session) == ["run it", "ran"]  # the records between them are links of the chain, not turns
    assert side(session)["events"] == [
        {"type": "progress hook_progress command", "text": "./hook.sh"},
        {"type": "attachment hook_success stdout", "text": "hook said hi"},
        {"type": "system local_command", "text": "<local-command-stdout>done</local-command-stdout>"},
    ]
    assert session.dropped == {"file-history-snapshot event": 1, "system event": 1, "permission-mode event": 1}


def test_a_tools_structured_result_is_kept_where_the_model_was_shown_less(tmp_path):
    call = {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a.py"}}
    shown = [{"type": "tool_result", "tool_use_id": "t1", "content": "     1\u2192a = 1\n     2\u2192b = 2"}]
    path = write(
        tmp_path / "log.jsonl",
        jsonl(
            event("u1", None, "user", "read a.py"),
            event("a1", "u1", "assistant", [call]),
            event(
                "r1",
                "a1",
                "user",
                shown,
                toolUseResult={"type": "text", "file": {"filePath": "a.py", "content": "a = 1\nb = 2", "numLines": 2}},
            ),
            event("a2", "r1", "assistant", [dict(call, id="t2")]),
            event(
                "r2",
                "a2",
                "user",
                [{"type": "tool_result", "tool_use_id": "t2", "content": "ok"}],
                toolUseResult={"stdout": "ok", "stderr": "warning: slow"},
            ),
        ),
    )
    [session] = read_transcripts(path)
    # the file's lines without their numbers, and the stderr the model never saw; "ok" it was shown
    assert side(session)["events"] == [
        {"type": "tool output", "text": "a = 1\nb = 2"},
        {"type": "tool output", "text": "warning: slow"},
    ]


def test_a_sub_agent_file_is_one_session_named_by_its_agent():
    [session] = read_transcripts(FIXTURES / "spotter-subagent-agent-aac57f5.jsonl")
    assert session.name == "ae4a77f8-aedd-4bc1-888f-c94edc91af04 [agent aac57f5]"
    assert session.metadata["agent"] == "aac57f5" and session.metadata["id"] == "ae4a77f8-aedd-4bc1-888f-c94edc91af04"


def test_a_parent_log_mirrors_its_sub_agent_as_a_session_of_its_own():
    """A parent log holds its sub-agent's turns in agent_progress records: read, they are the
    sub-agent's session, not lost among the parent's notices."""
    main, agent = read_transcripts(FIXTURES / "spotter-ae4a77f8-lines65-101-task-subagent.jsonl")
    assert (main.name, agent.name) == (
        "ae4a77f8-aedd-4bc1-888f-c94edc91af04",
        "ae4a77f8-aedd-4bc1-888f-c94edc91af04 [agent aac57f5]",
    )
    assert contents(agent)[0].startswith("Search hex.pm for the latest versions")
    assert sum(m["role"] == "tool" for m in agent.messages) == 12 and main.dropped == {}


def test_a_side_chain_inside_a_main_log_is_a_session_of_its_own(tmp_path):
    path = write(
        tmp_path / "log.jsonl",
        jsonl(
            event("u1", None, "user", "look into it"),
            event("s1", None, "user", "sub-task prompt", isSidechain=True, agentId="a7"),
            event("s2", "s1", "assistant", "sub-task answer", isSidechain=True, agentId="a7"),
            event("t1", None, "user", "an unnamed side chain", isSidechain=True),
            event("a1", "u1", "assistant", "done"),
        ),
    )
    by_name = {s.name: s for s in read_transcripts(path)}
    assert {name: contents(s) for name, s in by_name.items()} == {
        "s1": ["look into it", "done"],
        "s1 [agent a7]": ["sub-task prompt", "sub-task answer"],
        "s1 [side chain]": ["an unnamed side chain"],
    }


def test_a_bad_line_in_the_middle_does_not_split_the_conversation(tmp_path):
    path = write(
        tmp_path / "log.jsonl",
        jsonl(event("u1", None, "user", "one"), event("a1", "u1", "assistant", "two"))
        + '{"parentUuid": "a1", "type": "user", "uuid": "u2", "message": {"role": "user", "con\n'
        + jsonl(event("a2", "u2", "assistant", "four"), event("u3", "a2", "user", "five")),
    )
    [session], skipped = lenient(path)
    assert contents(session) == ["one", "two", "four", "five"]
    assert [s["line"] for s in skipped] == [3]


def test_a_message_of_the_wrong_shape_is_refused_at_its_line_and_leaves_no_trace(tmp_path):
    bad = event("u2", "a1", "user", [{"type": "text", "text": 5}], toolUseResult={"stdout": "should not be kept"})
    path = write(
        tmp_path / "log.jsonl",
        jsonl(
            event("u1", None, "user", "one"),
            event("a1", "u1", "assistant", "two"),
            bad,
            event("u3", "u2", "user", "three"),
        ),
    )
    [session], skipped = lenient(path)
    assert contents(session) == ["one", "two", "three"] and "side" not in session.metadata
    assert [s["line"] for s in skipped] == [3] and "event u2" in skipped[0]["reason"]
    with pytest.raises(TranscriptError) as caught:
        read_transcripts(path)
    assert caught.value.line == 3
    log = EventLog("s", "s.jsonl")
    with pytest.raises(Invalid):
        log.add(bad, 1)
    with pytest.raises(EmptyTranscript):  # nothing of it stayed: the log is as empty as before
        log.add({"type": "summary", "summary": "x", "leafUuid": "y"}, 2)
        log.sessions()


def test_events_without_links_are_one_session_in_file_order(tmp_path):
    rows = [
        {"type": role, "uuid": f"e{i}", "sessionId": "s1", "message": {"role": role, "content": f"turn {i}"}}
        for i, role in enumerate(["user", "assistant"] * 3)
    ]
    [session] = read_transcripts(write(tmp_path / "log.jsonl", jsonl(*rows)))
    assert contents(session) == [f"turn {i}" for i in range(6)]


def test_an_interrupt_marker_without_uuid_and_a_bare_string_are_skipped_and_named(tmp_path):
    marker = {
        "type": "user",
        "uuid": None,
        "parentUuid": "a1",
        "sessionId": "s1",
        "message": {"role": "user", "content": "[Request interrupted by user]"},
    }
    for rows, lines in [
        ([marker, "a bare string line", event("u1", None, "user", "hi"), event("a1", "u1", "assistant", "yo")], [1, 2]),
        ([event("u1", None, "user", "hi"), "a bare string line", event("a1", "u1", "assistant", "yo"), marker], [2, 4]),
    ]:
        [session], skipped = lenient(write(tmp_path / "log.jsonl", jsonl(*rows)))
        assert contents(session) == ["hi", "yo"]
        assert [s["line"] for s in skipped] == lines and any('needs a string "uuid"' in s["reason"] for s in skipped)


def test_another_message_under_a_uuid_already_taken_is_kept_not_replaced(tmp_path):
    path = write(
        tmp_path / "log.jsonl",
        jsonl(
            event("u1", None, "user", "first"),
            event("a1", "u1", "assistant", "reply"),
            event("a1", "u1", "assistant", "another reply"),
        ),
    )
    assert sorted(tuple(contents(s)) for s in read_transcripts(path)) == [
        ("first", "another reply"),
        ("first", "reply"),
    ]


def test_detection_is_no_broader_than_the_event_links():
    claude = ClaudeCode()
    assert claude.opens_log({"type": "user", "parentUuid": None, "uuid": "u"})
    assert claude.opens_log({"type": "summary", "summary": "x", "leafUuid": "u"})
    assert not claude.opens_log({"type": "summary", "summary": "x"})
    assert not claude.opens_log({"role": "user", "content": "hi"})
    assert not claude.opens_log({"type": "custom-title", "customTitle": "x"})


def test_an_orphan_follows_the_event_before_it_of_its_own_session(tmp_path):
    path = write(
        tmp_path / "log.jsonl",
        jsonl(
            event("u1", None, "user", "s2 question", session="s2"),
            event("v1", None, "user", "s1 question"),
            event("a1", "lost-line", "assistant", "s2 answer", session="s2"),
        ),
    )
    assert {s.name: contents(s) for s in read_transcripts(path)} == {
        "s2": ["s2 question", "s2 answer"],
        "s1": ["s1 question"],
    }
