"""The chat apps' exports (Claude.ai, Open WebUI, Grok, Google AI Studio, SillyTavern): the
conversation the user last saw is the session, other branches are sessions or alternatives,
what has no text is counted, and each shape is told from its look-alikes by content."""

from __future__ import annotations

import json

import pytest
from support import write, write_jsonl

from kvdb.errors import TranscriptError
from kvdb.transcripts import formats, iter_transcripts, read_transcripts


def read(tmp_path, value, name="export.json"):
    return read_transcripts(write(tmp_path / name, json.dumps(value)))


def side(session) -> dict:
    return session.metadata.get("side", {})


# Claude.ai --------------------------------------------------------------------------------


def claude_message(uuid, sender, text, parent=None, **more):
    message = {
        "uuid": uuid,
        "sender": sender,
        "text": text,
        "content": [{"type": "text", "text": text}],
        "attachments": [],
        "files": [],
    }
    if parent is not None:
        message["parent_message_uuid"] = parent
    return message | more


def test_claude_ai_reads_content_blocks_and_never_the_flattened_text_too(tmp_path):
    answer = {
        "uuid": "m2",
        "sender": "assistant",
        "text": "Weighing it.Yes.",  # the export runs thinking and answer together here
        "content": [
            {"type": "thinking", "thinking": "Weighing it.", "summaries": [{"summary": "Weighing the question"}]},
            {"type": "tool_use", "id": "t1", "name": "web_search", "input": {"query": "q"}},
            {
                "type": "tool_result",
                "tool_use_id": "t1",
                "content": [{"type": "knowledge", "title": "A page", "url": "https://a.example", "text": "found"}],
            },
            {"type": "token_budget", "remaining": 10},
            {"type": "text", "text": "Yes."},
        ],
    }
    (session,) = read(
        tmp_path,
        [
            {
                "uuid": "c1",
                "name": "",
                "summary": "A short chat.",
                "chat_messages": [claude_message("m1", "human", "Is it?"), answer],
            }
        ],
    )
    assert session.name == "c1"  # the app's unnamed conversation
    assert [m["role"] for m in session.messages] == ["user", "assistant", "tool", "assistant"]
    assert session.messages[1]["thinking"] == "Weighing the question\nWeighing it."
    assert session.messages[1]["tool_calls"][0]["name"] == "web_search"
    assert session.messages[2]["content"] == "A page\nhttps://a.example\nfound"
    assert session.messages[3]["content"] == "Yes."
    assert "Weighing it.Yes." not in json.dumps(session.messages)
    assert side(session) == {"summaries": ["A short chat."]}


def test_claude_ai_attachments_open_the_user_turn_and_files_are_counted(tmp_path):
    message = claude_message("m1", "human", "Summarise these")
    message["attachments"] = [{"file_name": "notes.txt", "extracted_content": "the notes' text"}]
    message["files"] = [{"file_name": "photo.png"}]
    del message["content"]  # exports before 2025 hold only "text"
    (session,) = read(
        tmp_path,
        [{"uuid": "c1", "name": "Files", "chat_messages": [message, claude_message("m2", "assistant", "Done.")]}],
    )
    assert session.messages[0]["content"] == "the notes' text\n[file not archived]\nSummarise these"
    assert session.dropped == {"file": 1}
    assert side(session)["attachments"] == ["notes.txt", "photo.png"]


def test_claude_ai_parent_links_make_a_session_per_branch_the_current_leaf_first(tmp_path):
    messages = [
        claude_message("m1", "human", "Question", parent="00000000-0000-4000-8000-000000000000"),
        claude_message("m2", "assistant", "First answer", parent="m1"),
        claude_message("m3", "human", "Edited follow-up", parent="m2"),
        claude_message("m4", "human", "Original follow-up", parent="m2"),
    ]
    sessions = read(
        tmp_path, [{"uuid": "c1", "name": "Tree", "current_leaf_message_uuid": "m3", "chat_messages": messages}]
    )
    assert [s.name for s in sessions] == ["Tree", "Tree [branch 2]"]
    assert [m["content"] for m in sessions[0].messages] == ["Question", "First answer", "Edited follow-up"]
    assert [m["content"] for m in sessions[1].messages] == ["Question", "First answer", "Original follow-up"]


def test_a_list_of_claude_ai_conversations_is_told_from_its_look_alikes():
    assert formats.session_format({"uuid": "c", "chat_messages": []}).name == "claude-ai"
    assert formats.session_format({"title": "t", "mapping": {}}).name == "chatgpt"
    assert formats.session_format({"messages": [{"role": "user", "content": "x"}]}).name == "messages"


def test_a_claude_ai_message_of_an_unknown_sender_fails_loudly(tmp_path):
    with pytest.raises(TranscriptError, match='"sender" must be'):
        read(tmp_path, [{"uuid": "c1", "name": "x", "chat_messages": [claude_message("m1", "robot", "hi")]}])


# Open WebUI -------------------------------------------------------------------------------


def webui_chat(current="a2"):
    nodes = {
        "u1": {
            "id": "u1",
            "parentId": None,
            "childrenIds": ["a1", "a2"],
            "role": "user",
            "content": "Question",
            "files": [{"name": "plan.pdf"}],
        },
        "a1": {"id": "a1", "parentId": "u1", "childrenIds": [], "role": "assistant", "content": "Older answer"},
        "a2": {
            "id": "a2",
            "parentId": "u1",
            "childrenIds": ["u2", "u3"],
            "role": "assistant",
            "content": "Newer answer",
        },
        "u2": {"id": "u2", "parentId": "a2", "childrenIds": [], "role": "user", "content": "Follow-up"},
        "u3": {"id": "u3", "parentId": "a2", "childrenIds": [], "role": "user", "content": "Edited follow-up"},
    }
    shown = [nodes["u1"], nodes["a2"]]
    return {"id": "", "title": "Chat", "history": {"messages": nodes, "currentId": current}, "messages": shown}


def test_open_webui_follows_current_id_with_regenerations_as_alternatives_and_edits_as_branches(tmp_path):
    sessions = read(tmp_path, [{"id": "row-1", "title": "Chat", "chat": webui_chat(current="u2")}])
    assert [s.name for s in sessions] == ["Chat", "Chat [branch 2]"]
    assert [m["content"] for m in sessions[0].messages] == ["Question", "Newer answer", "Follow-up"]
    assert [m["content"] for m in sessions[1].messages] == ["Question", "Newer answer", "Edited follow-up"]
    assert side(sessions[0]) == {"attachments": ["plan.pdf"], "alternatives": [{"turn": 1, "text": "Older answer"}]}
    assert sessions[0].metadata["id"] == "row-1"


def test_an_open_webui_chat_object_with_an_empty_id_reads_and_is_not_read_twice(tmp_path):
    (session,) = read(
        tmp_path,
        webui_chat(current="a2")
        | {
            "history": {
                "messages": {k: v for k, v in webui_chat()["history"]["messages"].items() if k[0] != "u" or k == "u1"},
                "currentId": "a2",
            }
        },
    )
    assert session.name == "Chat" and "id" not in session.metadata
    assert [m["content"] for m in session.messages] == ["Question", "Newer answer"]


def test_an_open_webui_chat_without_history_reads_its_flat_messages_by_position(tmp_path):
    chat = {
        "id": "",
        "title": "Flat",
        "history": {"messages": {}},
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    }
    (session,) = read(tmp_path, chat)
    assert [m["content"] for m in session.messages] == ["a", "b"]


# Grok -------------------------------------------------------------------------------------


def grok_export():
    def response(rid, sender, message, parent, ms, **more):
        return {
            "response": {
                "_id": rid,
                "sender": sender,
                "message": message,
                "parent_response_id": parent,
                "create_time": {"$date": {"$numberLong": str(ms)}},
            }
            | more
        }

    responses = [
        response("r3", "ASSISTANT", "Regenerated answer", "r1", 3000, image_attachments=[]),
        response("r1", "human", "Prompt", None, 1000, file_attachments=["f-1"]),
        response(
            "r2",
            "ASSISTANT",
            "First answer",
            "r1",
            2000,
            thinking_trace="Thought it over.",
            web_search_results=[{"title": "A source", "url": "https://s.example"}],
        ),
    ]
    return {
        "conversations": [{"conversation": {"id": "c1", "title": "Grok chat"}, "responses": responses}],
        "projects": [],
    }


def test_grok_orders_by_time_and_keeps_the_regeneration_not_taken_with_its_thinking(tmp_path):
    (session,) = read(tmp_path, grok_export())
    assert session.name == "Grok chat"
    assert [m["content"] for m in session.messages] == ["Prompt\n[file not archived]", "Regenerated answer"]
    assert session.dropped == {"file": 1}
    assert side(session)["alternatives"] == [{"turn": 1, "text": "First answer", "thinking": "Thought it over."}]
    assert side(session)["events"] == [{"type": "web search result", "text": "A source\nhttps://s.example"}]


def test_grok_is_told_from_sharegpt_though_both_hold_conversations():
    assert formats.session_format(grok_export()).name == "grok"
    assert formats.session_format({"conversations": [{"from": "human", "value": "hi"}]}).name == "sharegpt"
    assert (
        formats.session_format({"conversations": [{"from": "human", "value": "hi", "conversation": {}}]}).name
        == "sharegpt"
    )


# Google AI Studio -------------------------------------------------------------------------


def test_ai_studio_joins_a_role_s_chunks_and_counts_what_has_no_text(tmp_path):
    prompt = {
        "runSettings": {"model": "models/gemini"},
        "systemInstruction": {"parts": [{"text": "Be brief."}]},
        "chunkedPrompt": {
            "chunks": [
                {"role": "user", "text": "Look at this", "driveImage": {"id": "d1"}},
                {"role": "user", "inlineFile": {"mimeType": "application/pdf", "data": "AA=="}},
                {"role": "model", "text": "Looking closely.", "isThought": True},
                {"role": "model", "text": "It is a cat."},
            ],
            "pendingInputs": [{"role": "user", "text": "and a draft"}],
        },
    }
    (session,) = read(tmp_path, prompt, "My prompt.json")
    assert session.name == "My prompt"
    assert session.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Look at this\n[image not archived]\n[file not archived]"},
        {"role": "assistant", "content": "It is a cat.", "thinking": "Looking closely."},
    )
    assert session.dropped == {"image": 1, "file": 1}
    assert side(session)["events"] == [{"type": "unsent draft", "text": "and a draft"}]


# SillyTavern ------------------------------------------------------------------------------

HEADER = {"user_name": "unused", "character_name": "unused", "create_date": "2025-03-01@10h15m02s", "chat_metadata": {}}


def test_sillytavern_keeps_the_shown_swipe_and_the_others_as_alternatives(tmp_path):
    lines = [
        HEADER,
        {
            "name": "Aqua",
            "is_user": False,
            "mes": "Hello!",
            "swipe_id": 1,
            "swipes": ["Hi.", "Hello!"],
            "swipe_info": [{"extra": {"reasoning": "Be curt."}}, {}],
        },
        {"name": "Kazuma", "is_user": True, "mes": "Hey", "extra": {"file": {"name": "map.png"}}},
        {"name": "Aqua", "is_user": False, "mes": "Well?", "extra": {"reasoning": "They seem bored."}},
        {"name": "Narrator", "is_user": False, "is_system": True, "mes": "Time passes.", "extra": {"type": "narrator"}},
    ]
    (session,) = read_transcripts(write_jsonl(tmp_path / "chat.jsonl", lines))
    assert session.messages == (
        {"role": "assistant", "content": "Hello!", "name": "Aqua"},
        {"role": "user", "content": "Hey", "name": "Kazuma"},
        {"role": "assistant", "content": "Well?", "name": "Aqua", "thinking": "They seem bored."},
    )
    assert side(session) == {
        "alternatives": [{"turn": 0, "text": "Hi.", "thinking": "Be curt."}],
        "events": [{"type": "narrator", "text": "Narrator: Time passes."}],
        "attachments": ["map.png"],
    }


def test_a_sillytavern_chat_without_its_header_reads_and_a_bad_line_is_skipped_and_named(tmp_path):
    lines = [
        {"name": "Aqua", "is_user": False, "mes": "Hello!"},
        {"name": "Kazuma", "is_user": True, "mes": 5},
        {"name": "Kazuma", "is_user": True, "mes": "Hi"},
    ]
    skipped: list[dict] = []
    (session,) = iter_transcripts(write_jsonl(tmp_path / "chat.jsonl", lines), skipped=skipped)
    assert [m["content"] for m in session.messages] == ["Hello!", "Hi"]
    assert [s["line"] for s in skipped] == [2] and '"mes" must be a string' in skipped[0]["reason"]


def test_a_sillytavern_header_alone_is_nothing_to_archive(tmp_path):
    with pytest.raises(TranscriptError, match="only its header"):
        read_transcripts(write_jsonl(tmp_path / "chat.jsonl", [HEADER]))


def test_a_sillytavern_group_chat_keeps_its_scenario_display_text_and_counts_its_image(tmp_path):
    header = {
        "user_name": "User",
        "character_name": "unused",
        "chat_metadata": {"scenario": "A night watch.", "note_prompt": "Keep it short."},
    }
    path = write_jsonl(
        tmp_path / "group.jsonl",
        [
            header,
            {"name": "User", "is_user": True, "mes": "What did you see?", "extra": {"image": "user/images/map.png"}},
            {"name": "Scout", "is_user": False, "mes": "Torches.", "extra": {"display_text": "Torches, east."}},
        ],
    )
    [session] = read_transcripts(path)
    assert [m["content"] for m in session.messages] == [
        "What did you see?\n[image not archived]",
        "Torches.",
    ] and session.dropped == {"image": 1}
    assert session.metadata["side"]["events"] == [
        {"type": "scenario", "text": "A night watch."},
        {"type": "author's note", "text": "Keep it short."},
        {"type": "display text", "text": "Torches, east."},
    ]
    assert session.metadata["side"]["attachments"] == ["user/images/map.png"]
