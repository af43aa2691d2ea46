"""A .json file decoded in chunks, so memory holds about one session however large the file.

Errors name the line and column of the file (a minified file is one long line), and a shape
error found in a session is located by decoding that one session again with a scanner that
records where each object starts.
"""

from __future__ import annotations

import itertools
import json
import re
from json.decoder import JSONObject  # type: ignore[attr-defined]  # typeshed's json stubs omit the pure-Python parser
from json.scanner import py_make_scanner  # type: ignore[attr-defined]  # typeshed's json stubs omit the pure-Python scanner

from kvdb.errors import EmptyTranscript, TranscriptError
from kvdb.transcripts.encoding import decode, utf8_cut
from kvdb.transcripts.limits import longer_than, too_large
from kvdb.transcripts.messages import Invalid

CHUNK = 1 << 20  # bytes per read; tests shrink it to reach every boundary
_MARGIN = 64  # a JSON error this close to the end of what was read may only be a value cut short
_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_ANY_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


class JsonStream:
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
        cut = len(data) if self.eof else utf8_cut(data)
        rest = itertools.chain([data[cut:]], iter(lambda: self.file.read(CHUNK), b""))
        text = decode(data[:cut], self.shown, self.line, self.byte, rest)
        self.tail = data[cut:]
        self.byte += cut
        self.line += data.count(b"\n", 0, cut)
        return text

    def skip(self, space: re.Pattern = _JSON_SPACE) -> str:
        """Move past whitespace; the next character, or "" at the end of the file."""
        while True:
            spaces = space.match(self.buf, self.pos)
            assert spaces is not None  # a run of spaces matches, if only an empty one
            self.pos = spaces.end()
            if self.pos < len(self.buf) or not self.read(CHUNK):
                return self.buf[self.pos : self.pos + 1]

    def start(self) -> str:
        """Skip a byte order mark and whitespace; the first character of the top-level value."""
        while not self.buf and self.read(CHUNK):
            pass
        self.buf = self.buf.removeprefix("\ufeff")
        first = self.skip()
        if first.isspace():  # not JSON whitespace, but str.strip() (so a .txt) would call it blank
            error = self.invalid("Expecting value", self.pos)
            first = self.skip(_ANY_SPACE)
            if first:
                raise error
        if not first:
            raise EmptyTranscript(self.shown, "empty transcript")
        return first

    def where(self, at: int) -> tuple[int, int]:
        """The line and 1-based column of ``buf[at]`` in the file."""
        newline = self.buf.rfind("\n", 0, at)
        column = at - newline if newline >= 0 else self.col0 + at + 1
        return self.line0 + self.buf.count("\n", 0, at), column

    def invalid(self, message: str, at: int) -> TranscriptError:
        line, column = self.where(at)
        return TranscriptError(self.shown, f"invalid JSON: {message} (column {column})", line)

    def parse(self, label: str, parse, prefix: str = "", skipped: list[dict] | None = None, instead=None):
        """``parse`` of the value at ``pos`` (``label`` names it in size errors); its shape error
        (``Invalid``) becomes a TranscriptError starting with ``prefix``, on the line of the
        object at fault where that can be found. ``skipped``: given a list, the error is named
        there as ``{"line", "reason"}`` instead, and ``instead`` is returned."""
        value, start, end = self._value(label)
        self.pos = end
        try:
            return parse(value)
        except Invalid as error:
            lines_before = _lines_before_fault(self.buf[start:end], parse)
            line = None if lines_before is None else self.where(start)[0] + lines_before
            if skipped is None:
                raise TranscriptError(self.shown, f"{prefix}{error}", line) from None
            skipped.append({"line": line or self.where(start)[0], "reason": f"{prefix}{error}"})
            return instead

    def _value(self, label: str) -> tuple[object, int, int]:
        """(value, start, end) of the value at ``pos``, read on while the buffer's end may have cut it short.

        A decode that fails (or ends) near the end of the buffer, or on an unterminated string,
        is retried after reading more; reads double in size, so a value of n bytes costs O(n).
        """
        size = CHUNK
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
            if self.limit is not None and longer_than(self.buf, start, len(self.buf) if error else end, self.limit):
                raise TranscriptError(self.shown, too_large(label, self.limit), self.where(start)[0])
            if settled:
                return value, start, end
            self.read(size if self.limit is None else min(size, self.limit + 1))
            size *= 2


def _lines_before_fault(text: str, parse) -> int | None:
    """Lines of ``text`` (one JSON value) before the object its shape error is about, if any."""
    try:
        parse(LocatingDecoder().decode(text))
    except Invalid as error:
        offset = getattr(error.node, "offset", None)
        return None if offset is None else text.count("\n", 0, offset)
    except RecursionError:
        pass
    return None


class Located(dict):
    """A JSON object that remembers where it started, so shape errors in .json can name a line."""

    __slots__ = ("offset",)
    offset: int


class LocatingDecoder(json.JSONDecoder):
    """json's pure-Python scanner with object parsing wrapped to record each object's offset.

    The C scanner offers no such hook; the Python one is much slower, so it only re-decodes
    the one session a shape error was found in.
    """

    def __init__(self):
        super().__init__()

        def parse_object(string_and_end, *args):
            obj, end = JSONObject(string_and_end, *args)
            located = Located(obj)
            located.offset = string_and_end[1] - 1
            return located, end

        self.parse_object = parse_object
        self.scan_once = py_make_scanner(self)
