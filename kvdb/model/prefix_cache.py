"""KV caches of growing conversations, kept on disk so a later process can resume them.

A conversation archived turn by turn is re-ingested with one more turn each time; within one
process the last session's cache is reused, but a new process would prefill the whole
conversation again. This folder (``<archive>.prefix/``) keeps the cache of sessions that grew an
archived session (the sign of a conversation that grows), so the next turn costs one turn in any
process.

- **Shared turns.** An entry stores only the positions its path adds to the deepest shorter path
  of the same tokens that has an entry (its parent, named in its header); reading it reads the
  chain down to a root. A conversation of n turns costs its final length once, not n growing
  copies.
- **Half precision.** Keys and values are stored as float16 (their float32 values rounded once,
  to 11 significant bits): half the bytes, and a resumed prompt's log-probabilities within about
  0.01 nats of a fresh prefill's for SmolLM2 (bfloat16: 0.1; decision 0015). An entry whose
  values float16 cannot hold is stored as float32. A cache read back is therefore the model's
  own computation over the true tokens, rounded, not bit for bit what a prefill gives.
- **A cache, not the archive.** Entries are named by the content hash of (model, tokens), so an
  entry is valid for as long as it exists whatever happens to the sessions; each is checked
  (header, length, CRC32) when read and ignored if damaged (and deleted, with the entries that
  chain to it). Past the budget (``$KVDB_PREFIX_CACHE_MB``, default 1024; 0 turns it off; `kvdb
  serve --prefix-cache-mb`), the least recently used go first: reading or extending an entry
  touches its whole chain, so a parent goes no sooner than the entries that need it.
- **Sealed** beside an encrypted archive (``kvdb/sealing.py``): the keys and values are the
  session's tokens as the model saw them.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvdb import sealing
from kvdb.errors import CorruptData

MAGIC = b"KVDBPFX2"
MAGIC_V1 = b"KVDBPFX1"  # whole float32 caches (kvdb 0.1 to 0.3): still read, as roots
_LENGTH = struct.Struct("<I")
DEFAULT_BUDGET_MB = 1024
DTYPES = ("<f2", "<f4")


@dataclass(frozen=True)
class Trimmed:
    """What a trim deleted: entries, and their bytes."""

    entries: int = 0
    bytes: int = 0

    def __add__(self, other: Trimmed) -> Trimmed:
        return Trimmed(self.entries + other.entries, self.bytes + other.bytes)


@dataclass(frozen=True)
class _Link:
    """One entry as its header describes it: positions [start, end) of its path, chained to
    ``parent`` (which holds [0, start)) unless it is a root."""

    path: Path
    shape: tuple[int, ...]
    start: int
    parent: str | None
    dtype: str
    crc32: int
    body_at: int

    @property
    def end(self) -> int:
        return self.start + self.shape[2]

    @property
    def body_bytes(self) -> int:
        return 2 * np.dtype(self.dtype).itemsize * int(np.prod(self.shape))


def budget_bytes(megabytes: float | None = None) -> int:
    """The folder's cap: ``megabytes``, else ``$KVDB_PREFIX_CACHE_MB``, else the default."""
    chosen = os.environ.get("KVDB_PREFIX_CACHE_MB", DEFAULT_BUDGET_MB) if megabytes is None else megabytes
    return int(float(chosen) * 2**20)


class PrefixCache:
    """``dtype``: how new entries store keys and values ("<f2", or "<f4" where the stored values
    must be the computed ones bit for bit, as the attention sinks of an archive restore)."""

    def __init__(self, folder: Path, budget_mb: float | None = None, dtype: str = "<f2"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        self.folder = folder
        self.budget = budget_bytes(budget_mb)
        self.dtype = dtype

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
                return positions, capture.build_cache(model, *arrays)
        return None

    def arrays(self, key: str, positions: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Keys (as the cache held them) and values, float32, of entry ``key`` with its chain, if
        all of it is sound and it holds exactly ``positions``; the chain is touched (recently used)."""
        if self.budget <= 0:
            return None
        chain = self._chain(key, positions)
        if chain is None:
            return None
        parts = []
        for link in chain:
            arrays = self._body(link)
            if arrays is None:  # damaged: it and what chains to it are of no use to anyone
                link.path.unlink(missing_ok=True)
                return None
            parts.append(arrays)
        _touch(chain)
        if len(parts) == 1 and chain[0].dtype == "<f4":
            return parts[0]
        return (
            np.concatenate([k.astype(np.float32) for k, _ in parts], axis=2),
            np.concatenate([v.astype(np.float32) for _, v in parts], axis=2),
        )

    def save(self, key: str, cache, shorter: list[tuple[str, int]] | tuple = ()) -> None:
        """Keep a session's cache (atomically: temp file and rename), then trim to budget.
        ``shorter``: (key, positions) of shorter paths of the same tokens, deepest first; the
        entry stores only what it adds to the first of them that has a sound entry."""
        if self.budget <= 0:
            return
        import torch

        from kvdb.model import capture

        end = cache.get_seq_length()
        parent = next(((k, p) for k, p in shorter if 0 < p < end and self._chain(k, p) is not None), None)
        start = parent[1] if parent is not None else 0
        # converted as the cache is read (a server saves each new conversation while the next
        # request may be computing; converting afterwards in numpy was slower, decision 0032)
        keys, values = capture.cache_arrays(cache, start, dtype=torch.float16 if self.dtype == "<f2" else torch.float32)
        # past float16's range
        if keys.dtype == np.float16 and not (np.isfinite(keys).all() and np.isfinite(values).all()):
            keys, values = capture.cache_arrays(cache, start)
        dtype = "<f2" if keys.dtype == np.float16 else "<f4"
        body = [np.ascontiguousarray(a, dtype).reshape(-1).view(np.uint8).data for a in (keys, values)]
        if body[0].nbytes + body[1].nbytes > self.budget:
            return
        crc32 = zlib.crc32(body[1], zlib.crc32(body[0]))
        header = {
            "shape": list(keys.shape),
            "start": start,
            "parent": parent[0] if parent else None,
            "dtype": dtype,
            "crc32": crc32,
        }
        encoded = json.dumps(header).encode()
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{key}.{os.getpid()}.tmp"
        with sealing.writing(tmp) as f:
            f.write(MAGIC + _LENGTH.pack(len(encoded)) + encoded)
            f.write(body[0])
            f.write(body[1])
        os.replace(tmp, self.path(key))
        if parent is not None:
            _touch(self._chain(*parent) or [])
        self.trim()

    def prune(self, live: dict[str, int]) -> int:
        """Delete the entries of paths the archive no longer holds (``live``: node id -> the
        positions its path holds), those that do not hold them all, and the entries chained to
        them; returns how many."""
        dead = [p for p in self._entries() if live.get(p.stem) != self._positions(p)]
        for path in dead:
            path.unlink(missing_ok=True)
        return len(dead) + self._sweep(None).entries

    def trim(self) -> Trimmed:
        """Bring the folder within its budget, least recently used first, and delete the
        entries that cannot be read (damaged headers, broken chains); returns what was freed.
        A budget lowered since the entries were written takes effect here (`kvdb gc`)."""
        return self._sweep(self.budget)

    def entries(self) -> dict[str, int | None]:
        """Node id -> the positions each entry's header says it holds (None when unreadable)."""
        return {path.stem: self._positions(path) for path in self._entries()}

    def size(self) -> int:
        return sum(p.stat().st_size for p in self._entries())

    def _entries(self) -> list[Path]:
        return list(self.folder.glob("*.kv")) if self.folder.is_dir() else []

    def _sweep(self, budget: int | None) -> Trimmed:
        """Delete unreadable entries and broken chains, then, within ``budget`` (None: no
        limit), the least recently used. An entry counts as used when any entry that chains to
        it was, and parents come before children, so no kept entry loses its parent."""
        links: dict[str, _Link] = {}
        stats: dict[str, os.stat_result] = {}
        gone = Trimmed()
        for path in self._entries():
            link = self._link(path)
            if link is None:
                gone += _delete(path)
                continue
            try:
                stats[path.stem] = path.stat()
            except OSError:  # deleted meanwhile (another process trimming)
                continue
            links[path.stem] = link
        by_end = sorted(links, key=lambda k: links[k].end)
        sound: set[str] = set()
        for key in by_end:  # a parent ends before its children: it is settled first
            link = links[key]
            parent = links.get(link.parent) if link.parent is not None else None
            if (link.parent is None and link.start == 0) or (
                parent is not None and link.parent in sound and parent.end == link.start
            ):
                sound.add(key)
        used = {key: stats[key].st_mtime for key in sound}
        for key in reversed(by_end):
            above = links[key].parent
            if key in sound and above is not None:
                used[above] = max(used[above], used[key])
        kept: set[str] = set()
        total = 0
        over = False
        for key in sorted(sound, key=lambda k: (-used[k], links[k].end)):
            link = links[key]
            size = stats[key].st_size
            over = over or (budget is not None and total + size > budget)
            if over or (link.parent is not None and link.parent not in kept):
                gone += _delete(link.path)
            else:
                kept.add(key)
                total += size
        for key in set(links) - sound:
            gone += _delete(links[key].path)
        return gone

    def _chain(self, key: str, positions: int) -> list[_Link] | None:
        """The links from a root to entry ``key``, if every header reads and they join up to
        exactly ``positions``; bodies are not read."""
        chain: list[_Link] = []
        wanted: tuple[str | None, int] = (key, positions)
        while wanted[0] is not None:
            link = self._link(self.path(wanted[0]))
            if link is None or link.end != wanted[1] or (link.parent is not None and not 0 < link.start < link.end):
                return None
            chain.append(link)
            wanted = (link.parent, link.start)
        return list(reversed(chain)) if chain[-1].start == 0 else None

    @staticmethod
    def _link(path: Path) -> _Link | None:
        """An entry's header (shape, where its positions start, parent, dtype, crc32), or None
        when it is not one. Version 1 entries are float32 roots."""
        try:
            with sealing.reading(path) as f:
                head = f.read(len(MAGIC) + _LENGTH.size)
                if head[: len(MAGIC)] not in (MAGIC, MAGIC_V1):
                    return None
                (length,) = _LENGTH.unpack_from(head, len(MAGIC))
                header = json.loads(f.read(length))
            v1 = head.startswith(MAGIC_V1)
            shape = tuple(int(x) for x in header["shape"])
            start = 0 if v1 else int(header["start"])
            parent = None if v1 else header["parent"]
            dtype = "<f4" if v1 else header["dtype"]
            if len(shape) != 4 or start < 0 or dtype not in DTYPES or not (parent is None or isinstance(parent, str)):
                return None
            return _Link(path, shape, start, parent, dtype, int(header["crc32"]), len(MAGIC) + _LENGTH.size + length)
        except (OSError, ValueError, KeyError, TypeError, struct.error, CorruptData):
            return None

    @classmethod
    def _positions(cls, path: Path) -> int | None:
        """The positions an entry's header says its path holds (None when unreadable)."""
        link = cls._link(path)
        return link.end if link is not None else None

    @staticmethod
    def _body(link: _Link) -> tuple[np.ndarray, np.ndarray] | None:
        """Keys and values of one link, as stored, if its body is whole and its CRC matches."""
        body = bytearray(link.body_bytes)  # a bytearray: the cache's tensors must be writable
        try:
            with sealing.reading(link.path) as f:
                f.seek(link.body_at)
                if f.readinto(body) != len(body) or f.read(1) or zlib.crc32(body) != link.crc32:
                    return None
        except (OSError, CorruptData):
            return None
        count = len(body) // 2 // np.dtype(link.dtype).itemsize
        keys = np.frombuffer(body, link.dtype, count).reshape(link.shape)
        values = np.frombuffer(body, link.dtype, count, len(body) // 2).reshape(link.shape)
        return keys, values


def _touch(chain: list[_Link]) -> None:
    for link in chain:
        try:
            os.utime(link.path)
        except OSError:  # deleted meanwhile: the next read finds it gone
            pass


def _delete(path: Path) -> Trimmed:
    try:
        size = path.stat().st_size
        path.unlink()
    except OSError:
        return Trimmed()
    return Trimmed(1, size)
