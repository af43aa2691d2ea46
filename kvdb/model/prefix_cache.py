"""Exact KV caches of growing conversations, kept on disk so a later process can resume them.

A conversation archived turn by turn is re-ingested with one more turn each time; within one
process the last session's cache is reused, but a new process would prefill the whole
conversation again. This folder (``<archive>.prefix/``) keeps the full-precision cache of
sessions that grew an archived session (the sign of a conversation that grows), so the next
turn costs one turn in any process.

It is a cache, not the archive: entries are named by the content hash of (model, tokens), so
an entry is valid for as long as it exists whatever happens to the sessions; each is checked
(header, length, CRC32) when read and ignored if damaged; the least recently used go first
once the folder passes its budget (``$KVDB_PREFIX_CACHE_MB``, default 1024; 0 turns it off).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np

MAGIC = b"KVDBPFX1"
_LENGTH = struct.Struct("<I")
DEFAULT_BUDGET_MB = 1024


class PrefixCache:
    def __init__(self, folder: Path):
        self.folder = folder
        self.budget = int(float(os.environ.get("KVDB_PREFIX_CACHE_MB", DEFAULT_BUDGET_MB)) * 2**20)

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.kv"

    def load(self, model, wanted: list[tuple[str, int]]):
        """(tokens held, DynamicCache) of the first (key, positions) of ``wanted`` whose entry is
        sound and holds exactly those positions, else None. (Before full-length caches, a model
        with sliding-window layers saved only the last window: such an entry is not used.)"""
        if self.budget <= 0:
            return None
        from kvdb.model import (
            capture,  # torch: only the paths that hold a cache need it (gc and stats do not)
        )

        for key, positions in wanted:
            arrays = self.arrays(key, positions)
            if arrays is not None:
                os.utime(self.path(key))  # recently used: evicted last
                return positions, capture.build_cache(model, *arrays)
        return None

    def arrays(self, key: str, positions: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Keys (as the cache held them) and values of entry ``key``, if it is sound and holds
        exactly ``positions``."""
        return self._read(self.path(key), positions) if self.budget > 0 else None

    def save(self, key: str, cache) -> None:
        """Keep a session's whole cache (atomically: temp file and rename), then trim to budget."""
        if self.budget <= 0:
            return
        from kvdb.model import capture

        keys, values = capture.cache_arrays(cache)
        if 2 * keys.nbytes > self.budget:
            return
        body = keys.tobytes() + values.tobytes()
        header = json.dumps({"shape": list(keys.shape), "crc32": zlib.crc32(body)}).encode()
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{key}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(MAGIC + _LENGTH.pack(len(header)) + header + body)
        os.replace(tmp, self.path(key))
        self._trim()

    def prune(self, live: dict[str, int]) -> int:
        """Delete the entries of paths the archive no longer holds (``live``: node id -> the
        positions its path holds), and those that do not hold them all; returns how many."""
        dead = [p for p in self._entries() if live.get(p.stem) != self._positions(p)]
        for path in dead:
            path.unlink(missing_ok=True)
        return len(dead)

    def entries(self) -> dict[str, int | None]:
        """Node id -> the positions each entry's header says it holds (None when unreadable)."""
        return {path.stem: self._positions(path) for path in self._entries()}

    def size(self) -> int:
        return sum(p.stat().st_size for p in self._entries())

    def _entries(self) -> list[Path]:
        return list(self.folder.glob("*.kv")) if self.folder.is_dir() else []

    def _trim(self) -> None:
        entries = sorted(self._entries(), key=lambda p: p.stat().st_mtime, reverse=True)
        total = 0
        for path in entries:
            total += path.stat().st_size
            if total > self.budget:
                path.unlink(missing_ok=True)

    @staticmethod
    def _header(f) -> dict:
        """An entry's JSON header (shape, crc32), the file left at the body; ValueError if not one."""
        head = f.read(len(MAGIC) + _LENGTH.size)
        if not head.startswith(MAGIC):
            raise ValueError("not a prefix-cache entry")
        (length,) = _LENGTH.unpack_from(head, len(MAGIC))
        return json.loads(f.read(length))

    @classmethod
    def _positions(cls, path: Path) -> int | None:
        """The positions an entry's header says it holds (None when unreadable)."""
        try:
            with open(path, "rb") as f:
                return int(cls._header(f)["shape"][2])
        except (OSError, ValueError, KeyError, IndexError, TypeError, struct.error):
            return None

    @classmethod
    def _read(cls, path: Path, positions: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Keys and values of a sound entry holding exactly ``positions``, else None; an entry of
        another length is passed over on its header, without reading its body."""
        try:
            with open(path, "rb") as f:
                header = cls._header(f)
                shape = tuple(int(x) for x in header["shape"])
                if len(shape) != 4 or shape[2] != positions:
                    return None
                body = bytearray(8 * int(np.prod(shape)))  # a bytearray: the cache's tensors must be writable
                if f.readinto(body) != len(body) or f.read(1) or zlib.crc32(body) != header["crc32"]:
                    return None
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            return None
        half = len(body) // 2
        return np.frombuffer(body, "<f4", half // 4).reshape(shape), np.frombuffer(body, "<f4", half // 4, half).reshape(shape)
