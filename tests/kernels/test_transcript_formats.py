"""Every export format, read from its content: what each message becomes, what is kept only as a
placeholder (and counted), and the encodings a transcript may come in."""

import codecs
import json

import pytest
from support import CHAT_TEMPLATE, EXAMPLES, conversation_texts, write, write_jsonl

from kvdb.errors import TranscriptError
from kvdb.model import chat
from kvdb.model import tokenizer as tok
from kvdb.transcripts import read_transcripts, transcript_from_messages


def one(path):
    [transcript] = read_transcripts(path)
    return transcript


# --- OpenAI Chat Completions -------------------------------------------------------


def test_openai_tool_calls_with_null_content_keep_every_field(tmp_path):
    path = write(tmp_path / "t.json", (EXAMPLES / "openai-tools.json").read_text())
    transcript = one(path)
    assert transcript.metadata == {
        "format": "openai",
        "id": "weather-tools",
        "title": "Do I need an umbrella in Lyon today?",
    }
    assert transcript.messages[1:] == (
        {"role": "user", "content": "Do I need an umbrella in Lyon today?", "name": "ana"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_7Qd2", "name": "get_forecast", "arguments": '{"city": "Lyon", "day": "today"}'}
            ],
        },
        {
            "role": "tool",
            "content": '{"rain_mm": 6, "chance": 0.8}',
            "tool_call_id": "call_7Qd2",
            "name": "get_forecast",
        },
        {"role": "assistant", "content": "Yes: an 80% chance of rain, about 6 mm. Take the umbrella."},
    )
    assert transcript.dropped == {}


def test_openai_empty_string_content_keeps_tool_calls_too():
    transcript = transcript_from_messages([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ])  # fmt: skip
    assert transcript.messages[1]["tool_calls"] == [{"id": "c", "name": "f", "arguments": "{}"}]


def test_openai_legacy_function_call_refusal_and_media_parts():
    transcript = transcript_from_messages([
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:"}},
                                     {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]},
        {"role": "assistant", "content": None, "function_call": {"name": "lookup", "arguments": '{"q": 1}'}},
        {"role": "function", "name": "lookup", "content": "found"},
        {"role": "assistant", "content": None, "refusal": "I can't help with that."},
    ])  # fmt: skip
    assert transcript.messages == (
        {"role": "user", "content": "look\n[image not archived]\n[audio not archived]"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": None, "name": "lookup", "arguments": '{"q": 1}'}]},
        {"role": "tool", "content": "found", "name": "lookup"},
        {"role": "assistant", "content": "I can't help with that."},
    )
    assert transcript.dropped == {"image": 1, "audio": 1}


@pytest.mark.parametrize("message, reason", [
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": "f"}]},
     '"function" must be an object'),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]},
     "needs a function name"),
    ({"role": "assistant", "content": None, "tool_calls": "f()"}, '"tool_calls" must be a list of objects'),
    ({"role": "user", "content": [{"type": 3}]}, '"type" must be a string'),
])  # fmt: skip
def test_malformed_tool_calls_are_refused_naming_the_field(message, reason):
    with pytest.raises(TranscriptError, match=reason):
        transcript_from_messages([message])


# --- OpenAI Responses API ------------------------------------------------------------


def test_responses_items_join_reasoning_and_calls_to_their_turn():
    transcript = one(EXAMPLES / "responses.json")
    assert transcript.metadata == {"format": "openai-responses"}
    assert transcript.messages[1:] == (
        {"role": "user", "content": "What is 17% of 240?"},
        {"role": "assistant", "content": "", "thinking": "Compute 0.17 * 240 with the calculator.",
         "tool_calls": [{"id": "call_calc", "name": "calculate", "arguments": '{"expression": "0.17 * 240"}'}]},
        {"role": "tool", "content": "40.8", "tool_call_id": "call_calc", "name": "calculate"},
        {"role": "assistant", "content": "17% of 240 is 40.8."},
    )  # fmt: skip
    assert transcript.messages[0]["role"] == "system"


def test_responses_string_input_hosted_calls_and_jsonl_items(tmp_path):
    transcript = one(
        write(
            tmp_path / "r.json",
            json.dumps({"input": "search the web", "output": [{"type": "web_search_call", "id": "ws"}]}),
        )
    )
    assert transcript.messages == (
        {"role": "user", "content": "search the web"},
        {"role": "assistant", "content": "[web search call not archived]"},
    )
    assert transcript.dropped == {"web search call": 1}
    items = write_jsonl(tmp_path / "items.jsonl", [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+2?"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "4"},
    ])  # fmt: skip
    assert one(items).messages == (
        {"role": "user", "content": "2+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "name": "add", "arguments": '{"a": 2, "b": 2}'}],
        },
        {"role": "tool", "content": "4", "tool_call_id": "c1", "name": "add"},
    )


# --- ChatGPT data export -----------------------------------------------------------------


def test_chatgpt_export_follows_current_node_and_keeps_edited_branches_as_forks():
    main, fork = read_transcripts(EXAMPLES / "conversations.json")
    assert (main.name, fork.name) == ("Sourdough timing", "Sourdough timing [branch 2]")
    assert main.metadata == {"format": "chatgpt", "id": "6a1f-sourdough"}
    assert fork.metadata == {"format": "chatgpt", "id": "6a1f-sourdough", "branch": 2}
    assert [m["content"] for m in main.messages] == [
        "How long should sourdough rise in a cold kitchen (17 C)?",
        "Plan on 8 to 10 hours at 17 C, or leave it in the fridge overnight and bake in the morning.",
    ]  # the empty, hidden system node holds nothing
    assert fork.messages[0]["content"] == "How long should sourdough rise?"


def test_chatgpt_export_content_types(tmp_path):
    def node(node_id, parent, role, content, **message):
        return node_id, {
            "id": node_id,
            "parent": parent,
            "children": [],
            "message": {"author": {"role": role}, "content": content, **message},
        }

    nodes = dict([
        node("c", None, "system",
             {"content_type": "user_editable_context", "user_profile": "I am a chemist.",
              "user_instructions": "Be terse."}),
        node("u", "c", "user",
             {"content_type": "multimodal_text",
              "parts": [{"content_type": "image_asset_pointer", "asset_pointer": "file-service://x"},
                        "What is this?"]}),
        node("t", "u", "assistant",
             {"content_type": "thoughts", "thoughts": [{"summary": "Looking", "content": "A flask."}]}),
        node("k", "t", "assistant", {"content_type": "code", "language": "python", "text": "print(1)"},
             recipient="python"),
        node("o", "k", "tool", {"content_type": "execution_output", "text": "1"}),
        node("a", "o", "assistant", {"content_type": "text", "parts": ["An Erlenmeyer flask."]}),
    ])  # fmt: skip
    for node_id, value in nodes.items():
        value["children"] = [child for child, v in nodes.items() if v["parent"] == node_id]
    path = write(
        tmp_path / "conversations.json",
        json.dumps([{"title": "Lab", "id": "x", "mapping": nodes, "current_node": "a"}]),
    )
    transcript = one(path)
    assert transcript.messages == (
        {"role": "system", "content": "I am a chemist.\n\nBe terse."},
        {"role": "user", "content": "[image not archived]\nWhat is this?"},
        {
            "role": "assistant",
            "content": "",
            "thinking": "Looking\nA flask.",
            "tool_calls": [{"id": None, "name": "python", "arguments": "print(1)"}],
        },
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": "An Erlenmeyer flask."},
    )
    assert transcript.dropped == {"image": 1}


def test_chatgpt_export_with_broken_parent_links_is_refused(tmp_path):
    mapping = {
        "a": {"id": "a", "parent": "b", "children": [], "message": None},
        "b": {"id": "b", "parent": "a", "children": ["a"], "message": None},
    }
    with pytest.raises(TranscriptError, match="parent links"):
        read_transcripts(
            write(tmp_path / "c.json", json.dumps({"title": "loop", "mapping": mapping, "current_node": "a"}))
        )


# --- Anthropic Messages ---------------------------------------------------------------------


def test_anthropic_system_tool_use_tool_result_thinking_and_image():
    transcript = one(EXAMPLES / "anthropic.json")
    assert transcript.metadata == {"format": "anthropic"}
    assert transcript.messages == (
        {"role": "system",
         "content": ("You are a concise, friendly assistant. "
                     "Answer in plain language and show code only when it helps.")},
        {"role": "user",
         "content": ("[image not archived]\n"
                     "How many rows does the table in this screenshot have? Count them with the tool.")},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "toolu_01A", "name": "count_rows", "arguments": '{"image": 0}'}],
         "thinking": "I cannot see the image well; use the row counter."},
        {"role": "tool", "content": "12", "tool_call_id": "toolu_01A", "name": "count_rows"},
        {"role": "assistant", "content": "The table has 12 rows."},
    )  # fmt: skip
    assert transcript.dropped == {"image": 1}


def test_anthropic_system_blocks_error_results_and_text_after_results(tmp_path):
    transcript = transcript_from_messages([
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}},
                                          {"type": "redacted_thinking", "data": "xx"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                      "content": [{"type": "text", "text": "denied"}]},
                                     {"type": "text", "text": "try sudo"}]},
    ])  # fmt: skip
    assert transcript.messages == (
        {
            "role": "assistant",
            "content": "[redacted thinking not archived]",
            "tool_calls": [{"id": "t1", "name": "ls", "arguments": "{}"}],
        },
        {"role": "tool", "content": "denied", "tool_call_id": "t1", "is_error": True, "name": "ls"},
        {"role": "user", "content": "try sudo"},
    )
    blocks = {
        "system": [{"type": "text", "text": "Rule one."}, {"type": "text", "text": "Rule two."}],
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert one(write(tmp_path / "a.json", json.dumps(blocks))).messages[0] == {
        "role": "system",
        "content": "Rule one.\nRule two.",
    }


# --- agent event logs ------------------------------------------------------------------------


def event(uuid, parent, role, content, session="s1", **extra):
    kind = "user" if role == "user" else "assistant"
    return {
        "parentUuid": parent,
        "type": kind,
        "message": {"role": role, "content": content, **extra.pop("message", {})},
        "uuid": uuid,
        "sessionId": session,
        **extra,
    }


def test_agent_events_follow_the_parent_chain_and_name_the_session_by_its_summary():
    transcript = one(EXAMPLES / "claude-code.jsonl")
    when = {
        "started": "2026-11-30T09:12:01",
        "ended": "2026-11-30T09:12:12",
        "cwd": "/home/ana/repo",
    }  # the events' own (kvdb.transcripts.stamps)
    summary = {
        "title": "Find the failing test"
    }  # kept though it names the session: a later version's summary replaces an earlier prompt
    assert (transcript.name, transcript.metadata) == (
        "Find the failing test",
        {"format": "claude-code", "id": "9c2d-cc", "line": 2} | summary | when,
    )
    assert [m["role"] for m in transcript.messages] == ["user", "assistant", "tool", "assistant"]
    assert transcript.messages[1]["tool_calls"] == [
        {"id": "toolu_1", "name": "Bash", "arguments": '{"command": "pytest -q"}'}
    ]
    assert transcript.messages[2]["name"] == "Bash"


def test_agent_events_group_sessions_merge_streamed_replies_and_keep_branches(tmp_path):
    path = write_jsonl(tmp_path / "log.jsonl", [
        event("u1", None, "user", "first question"),
        {"type": "file-history-snapshot", "messageId": "m", "snapshot": {}},
        event("a1", "u1", "assistant", [{"type": "text", "text": "part one"}], message={"id": "msg_1"}),
        {"parentUuid": "a1", "type": "system", "content": "hook ran", "uuid": "x1", "sessionId": "s1"},
        event("a2", "x1", "assistant", [{"type": "text", "text": "part two"}], message={"id": "msg_1"}),
        event("v1", None, "user", "other session", session="s2"),
        event("u2", "a2", "user", "follow-up"),
        event("u3", "a2", "user", "follow-up, edited"),
    ])  # fmt: skip
    sessions = read_transcripts(path)
    by_name = {t.name: t for t in sessions}
    assert set(by_name) == {"s1", "s1 [branch 2]", "s2"}
    assert [m["content"] for m in by_name["s1"].messages] == [
        "first question",
        "part one\npart two",
        "follow-up, edited",
    ]
    assert [m["content"] for m in by_name["s1 [branch 2]"].messages] == [
        "first question",
        "part one\npart two",
        "follow-up",
    ]
    assert by_name["s1"].dropped == {
        "file-history-snapshot event": 1
    }  # the system event's text is kept, as a side event
    assert by_name["s1"].metadata["side"] == {"events": [{"type": "system", "text": "hook ran"}]}
    assert by_name["s2"].messages == ({"role": "user", "content": "other session"},)


def test_agent_event_without_uuid_is_refused_with_its_line(tmp_path):
    path = write_jsonl(
        tmp_path / "log.jsonl",
        [
            event("u1", None, "user", "a"),
            {
                "parentUuid": "u1",
                "type": "assistant",
                "message": {"role": "assistant", "content": "b"},
                "sessionId": "s1",
            },
        ],
    )
    with pytest.raises(TranscriptError) as caught:
        read_transcripts(path)
    assert (caught.value.line, 'needs a string "uuid"' in caught.value.reason) == (2, True)


def test_a_summary_whose_leaf_is_not_a_string_is_refused_with_its_line(tmp_path):
    """It raised TypeError (an internal error) from using a list as a key."""
    path = write_jsonl(
        tmp_path / "log.jsonl",
        [event("u1", None, "user", "a"), {"type": "summary", "summary": "x", "leafUuid": ["u1"]}],
    )
    with pytest.raises(TranscriptError) as caught:
        read_transcripts(path)
    assert (caught.value.line, 'needs a string "leafUuid"' in caught.value.reason) == (2, True)


# --- LMSYS, Alpaca, ShareGPT ----------------------------------------------------------------------


def test_lmsys_alpaca_and_sharegpt_with_system_turns(tmp_path):
    lmsys = one(EXAMPLES / "lmsys.jsonl")
    assert (lmsys.name, lmsys.metadata["format"], [m["role"] for m in lmsys.messages]) == (
        "33f01b2c",
        "lmsys",
        ["user", "assistant"],
    )
    first, second = read_transcripts(EXAMPLES / "alpaca.json")
    assert first.messages[0] == {"role": "user", "content": "Give three tips for staying healthy."}
    assert second.messages[0] == {
        "role": "user",
        "content": "Translate the sentence into French.\n\nThe library opens at nine.",
    }
    sharegpt = one(write(tmp_path / "sg.json", json.dumps({"system": "Be kind.", "conversations": [
        {"from": "system", "value": "And brief."}, {"from": "human", "value": "weather?"},
        {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Oslo"}}'},
        {"from": "observation", "value": "-3 C"}, {"from": "gpt", "value": "Cold: -3 C."},
    ]})))  # fmt: skip
    assert sharegpt.messages == (
        {"role": "system", "content": "Be kind."},
        {"role": "system", "content": "And brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": None, "name": "weather", "arguments": '{"city": "Oslo"}'}],
        },
        {"role": "tool", "content": "-3 C"},
        {"role": "assistant", "content": "Cold: -3 C."},
    )


def test_alpaca_without_output_is_refused(tmp_path):
    with pytest.raises(TranscriptError, match='needs "output"'):
        read_transcripts(write(tmp_path / "alpaca.json", json.dumps([{"instruction": "x"}])))


# --- layout and encoding from the content ----------------------------------------------------------


def test_layout_is_read_from_the_content_not_the_suffix(tmp_path):
    session = {"messages": [{"role": "user", "content": "a"}]}
    as_lines = write(tmp_path / "lines.json", json.dumps(session) + "\n" + json.dumps(session) + "\n")
    assert len(read_transcripts(as_lines)) == 2
    indented = write(tmp_path / "indented.jsonl", json.dumps(session, indent=2))
    assert one(indented).messages == ({"role": "user", "content": "a"},)
    message_list = write(
        tmp_path / "list.json", json.dumps([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    )
    transcript = one(message_list)
    assert (transcript.name, transcript.metadata, len(transcript.messages)) == ("list", {"format": "messages"}, 2)


@pytest.mark.parametrize("codec", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_utf16_and_utf32_with_a_byte_order_mark_read_as_text(tmp_path, codec):
    mark = {
        "utf-16-le": codecs.BOM_UTF16_LE,
        "utf-16-be": codecs.BOM_UTF16_BE,
        "utf-32-le": codecs.BOM_UTF32_LE,
        "utf-32-be": codecs.BOM_UTF32_BE,
    }[codec]
    text = "Café ☕ 東京 😀\r\nline two\n"
    path = tmp_path / "wide.txt"
    path.write_bytes(mark + text.encode(codec))
    assert one(path).text == text
    lines = tmp_path / "wide.jsonl"
    lines.write_bytes(mark + (json.dumps({"role": "user", "content": "😀 é"}, ensure_ascii=False) + "\n").encode(codec))
    assert one(lines).messages == ({"role": "user", "content": "😀 é"},)


def test_utf16_json_reads_the_same_in_tiny_chunks(tmp_path):
    from unittest import mock

    from kvdb.transcripts import json_stream

    path = tmp_path / "wide.json"
    path.write_bytes(
        codecs.BOM_UTF16_LE
        + json.dumps({"messages": [{"role": "user", "content": "東京 😀" * 5}]}, ensure_ascii=False).encode("utf-16-le")
    )
    expected = one(path)
    for chunk in (1, 2, 3, 7):
        with mock.patch.object(json_stream, "CHUNK", chunk):
            assert one(path) == expected


@pytest.mark.parametrize("data, named", [
    ("Grüße aus Köln\n".encode("utf-16-le"), "iconv -f UTF-16LE -t UTF-8"),
    ("Grüße aus Köln\n".encode("utf-16-be"), "iconv -f UTF-16BE -t UTF-8"),
    ("Grüße aus Köln\n".encode("utf-32-le"), "iconv -f UTF-32LE -t UTF-8"),
    ("Grüße aus Köln\n".encode("latin-1"), "looks like LATIN1 text. Convert it with: iconv -f LATIN1 -t UTF-8"),
    ("“Quoted” – café\n".encode("cp1252"),
     "looks like WINDOWS-1252 text. Convert it with: iconv -f WINDOWS-1252 -t UTF-8"),
])  # fmt: skip
def test_other_encodings_are_refused_naming_the_likely_one_and_the_fix(tmp_path, data, named):
    path = write(tmp_path / "notes.txt", "")
    path.write_bytes(data)
    with pytest.raises(TranscriptError) as caught:
        read_transcripts(path)
    assert named in caught.value.reason
    assert f"{path} > converted.txt" in caught.value.reason


def test_invalid_utf16_after_its_mark_is_refused(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(codecs.BOM_UTF16_LE + "ok".encode("utf-16-le") + b"\x00\xd8")  # a lone high surrogate
    with pytest.raises(TranscriptError, match="UTF-16-LE byte order mark, but is not valid UTF-16-LE"):
        read_transcripts(path)


# --- rendering: nothing added, nothing dropped -------------------------------------------------------


def test_textual_rendering_of_tools_names_and_thinking(tiny_model):
    tokenizer = tok.load_full(tiny_model)
    messages = transcript_from_messages([
        {"role": "user", "name": "ana", "content": "rain?"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "forecast", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "6 mm"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "6 mm is wet."},
                                          {"type": "text", "text": "Yes."}]},
    ]).messages  # fmt: skip
    assert chat.render(tokenizer, messages) == (
        "<|im_start|>user\nana: rain?<|im_end|>\n"
        '<|im_start|>assistant\nChecking.\n<tool_call id="c1" name="forecast">{"city": "Lyon"}</tool_call><|im_end|>\n'
        '<|im_start|>tool\n<tool_result id="c1" name="forecast">\n6 mm\n</tool_result><|im_end|>\n'
        "<|im_start|>assistant\n<thinking>\n6 mm is wet.\n</thinking>\nYes.<|im_end|>\n"
    )


def test_a_template_that_renders_tools_gets_them_structured(tiny_model):
    tokenizer = tok.load_full(tiny_model)
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %}"
        "<call {{ c['id'] }} {{ c['function']['name'] }} {{ c['function']['arguments']['city'] }}>{% endfor %}"
        "{% if m['role'] == 'tool' %}<for {{ m['tool_call_id'] }}>{% endif %}{% endfor %}"
    )
    messages = transcript_from_messages([
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "forecast", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "6 mm"},
    ]).messages  # fmt: skip
    assert chat.render(tokenizer, messages) == "[assistant]<call c1 forecast Lyon>[tool]6 mm<for c1>"


def test_a_default_system_prompt_is_replaced_by_an_empty_system_turn(tiny_model):
    embedded = tok.load_full(None)
    assert chat.writes_default_system(embedded)
    rendered = chat.render(embedded, [{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert "SmolLM" not in chat.render(embedded, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    given = chat.render(embedded, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert given == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    plain = tok.load_full(tiny_model)
    assert plain.chat_template == CHAT_TEMPLATE and not chat.writes_default_system(plain)
    assert chat.render(plain, [{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize(
    "name",
    [
        "openai-tools.json",
        "responses.json",
        "anthropic.json",
        "conversations.json",
        "claude-code.jsonl",
        "lmsys.jsonl",
        "alpaca.json",
        "sharegpt.json",
    ],
)
def test_every_text_of_each_example_reaches_the_rendering(name):
    tokenizer = tok.load_full(None)
    path = EXAMPLES / name
    rendered = "".join(chat.render(tokenizer, t.messages) for t in read_transcripts(path))
    raw = (
        [json.loads(line) for line in path.read_text().splitlines()]
        if name.endswith(".jsonl")
        else json.loads(path.read_text())
    )
    texts = list(conversation_texts(raw))
    assert texts
    for text in texts:
        assert text in rendered


def test_a_placeholder_in_a_reasoning_item_is_counted_once():
    transcript = transcript_from_messages(
        [{"type": "reasoning", "summary": [], "content": [{"type": "image"}, {"type": "reasoning_text", "text": "x"}]}]
    )
    assert transcript.messages == ({"role": "assistant", "content": "", "thinking": "[image not archived]\nx"},)
    assert transcript.dropped == {"image": 1}
