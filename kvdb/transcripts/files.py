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
from kvdb.transcripts.formats import Format, Log, read_session, registered
from kvdb.transcripts.formats.messages import MESSAGES
from kvdb.transcripts.json_stream import JsonStream
from kvdb.transcripts.limits import too_large
from kvdb.transcripts.messages import Conversation, Invalid, message_error
from kvdb.transcripts.sessions import Transcript, chat, first_prompt
from kvdb.transcripts.stamps import StampedLog

SUPPORTED_SUFFIXES = (".txt", ".md", ".jsonl", ".json")
WAITING_RECORDS = 64  # records held while none has set a JSONL file's layout; past them, the next decides as it can


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


def iter_transcripts(
    path: str | Path, max_session_bytes: int | None = None, skipped: list[dict] | None = None
) -> Iterator[Transcript]:
    """Yield the sessions of one file as they are read; a TranscriptError comes when reached
    (``EmptyTranscript`` for a file with nothing to archive).

    A session taking more than ``max_session_bytes`` bytes of the file is refused, naming the
    line where it starts, after reading at most about that many bytes (plus one chunk).
    ``skipped``: given a list, a JSON Lines record that is malformed (not JSON, or not a
    record of the file's layout), or an element of a JSON list that is not of the list's
    shape, is left out and named there as ``{"line", "reason"}``, and the rest of the file is
    read; without one, it fails the file.
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
        files.extend(
            Path(directory, name)
            for name in names
            if not name.startswith(".") and _suffix(Path(name)) in SUPPORTED_SUFFIXES
        )
    return sorted(files)


def _iter_text(file, shown: str, limit: int | None) -> Iterator[Transcript]:
    if limit is not None and os.fstat(file.fileno()).st_size > limit:
        raise TranscriptError(shown, too_large("the session", limit), 1)
    text = decode(file.read(), shown)
    if not text.strip():
        raise EmptyTranscript(shown, "empty transcript")
    yield Transcript(Path(shown).stem, shown, text, None, {"format": "text"})


def _iter_json_file(
    file, shown: str, limit: int | None, jsonl: bool, skipped: list[dict] | None
) -> Iterator[Transcript]:
    """JSON Lines or one JSON value, whichever the content is: a ``.json`` holding one object per
    line reads as JSONL, and a ``.jsonl`` holding one value over several lines reads as JSON."""
    as_jsonl = _looks_like_jsonl(file, jsonl)
    file.seek(0)  # a byte order mark read again is skipped by both readers
    yield from (_iter_jsonl(file, shown, limit, skipped) if as_jsonl else _iter_json(file, shown, limit, skipped))


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
    """The first record a format takes decides the layout: a session per line, or the records
    of one log (agent events, one message per line). A malformed record fails the file, or
    with ``skipped`` is named there and left out.

    Lines are read with a bounded ``readline`` so that an oversized one never sits in memory;
    when the whole file is one log, its lines count together.
    """
    stem = Path(shown).stem
    log: Log | None = None
    layout = first = None  # "sessions" or "log", and the line that set it
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
            raise TranscriptError(
                shown, too_large("the session", limit), line if layout in (None, "sessions") else first
            )
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
        # a typed record of no layout (an agent log's snapshot line): the next decides
        if layout is None and _undecided(obj) and len(waiting) < WAITING_RECORDS:
            waiting.append((line, obj))
            continue
        decided = layout is None
        # the record that sets the layout, then those read before it
        for at, record in [(line, obj), *(waiting if decided else ())]:
            try:
                if isinstance(record, Invalid):
                    raise record
                target = log if layout is not None else _opened(_decide(record), stem, shown)
                if target is None:
                    sessions = read_session(record, f"{stem}#{at}", f"{shown}#L{at}")
                    kind_of_line = "sessions"
                else:
                    target.add(record, at)
                    log, kind_of_line = target, "log"
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
        reason = str(record if isinstance(record, Invalid) else message_error(record))
        if skipped is None:
            raise TranscriptError(shown, reason, at)
        skipped.append({"line": at, "reason": reason})
    if skipped:
        # the records waiting for a layout were taken after the one that set it
        skipped.sort(key=lambda skip: skip["line"])
    if layout is None:
        if skipped:
            raise TranscriptError(
                shown,
                f"no line holds a record kvdb reads ({len(skipped)} skipped; "
                f"the first, line {skipped[0]['line']}: {skipped[0]['reason']})",
            )
        raise EmptyTranscript(shown, "empty transcript")
    if log is not None:
        yield from _log_sessions(log, shown)


def _log_sessions(log: Log, shown: str) -> list[Transcript]:
    """A log's sessions, once all its records are read; what it could not read fails the file."""
    try:
        return log.sessions()
    except Invalid as error:
        raise TranscriptError(shown, str(error)) from None


def _decide(record) -> Format | None:
    """The format of the first record one takes: None when one takes it as a session object,
    the format whose log it opens otherwise (messages, when none takes it: its error says why)."""
    for candidate in registered():
        if candidate.opens_log(record):
            return candidate
        if candidate.claims(record):
            return None
    return MESSAGES


def _opened(found: Format | None, stem: str, shown: str) -> Log | None:
    return None if found is None else StampedLog(found.log(stem, shown))


def _iter_json(file, shown: str, limit: int | None, skipped: list[dict] | None) -> Iterator[Transcript]:
    """A top-level list of sessions yields each as it is read, a list of a log's records (of
    messages) is that log's sessions, and any other value is one session object.

    ``skipped``: given a list, an element of a list after the first that has the wrong shape
    is named there and left out (the first sets what the list holds); JSON that does not
    parse fails the file, since nothing after it can be trusted to be read right.
    """
    stream = JsonStream(file, shown, limit)
    stem = Path(shown).stem
    if stream.start() != "[":
        yield from stream.parse("the session", lambda value: read_session(value, stem, shown))
    else:
        yield from _iter_json_list(stream, stem, shown, skipped)
    if stream.skip():
        raise stream.invalid("Extra data", stream.pos)


def _iter_json_list(stream: JsonStream, stem: str, shown: str, skipped: list[dict] | None) -> Iterator[Transcript]:
    """The first element decides: a session object makes each element a session, any other
    object makes the list one log's records."""
    stream.pos += 1
    count, log = 0, None
    if stream.skip() != "]":
        while True:
            if count == 0:
                log, sessions = stream.parse("session #0", lambda value: _first_in_list(value, stem, shown))
                yield from sessions
            elif log is not None:
                stream.parse(
                    f"{log.label}[{count}]",
                    lambda value, c=count, into=log: into.add(value, c),
                    f"{log.label}[{count}]: ",
                    skipped,
                )
            else:
                read = lambda value, c=count: read_session(value, f"{stem}#{c}", f"{shown}#{c}")  # noqa: E731 - bound to this element
                yield from stream.parse(f"session #{count}", read, f"session #{count}: ", skipped, instead=[])
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
    if log is not None:
        yield from _log_sessions(log, shown)


def _first_in_list(value, stem: str, shown: str) -> tuple[Log | None, list[Transcript]]:
    """(the log a list of records builds, None for a list of sessions; the sessions read)."""
    found = _decide(value) if isinstance(value, dict) else None
    if found is None:
        try:
            return None, read_session(value, f"{stem}#0", f"{shown}#0")
        except Invalid as error:
            raise Invalid(f"session #0: {error}", error.node) from None
    log = StampedLog(found.log(stem, shown))
    try:
        log.add(value, 0)
    except Invalid as error:
        raise Invalid(f"{log.label}[0]: {error}", error.node) from None
    return log, []


def _undecided(obj) -> bool:
    """A record that sets no layout: an object with a string "type" that no format takes and
    that is no message (Claude Code opens logs with "file-history-snapshot")."""
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("type"), str)
        and not any(f.opens_log(obj) or f.claims(obj) for f in registered())
        and message_error(obj) is not None
    )


def transcript_from_text(text: str, name: str = "text") -> Transcript:
    """A text session that did not come from a file (kept verbatim, like a .txt)."""
    if not isinstance(text, str):
        raise TranscriptError("<text>", f"text must be a string, not {type(text).__name__}")
    if not text.strip():
        raise TranscriptError("<text>", "empty transcript")
    return Transcript(name, "<text>", text, None, {"format": "text"})


def transcript_from_messages(messages, name: str = "messages") -> Transcript:
    """A message session that did not come from a file, checked exactly like one that did
    (its messages may take any shape a file's may). A name given is its title; without one, its
    first prompt is."""
    try:
        conversation = Conversation().add_all(messages)
        return chat(
            name,
            "<messages>",
            conversation,
            {"format": "messages"},
            title=first_prompt(conversation.messages()) if name == "messages" else None,
        )
    except Invalid as error:
        raise TranscriptError("<messages>", str(error)) from None
