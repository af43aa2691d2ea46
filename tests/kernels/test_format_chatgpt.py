"""The ChatGPT data export beyond plain text: reasoning joins the reply it led to, tool and
browsing nodes keep their text, attachments are named, and what holds no text is counted."""

import json

import pytest
from support import write

from kvdb.errors import TranscriptError
from kvdb.transcripts import read_transcripts


def export(tmp_path, nodes: list[tuple], current: str, title="Lab"):
    """nodes: (id, parent, role, content, message extras); children are derived from the parents."""
    mapping = {
        node_id: {
            "id": node_id,
            "parent": parent,
            "children": [],
            "message": {"author": {"role": role}, "content": content, **extra},
        }
        for node_id, parent, role, content, extra in nodes
    }
    for node_id, node in mapping.items():
        if node["parent"] is not None:
            mapping[node["parent"]]["children"].append(node_id)
    return read_transcripts(
        write(
            tmp_path / "conversations.json",
            json.dumps([{"title": title, "id": "c1", "mapping": mapping, "current_node": current}]),
        )
    )


def test_thoughts_and_the_recap_become_the_thinking_of_the_next_assistant_turn(tmp_path):
    [session] = export(tmp_path, [
        ("u", None, "user", {"content_type": "text", "parts": ["Why?"]}, {}),
        ("t", "u", "assistant",
         {"content_type": "thoughts", "thoughts": [{"summary": "Weighing", "content": "X, then Y."}]}, {}),
        ("r", "t", "assistant", {"content_type": "reasoning_recap", "content": "Thought for 7s"}, {}),
        ("a", "r", "assistant", {"content_type": "text", "parts": ["Because Y."]}, {}),
    ], "a")  # fmt: skip
    assert session.messages == (
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because Y.", "thinking": "Weighing\nX, then Y.\nThought for 7s"},
    )


def test_thoughts_in_parts_and_a_thought_with_no_reply_after_it_are_kept(tmp_path):
    [session] = export(tmp_path, [
        ("u", None, "user", {"content_type": "text", "parts": ["Why?"]}, {}),
        ("t", "u", "assistant", {"content_type": "thoughts", "parts": ["Hmm."]}, {}),
    ], "t")  # fmt: skip
    assert session.messages[-1] == {"role": "assistant", "content": "", "thinking": "Hmm."}


def test_tool_nodes_keep_their_text_and_what_has_none_is_counted(tmp_path):
    [session] = export(tmp_path, [
        ("u", None, "user", {"content_type": "text", "parts": ["Find it"]}, {}),
        ("c", "u", "assistant", {"content_type": "code", "language": "unknown", "text": 'search("x")'},
         {"recipient": "browser"}),
        ("b", "c", "tool",
         {"content_type": "tether_browsing_display", "result": "# 1 x.org", "summary": "One hit", "assets": []}, {}),
        ("q", "b", "tool",
         {"content_type": "tether_quote", "url": "https://x.org", "domain": "x.org", "title": "X", "text": "A quote."},
         {}),
        ("e", "q", "tool", {"content_type": "system_error", "name": "timeout", "text": "The tool timed out."}, {}),
        ("s", "e", "tool",
         {"content_type": "computer_output", "computer_id": "pc", "screenshot": {"asset_pointer": "file-service://s"}},
         {}),
        ("a", "s", "assistant", {"content_type": "text", "parts": ["Found."]}, {}),
    ], "a")  # fmt: skip
    assert [m["content"] for m in session.messages[2:6]] == [
        "One hit\n\n# 1 x.org",
        "X\n\nA quote.",
        "timeout\n\nThe tool timed out.",
        "[computer_output not archived]",
    ]
    assert session.messages[1]["tool_calls"] == [{"id": None, "name": "browser", "arguments": 'search("x")'}]
    assert session.dropped == {"computer_output": 1}


def test_attachments_are_named_on_the_branch_that_holds_them(tmp_path):
    image = {"content_type": "image_asset_pointer", "asset_pointer": "file-service://f1"}
    attached = {
        "metadata": {"attachments": [{"id": "f1", "name": "plot.png", "size": 9}, {"id": "f2", "name": "data.csv"}]}
    }
    main, edit = export(tmp_path, [
        ("s", None, "system", {"content_type": "text", "parts": [""]},
         {"metadata": {"is_visually_hidden_from_conversation": True}}),
        ("u1", "s", "user", {"content_type": "multimodal_text", "parts": [image, "What is this?"]}, attached),
        ("a1", "u1", "assistant", {"content_type": "text", "parts": ["A plot."]}, {}),
        ("u2", "s", "user", {"content_type": "text", "parts": ["Edited, no file."]}, {}),
    ], "a1")  # fmt: skip
    assert (main.name, edit.name) == ("Lab", "Lab [branch 2]")
    assert main.metadata["side"] == {"attachments": ["plot.png", "data.csv"]}
    assert main.messages[0] == {
        "role": "user",
        "content": "[image not archived]\nWhat is this?",
    }  # the hidden, empty system node holds nothing
    assert main.dropped == {"image": 1}
    assert "side" not in edit.metadata and edit.dropped == {}


def test_hidden_context_with_text_stays_a_turn(tmp_path):
    hidden = {"metadata": {"is_visually_hidden_from_conversation": True}}
    [session] = export(tmp_path, [
        ("m", None, "system",
         {"content_type": "model_editable_context", "model_set_context": "Likes tea.", "repository": None}, hidden),
        ("u", "m", "user", {"content_type": "text", "parts": ["Drink?"]}, {}),
    ], "u")  # fmt: skip
    assert session.messages[0] == {"role": "system", "content": "Likes tea."}


def test_thoughts_that_are_not_objects_are_refused(tmp_path):
    with pytest.raises(TranscriptError, match='"thoughts" must be a list of objects'):
        export(tmp_path, [("t", None, "assistant", {"content_type": "thoughts", "thoughts": ["loose"]}, {})], "t")
