"""The frame tier K's codebook formats share (docs/formats.md): ``magic (8 bytes) | u32 version |
u32 header length | JSON header | payload | u32 CRC32`` of every byte before the CRC. The header
names everything needed to read the payload, so a reader needs no pickle and no guessing."""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np

from kvdb.errors import CorruptData

PREFIX = struct.Struct("<8s I I")  # magic, version, header length
CRC = struct.Struct("<I")


def frame(magic: bytes, version: int, header: dict[str, Any], payload: list[bytes]) -> bytes:
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    body = b"".join([PREFIX.pack(magic, version, len(head)), head, *payload])
    return body + CRC.pack(zlib.crc32(body))


def unframe(blob: bytes, magic: bytes, newest: int, what: str) -> tuple[int, dict[str, Any], int]:
    """(version, header, the payload's first byte) of a framed ``blob``, checked: its magic, a
    version this kvdb reads (at most ``newest``) and its CRC; ``what`` names the format in errors."""
    if len(blob) < PREFIX.size + CRC.size or blob[:8] != magic:
        raise CorruptData(f"not a kvdb {what} blob (bad magic)")
    _, version, length = PREFIX.unpack_from(blob)
    if version > newest:
        raise CorruptData(f"{what} format version {version} is newer than this kvdb reads ({newest}); upgrade kvdb")
    (crc,) = CRC.unpack_from(blob, len(blob) - CRC.size)
    if zlib.crc32(blob[: -CRC.size]) != crc:
        raise CorruptData(f"{what} blob failed its CRC check")
    return version, json.loads(blob[PREFIX.size : PREFIX.size + length]), PREFIX.size + length


class Arrays:
    """The arrays of a framed blob's payload, taken in order from its first byte (``unframe``'s
    third value), each checked against the payload's end; ``done`` checks that nothing is left."""

    def __init__(self, blob: bytes, at: int, what: str):
        self._blob, self._at, self._what = blob, at, what

    def take(self, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape))
        size = np.dtype(dtype).itemsize * count
        if self._at + size > len(self._blob) - CRC.size:
            raise CorruptData(f"{self._what} blob is truncated")
        out = np.frombuffer(self._blob, dtype, count, self._at).reshape(shape)
        self._at += size
        return out

    def done(self) -> None:
        if self._at != len(self._blob) - CRC.size:
            raise CorruptData(f"{self._what} blob has trailing bytes")
