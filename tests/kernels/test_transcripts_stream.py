"""Streaming transcript files: sessions come one at a time, the read size never changes what is
parsed or what an error says, and memory stays bounded by one session whatever the file size."""

import json
import tracemalloc
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import examples

from kvdb.errors import TranscriptError
from kvdb.transcripts import iter_transcripts, json_stream, read_transcripts

TINY_CHUNKS = (1, 2, 3, 5, 7)
PROPERTY = settings(
    max_examples=examples(40),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MB = 1 << 20
USER_A = {"messages": [{"role": "user", "content": "a"}]}


def write(path: Path, content: str | bytes) -> Path:
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


def jsonl_line(obj) -> str:
    return json.dumps(obj) + "\n"


def outcome(path, chunk=None, **limits):
    """(sessions yielded, (reason, line) of the error that stopped them, or None)."""
    sessions = []
    with mock.patch.object(json_stream, "CHUNK", chunk or json_stream.CHUNK):
        try:
            sessions.extend(iter_transcripts(path, **limits))  # keeps the sessions before an error
        except TranscriptError as error:
            assert error.path == str(path)
            return sessions, (error.reason, error.line)
    return sessions, None


def assert_chunk_size_does_not_matter(path, **limits):
    expected = outcome(path, **limits)
    for chunk in TINY_CHUNKS:
        assert outcome(path, chunk, **limits) == expected, f"chunk {chunk}"
    return expected


def too_large(label, size):
    return f"{label} is larger than {size}, the most one session may hold; split it into smaller sessions"


# --- the read size changes nothing -------------------------------------------------

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)  # any character, escapes, emoji
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text
nested = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=8
)
content = text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=3)
openai = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "Assistant", "system"]), "content": content}),
            min_size=1,
            max_size=3,
        )
    },
    optional={"name": text.filter(bool), "id": st.integers(), "extra": nested},
)
sharegpt = st.fixed_dictionaries(
    {
        "conversations": st.lists(
            st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt"]), "value": text}), min_size=1, max_size=3
        )
    },
    optional={"id": text.filter(bool), "extra": nested},
)
dump_styles = st.sampled_from([
    {"separators": (",", ":")},  # minified: one line
    {"separators": (",", ":"), "ensure_ascii": False},
    {},
    {"indent": 2, "ensure_ascii": False},
    {"indent": "\t"},
])  # fmt: skip


@PROPERTY
@given(sessions=st.lists(openai | sharegpt, min_size=1, max_size=5), style=dump_styles, as_list=st.booleans(),
       bom=st.booleans(), padding=st.sampled_from(["", " ", "\n", "\r\n\t "]))  # fmt: skip
def test_any_chunk_size_gives_the_same_sessions(tmp_path_factory, sessions, style, as_list, bom, padding):
    value = sessions if as_list else sessions[0]
    raw = ("\ufeff" if bom else "") + padding + json.dumps(value, **style) + padding
    path = write(tmp_path_factory.mktemp("chunks") / "s.json", raw)

    parsed, error = assert_chunk_size_does_not_matter(path)

    assert error is None
    assert len(parsed) == (len(sessions) if as_list else 1)
    assert parsed == read_transcripts(path)


@PROPERTY
@given(sessions=st.lists(openai, min_size=1, max_size=4), style=dump_styles, data=st.data())
def test_any_chunk_size_gives_the_same_json_error(tmp_path_factory, sessions, style, data):
    raw = json.dumps(sessions, **style)
    at = data.draw(st.integers(0, len(raw)))
    cut = data.draw(st.integers(0, 2))
    raw = raw[:at] + data.draw(st.sampled_from(list('[]{},:"\\ \n0-.eEx'))) + raw[at + cut :]
    path = write(tmp_path_factory.mktemp("broken") / "b.json", raw)

    _, error = assert_chunk_size_does_not_matter(path)

    try:
        json.loads(raw)
    except json.JSONDecodeError as expected:
        assert error is not None
        if error[0].startswith("invalid JSON"):  # not a shape error found before it
            assert error == (f"invalid JSON: {expected.msg} (column {expected.colno})", expected.lineno)


def test_invalid_json_deep_into_a_minified_line_names_its_column(tmp_path):
    good = json.dumps([USER_A] * 40, separators=(",", ":"))
    raw = good[:-1] + ',{"messages":[{"role":"user",,"content":"a"}]}]'
    path = write(tmp_path / "m.json", "\n\n" + raw)

    parsed, error = assert_chunk_size_does_not_matter(path)

    column = raw.index(",,") + 2
    assert column > 1000
    assert (len(parsed), error) == (
        40,
        (f"invalid JSON: Expecting property name enclosed in double quotes (column {column})", 3),
    )
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads("\n\n" + raw)
    assert (expected.value.lineno, expected.value.colno) == (3, column)


def test_a_shape_error_names_the_line_of_its_message(tmp_path):
    sessions = [USER_A] * 3 + [{"messages": [{"role": "user", "content": "a"}, {"role": "alien", "content": "b"}]}]
    raw = json.dumps(sessions, indent=2)
    path = write(tmp_path / "p.json", raw)

    parsed, error = assert_chunk_size_does_not_matter(path)

    assert len(parsed) == 3
    line = raw[: raw.index('"alien"')].count("\n")  # the line of the object holding it: one before
    assert error[0].startswith("session #3: messages[1]: unknown role 'alien'")
    assert error[1] == line


@pytest.mark.parametrize("tail, problem", [
    (b'{"messages": [{"role": "user", "content": "\xe6\x9d("}]}]', b"\xe6"),  # a 3-byte character cut short
    (b'{"messages": [{"role": "user", "content": "\xe6\x9d', b"\xe6"),  # ... by the end of the file
    (b'{"messages": [{"role": "user", "content": "\xe6\x9d\xb1\x00"}]}]', b"\x00"),
    (b'{"messages": [{"role": "\xff"}]}\n\n\x00]', b"\x00"),  # a NUL anywhere says more than a bad byte
])  # fmt: skip
def test_encoding_errors_name_the_byte_whatever_the_chunk_size(tmp_path, tail, problem):
    raw = json.dumps([USER_A, USER_A]).encode()[:-1] + b",\n" + tail
    at = raw.index(problem)
    path = write(tmp_path / "e.json", raw)

    # Sessions before a bad byte are yielded only when it lies beyond the first read, so
    # compare the errors alone.
    _, error = outcome(path)
    assert all(outcome(path, chunk)[1] == error for chunk in TINY_CHUNKS)
    reason = (
        f"binary file (NUL byte at byte {at}), not a transcript"
        if problem == b"\x00"
        else f"invalid UTF-8 at byte {at}"
    )
    assert error == (reason, raw.count(b"\n", 0, at) + 1)


# --- limits -------------------------------------------------------------------------


def test_a_list_element_over_the_limit_names_its_number_and_line(tmp_path):
    sessions = [
        USER_A,
        USER_A,
        {"messages": [{"role": "user", "content": "é" * 600}]},
        USER_A,
    ]  # 1200 bytes, 600 characters
    raw = json.dumps(sessions, indent=1, ensure_ascii=False)
    path = write(tmp_path / "l.json", raw)
    element = json.dumps(sessions[2], indent=1, ensure_ascii=False).replace("\n", "\n ")
    size = len(element.encode())

    parsed, error = assert_chunk_size_does_not_matter(path, max_session_bytes=1024)
    assert (len(parsed), error) == (2, (too_large("session #2", "1 KiB"), raw[: raw.index(element)].count("\n") + 1))

    assert assert_chunk_size_does_not_matter(path, max_session_bytes=size)[1] is None
    assert assert_chunk_size_does_not_matter(path, max_session_bytes=size - 1)[1][0] == too_large(
        "session #2", f"{size - 1} bytes"
    )


def test_a_lone_object_over_the_limit_names_the_line_it_starts_on(tmp_path):
    path = write(tmp_path / "o.json", "\n\n" + json.dumps({"messages": [{"role": "user", "content": "x" * 600}]}))
    _, error = assert_chunk_size_does_not_matter(path, max_session_bytes=512)
    assert error == (too_large("the session", "512 bytes"), 3)


def test_jsonl_limits_each_line_or_the_whole_message_file(tmp_path):
    sessions = write(
        tmp_path / "s.jsonl",
        "".join(map(jsonl_line, [USER_A, USER_A, {"messages": [{"role": "user", "content": "x" * 2100}]}])),
    )
    assert outcome(sessions, max_session_bytes=2048) == (
        read_transcripts(sessions)[:2],
        (too_large("the session", "2 KiB"), 3),
    )
    assert len(outcome(sessions, max_session_bytes=4096)[0]) == 3

    messages = write(tmp_path / "m.jsonl", "\n" + jsonl_line({"role": "user", "content": "y"}) * 10)
    size = messages.stat().st_size - 1  # the one session: every line from its first message on
    assert len(outcome(messages, max_session_bytes=size)[0]) == 1
    assert outcome(messages, max_session_bytes=size - 1) == ([], (too_large("the session", f"{size - 1} bytes"), 2))


def test_text_over_the_limit(tmp_path):
    path = write(tmp_path / "t.txt", "hello\n" * 200)
    assert outcome(path, max_session_bytes=MB) == (read_transcripts(path), None)
    assert outcome(path, max_session_bytes=1000) == ([], (too_large("the session", "1000 bytes"), 1))


def write_huge(path: Path, head: bytes, tail: bytes, megabytes: int = 100) -> Path:
    block = b"x" * MB
    with open(path, "wb") as file:
        file.write(head)
        file.writelines(block for _ in range(megabytes))
        file.write(tail)
    return path


def peak_bytes(call):
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("suffix, head, tail, label", [
    (".json", b'[{"messages": [{"role": "user", "content": "', b'"}]}]', "session #0"),
    (".json", b'{"messages": [{"role": "user", "content": "', b'"}]}', "the session"),
    (".jsonl", b'{"messages": [{"role": "user", "content": "', b'"}]}\n', "the session"),
    (".jsonl", b'{"role": "user", "content": "', b'"}\n', "the session"),
    (".txt", b"", b"\n", "the session"),
])  # fmt: skip
def test_a_100_mb_session_is_refused_without_reading_it(tmp_path, suffix, head, tail, label):
    path = write_huge(tmp_path / f"huge{suffix}", head, tail)

    (_, error), peak = peak_bytes(lambda: outcome(path, max_session_bytes=MB))

    assert error == (too_large(label, "1 MiB"), 1)
    assert peak < 8 * MB


def test_a_30_mb_minified_list_streams_in_bounded_memory(tmp_path):
    session = json.dumps(
        {"messages": [{"role": "user", "content": "q" * 3000}, {"role": "gpt", "content": "東京" * 50}]},
        ensure_ascii=False,
    )
    count = 30 * MB // len(session)
    path = tmp_path / "big.json"
    with open(path, "w", encoding="utf-8") as file:
        file.write("[" + session)
        file.writelines(("," + session) * 1000 for _ in range(count // 1000))
        file.write(("," + session) * (count % 1000 - 1) + "]")
    assert path.stat().st_size > 30 * MB

    counted, peak = peak_bytes(lambda: sum(1 for _ in iter_transcripts(path, max_session_bytes=MB)))

    assert counted == count
    assert peak < 8 * MB


# --- errors come when reached -------------------------------------------------------


@pytest.mark.parametrize("suffix, raw, reason, line", [
    (".json", json.dumps([USER_A, USER_A, {"messages": "hi"}], indent=1), "session #2: messages must be a list", 18),
    (".json", json.dumps([USER_A, USER_A])[:-1] + ", {broken", "invalid JSON: Expecting property name", 1),
    (".jsonl", "\n".join(json.dumps(s) for s in [USER_A, USER_A, {"messages": []}]), "no messages", 3),
])  # fmt: skip
def test_sessions_before_an_error_are_yielded_first(tmp_path, suffix, raw, reason, line):
    path = write(tmp_path / f"lazy{suffix}", raw)
    sessions = iter_transcripts(path)

    assert [next(sessions).name, next(sessions).name] == [
        f"lazy#{n}" for n in ((0, 1) if suffix == ".json" else (1, 2))
    ]
    with pytest.raises(TranscriptError) as caught:
        next(sessions)
    assert (caught.value.reason.startswith(reason), caught.value.line) == (True, line)
    with pytest.raises(TranscriptError):
        read_transcripts(path)  # all or nothing


def test_even_a_missing_file_is_reported_when_iterated(tmp_path):
    sessions = iter_transcripts(tmp_path / "gone.json")
    with pytest.raises(TranscriptError, match="cannot read"):
        next(sessions)


def test_deep_nesting_is_a_transcript_error(tmp_path):
    for suffix in (".json", ".jsonl"):
        path = write(tmp_path / f"deep{suffix}", "[" * 100_000)
        assert outcome(path)[1] == ("invalid JSON: nested too deeply", 1)
