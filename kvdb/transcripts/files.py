"""Transcript files into sessions: verbatim text (``.txt``, ``.md``), or JSON and JSONL
whose layout is read from their content.

``iter_transcripts`` streams a file one session at a time, so memory holds about one session
(plus a read buffer) however large the file is, and ``max_session_bytes`` refuses a session
before it is read into memory. Its errors come when reached, after the sessions before them,
so a caller that must not archive half a file takes them all before writing any (the ingest does).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from kvdb.errors import EmptyTranscript, TranscriptError
from kvdb.transcripts.encoding import decode, open_utf8, transcoding_error
from kvdb.transcripts.events import EventLog, is_event
from kvdb.transcripts.json_stream import JsonStream
from kvdb.transcripts.limits import too_large
from kvdb.transcripts.messages import Conversation, Invalid
from kvdb.transcripts.sessions import Transcript, chat, from_object

SUPPORTED_SUFFIXES = (".txt", ".md", ".jsonl", ".json")
WAITING_RECORDS = 64  # records held while none has set a JSONL file's layout; past them, the next decides as it can
# JSON keys that make an object a session, not a message, wherever they appear
_SESSION_MARKS = ("messages", "conversations", "conversation", "mapping", "instruction", "input", "instructions")


def find_transcript_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand directories (recursively, sorted, hidden entries skipped) into transcript files.

    A file named explicitly must have a supported suffix, since the user clearly meant it;
    inside directories other files are skipped silently. Duplicates are listed once.
    """
    found: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found.extend(_walk(path))
        elif not path.exists():
            raise TranscriptError(given, "no such file or directory")
        elif _suffix(path) not in SUPPORTED_SUFFIXES:
            raise TranscriptError(given, _unsupported(path))
        else:
            found.append(path)
    return list(dict.fromkeys(found))


def iter_transcripts(path: str | Path, max_session_bytes: int | None = None, skipped: list[dict] | None = None) -> Iterator[Transcript]:
    """Yield the sessions of one file as they are read; a TranscriptError comes when reached
    (``EmptyTranscript`` for a file with nothing to archive).

    A session taking more than ``max_session_bytes`` bytes of the file is refused, naming the
    line where it starts, after reading at most about that many bytes (plus one chunk).
    ``skipped``: given a list, a JSON Lines record that is malformed (not JSON, or not a
    record of the file's layout) is left out and named there as ``{"line", "reason"}``, and
    the rest of the file is read; without one, it fails the file.
    """
    shown = os.fspath(path)
    suffix = _suffix(Path(shown))
    if suffix not in SUPPORTED_SUFFIXES:
        raise TranscriptError(shown, _unsupported(Path(shown)))
    try:
        with open(shown, "rb") as raw:
            file = open_utf8(raw)
            if suffix in (".txt", ".md"):
                yield from _iter_text(file, shown, max_session_bytes)
            else:
                yield from _iter_json_file(file, shown, max_session_bytes, suffix == ".jsonl", skipped)
    except OSError as error:
        raise TranscriptError(shown, f"cannot read: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise transcoding_error(error, shown) from None


def read_transcripts(path: str | Path) -> list[Transcript]:
    """Parse one file into its sessions; raises TranscriptError and returns nothing on any problem."""
    return list(iter_transcripts(path))


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def _unsupported(path: Path) -> str:
    given = repr(path.suffix) if path.suffix else "no suffix"
    return f"unsupported file type ({given}); supported: {', '.join(SUPPORTED_SUFFIXES)}"


def _walk(root: Path) -> list[Path]:
    def unreadable(error: OSError):
        raise TranscriptError(error.filename, f"cannot read directory: {error.strerror or error}")

    files: list[Path] = []
    for directory, subdirectories, names in os.walk(root, onerror=unreadable):
        subdirectories[:] = [d for d in subdirectories if not d.startswith(".")]
        files.extend(Path(directory, name) for name in names if not name.startswith(".") and _suffix(Path(name)) in SUPPORTED_SUFFIXES)
    return sorted(files)


def _iter_text(file, shown: str, limit: int | None) -> Iterator[Transcript]:
    if limit is not None and os.fstat(file.fileno()).st_size > limit:
        raise TranscriptError(shown, too_large("the session", limit), 1)
    text = decode(file.read(), shown)
    if not text.strip():
        raise EmptyTranscript(shown, "empty transcript")
    yield Transcript(Path(shown).stem, shown, text, None, {"format": "text"})


def _iter_json_file(file, shown: str, limit: int | None, jsonl: bool, skipped: list[dict] | None) -> Iterator[Transcript]:
    """JSON Lines or one JSON value, whichever the content is: a ``.json`` holding one object per
    line reads as JSONL, and a ``.jsonl`` holding one value over several lines reads as JSON."""
    as_jsonl = _looks_like_jsonl(file, jsonl)
    file.seek(0)  # a byte order mark read again is skipped by both readers
    yield from (_iter_jsonl(file, shown, limit, skipped) if as_jsonl else _iter_json(file, shown, limit))


def _looks_like_jsonl(file, jsonl: bool) -> bool:
    """From the first two non-blank lines: JSONL is a whole object on a line, and another after it."""
    lines = (raw for raw in iter(lambda: file.readline(1 << 16), b"") if raw.strip())
    first = next(lines, b"")
    if not first.endswith(b"\n"):  # the only line, or one too long to look at
        return jsonl
    try:
        value = json.loads(first.decode("utf-8", errors="replace").lstrip("\ufeff"))
    except ValueError:
        return jsonl and not first.rstrip().endswith((b"{", b"["))  # else the start of an indented value
    if jsonl:
        return True
    second = next(lines, b"")
    return isinstance(value, dict) and second.lstrip().startswith(b"{")


def _iter_jsonl(file, shown: str, limit: int | None, skipped: list[dict] | None) -> Iterator[Transcript]:
    """The first record decides the layout: a session per line, one message per line, or agent
    events. A malformed record fails the file, or with ``skipped`` is named there and left out.

    Lines are read with a bounded ``readline`` so that an oversized one never sits in memory;
    when the whole file is one session (messages or events), its lines count together.
    """
    stem = Path(shown).stem
    conversation, events = Conversation(), EventLog(stem, shown)
    layout = first = None
    waiting: list[tuple[int, object]] = []  # (line, record) read before any record set the layout
    offset = used = 0
    for line in itertools.count(1):
        if layout in (None, "sessions") and not waiting:  # records waiting for a layout count together
            used = 0
        raw = file.readline(-1 if limit is None else limit - used + 1)
        if not raw:
            break
        used += len(raw)
        if limit is not None and used > limit:
            raise TranscriptError(shown, too_large("the session", limit), line if layout in (None, "sessions") else first)
        text = decode(raw, shown, line, offset)
        offset += len(raw)
        if line == 1:
            text = text.removeprefix("\ufeff")
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as error:
            obj = Invalid(f"invalid JSON: {error.msg} (column {error.colno})")
        except RecursionError:
            obj = Invalid("invalid JSON: nested too deeply")
        if (
            layout is None and _undecided(obj) and len(waiting) < WAITING_RECORDS
        ):  # a typed record of no layout (an agent log's snapshot line): the next decides
            waiting.append((line, obj))
            continue
        decided = layout is None
        for at, record in [(line, obj), *(waiting if decided else ())]:  # the record that sets the layout, then those read before it
            try:
                if isinstance(record, Invalid):
                    raise record
                kind_of_line = layout or ("events" if is_event(record) else "sessions" if _is_session(record) else "messages")
                if kind_of_line == "sessions":
                    sessions = from_object(record, f"{stem}#{at}", f"{shown}#L{at}")
                elif kind_of_line == "events":
                    events.add(record, at)
                else:
                    conversation.add(record)
            except Invalid as error:
                if skipped is None:
                    raise TranscriptError(shown, str(error), at) from None
                skipped.append({"line": at, "reason": str(error)})
                if layout is None:
                    break  # it set nothing: those read before wait for the next
                continue
            if layout is None:
                layout, first = kind_of_line, at
            if layout == "sessions":
                yield from sessions
        if decided and layout is not None:
            waiting.clear()
    for at, record in waiting:  # nothing decided the layout: they are what they looked like, records of none
        reason = str(record if isinstance(record, Invalid) else _as_message_error(record))
        if skipped is None:
            raise TranscriptError(shown, reason, at)
        skipped.append({"line": at, "reason": reason})
    if skipped:
        skipped.sort(key=lambda skip: skip["line"])  # the records waiting for a layout were taken after the one that set it
    if layout is None:
        if skipped:
            raise TranscriptError(
                shown, f"no line holds a record kvdb reads ({len(skipped)} skipped; the first, line {skipped[0]['line']}: {skipped[0]['reason']})"
            )
        raise EmptyTranscript(shown, "empty transcript")
    try:
        if layout == "messages":
            yield chat(stem, shown, conversation, {"format": "jsonl-messages"})
        elif layout == "events":
            found = events.sessions()
            if not found:  # summaries alone: nothing to archive; other records: a layout kvdb may misread, never "empty"
                raise (EmptyTranscript if events.summaries_only() else TranscriptError)(shown, events.why_empty())
            yield from found
    except Invalid as error:
        raise TranscriptError(shown, str(error)) from None


def _iter_json(file, shown: str, limit: int | None) -> Iterator[Transcript]:
    """A top-level list of sessions yields each as it is read, a list of messages is one session,
    and any other value is one session."""
    stream = JsonStream(file, shown, limit)
    stem = Path(shown).stem
    if stream.start() != "[":
        yield from stream.parse("the session", lambda value: from_object(value, stem, shown))
    else:
        yield from _iter_json_list(stream, stem, shown)
    if stream.skip():
        raise stream.invalid("Extra data", stream.pos)


def _iter_json_list(stream: JsonStream, stem: str, shown: str) -> Iterator[Transcript]:
    """The first element decides: a message makes the list one session, else each element is one."""
    stream.pos += 1
    count, conversation = 0, None
    if stream.skip() != "]":
        while True:
            if count == 0:
                conversation, sessions = stream.parse("session #0", lambda value: _first_in_list(value, stem, shown))
                yield from sessions
            elif conversation is not None:
                stream.parse(f"messages[{count}]", lambda value, c=count, into=conversation: into.add(value, f"messages[{c}]: "))
            else:
                yield from stream.parse(f"session #{count}", lambda value, c=count: from_object(value, f"{stem}#{c}", f"{shown}#{c}"), f"session #{count}: ")
            count += 1
            separator = stream.skip()
            if separator == "]":
                break
            if separator != ",":
                raise stream.invalid("Expecting ',' delimiter", stream.pos)
            stream.pos += 1
            stream.skip()
    stream.pos += 1
    if not count:
        raise EmptyTranscript(shown, "empty transcript (the list holds no sessions)")
    if conversation is not None:
        yield chat(stem, shown, conversation, {"format": "json-messages"})


def _first_in_list(value, stem: str, shown: str) -> tuple[Conversation | None, list[Transcript]]:
    """(the conversation a list of messages builds, None for a list of sessions; the sessions read)."""
    if _is_session(value) or not isinstance(value, dict):
        try:
            return None, from_object(value, f"{stem}#0", f"{shown}#0")
        except Invalid as error:
            raise Invalid(f"session #0: {error}", error.node) from None
    conversation = Conversation()
    conversation.add(value, "messages[0]: ")
    return conversation, []


def _undecided(obj) -> bool:
    """A record that sets no layout: an object with a string "type" that is neither an agent
    event, a session nor a message (Claude Code opens logs with "file-history-snapshot")."""
    return isinstance(obj, dict) and isinstance(obj.get("type"), str) and not is_event(obj) and not _is_session(obj) and _as_message_error(obj) is not None


def _as_message_error(obj) -> Invalid | None:
    """Why ``obj`` is no message (None when it is one)."""
    try:
        Conversation().add(obj)
    except Invalid as error:
        return error
    return None


def _is_session(obj) -> bool:
    return isinstance(obj, dict) and any(key in obj for key in _SESSION_MARKS) and "role" not in obj and "from" not in obj


def transcript_from_text(text: str, name: str = "text") -> Transcript:
    """A text session that did not come from a file (kept verbatim, like a .txt)."""
    if not isinstance(text, str):
        raise TranscriptError("<text>", f"text must be a string, not {type(text).__name__}")
    if not text.strip():
        raise TranscriptError("<text>", "empty transcript")
    return Transcript(name, "<text>", text, None, {"format": "text"})


def transcript_from_messages(messages, name: str = "messages") -> Transcript:
    """A message session that did not come from a file, checked exactly like one that did
    (its messages may take any shape a file's may)."""
    try:
        return chat(name, "<messages>", Conversation().add_all(messages), {"format": "messages"})
    except Invalid as error:
        raise TranscriptError("<messages>", str(error)) from None
