"""Read transcript files into sessions: verbatim text, or normalised chat messages.

Text (``.txt``/``.md``) is kept exactly as its bytes decode, because the archive must give
it back byte for byte. Message files (``.jsonl``/``.json``, OpenAI or ShareGPT shaped) are
reduced to ``[{"role", "content"}]`` so that one chat template can render them all.

Every problem is a ``TranscriptError`` naming the file and, where known, the line, and a
file either parses completely or yields nothing, so a half-read file is never archived.

Roles are matched case-insensitively and mapped as in ``ROLE_ALIASES``; OpenAI content
given as a list of text parts is joined with newlines; other keys of a message (``name``,
``tool_calls``...) are ignored. Indexes in names and messages (``#0``, ``messages[0]``)
count from 0; line numbers count from 1.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from json.decoder import JSONObject
from json.scanner import py_make_scanner
from pathlib import Path
from typing import Iterable, Iterator

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


def read_transcripts(path: str | Path) -> list[Transcript]:
    """Parse one file into its sessions; raises TranscriptError and returns nothing on any problem."""
    shown = os.fspath(path)
    suffix = _suffix(Path(shown))
    if suffix not in SUPPORTED_SUFFIXES:
        raise TranscriptError(shown, _unsupported(Path(shown)))
    try:
        if suffix == ".jsonl":
            return _read_jsonl(shown)
        data = Path(shown).read_bytes()
    except OSError as error:
        raise TranscriptError(shown, f"cannot read: {error.strerror or error}") from None
    text = _decode(data, shown)
    if not text.strip():
        raise TranscriptError(shown, "empty transcript")
    if suffix == ".json":
        return _parse_json(text, shown)
    return [Transcript(Path(shown).stem, shown, text, None, {"format": "text"})]


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

    The C scanner offers no such hook; the Python one is slower, which is acceptable while
    whole .json files are read into memory anyway.
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


def _decode(data: bytes, shown: str, first_line: int = 1, first_byte: int = 0) -> str:
    """Strict UTF-8, since anything else would not round-trip; positions are file-relative."""
    nul = data.find(b"\x00")
    if nul >= 0:
        line = first_line + data.count(b"\n", 0, nul)
        raise TranscriptError(shown, f"binary file (NUL byte at byte {first_byte + nul}), not a transcript", line)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = first_line + data.count(b"\n", 0, error.start)
        raise TranscriptError(shown, f"invalid UTF-8 at byte {first_byte + error.start}", line) from None


def _parse_json(text: str, shown: str) -> list[Transcript]:
    text = text.removeprefix("\ufeff")
    try:
        data = _LocatingDecoder().decode(text)
    except json.JSONDecodeError as error:
        raise TranscriptError(shown, f"invalid JSON: {error.msg} (column {error.colno})", error.lineno) from None
    stem = Path(shown).stem
    try:
        if not isinstance(data, list):
            return [_session_transcript(data, stem, shown, None)]
        if not data:
            raise _Invalid("empty transcript (the list holds no sessions)")
        transcripts = []
        for index, item in enumerate(data):
            try:
                transcripts.append(_session_transcript(item, f"{stem}#{index}", f"{shown}#{index}", None))
            except _Invalid as error:
                raise _Invalid(f"session #{index}: {error}", error.node) from None
        return transcripts
    except _Invalid as error:
        raise TranscriptError(shown, str(error), _line_of(text, error.node)) from None


def _line_of(text: str, node) -> int | None:
    offset = getattr(node, "offset", None)
    return None if offset is None else text.count("\n", 0, offset) + 1


def _read_jsonl(shown: str) -> list[Transcript]:
    """The first object decides the layout: a session per line, or one message per line."""
    stem = Path(shown).stem
    sessions: list[Transcript] = []
    messages: list[dict] = []
    session_per_line = None
    for line, obj in _jsonl_objects(shown):
        if session_per_line is None:
            session_per_line = isinstance(obj, dict) and ("messages" in obj or "conversations" in obj)
        try:
            if session_per_line:
                sessions.append(_session_transcript(obj, f"{stem}#{line}", f"{shown}#L{line}", "jsonl-sessions"))
            else:
                messages.append(_normalise_message(obj))
        except _Invalid as error:
            raise TranscriptError(shown, str(error), line) from None
    if session_per_line is None:
        raise TranscriptError(shown, "empty transcript")
    if session_per_line:
        return sessions
    return [Transcript(stem, shown, None, tuple(messages), {"format": "jsonl-messages"})]


def _jsonl_objects(shown: str) -> Iterator[tuple[int, object]]:
    """(line number, value) of each non-blank line, read one line at a time."""
    offset = 0
    with open(shown, "rb") as file:
        for line, raw in enumerate(file, start=1):
            text = _decode(raw, shown, line, offset)
            offset += len(raw)
            if line == 1:
                text = text.removeprefix("\ufeff")
            if not text.strip():
                continue
            try:
                yield line, json.loads(text)
            except json.JSONDecodeError as error:
                raise TranscriptError(shown, f"invalid JSON: {error.msg} (column {error.colno})", line) from None


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
