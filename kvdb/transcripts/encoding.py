"""From a file's bytes to its text: UTF-8, or UTF-16/UTF-32 when a byte order mark says so.

Strict UTF-8 is the default because anything guessed might not round-trip; a file in another
encoding is refused with the encoding it most likely is and the command that converts it.
Positions in errors are the file's own (for a transcoded file: of its UTF-8 form).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from kvdb.errors import TranscriptError

# Longest first: the UTF-32-LE mark begins with the UTF-16-LE one.
BYTE_ORDER_MARKS = (
    (codecs.BOM_UTF32_LE, "utf-32-le", "UTF-32"),
    (codecs.BOM_UTF32_BE, "utf-32-be", "UTF-32"),
    (codecs.BOM_UTF16_LE, "utf-16-le", "UTF-16"),
    (codecs.BOM_UTF16_BE, "utf-16-be", "UTF-16"),
)


def open_utf8(file):
    """``file`` (binary, at its start) as UTF-8 bytes: itself, or a transcoding reader past a UTF-16/32 mark."""
    head = file.read(4)
    file.seek(0)
    for mark, codec, _ in BYTE_ORDER_MARKS:
        if head.startswith(mark):
            return Transcoded(file, codec, len(mark))
    return file


class Transcoded:
    """A UTF-16/32 file read as UTF-8 bytes, with the calls the readers make (``read``,
    ``readline``, ``seek(0)``, ``fileno``). Bytes that end the file in the middle of a character
    are an error, not dropped."""

    READ = 1 << 16

    def __init__(self, file, codec: str, start: int):
        self._file, self._codec, self._start = file, codec, start
        self.seek(0)

    def seek(self, offset: int) -> None:
        if offset != 0:
            raise ValueError("a transcoded file seeks back to its start only")
        self._file.seek(self._start)
        self._decoder = codecs.getincrementaldecoder(self._codec)("strict")
        self._buffer, self._eof = b"", False

    def fileno(self) -> int:
        return self._file.fileno()

    def read(self, size: int = -1) -> bytes:
        while not self._eof and (size < 0 or len(self._buffer) < size):
            self._fill()
        return self._take(len(self._buffer) if size < 0 else size)

    def readline(self, size: int = -1) -> bytes:
        while not self._eof and b"\n" not in self._buffer and (size < 0 or len(self._buffer) < size):
            self._fill()
        end = self._buffer.find(b"\n") + 1 or len(self._buffer)
        return self._take(end if size < 0 else min(end, size))

    def _fill(self) -> None:
        data = self._file.read(self.READ)
        self._eof = not data
        self._buffer += self._decoder.decode(data, final=self._eof).encode("utf-8")

    def _take(self, size: int) -> bytes:
        out, self._buffer = self._buffer[:size], self._buffer[size:]
        return out


def decode(data: bytes, shown: str, first_line: int = 1, first_byte: int = 0, rest: Iterable[bytes] = ()) -> str:
    """Strict UTF-8; positions are file-relative.

    A NUL byte anywhere, in ``data`` or in the ``rest`` of the file (read only on this error
    path), makes it UTF-16/32 without a mark or a binary file, which says more than the first
    bad byte would.
    """
    _refuse_nul(data, shown, first_line, first_byte)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = first_line + data.count(b"\n", 0, error.start)
        invalid = TranscriptError(
            shown, f"invalid UTF-8 at byte {first_byte + error.start}{_likely_encoding(data, shown)}", line
        )
    line, byte = first_line + data.count(b"\n"), first_byte + len(data)
    for chunk in rest:
        _refuse_nul(chunk, shown, line, byte)
        line, byte = line + chunk.count(b"\n"), byte + len(chunk)
    raise invalid


def transcoding_error(error: UnicodeDecodeError, shown: str) -> TranscriptError:
    """A UTF-16/32 file (it has the mark) whose bytes are not valid in it."""
    return TranscriptError(
        shown,
        f"the file starts with a {error.encoding.upper()} byte order mark, "
        f"but is not valid {error.encoding.upper()}: {error.reason}",
    )


def utf8_cut(data: bytes) -> int:
    """Where to cut ``data`` so that a character split by the end of a read waits for its other bytes."""
    for back in range(1, min(len(data), 4) + 1):
        byte = data[-back]
        if byte < 0x80 or byte >= 0xC0:  # not a continuation byte: the last character starts here
            size = 1 if byte < 0xC0 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) - back if size > back else len(data)
    return len(data)


def _refuse_nul(data: bytes, shown: str, first_line: int, first_byte: int) -> None:
    nul = data.find(b"\x00")
    if nul < 0:
        return
    line = first_line + data.count(b"\n", 0, nul)
    wide = _wide_encoding(data)
    if wide:
        raise TranscriptError(
            shown,
            f"this looks like {wide} text without a byte order mark; kvdb reads UTF-8, or UTF-16/UTF-32 that "
            "starts with a byte order mark. "
            f"Convert it with: iconv -f {wide} -t UTF-8 {_quoted(shown)} > converted{_suffix(shown)}",
            line,
        )
    raise TranscriptError(shown, f"binary file (NUL byte at byte {first_byte + nul}), not a transcript", line)


def _wide_encoding(data: bytes) -> str | None:
    """UTF-16LE/BE or UTF-32LE/BE when NULs fall where that encoding puts them for mostly-ASCII text."""
    sample = data[: 4096 - 4096 % 4]
    if len(sample) < 4:
        return None
    for name, width, offsets in (
        ("UTF-32LE", 4, (1, 2, 3)),
        ("UTF-32BE", 4, (0, 1, 2)),
        ("UTF-16LE", 2, (1,)),
        ("UTF-16BE", 2, (0,)),
    ):
        columns = [sample[offset::width] for offset in offsets]
        if all(column.count(0) >= 0.9 * len(column) for column in columns):
            return name
    return None


def _likely_encoding(data: bytes, shown: str) -> str:
    """A hint naming the single-byte encoding ``data`` is most likely in, when no valid UTF-8
    sequence beyond ASCII suggests it is UTF-8 with a bad byte. Windows-1252 uses 0x80-0x9F for
    printable characters, where Latin-1 has control codes."""
    if _has_utf8_sequence(data):
        return ""
    name = "WINDOWS-1252" if any(0x80 <= byte <= 0x9F for byte in data) else "LATIN1"
    try:
        data.decode("cp1252" if name == "WINDOWS-1252" else "latin-1")
    except UnicodeDecodeError:
        return ""
    return (
        f"; the file is not UTF-8 and looks like {name} text. "
        f"Convert it with: iconv -f {name} -t UTF-8 {_quoted(shown)} > converted{_suffix(shown)}"
    )


def _has_utf8_sequence(data: bytes) -> bool:
    return any(ord(c) > 0x7F for c in data.decode("utf-8", errors="ignore"))


def _quoted(path: str) -> str:
    return (
        path
        if path.replace("/", "").replace(".", "").replace("-", "").replace("_", "").isalnum()
        else "'" + path.replace("'", "'\\''") + "'"
    )


def _suffix(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    return name[name.rfind(".") :] if "." in name else ""
