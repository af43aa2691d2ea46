"""The file format of the index sidecars: named arrays behind a JSON header, for the phrase
index's segments (``segment.py``) and the semantic tier's chunk index (``chunk_index.py``).

A file is its kind's 8-byte magic, the header's length (u32), the header (the kind's fields, the
arrays' table and a CRC32), padding to ``ALIGN``, then the arrays, each at a multiple of
``ALIGN``: so a reader maps the file once and every array is a view of that mapping, aligned
for any dtype, never copied; a query pages in what it reads. The CRC covers the arrays the kind
names (its small, structural ones, or all of them), in table order: which ones is the reader's
rule, not the file's, so a damaged header cannot narrow it. A file is written to a temporary
file beside it, fsynced and renamed over the old one: a crash leaves one or the other. Beside
an encrypted archive the whole file is sealed (``kvdb/sealing.py``), and a reader decrypts it
into memory instead of mapping it: the cost of reading every byte where a query read a few pages.

Kernel-level: arrays and a header in, arrays and a header out; nothing here knows the archive.
The byte layout is in docs/formats.md ("Sidecar files"). safetensors was measured for this and
not taken (docs/decisions/0059-library-bm25-and-one-sidecar-format.md).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvdb import sealing
from kvdb.errors import CorruptData

ALIGN = 64  # an array's start: a cache line, past any dtype's alignment
_LENGTH = struct.Struct("<I")
_PREFIX = 8 + _LENGTH.size  # magic, header length
RESERVED = ("arrays", "crc32")  # header keys the format itself writes
REMEDY = "kvdb rebuilds it from the archive when next used (`kvdb repair` does it now)"

# A layout of a format older than the table: each array's dtype and shape, derived from its
# header's counts, laid end to end from the header's end in the order given.
Layout = Callable[[dict], Mapping[str, tuple[np.dtype, tuple[int, ...]]]]


@dataclass(frozen=True)
class Sidecar:
    magic: bytes
    header: dict  # the kind's fields, with "arrays" and "crc32"
    arrays: dict[str, np.ndarray]  # read-only views of one mapping of the file
    mapping: object = None  # what they view: the file's mapping, or a sealed file's plaintext

    def let_pages_go(self) -> None:
        """Drop the pages of the file that reads paged into this process. They count in its RSS
        for as long as it maps them, though they are the page cache's: many lookups page in most
        of a file (a 1e8 backfill's lookups held all ~650 MB of its search index resident by its
        end). The page cache keeps them, and the next read of one maps it back without reading
        the disk. A sealed file's plaintext is this process's own memory, and stays."""
        if isinstance(self.mapping, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping.madvise(mmap.MADV_DONTNEED)


def write(
    path: Path, magic: bytes, fields: Mapping, arrays: Mapping[str, np.ndarray], checked: Collection[str] | None = None
) -> int:
    """Write ``arrays`` (each made C-contiguous) under ``fields``, atomically; the CRC32 of the
    ``checked`` arrays (None: all), which the header holds too."""
    if len(magic) != 8 or any(key in fields for key in RESERVED):
        raise ValueError(f"a sidecar takes an 8-byte magic and fields other than {RESERVED}")
    laid = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    offsets, offset, size = {}, 0, 0
    for name, a in laid.items():
        offsets[name] = offset
        size = max(size, offset + a.nbytes)  # no padding after the last: its last byte is the file's
        offset += _aligned(a.nbytes)
    table = {name: {"dtype": a.dtype.str, "shape": list(a.shape), "offset": offsets[name]} for name, a in laid.items()}
    crc = _crc32(laid, checked)
    header = json.dumps({**fields, "arrays": table, "crc32": crc}).encode()
    start = _aligned(_PREFIX + len(header))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with sealing.writing(tmp, sync=True) as f:  # front to back, padding written: a sealed file cannot seek
            f.write(magic + _LENGTH.pack(len(header)) + header)
            at = _PREFIX + len(header)
            for name, a in laid.items():
                f.write(bytes(start + offsets[name] - at))
                f.write(a.reshape(-1).view(np.uint8).data)
                at = start + offsets[name] + a.nbytes
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return crc


def header(path: Path, magics: Collection[bytes]) -> tuple[bytes, dict]:
    """(magic, header) alone: ``CorruptData`` when the file is not of one of ``magics`` or its
    header does not parse; ``OSError`` when it cannot be read."""
    with sealing.reading(path) as f:
        return _header(f, path, magics)[:2]


def read(
    path: Path,
    magic: bytes,
    *,
    checked: Collection[str] | None = None,
    check_up_to: int | None = None,
    older: Mapping[bytes, Layout] | None = None,
) -> Sidecar:
    """Map the file: its header and arrays come from one open file, so one renamed over it
    meanwhile is never half read. The CRC of the ``checked`` arrays (None: all) is compared when
    the file is at most ``check_up_to`` bytes (None: always): a CRC reads every byte it covers,
    where a query reads a few pages. ``older``: the layouts of older magics, read as well."""
    older = older or {}
    try:
        f = sealing.reading(path)
    except OSError as exc:
        raise CorruptData(f"{path} cannot be read ({exc.strerror}); {REMEDY}") from exc
    with f:
        found, fields, end = _header(f, path, (magic, *older))
        mapping = sealing.contents(f)
        size = len(mapping)
    try:
        if found == magic:
            start = _aligned(end)
            places = {
                name: (np.dtype(e["dtype"]), tuple(int(n) for n in e["shape"]), start + int(e["offset"]))
                for name, e in fields["arrays"].items()
            }
        else:
            places, at = {}, end
            for name, (dtype, shape) in older[found](fields).items():
                places[name] = (np.dtype(dtype), tuple(shape), at)
                at += np.dtype(dtype).itemsize * int(np.prod(shape))
        crc = int(fields["crc32"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptData(f"{path}: its header's array table is damaged ({exc!r}); {REMEDY}") from exc
    arrays = {}
    for name, (dtype, shape, at) in places.items():
        count = int(np.prod(shape))
        if min(shape, default=0) < 0 or at < end or at + dtype.itemsize * count > size:
            raise CorruptData(
                f"{path} is cut short or its header is damaged: array {name!r} lies past its {size} bytes; {REMEDY}"
            )
        flat = np.frombuffer(mapping, dtype, count, at)
        arrays[name] = flat if len(shape) == 1 else flat.reshape(shape)
    if found != magic and size != max(
        (at + dtype.itemsize * int(np.prod(shape)) for dtype, shape, at in places.values()), default=end
    ):
        raise CorruptData(f"{path} has {size} bytes where its header promises another length; {REMEDY}")
    if (check_up_to is None or size <= check_up_to) and _crc32(arrays, checked) != crc:
        raise CorruptData(f"{path} failed its integrity check (CRC32); {REMEDY}")
    return Sidecar(found, fields, arrays, mapping)


def _header(f, path: Path, magics: Collection[bytes]) -> tuple[bytes, dict, int]:
    """(magic, header, where the header ends) of an open file."""
    head = f.read(_PREFIX)
    magic = head[:8]
    if len(head) < _PREFIX or magic not in magics:
        expected = " or ".join(m.decode(errors="replace") for m in magics)
        raise CorruptData(
            f"{path} is not a sidecar of this kvdb (magic {magic!r}, expected {expected}: "
            f"another kind, or another version); {REMEDY}"
        )
    (length,) = _LENGTH.unpack_from(head, 8)
    text = f.read(length)
    try:
        fields = json.loads(text) if len(text) == length else None
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        raise CorruptData(f"{path}: its header is cut short or damaged; {REMEDY}")
    return magic, fields, _PREFIX + length


def _crc32(arrays: Mapping[str, np.ndarray], checked: Collection[str] | None) -> int:
    """CRC32 of the ``checked`` arrays' bytes (None: all), in the table's order, without copies."""
    crc = 0
    for name, a in arrays.items():
        if (checked is None or name in checked) and a.nbytes:
            crc = zlib.crc32(np.ascontiguousarray(a).data, crc)
    return crc


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
