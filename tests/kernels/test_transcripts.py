import json
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from support import EXAMPLES, examples

from kvdb.errors import TranscriptError
from kvdb.transcripts import (
    ROLE_ALIASES,
    SUPPORTED_SUFFIXES,
    Transcript,
    find_transcript_files,
    json_stream,
    read_transcripts,
    transcript_from_messages,
    transcript_from_text,
)


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode("utf-8")
    path.write_bytes(content)
    return path


def jsonl(*objects) -> str:
    return "".join(json.dumps(obj) + "\n" for obj in objects)


def read_error(path) -> TranscriptError:
    with pytest.raises(TranscriptError) as caught:
        read_transcripts(path)
    return caught.value


# --- text ------------------------------------------------------------------


def test_text_is_kept_verbatim_with_crlf_lone_cr_and_unicode(tmp_path):
    raw = "Café ☕ 東京\r\nline two\rline three\n\n  trailing spaces  \r\n".encode()
    path = write(tmp_path / "mixed.txt", raw)

    [transcript] = read_transcripts(path)

    assert transcript.text.encode("utf-8") == raw
    assert transcript == Transcript("mixed", str(path), transcript.text, None, {"format": "text"})


def test_text_keeps_a_byte_order_mark_so_it_round_trips(tmp_path):
    raw = b"\xef\xbb\xbfhello\n"
    [transcript] = read_transcripts(write(tmp_path / "bom.md", raw))
    assert transcript.text.encode("utf-8") == raw


@settings(max_examples=examples(50), deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), min_size=1))
def test_any_nonblank_text_round_trips_byte_exact(tmp_path_factory, text):
    assume(text.strip())
    raw = text.encode("utf-8")
    path = write(tmp_path_factory.mktemp("rt") / "t.txt", raw)
    [transcript] = read_transcripts(path)
    assert transcript.text.encode("utf-8") == raw


def test_source_is_the_path_as_given(tmp_path, monkeypatch):
    write(tmp_path / "notes.md", "# hi\n")
    monkeypatch.chdir(tmp_path)
    [transcript] = read_transcripts("./notes.md")
    assert transcript.source == "./notes.md"
    assert transcript.name == "notes"


def test_transcript_from_text():
    transcript = transcript_from_text("a\r\nb", name="pasted")
    assert (transcript.name, transcript.source, transcript.text) == ("pasted", "<text>", "a\r\nb")
    assert transcript.messages is None
    assert transcript.metadata == {"format": "text"}


@pytest.mark.parametrize("bad", ["", " \n\t", None, b"bytes"])
def test_transcript_from_text_rejects_empty_or_non_string(bad):
    with pytest.raises(TranscriptError) as caught:
        transcript_from_text(bad)
    assert caught.value.path == "<text>"


# --- jsonl -----------------------------------------------------------------


def test_jsonl_with_one_message_per_line_is_one_session(tmp_path):
    path = write(
        tmp_path / "chat.jsonl",
        jsonl(
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "name": "bot"},
        ),
    )

    [transcript] = read_transcripts(path)

    assert transcript.name == "chat"
    assert transcript.source == str(path)
    assert transcript.text is None
    assert transcript.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "name": "bot"},
    )
    assert transcript.metadata == {"format": "messages"}


def test_jsonl_with_one_session_per_line_names_each_session(tmp_path):
    message = [{"role": "user", "content": "x"}]
    path = write(
        tmp_path / "s.jsonl",
        jsonl(
            {"id": "a1", "name": "first", "messages": message},
            {"id": 42, "messages": message},
        )
        + "\n"  # a blank line is skipped but still counted
        + jsonl({"conversations": [{"from": "human", "value": "y"}]}),
    )

    transcripts = read_transcripts(path)

    assert [t.name for t in transcripts] == ["first", "42", "s#4"]
    assert [t.source for t in transcripts] == [f"{path}#L1", f"{path}#L2", f"{path}#L4"]
    assert [t.metadata for t in transcripts] == [
        {"format": "openai", "id": "a1"},
        {"format": "openai", "id": 42, "title": "x"},  # named by an id or a line: titled by the first prompt
        {"format": "sharegpt", "title": "y"},
    ]
    assert transcripts[2].messages == ({"role": "user", "content": "y"},)


def test_null_id_and_name_count_as_absent(tmp_path):
    path = write(
        tmp_path / "n.jsonl", jsonl({"id": None, "name": None, "messages": [{"role": "user", "content": "a"}]})
    )
    [transcript] = read_transcripts(path)
    assert (transcript.name, transcript.metadata) == ("n#1", {"format": "openai", "title": "a"})


def test_jsonl_accepts_crlf_line_endings_and_a_bom(tmp_path):
    raw = "\ufeff" + jsonl({"role": "user", "content": "a"}).replace("\n", "\r\n")
    [transcript] = read_transcripts(write(tmp_path / "w.jsonl", raw))
    assert transcript.messages == ({"role": "user", "content": "a"},)


# --- json ------------------------------------------------------------------


def test_openai_json_joins_text_parts_and_maps_roles(tmp_path):
    data = {
        "id": "conv-9",
        "messages": [
            {"role": "developer", "content": "Rules."},
            {"role": "User", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
    }
    path = write(tmp_path / "o.json", json.dumps(data))

    [transcript] = read_transcripts(path)

    assert transcript.name == "conv-9"
    assert transcript.source == str(path)
    assert transcript.metadata == {"format": "openai", "id": "conv-9", "title": "one two"}
    assert transcript.messages == (
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "one\ntwo"},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    )


def test_sharegpt_json_maps_every_documented_role(tmp_path):
    expected = {
        "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
        "model": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
        "system": "system", "tool": "tool", "function": "tool", "observation": "tool",
    }  # fmt: skip
    conversation = [{"from": role, "value": role} for role in expected]
    path = write(tmp_path / "sg.json", json.dumps({"conversations": conversation}))

    [transcript] = read_transcripts(path)

    assert transcript.metadata == {"format": "sharegpt"}
    assert transcript.messages == tuple({"role": expected[r], "content": r} for r in expected)
    assert set(ROLE_ALIASES.values()) == {"user", "assistant", "system", "tool"}


def test_json_list_mixes_formats_and_names_unnamed_items_by_index(tmp_path):
    data = [
        {"name": "named", "messages": [{"role": "user", "content": "a"}]},
        {"conversations": [{"from": "human", "value": "b"}]},
    ]
    path = write(tmp_path / "many.json", json.dumps(data))

    first, second = read_transcripts(path)

    assert (first.name, first.source, first.metadata) == ("named", f"{path}#0", {"format": "openai"})
    assert (second.name, second.source, second.metadata) == (
        "many#1",
        f"{path}#1",
        {"format": "sharegpt", "title": "b"},
    )


def test_transcript_from_messages_normalises_like_files():
    transcript = transcript_from_messages([{"from": "gpt", "value": "hi"}], name="live")
    assert transcript.name == "live"
    assert transcript.source == "<messages>"
    assert transcript.messages == ({"role": "assistant", "content": "hi"},)
    assert transcript.metadata == {"format": "messages"}


@pytest.mark.parametrize(
    "messages, reason",
    [
        ([], "no messages"),
        ("hi", "messages must be a list"),
        ([{"role": "wizard", "content": "x"}], "unknown role 'wizard'"),
        ([{"role": "user", "content": 3}], "must be a string, null or a list of content parts"),
    ],
)
def test_transcript_from_messages_rejects_bad_input(messages, reason):
    with pytest.raises(TranscriptError) as caught:
        transcript_from_messages(messages)
    assert caught.value.path == "<messages>"
    assert reason in str(caught.value)


# --- directories -----------------------------------------------------------


def test_directories_are_expanded_recursively_sorted_and_filtered(tmp_path):
    for name in ["b.txt", "a.md", "sub/c.jsonl", "sub/deeper/d.json", "a-z.json", "README", "x.csv",
                 ".hidden.txt", ".git/e.txt", "sub/.cache/f.md", "upper.TXT"]:  # fmt: skip
        write(tmp_path / name, "x")

    found = find_transcript_files([tmp_path])

    relative = [p.relative_to(tmp_path).as_posix() for p in found]
    assert relative == ["a-z.json", "a.md", "b.txt", "sub/c.jsonl", "sub/deeper/d.json", "upper.TXT"]
    assert find_transcript_files([tmp_path]) == found


def test_explicit_files_are_kept_in_order_once(tmp_path):
    a = write(tmp_path / "a.txt", "a")
    z = write(tmp_path / "d" / "z.txt", "z")
    assert find_transcript_files([z, str(tmp_path / "d"), a]) == [z, a]


def test_missing_path_is_an_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(TranscriptError) as caught:
        find_transcript_files([missing])
    assert str(caught.value) == f"{missing}: no such file or directory"


def test_explicit_unsupported_file_names_the_supported_suffixes(tmp_path):
    path = write(tmp_path / "data.csv", "a,b")
    for call in (find_transcript_files, lambda p: read_transcripts(p[0])):
        with pytest.raises(TranscriptError) as caught:
            call([path])
        assert str(path) in str(caught.value)
        assert all(suffix in str(caught.value) for suffix in SUPPORTED_SUFFIXES)


def test_a_bad_file_does_not_stop_the_others(tmp_path):
    write(tmp_path / "good.txt", "fine")
    write(tmp_path / "bad.jsonl", jsonl({"role": "user", "content": "a"}) + "{oops\n")
    write(tmp_path / "good2.jsonl", jsonl({"role": "user", "content": "b"}))

    parsed, failures = {}, {}
    for path in find_transcript_files([tmp_path]):
        try:
            parsed[path.name] = read_transcripts(path)
        except TranscriptError as error:
            failures[path.name] = error

    assert sorted(parsed) == ["good.txt", "good2.jsonl"]
    assert list(failures) == ["bad.jsonl"]
    assert failures["bad.jsonl"].line == 2


def test_directory_passed_to_read_transcripts_is_an_error(tmp_path):
    (tmp_path / "dir.json").mkdir()
    error = read_error(tmp_path / "dir.json")
    assert "cannot read" in error.reason


# --- bad input: each error names the file and the line ---------------------

BAD_JSONL = [
    ("empty", b"", "empty transcript", None),
    ("blank lines only", b"\n  \n\r\n", "empty transcript", None),
    ("invalid json", b'{"role": "user", "content": "a"}\n{"role": \n', "invalid JSON", 2),
    ("invalid utf-8", b'{"role": "user", "content": "a"}\n{"role": "user", "content": "\xff"}\n',
     "invalid UTF-8 at byte 62", 2),
    ("binary", b'{"role": "user", "content": "a"}\n\x00\x01\x02', "binary file", 2),
    ("unknown role", jsonl({"role": "user", "content": "a"}, {"role": "narrator", "content": "b"}),
     "unknown role 'narrator'; allowed roles: assistant, bard", 2),
    ("content not a string", jsonl({"role": "user", "content": 5}),
     "must be a string, null or a list of content parts, not a number", 1),
    ("missing content", jsonl({"role": "user", "content": "a"}, {"role": "user"}), 'has no "content"', 2),
    ("role not a string", jsonl({"role": None, "content": "a"}), '"role" must be a string, not null', 1),
    ("message not an object", jsonl({"role": "user", "content": "a"}, ["user", "a"]), "got a list", 2),
    ("messages not a list", jsonl({"messages": [{"role": "user", "content": "a"}]}, {"messages": "hi"}),
     "messages must be a list, not a string", 2),
    ("session without messages", jsonl({"messages": [{"role": "user", "content": "a"}]}, {}),
     "no session of any format", 2),
    ("empty messages list", jsonl({"messages": [{"role": "user", "content": "a"}]}, {"messages": []}),
     "no messages", 2),
    ("bad message inside a session",
     jsonl({"messages": [{"role": "user", "content": "a"}, {"role": "x", "content": "b"}]}),
     "messages[1]: unknown role 'x'", 1),
    ("message line among sessions",
     jsonl({"messages": [{"role": "user", "content": "a"}]}, {"role": "user", "content": "b"}),
     "no session of any format", 2),
    ("session line among messages", jsonl({"role": "user", "content": "a"}, {"messages": []}),
     'expected a message object', 2),
    ("name not a string", jsonl({"name": 7, "messages": [{"role": "user", "content": "a"}]}),
     '"name" must be a non-empty string', 1),
    ("id not a scalar", jsonl({"name": "n", "id": {"a": 1}, "messages": [{"role": "user", "content": "a"}]}),
     '"id" must be', 1),
]  # fmt: skip

BAD_JSON = [
    ("empty", b"", "empty transcript", None),
    ("whitespace", b" \n ", "empty transcript", None),
    ("syntax", b'{\n  "messages": [\n    {"role": "user",, "content": "a"}\n  ]\n}', "invalid JSON", 3),
    ("invalid utf-8", b'{"messages": [\n\n {"role": "user", "content": "\xc3\x28"}]}', "invalid UTF-8 at byte 46", 3),
    ("binary", b"\x89PNG\r\n\x1a\n\x00\x00", "binary file (NUL byte at byte 8)", 3),
    ("top level not an object", b'"hello"', "got a string", None),
    ("empty list", b"[]", "no sessions", None),
    ("no session key", b'{\n"id": 1\n}', "no session of any format", 1),
    ("messages not a list", b'{"messages": {"role": "user"}}', "messages must be a list, not an object", 1),
    ("empty messages", b'{\n  "messages": []\n}', "no messages", 1),
    ("unknown role, located",
     b'{"messages": [\n  {"role": "user", "content": "a"},\n  {"role": "alien", "content": "b"}\n]}',
     "messages[1]: unknown role 'alien'", 3),
    ("sharegpt unknown role",
     b'{"conversations": [\n  {"from": "human", "value": "a"},\n  {"from": "robot", "value": "b"}\n]}',
     "unknown role 'robot'", 3),
    ("sharegpt value not a string", b'{"conversations": [\n  {"from": "human", "value": 5}\n]}', '"value"', 2),
    ("message not an object falls back to its session",
     b'[\n {"messages": [{"role": "user", "content": "a"}]},\n {"messages": [\n  "hi"]}\n]',
     "session #1: messages[0]", 3),
    ("list item not an object", b'[{"messages": [{"role": "user", "content": "a"}]}, 3]',
     "session #1: expected a session object", None),
    ("text part without text", b'{"messages": [\n{"role": "user", "content": [{"type": "text"}]}]}',
     "needs a string", 2),
]  # fmt: skip


@pytest.mark.parametrize("suffix, content, reason, line", [
    *[pytest.param(".jsonl", c, r, n, id=f"jsonl-{i}") for i, c, r, n in BAD_JSONL],
    *[pytest.param(".json", c, r, n, id=f"json-{i}") for i, c, r, n in BAD_JSON],
    pytest.param(".txt", b"", "empty transcript", None, id="txt-empty"),
    pytest.param(".md", b"\n \r\n", "empty transcript", None, id="md-blank"),
    pytest.param(".txt", b"caf\xc3\xa9\nna\xefve\n", "invalid UTF-8 at byte 8", 2, id="txt-invalid-utf8"),
    pytest.param(".md", b"\x7fELF\x02\x01\x01\x00\x00", "binary file", 1, id="md-binary"),
])  # fmt: skip
def test_bad_input_is_a_transcript_error_naming_file_and_line(tmp_path, suffix, content, reason, line):
    path = write(tmp_path / f"bad{suffix}", content)

    error = read_error(path)

    assert reason in error.reason
    assert error.line == line
    expected_where = f"{path}:{line}" if line is not None else str(path)
    assert str(error).startswith(f"{expected_where}: ")


@pytest.mark.parametrize("content", [pytest.param(c, id=i) for i, c, _, _ in BAD_JSON])
def test_bad_json_reads_the_same_in_tiny_chunks(tmp_path, content):
    path = write(tmp_path / "bad.json", content)
    expected = read_error(path)
    for chunk in range(1, 8):
        with mock.patch.object(json_stream, "CHUNK", chunk):
            assert (read_error(path).reason, read_error(path).line) == (expected.reason, expected.line)


def test_unknown_role_error_lists_every_allowed_role(tmp_path):
    path = write(tmp_path / "r.jsonl", jsonl({"role": "narrator", "content": "b"}))
    error = read_error(path)
    assert all(role in str(error) for role in ROLE_ALIASES)


def test_a_file_with_one_bad_session_yields_no_sessions(tmp_path):
    good = {"messages": [{"role": "user", "content": "a"}]}
    path = write(tmp_path / "s.jsonl", jsonl(good, good, good, {"messages": [{"role": "user", "content": 5}]}))
    assert read_error(path).line == 4


# --- the shipped examples --------------------------------------------------


def test_examples_cover_every_format_and_parse():
    files = find_transcript_files([EXAMPLES])
    by_file = {p.name: read_transcripts(p) for p in files}
    formats = {t.metadata["format"] for ts in by_file.values() for t in ts}
    assert formats == {
        "text", "messages", "openai", "sharegpt", "anthropic", "openai-responses", "chatgpt",
        "claude-code", "lmsys", "alpaca",
    }  # fmt: skip
    assert 3 <= len(by_file["chat.jsonl"][0].messages) <= 6
    assert 2 <= len(by_file["sessions.jsonl"]) <= 3
    assert all(p.stat().st_size < 1536 for p in files)
    assert any(ord(c) > 0xFFFF for c in by_file["notes.md"][0].text)  # an emoji
    assert any("\u4e00" <= c <= "\u9fff" for c in by_file["notes.md"][0].text)  # CJK


def test_examples_share_a_system_prompt_for_prefix_sharing():
    sessions = [t for p in find_transcript_files([EXAMPLES]) for t in read_transcripts(p) if t.messages]
    system_prompts = [t.messages[0]["content"] for t in sessions if t.messages[0]["role"] == "system"]
    assert len(system_prompts) > len(set(system_prompts))


# --- one bad record never costs a file (the ingest's default; read_transcripts stays strict) ---


def _lenient(path) -> tuple[list[Transcript], list[dict]]:
    from kvdb.transcripts import iter_transcripts

    skipped: list[dict] = []
    return list(iter_transcripts(path, skipped=skipped)), skipped


def test_a_malformed_line_is_left_out_and_named_and_the_rest_is_read(tmp_path):
    path = write(
        tmp_path / "m.jsonl",
        jsonl({"role": "user", "content": "one"})
        + '{"role": \n'
        + jsonl({"role": "narrator", "content": "x"}, {"role": "assistant", "content": "two"}),
    )
    [session], skipped = _lenient(path)
    assert [m["content"] for m in session.messages] == ["one", "two"]
    assert [s["line"] for s in skipped] == [2, 3]
    assert "invalid JSON" in skipped[0]["reason"] and "unknown role 'narrator'" in skipped[1]["reason"]
    assert read_error(path).line == 2  # strict: the file fails at its first bad line, as before


def test_a_bad_session_of_a_json_list_is_left_out_and_named_and_the_rest_is_read(tmp_path):
    good = lambda text: {"messages": [{"role": "user", "content": text}]}  # noqa: E731
    path = write(
        tmp_path / "list.json",
        "[\n" + ",\n".join(json.dumps(s) for s in [good("one"), {"colour": "blue"}, good("three")]) + "\n]\n",
    )
    sessions, skipped = _lenient(path)
    assert [s.messages[0]["content"] for s in sessions] == ["one", "three"]
    assert skipped == [{"line": 3, "reason": skipped[0]["reason"]}] and skipped[0]["reason"].startswith(
        "session #1: an object with keys"
    )
    assert read_error(path).line == 3  # strict: the file fails there, as before
    broken = write(tmp_path / "broken.json", '[{"messages": [{"role": "user", "content": "a"}]}, {"messages": ]')
    with pytest.raises(TranscriptError, match="invalid JSON"):  # JSON that does not parse is never skipped past
        _lenient(broken)


def test_an_agent_logs_bad_events_are_left_out_and_its_first_good_record_sets_the_layout(tmp_path):
    event = lambda uuid, parent, role, text: {  # noqa: E731
        "type": role,
        "uuid": uuid,
        "parentUuid": parent,
        "sessionId": "s",
        "message": {"role": role, "content": text},
    }
    path = write(
        tmp_path / "log.jsonl",
        "not json at all\n"
        + jsonl(
            event("a", None, "user", "hello"),
            "a bare string line",
            {
                "type": "user",
                "uuid": None,
                "parentUuid": "a",
                "message": {"role": "user", "content": "[Request interrupted by user]"},
            },
            event("b", "a", "assistant", "hi there"),
        ),
    )
    [session], skipped = _lenient(path)
    assert [m["content"] for m in session.messages] == ["hello", "hi there"]
    assert [s["line"] for s in skipped] == [1, 3, 4]


def test_a_log_of_summaries_alone_is_empty_not_failed(tmp_path):
    from kvdb.errors import EmptyTranscript

    path = write(
        tmp_path / "summaries.jsonl",
        jsonl(
            {"type": "summary", "summary": "Fixing the build", "leafUuid": "x1"},
            {"type": "summary", "summary": "Docs", "leafUuid": "x2"},
        ),
    )
    with pytest.raises(EmptyTranscript, match="2 summaries of sessions in other files"):
        _lenient(path)
    with pytest.raises(EmptyTranscript):
        _lenient(write(tmp_path / "blank.txt", "\n"))


def test_a_file_of_bad_lines_alone_fails_naming_the_first(tmp_path):
    from kvdb.errors import EmptyTranscript

    path = write(tmp_path / "bad.jsonl", "{oops\n[1, 2\n")
    with pytest.raises(
        TranscriptError, match="no line holds a record kvdb reads \\(2 skipped; the first, line 1: invalid JSON"
    ) as caught:
        _lenient(path)
    assert not isinstance(caught.value, EmptyTranscript)


def test_every_export_fixture_names_its_source_and_licence():
    """Fixtures from other projects come in with where they came from (tests/fixtures/README.md)."""
    root = Path(__file__).resolve().parents[1] / "fixtures"
    readme = (root / "README.md").read_text()
    files = sorted(
        p
        for p in (root / "exports").rglob("*")
        if p.is_file() and not p.name.startswith("LAYOUTS") and p.name != "text-keys.toml"
    )  # text-keys.toml: what test_export_fixtures checks
    assert len(files) >= 30
    unlisted = [p.name for p in files if f"`{p.name}`" not in readme]
    assert unlisted == []
    licensed, heading = [], ""
    for line in readme.splitlines():  # a row names its licence, or the heading of its table does for all of them
        heading = line if line.startswith("#") else heading
        if line.startswith("| `") and any(f"`{p.name}`" in line for p in files):
            licensed.append(
                any(word in line + heading for word in ("MIT", "Apache-2.0", "SYNTHETIC", "CC0", "| same |"))
            )
    assert len(licensed) >= len(files) and all(licensed)


def test_a_claude_code_log_that_opens_with_a_snapshot_record_reads_whole():
    """Claude Code 2.1 opens a log with a "file-history-snapshot" record, which is no event of
    the chain (no uuid): it waits for the next record to set the layout, and is counted."""
    path = Path(__file__).resolve().parents[1] / "fixtures" / "exports" / "claude-code" / "spotter-short.jsonl"
    sessions, skipped = _lenient(path)
    assert skipped == [] and sessions and sessions[0].metadata["format"] == "claude-code"
    assert sessions[0].dropped.get("file-history-snapshot event") == 1
    assert read_transcripts(path)  # strict reads it too


def test_records_that_wait_for_a_layout_are_named_when_none_comes(tmp_path):
    path = write(tmp_path / "odd.jsonl", jsonl({"type": "file-history-snapshot", "snapshot": {}}) + "{oops\n")
    with pytest.raises(TranscriptError, match="2 skipped; the first, line 1"):
        _lenient(path)
    assert read_error(path).line == 2


def test_an_event_log_of_records_kvdb_does_not_read_fails_rather_than_reads_as_empty(tmp_path):
    """Records that carry "sessionId" like Claude Code's events but hold no Claude Code message
    (a tool's log kvdb does not know): "empty" (exit 0) would drop their text silently, so it fails, named."""
    from kvdb.errors import EmptyTranscript

    note = {"sessionId": "s1", "type": "note", "uuid": "n1", "parentUuid": None, "text": "a note kvdb does not read"}
    path = write(tmp_path / "notes.jsonl", jsonl(note, dict(note, uuid="n2", parentUuid="n1")))
    with pytest.raises(TranscriptError, match="no user or assistant messages") as caught:
        _lenient(path)
    assert not isinstance(caught.value, EmptyTranscript)


def test_parallel_tool_calls_of_a_claude_code_log_are_one_conversation_not_branches():
    """With parallel tool calls Claude Code writes a reply as one event per call and each result
    as the child of its own call: read by links alone, all but one result looked like branches
    (this sub-agent log read as 10 sessions). Every call and every result is in the one."""
    path = (
        Path(__file__).resolve().parents[1]
        / "fixtures"
        / "exports"
        / "claude-code"
        / "spotter-subagent-agent-aac57f5.jsonl"
    )
    [session], skipped = _lenient(path)
    assert skipped == []
    calls, results = {}, {}
    for line in path.read_text().splitlines():
        for part in (json.loads(line).get("message") or {}).get("content") or []:
            if isinstance(part, dict) and part.get("type") == "tool_use":
                calls[part["id"]] = part["name"]
            if isinstance(part, dict) and part.get("type") == "tool_result":
                text = (
                    part["content"]
                    if isinstance(part["content"], str)
                    else "".join(p.get("text", "") for p in part["content"])
                )
                results[part["tool_use_id"]] = text
    assert len(calls) == len(results) == 12
    held = json.dumps(session.messages)
    texts = "".join(m["content"] for m in session.messages if isinstance(m.get("content"), str))
    assert all(call in held for call in calls) and all(text[:200] in texts for text in results.values())


def test_a_skipped_message_counts_no_placeholder_and_waiting_records_count_against_the_limit(tmp_path):
    from kvdb.transcripts import iter_transcripts

    path = write(
        tmp_path / "m.jsonl",
        jsonl(
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": 5}]},
            {"role": "assistant", "content": "a"},
        ),
    )
    [session], skipped = _lenient(path)
    assert [s["line"] for s in skipped] == [
        2
    ] and session.dropped == {}  # the image of the refused message is not counted
    snapshot = json.dumps({"type": "file-history-snapshot", "snapshot": {"pad": "x" * 200}}) + "\n"
    event = {
        "type": "user",
        "uuid": "u1",
        "parentUuid": None,
        "sessionId": "s",
        "message": {"role": "user", "content": "hi"},
    }
    big = write(tmp_path / "log.jsonl", snapshot * 3 + jsonl(event))
    with pytest.raises(TranscriptError, match="larger than"):
        list(iter_transcripts(big, max_session_bytes=400, skipped=[]))


def test_a_cycle_of_parent_links_ends_the_chain():
    """A damaged log whose links loop (A -> B -> A) is read, not looped over forever."""
    from kvdb.transcripts.formats.claude_code import EventLog

    log = EventLog("s", "s.jsonl")
    for line, (uuid, parent, role) in enumerate(
        [("a", "b", "user"), ("b", "a", "assistant"), ("c", "b", "user")], start=1
    ):
        log.add(
            {
                "type": role,
                "uuid": uuid,
                "parentUuid": parent,
                "sessionId": "s",
                "message": {"role": role, "content": uuid},
            },
            line,
        )
    [session] = log.sessions()
    assert [m["content"] for m in session.messages] == ["a", "b", "c"]
