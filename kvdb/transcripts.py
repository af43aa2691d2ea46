"""Read transcript files into sessions: verbatim text, or normalised chat messages.

Text (``.txt``/``.md``) is kept exactly as its bytes decode, because the archive must give
it back byte for byte. Message files (``.jsonl``/``.json``, OpenAI or ShareGPT shaped) are
reduced to ``[{"role", "content"}]`` so that one chat template can render them all.

Every problem is a ``TranscriptError`` naming the file and, where known, the line.
``iter_transcripts`` streams a file one session at a time, so memory holds about one session
(plus a read buffer) however large the file is, and ``max_session_bytes`` refuses a session
before it is read into memory. Its errors come when reached, after the sessions before them,
so a caller that must not archive half a file reads it twice: once to check, once to ingest.
``read_transcripts`` is the all-or-nothing list.

Roles are matched case-insensitively and mapped as in ``ROLE_ALIASES``; OpenAI content
given as a list of text parts is joined with newlines; other keys of a message (``name``,
``tool_calls``...) are ignored. Indexes in names and messages (``#0``, ``messages[0]``)
count from 0; line numbers count from 1.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from json.decoder import JSONObject
from json.scanner import py_make_scanner
from pathlib import Path

from kvdb.errors import TranscriptError

SUPPORTED_SUFFIXES = (".txt", ".md", ".jsonl", ".json")

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
    "developer": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}

_CHUNK = 1 << 20  # bytes per read of a .json file; tests shrink it to reach every boundary
_MARGIN = 64  # a JSON error this close to the end of what was read may only be a value cut short
_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_ANY_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()

_TEXT_SOURCE = "<text>"
_MESSAGES_SOURCE = "<messages>"


@dataclass(frozen=True)
class Transcript:
    """One session: either verbatim ``text`` or normalised ``messages`` (the other is None)."""

    name: str
    source: str
    text: str | None
    messages: tuple[dict, ...] | None
    metadata: dict


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


def iter_transcripts(path: str | Path, max_session_bytes: int | None = None) -> Iterator[Transcript]:
    """Yield the sessions of one file as they are read; a TranscriptError comes when reached.

    A session taking more than ``max_session_bytes`` bytes of the file is refused, naming the
    line where it starts, after reading at most about that many bytes (plus one chunk).
    """
    shown = os.fspath(path)
    suffix = _suffix(Path(shown))
    if suffix not in SUPPORTED_SUFFIXES:
        raise TranscriptError(shown, _unsupported(Path(shown)))
    read = {".jsonl": _iter_jsonl, ".json": _iter_json}.get(suffix, _iter_text)
    try:
        with open(shown, "rb") as file:
            yield from read(file, shown, max_session_bytes)
    except OSError as error:
        raise TranscriptError(shown, f"cannot read: {error.strerror or error}") from None


def read_transcripts(path: str | Path) -> list[Transcript]:
    """Parse one file into its sessions; raises TranscriptError and returns nothing on any problem."""
    return list(iter_transcripts(path))


def transcript_from_text(text: str, name: str = "text") -> Transcript:
    """A text session that did not come from a file (kept verbatim, like a .txt)."""
    if not isinstance(text, str):
        raise TranscriptError(_TEXT_SOURCE, f"text must be a string, not {type(text).__name__}")
    if not text.strip():
        raise TranscriptError(_TEXT_SOURCE, "empty transcript")
    return Transcript(name, _TEXT_SOURCE, text, None, {"format": "text"})


def transcript_from_messages(messages, name: str = "messages") -> Transcript:
    """A message session that did not come from a file, checked exactly like one that did."""
    try:
        normalised = _normalise_messages(messages, None)
    except _Invalid as error:
        raise TranscriptError(_MESSAGES_SOURCE, str(error)) from None
    return Transcript(name, _MESSAGES_SOURCE, None, normalised, {"format": "messages"})


class _Invalid(Exception):
    """A JSON value has the wrong shape; ``node`` is the nearest enclosing object, to find its line."""

    def __init__(self, message: str, node=None):
        super().__init__(message)
        self.node = node


class _Located(dict):
    """A JSON object that remembers where it started, so shape errors in .json can name a line."""

    __slots__ = ("offset",)


class _LocatingDecoder(json.JSONDecoder):
    """json's pure-Python scanner with object parsing wrapped to record each object's offset.

    The C scanner offers no such hook; the Python one is much slower, so it only re-decodes
    the one session a shape error was found in.
    """

    def __init__(self):
        super().__init__()

        def parse_object(string_and_end, *args):
            obj, end = JSONObject(string_and_end, *args)
            located = _Located(obj)
            located.offset = string_and_end[1] - 1
            return located, end

        self.parse_object = parse_object
        self.scan_once = py_make_scanner(self)


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def _unsupported(path: Path) -> str:
    kind = repr(path.suffix) if path.suffix else "no suffix"
    return f"unsupported file type ({kind}); supported: {', '.join(SUPPORTED_SUFFIXES)}"


def _walk(root: Path) -> list[Path]:
    def unreadable(error: OSError):
        raise TranscriptError(error.filename, f"cannot read directory: {error.strerror or error}")

    files = []
    for directory, subdirectories, names in os.walk(root, onerror=unreadable):
        subdirectories[:] = [d for d in subdirectories if not d.startswith(".")]
        files.extend(
            Path(directory, name)
            for name in names
            if not name.startswith(".") and _suffix(Path(name)) in SUPPORTED_SUFFIXES
        )
    return sorted(files)


def _decode(data: bytes, shown: str, first_line: int = 1, first_byte: int = 0, rest: Iterable[bytes] = ()) -> str:
    """Strict UTF-8, since anything else would not round-trip; positions are file-relative.

    A NUL byte anywhere, in ``data`` or in the ``rest`` of the file (read only on this error
    path), makes it a binary file, which says more than the first bad byte would.
    """
    _refuse_nul(data, shown, first_line, first_byte)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = first_line + data.count(b"\n", 0, error.start)
        invalid = TranscriptError(shown, f"invalid UTF-8 at byte {first_byte + error.start}", line)
    line, byte = first_line + data.count(b"\n"), first_byte + len(data)
    for chunk in rest:
        _refuse_nul(chunk, shown, line, byte)
        line, byte = line + chunk.count(b"\n"), byte + len(chunk)
    raise invalid


def _refuse_nul(data: bytes, shown: str, first_line: int, first_byte: int) -> None:
    nul = data.find(b"\x00")
    if nul >= 0:
        line = first_line + data.count(b"\n", 0, nul)
        raise TranscriptError(shown, f"binary file (NUL byte at byte {first_byte + nul}), not a transcript", line)


def _utf8_cut(data: bytes) -> int:
    """Where to cut ``data`` so that a character split by the end of a read waits for its other bytes."""
    for back in range(1, min(len(data), 4) + 1):
        byte = data[-back]
        if byte < 0x80 or byte >= 0xC0:  # not a continuation byte: the last character starts here
            size = 1 if byte < 0xC0 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) - back if size > back else len(data)
    return len(data)


def _too_large(label: str, limit: int) -> str:
    return f"{label} is larger than {_size(limit)}, the most one session may hold; split it into smaller sessions"


def _size(count: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift and count % (1 << shift) == 0:
            return f"{count >> shift} {unit}"
    return f"{count} byte{'s' * (count != 1)}"


def _longer_than(text: str, start: int, end: int, limit: int) -> bool:
    """Whether ``text[start:end]`` takes more than ``limit`` bytes of UTF-8 (1 to 4 per character).

    Encoding is only needed when the character count leaves it open.
    """
    chars = end - start
    if chars > limit or 4 * chars <= limit:
        return chars > limit
    return len(text[start:end].encode("utf-8")) > limit


def _iter_text(file, shown: str, limit: int | None) -> Iterator[Transcript]:
    if limit is not None and os.fstat(file.fileno()).st_size > limit:
        raise TranscriptError(shown, _too_large("the session", limit), 1)
    text = _decode(file.read(), shown)
    if not text.strip():
        raise TranscriptError(shown, "empty transcript")
    yield Transcript(Path(shown).stem, shown, text, None, {"format": "text"})


def _iter_jsonl(file, shown: str, limit: int | None) -> Iterator[Transcript]:
    """The first object decides the layout: a session per line, or one message per line.

    Lines are read with a bounded ``readline`` so that an oversized one never sits in memory;
    with one message per line the whole file is one session, so its lines count together.
    """
    stem = Path(shown).stem
    messages: list[dict] = []
    session_per_line = first = None
    offset = used = 0
    for line in itertools.count(1):
        if session_per_line is not False:
            used = 0
        raw = file.readline(-1 if limit is None else limit - used + 1)
        if not raw:
            break
        used += len(raw)
        if limit is not None and used > limit:
            raise TranscriptError(shown, _too_large("the session", limit), line if session_per_line is not False else first)
        text = _decode(raw, shown, line, offset)
        offset += len(raw)
        if line == 1:
            text = text.removeprefix("\ufeff")
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as error:
            raise TranscriptError(shown, f"invalid JSON: {error.msg} (column {error.colno})", line) from None
        except RecursionError:
            raise TranscriptError(shown, "invalid JSON: nested too deeply", line) from None
        if session_per_line is None:
            session_per_line = isinstance(obj, dict) and ("messages" in obj or "conversations" in obj)
            first = line
        try:
            if session_per_line:
                session = _session_transcript(obj, f"{stem}#{line}", f"{shown}#L{line}", "jsonl-sessions")
            else:
                messages.append(_normalise_message(obj))
        except _Invalid as error:
            raise TranscriptError(shown, str(error), line) from None
        if session_per_line:
            yield session
    if session_per_line is None:
        raise TranscriptError(shown, "empty transcript")
    if not session_per_line:
        yield Transcript(stem, shown, None, tuple(messages), {"format": "jsonl-messages"})


def _iter_json(file, shown: str, limit: int | None) -> Iterator[Transcript]:
    """A top-level list yields one session per element, each decoded as it is read; any other value is one session."""
    stream = _JsonStream(file, shown, limit)
    stem = Path(shown).stem
    if stream.start() != "[":
        yield stream.session(stem, shown, None)
        count = 1
    else:
        stream.pos += 1
        count = 0
        if stream.skip() != "]":
            while True:
                yield stream.session(f"{stem}#{count}", f"{shown}#{count}", count)
                count += 1
                separator = stream.skip()
                if separator == "]":
                    break
                if separator != ",":
                    raise stream.invalid("Expecting ',' delimiter", stream.pos)
                stream.pos += 1
                stream.skip()
        stream.pos += 1
    if stream.skip():
        raise stream.invalid("Extra data", stream.pos)
    if not count:
        raise TranscriptError(shown, "empty transcript (the list holds no sessions)")


class _JsonStream:
    """A .json file decoded in chunks, with a cursor ``pos`` into the decoded text ``buf``.

    Text before ``pos`` is consumed and dropped at the next read, so ``buf`` holds about one
    value plus a chunk. Minified files are one long line, so errors need the line *and* the
    column of ``buf[0]`` (``line0``, 0-based ``col0``) to point at the right place.
    """

    def __init__(self, file, shown: str, limit: int | None):
        self.file, self.shown, self.limit = file, shown, limit
        self.buf, self.pos, self.line0, self.col0 = "", 0, 1, 0
        self.tail = b""  # the first bytes of a character cut by the end of the last read
        self.byte, self.line = 0, 1  # where the next bytes to decode sit in the file
        self.eof = False

    def read(self, size: int) -> bool:
        """Drop the consumed text and append up to ``size`` more bytes; False at the end of the file."""
        text = self._decode_next(size)
        consumed = self.pos
        newline = self.buf.rfind("\n", 0, consumed)
        if newline < 0:
            self.col0 += consumed
        else:
            self.line0 += self.buf.count("\n", 0, consumed)
            self.col0 = consumed - newline - 1
        self.buf, self.pos = self.buf[consumed:] + text, 0
        return not self.eof

    def _decode_next(self, size: int) -> str:
        data = self.tail + self.file.read(size)
        self.eof = len(data) == len(self.tail)
        cut = len(data) if self.eof else _utf8_cut(data)
        rest = itertools.chain([data[cut:]], iter(lambda: self.file.read(_CHUNK), b""))
        text = _decode(data[:cut], self.shown, self.line, self.byte, rest)
        self.tail = data[cut:]
        self.byte += cut
        self.line += data.count(b"\n", 0, cut)
        return text

    def skip(self, space: re.Pattern = _JSON_SPACE) -> str:
        """Move past whitespace; the next character, or "" at the end of the file."""
        while True:
            self.pos = space.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self.read(_CHUNK):
                return self.buf[self.pos : self.pos + 1]

    def start(self) -> str:
        """Skip a byte order mark and whitespace; the first character of the top-level value."""
        while not self.buf and self.read(_CHUNK):
            pass
        self.buf = self.buf.removeprefix("\ufeff")
        first = self.skip()
        if first.isspace():  # not JSON whitespace, but str.strip() (so a .txt) would call it blank
            error = self.invalid("Expecting value", self.pos)
            first = self.skip(_ANY_SPACE)
            if first:
                raise error
        if not first:
            raise TranscriptError(self.shown, "empty transcript")
        return first

    def where(self, at: int) -> tuple[int, int]:
        """The line and 1-based column of ``buf[at]`` in the file."""
        newline = self.buf.rfind("\n", 0, at)
        column = at - newline if newline >= 0 else self.col0 + at + 1
        return self.line0 + self.buf.count("\n", 0, at), column

    def invalid(self, message: str, at: int) -> TranscriptError:
        line, column = self.where(at)
        return TranscriptError(self.shown, f"invalid JSON: {message} (column {column})", line)

    def session(self, name: str, source: str, index: int | None) -> Transcript:
        """The session at ``pos``; ``index`` is its place in a top-level list (None for a lone value)."""
        label = "the session" if index is None else f"session #{index}"
        value, start, end = self._value(label)
        self.pos = end
        try:
            return _session_transcript(value, name, source, None)
        except _Invalid as error:
            message = str(error) if index is None else f"{label}: {error}"
            lines_before = _lines_before_fault(self.buf[start:end])
            line = None if lines_before is None else self.where(start)[0] + lines_before
            raise TranscriptError(self.shown, message, line) from None

    def _value(self, label: str) -> tuple[object, int, int]:
        """(value, start, end) of the value at ``pos``, read on while the buffer's end may have cut it short.

        A decode that fails (or ends) near the end of the buffer, or on an unterminated string,
        is retried after reading more; reads double in size, so a value of n bytes costs O(n).
        """
        size = _CHUNK
        while True:
            start = self.pos
            try:
                value, end = _DECODER.raw_decode(self.buf, start)
                error = None
            except json.JSONDecodeError as caught:
                value, end, error = None, caught.pos, caught
            except RecursionError:
                raise TranscriptError(self.shown, "invalid JSON: nested too deeply", self.where(start)[0]) from None
            cut_short = len(self.buf) - end < _MARGIN or (error and error.msg.startswith("Unterminated string"))
            settled = self.eof or not cut_short
            if error and settled:
                raise self.invalid(error.msg, error.pos)
            if self.limit is not None and _longer_than(self.buf, start, len(self.buf) if error else end, self.limit):
                raise TranscriptError(self.shown, _too_large(label, self.limit), self.where(start)[0])
            if settled:
                return value, start, end
            self.read(size if self.limit is None else min(size, self.limit + 1))
            size *= 2


def _lines_before_fault(text: str) -> int | None:
    """Lines of ``text`` (one JSON session) before the object its shape error is about, if any."""
    try:
        _session_transcript(_LocatingDecoder().decode(text), "", "", None)
    except _Invalid as error:
        offset = getattr(error.node, "offset", None)
        return None if offset is None else text.count("\n", 0, offset)
    except RecursionError:
        pass
    return None


def _session_transcript(obj, default_name: str, source: str, layout: str | None) -> Transcript:
    """A session object: OpenAI ``{"messages"}`` or ShareGPT ``{"conversations"}``, maybe with id/name."""
    if not isinstance(obj, dict):
        raise _Invalid(f'expected a session object with "messages" or "conversations", got {_kind(obj)}')
    if "messages" in obj:
        messages, detected = _normalise_messages(obj["messages"], obj), "openai"
    elif "conversations" in obj:
        messages, detected = _normalise_messages(obj["conversations"], obj), "sharegpt"
    else:
        raise _Invalid('session has neither "messages" (OpenAI) nor "conversations" (ShareGPT)', obj)
    name = _session_name(obj, default_name)
    metadata = {"format": layout or detected}
    if obj.get("id") is not None:
        metadata["id"] = obj["id"]
    return Transcript(name, source, None, messages, metadata)


def _session_name(obj: dict, default: str) -> str:
    """The "name" field, else the "id", else ``default``; null counts as absent."""
    name, session_id = obj.get("name"), obj.get("id")
    valid_id = isinstance(session_id, (str, int)) and not isinstance(session_id, bool) and session_id != ""
    if session_id is not None and not valid_id:
        raise _Invalid(f'"id" must be a non-empty string or an integer, got {session_id!r}', obj)
    if name is not None and (not isinstance(name, str) or not name):
        raise _Invalid(f'"name" must be a non-empty string, got {name!r}', obj)
    if name is not None:
        return name
    return default if session_id is None else str(session_id)


def _normalise_messages(messages, owner) -> tuple[dict, ...]:
    if not isinstance(messages, (list, tuple)):
        raise _Invalid(f"messages must be a list, not {_kind(messages)}", owner)
    if not messages:
        raise _Invalid("no messages (the list is empty)", owner)
    normalised = []
    for index, message in enumerate(messages):
        try:
            normalised.append(_normalise_message(message))
        except _Invalid as error:
            raise _Invalid(f"messages[{index}]: {error}", error.node or owner) from None
    return tuple(normalised)


def _normalise_message(message) -> dict:
    """OpenAI ``{"role", "content"}`` or ShareGPT ``{"from", "value"}`` to ``{"role", "content"}``."""
    if isinstance(message, dict) and "role" in message:
        role_key, content_key = "role", "content"
    elif isinstance(message, dict) and "from" in message:
        role_key, content_key = "from", "value"
    else:
        raise _Invalid(
            'expected a message object with "role" and "content" (or ShareGPT "from" and "value"), '
            f"got {_kind(message)}",
            message if isinstance(message, dict) else None,
        )
    role = message[role_key]
    if not isinstance(role, str):
        raise _Invalid(f'"{role_key}" must be a string, not {_kind(role)}', message)
    if role.lower() not in ROLE_ALIASES:
        allowed = ", ".join(sorted(ROLE_ALIASES))
        raise _Invalid(f"unknown role {role!r}; allowed roles: {allowed}", message)
    if content_key not in message:
        raise _Invalid(f'message has no "{content_key}"', message)
    try:
        content = _content_text(message[content_key])
    except _Invalid as error:
        raise _Invalid(f'"{content_key}": {error}', message) from None
    return {"role": ROLE_ALIASES[role.lower()], "content": content}


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _Invalid(f"must be a string or a list of text parts, not {_kind(content)}")
    texts = []
    for part in content:
        if not isinstance(part, dict):
            raise _Invalid(f'each part must be an object {{"type": "text", "text": "..."}}, not {_kind(part)}')
        if part.get("type", "text") != "text":
            raise _Invalid(f"only text parts are supported, got a part of type {part['type']!r}")
        if not isinstance(part.get("text"), str):
            raise _Invalid(f'a text part needs a string "text", not {_kind(part.get("text"))}')
        texts.append(part["text"])
    return "\n".join(texts)


def _kind(value) -> str:
    """The JSON name of a value's type, which is what the user wrote."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
