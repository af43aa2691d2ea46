"""Training sets (LLaMA-Factory and friends) read whole: v1's {"type", "value"} parts, tool
schemas, media beside the turns, and preference pairs whose rejected reply is kept aside."""

import json

import pytest
from support import write, write_jsonl

from kvdb.errors import TranscriptError
from kvdb.transcripts import iter_transcripts, read_transcripts

TOOLS = '[{"type": "function", "function": {"name": "area", "description": "Area of a circle", "parameters": {}}}]'


def one(path, **options):
    [transcript] = read_transcripts(path, **options)
    return transcript


def parts(role, *items):
    return {"role": role, "content": [{"type": kind, "value": value} for kind, value in items]}


def test_v1_parts_text_reasoning_tool_call_and_media(tmp_path):
    record = {
        "messages": [
            parts("user", ("image_url", "data/1.jpg"), ("text", "How big is this circle?")),
            parts(
                "assistant",
                ("reasoning", "Radius 2, so 4 pi."),
                ("tool_call", '{"name": "area", "arguments": {"radius": 2}}'),
            ),
            parts("tool", ("text", "12.57")),
            parts("assistant", ("text", "About 12.57.")),
        ],
        "tools": TOOLS,
    }
    session = one(write_jsonl(tmp_path / "sft.jsonl", [record]))
    assert session.messages == (
        {"role": "user", "content": "[image not archived]\nHow big is this circle?"},
        {
            "role": "assistant",
            "content": "",
            "thinking": "Radius 2, so 4 pi.",
            "tool_calls": [{"id": None, "name": "area", "arguments": '{"radius": 2}'}],
        },
        {"role": "tool", "content": "12.57"},
        {"role": "assistant", "content": "About 12.57."},
    )
    assert session.metadata == {
        "format": "openai",
        "title": "How big is this circle?",
        "side": {"tools": [TOOLS], "attachments": ["data/1.jpg"]},
    }
    assert session.dropped == {"image": 1}


def test_a_v1_tool_call_that_is_no_json_call_stays_text_and_an_unknown_part_is_refused(tmp_path):
    session = one(
        write_jsonl(
            tmp_path / "a.jsonl",
            [{"messages": [parts("user", ("text", "hi")), parts("assistant", ("tool_call", "call area(2)"))]}],
        )
    )
    assert session.messages[1] == {"role": "assistant", "content": "call area(2)"}
    with pytest.raises(TranscriptError, match="unknown part type 'sticker'"):
        read_transcripts(write_jsonl(tmp_path / "b.jsonl", [{"messages": [parts("user", ("sticker", "x"))]}]))


def test_a_refused_message_leaves_no_attachment_or_count_behind(tmp_path):
    good = parts("user", ("image_url", "a.jpg"), ("text", "ok"))
    bad = parts("user", ("image_url", "b.jpg"), ("text", None))
    skipped: list = []
    [session] = iter_transcripts(write_jsonl(tmp_path / "messages.jsonl", [good, bad]), skipped=skipped)
    assert (session.metadata["side"], session.dropped) == ({"attachments": ["a.jpg"]}, {"image": 1})
    assert [entry["line"] for entry in skipped] == [2]


def test_sharegpt_preference_pair_chosen_ends_the_session_and_rejected_is_an_alternative(tmp_path):
    pair = {
        "conversations": [{"from": "human", "value": "Name a prime."}],
        "chosen": {"from": "gpt", "value": "7"},
        "rejected": {"from": "gpt", "value": "9"},
    }
    session = one(write(tmp_path / "dpo.json", json.dumps([pair])))
    assert session.messages == ({"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"})
    assert session.metadata["side"] == {"alternatives": [{"turn": 1, "text": "9"}]}


def test_v1_preference_pair_keeps_the_rejected_turns_from_where_they_part(tmp_path):
    system, prompt = parts("system", ("text", "Be exact.")), parts("user", ("text", "Name a prime."))
    pair = {
        "chosen_messages": [system, prompt, parts("assistant", ("text", "7"))],
        "rejected_messages": [system, prompt, parts("assistant", ("reasoning", "odd"), ("text", "9"))],
    }
    session = one(write_jsonl(tmp_path / "dpo.jsonl", [pair]))
    assert [m["content"] for m in session.messages] == ["Be exact.", "Name a prime.", "7"]
    assert session.metadata["side"] == {"alternatives": [{"turn": 2, "text": "odd\n9"}]}
    with pytest.raises(TranscriptError, match='"rejected_messages" must be a list'):
        read_transcripts(write_jsonl(tmp_path / "bad.jsonl", [{"chosen_messages": [prompt], "rejected_messages": "9"}]))


def test_glaive_tool_calls_with_tools_as_a_json_string_or_a_list(tmp_path):
    schema = {"name": "weather", "description": "Weather in a city", "parameters": {"type": "object"}}
    turns = [
        {"from": "human", "value": "Oslo?"},
        {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Oslo"}}'},
        {"from": "observation", "value": "-3 C"},
        {"from": "gpt", "value": "Cold."},
    ]
    as_text, as_list = read_transcripts(
        write(
            tmp_path / "glaive.json",
            json.dumps(
                [{"conversations": turns, "tools": json.dumps([schema])}, {"conversations": turns, "tools": [schema]}]
            ),
        )
    )
    assert as_text.metadata["side"] == {"tools": [json.dumps([schema])]}
    assert as_list.metadata["side"] == {"tools": [json.dumps(schema)]}
    assert as_text.messages[1]["tool_calls"] == [{"id": None, "name": "weather", "arguments": '{"city": "Oslo"}'}]
    with pytest.raises(TranscriptError, match='"tools" must be a JSON string or a list'):
        read_transcripts(write(tmp_path / "bad.json", json.dumps({"conversations": turns, "tools": 3})))


def test_media_lists_beside_the_turns_are_counted_and_their_markers_kept(tmp_path):
    record = {
        "messages": [{"role": "user", "content": "<image><image>Same?"}, {"role": "assistant", "content": "Yes."}],
        "images": ["a.jpg", "b.jpg"],
        "videos": ["c.mp4"],
    }
    session = one(write(tmp_path / "mllm.json", json.dumps([record])))
    assert session.messages[0]["content"] == "<image><image>Same?"
    assert session.dropped == {"image": 2, "video": 1}
    assert session.metadata["side"] == {"attachments": ["a.jpg", "b.jpg", "c.mp4"]}
    with pytest.raises(TranscriptError, match='"images" must be a list of file paths'):
        read_transcripts(write(tmp_path / "bad.json", json.dumps([dict(record, images="a.jpg")])))


def test_openai_text_parts_are_still_read_beside_value_parts(tmp_path):
    session = one(
        write_jsonl(
            tmp_path / "o.jsonl", [{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}]
        )
    )
    assert session.messages == ({"role": "user", "content": "hi"},)
    assert "side" not in session.metadata
