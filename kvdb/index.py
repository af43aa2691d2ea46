"""The search index: the walk key of every archived position, sorted.

A position's key is the exact-integer radix walk of its last D tokens (``fractal.walk_keys``),
so the positions whose last s tokens equal a phrase piece are one contiguous range of sorted
keys (the decay law as an interval, the separation property as disjoint intervals), found by
binary search. Index ids are *slots*: each trie node gets a contiguous run of slots when it
is added, and the database maps runs back to nodes (``search_ranges``). Nodes no session uses
are filtered out at query time; their slots stay as tombstones until the index is rebuilt.
The token at every slot is kept too (2 bytes, or 4 for vocabularies over 65,536), so checking
a hit and showing its context read memory, not the database: derived data, like the rest.

The index is derived data: it lives in a sidecar file next to the archive, bound to the
database by a generation number and the slot count, and is rebuilt from the token streams
whenever it is missing or disagrees with the database. Why sorted keys and not FAISS: see
docs/decisions/0001-sorted-walk-keys-not-faiss.md (measured: a FAISS flat range search scans 16 bytes/token per query piece).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvdb import fractal
from kvdb.errors import CorruptData
from kvdb.storage import Storage
from kvdb.storage.base import AddTiers, IndexState, ReplaceIndexState, SessionWrite

MAGIC = b"KVDBIDX3"
_LENGTH = struct.Struct("<I")
_KEY = np.dtype("<u8")
_SLOT = np.dtype("<u4")  # up to 2**32 positions per index



def index_key(tokenizer_hash: str) -> str:
    """One search index per tokenizer: token ids mean the same thing only under one tokenizer."""
    return tokenizer_hash[:16]


def _token_dtype(alphabet: int) -> np.dtype:
    """The token at each slot (hits are checked and shown without a database read): 2 bytes
    for vocabularies up to 65,536 (14 bytes a position in all), else 4."""
    return np.dtype("<u2") if alphabet <= 1 << 16 else np.dtype("<u4")


@dataclass(frozen=True)
class IndexHeader:
    alphabet: int
    ntotal: int
    generation: int


class WalkIndex:
    """Sorted walk keys with their slots, and the token at every slot (14 or 16 bytes a position)."""

    def __init__(self, alphabet: int, generation: int = 0, keys=None, slots=None, tokens=None):
        self.alphabet = alphabet
        self.depth = fractal.key_depth(alphabet)  # tokens one key resolves: a query piece's length
        self.generation = generation
        self.keys = np.zeros(0, _KEY) if keys is None else keys
        self.slots = np.zeros(0, _SLOT) if slots is None else slots
        self.tokens = np.zeros(0, _token_dtype(alphabet)) if tokens is None else tokens  # by slot, tombstones included

    @property
    def ntotal(self) -> int:
        """Slots handed out, tombstones included."""
        return len(self.tokens)

    def add(self, tokens: np.ndarray, context: np.ndarray | None = None) -> int:
        """Index ``tokens`` (walked on from ``context``, the tokens just before them on their
        path); returns the first slot they occupy."""
        first = self.ntotal
        keys = fractal.walk_keys(tokens, self.alphabet, () if context is None else context)
        order = np.argsort(keys, kind="stable")
        at = np.searchsorted(self.keys, keys[order], side="right")
        self.keys = np.insert(self.keys, at, keys[order])
        self.slots = np.insert(self.slots, at, (first + order).astype(_SLOT))
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens).astype(self.tokens.dtype)])
        return first

    def bounds(self, piece: np.ndarray) -> tuple[int, int]:
        """[a, b) in sorted-key order: the entries whose last ``len(piece)`` tokens are ``piece``.

        Ranges nest: the bounds of a longer suffix of a phrase lie inside those of a shorter one.
        """
        lo, hi = fractal.key_range(piece, self.alphabet)
        a = int(np.searchsorted(self.keys, np.uint64(lo)))
        b = int(np.searchsorted(self.keys, np.uint64(hi))) if hi < 1 << 64 else len(self.keys)
        return a, b

    def within(self, piece: np.ndarray) -> np.ndarray:
        """Sorted slots whose last ``len(piece)`` tokens are ``piece`` (``len(piece) <= depth``)."""
        a, b = self.bounds(piece)
        return np.sort(self.slots[a:b].astype(np.int64))

    # persistence ----------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename): a crash leaves the old file or the new one."""
        body = b"".join(a.tobytes() for a in (self.keys.astype(_KEY, copy=False), self.slots.astype(_SLOT, copy=False), self.tokens))
        header = json.dumps(
            {"alphabet": self.alphabet, "ntotal": self.ntotal, "entries": len(self.keys), "generation": self.generation, "crc32": zlib.crc32(body)}
        ).encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC + _LENGTH.pack(len(header)) + header + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> WalkIndex:
        data = path.read_bytes()
        header, start = _parse_header(data, path)
        body = memoryview(data)[start:]
        n, total = header.get("entries", -1), header.get("ntotal", -1)
        token = _token_dtype(header["alphabet"])
        if zlib.crc32(body) != header.get("crc32") or len(body) != n * (_KEY.itemsize + _SLOT.itemsize) + total * token.itemsize:
            raise CorruptData(f"{path} failed its integrity check")
        # The header's length leaves the arrays at any byte offset; numpy copies a misaligned
        # array on every searchsorted (measured: 5 ms a lookup at 1e7 keys), so align them once.
        keys = np.require(np.frombuffer(body, _KEY, n), requirements="A")
        slots = np.require(np.frombuffer(body, _SLOT, n, n * _KEY.itemsize), requirements="A")
        tokens = np.require(np.frombuffer(body, token, total, n * (_KEY.itemsize + _SLOT.itemsize)), requirements="A")
        return cls(header["alphabet"], header["generation"], keys, slots, tokens)

    @staticmethod
    def read_header(path: Path) -> IndexHeader | None:
        """The header alone, or None when the file is missing or unreadable."""
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + _LENGTH.size)
                if len(head) < len(MAGIC) + _LENGTH.size or not head.startswith(MAGIC):
                    return None
                (length,) = _LENGTH.unpack_from(head, len(MAGIC))
                header = json.loads(f.read(length))
            return IndexHeader(header["alphabet"], header["ntotal"], header["generation"])
        except (OSError, ValueError, KeyError):
            return None


def _parse_header(data: bytes, path: Path) -> tuple[dict, int]:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LENGTH.size:
        raise CorruptData(f"{path} is not a kvdb search index")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LENGTH.size
    try:
        return json.loads(data[start : start + length]), start + length
    except ValueError as exc:
        raise CorruptData(f"{path}: damaged header") from exc


@dataclass(frozen=True)
class SlotMap:
    """Live slot runs, sorted by first slot: which trie node and position a slot belongs to."""

    node_ids: np.ndarray  # object array of str
    first: np.ndarray  # int64: first slot of the run
    length: np.ndarray  # int64: tokens in the node
    start: np.ndarray  # int64: the node's first position on its path

    @classmethod
    def from_rows(cls, rows) -> SlotMap:
        """From (node_id, first_slot, n_tokens, start) rows."""
        rows = sorted(rows, key=lambda r: r[1])
        columns = list(zip(*rows)) if rows else [[], [], [], []]
        return cls(np.array(columns[0], dtype=object), *(np.array(c, dtype=np.int64) for c in columns[1:]))

    def locate(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(run index, position in its node) per slot; run index -1 for tombstones."""
        slots = np.asarray(slots, dtype=np.int64)
        run = np.searchsorted(self.first, slots, side="right") - 1
        ok = run >= 0
        position = slots - np.where(ok, self.first[np.maximum(run, 0)], 0)
        ok &= position < np.where(ok, self.length[np.maximum(run, 0)], 0)
        return np.where(ok, run, -1), position


class Indexes:
    """The search indexes of one archive, one per tokenizer (``key``), each in a sidecar file
    bound to the database: loaded when the file agrees with the database, else rebuilt (a
    read-only store takes the write lock for that moment: the file and the database must agree)."""

    def __init__(self, storage: Storage):
        self._store = storage
        self._folder = storage.derived_path(".index")
        self._loaded: dict[str, WalkIndex] = {}
        self._checked: dict[str, object] = {}  # key -> the storage version its loaded copy was last checked at
        self.rebuilt: list[str] = []  # keys rebuilt by this process, in order

    def path(self, key: str) -> Path:
        return self._folder / f"{key}.keys"

    def get(self, key: str, tokenizer_hash: str, alphabet: int = 0) -> WalkIndex:
        """The index, rebuilt if its file is missing, damaged or stale, if it was built for a
        smaller ``alphabet`` than a new stream needs, or if tombstones outnumber live points."""
        if self._current(key, alphabet):
            return self._loaded[key]
        state = self._store.index_state(key)
        header = WalkIndex.read_header(self.path(key))
        nodes = self._searchable(tokenizer_hash)
        index = None
        if (
            state is not None
            and header is not None
            and (header.generation, header.ntotal) == (state.generation, state.ntotal)
            and set(state.ranges) == {n.node_id for n in nodes}
        ):
            try:
                index = WalkIndex.load(self.path(key))
            except CorruptData:
                index = None
        live = sum(n.n_tokens for n in nodes)
        if index is None or index.alphabet < alphabet or index.ntotal > 2 * live + fractal.DEFAULT_BLOCK:
            index = self.rebuild(key, tokenizer_hash, alphabet)
        self._keep(key, index)
        return index

    def _current(self, key: str, alphabet: int) -> bool:
        """Whether the loaded copy can serve: checked against the database once per storage
        version, which moves whenever another process may have written."""
        index = self._loaded.get(key)
        if index is None or index.alphabet < alphabet:
            return False
        version = self._store.version()
        if self._checked.get(key) != version:
            if self._store.index_generation(key) != (index.generation, index.ntotal):
                return False
            self._checked[key] = version
        return True

    def _keep(self, key: str, index: WalkIndex) -> None:
        self._loaded[key] = index
        self._checked[key] = self._store.version()

    def rebuild(self, key: str, tokenizer_hash: str, alphabet: int = 0) -> WalkIndex:
        """A new index from the token streams of every node that keeps the search tier."""
        with self._store.writable():
            return self._rebuild(key, tokenizer_hash, alphabet)

    def _rebuild(self, key: str, tokenizer_hash: str, alphabet: int) -> WalkIndex:
        state = self._store.index_state(key)
        header = WalkIndex.read_header(self.path(key))
        generation = _fresh_generation(state.generation if state else 0, header.generation if header else 0)
        model_ids = self._store.model_ids_with_tokenizer(tokenizer_hash)
        index = WalkIndex(max(alphabet, self._store.max_alphabet(model_ids), fractal.MIN_ALPHABET), generation)
        first_slots = {}
        for node in self._searchable(tokenizer_hash):  # parents first
            context = None
            if node.parent_id is not None:
                context = self._store.load_tokens(node.parent_id, max(0, node.start - index.depth + 1), node.start)
            first_slots[node.node_id] = index.add(self._store.node_tokens(node.node_id), context)
        index.save(self.path(key))
        self._store.apply(ReplaceIndexState(IndexState(key, index.alphabet, index.depth, index.ntotal, generation, first_slots)))
        self._keep(key, index)
        self.rebuilt.append(key)
        return index

    def commit(
        self, key: str, tokenizer_hash: str, plan: SessionWrite | AddTiers, joining: dict[str, tuple[np.ndarray, np.ndarray]], alphabet: int = 0, based_on=None
    ) -> None:
        """Commit a plan whose nodes join the index (``joining``: node id -> its tokens, and the
        tokens before them on its path): a session's new node, or nodes given the search tier.
        The sidecar is saved first; if the database commit then fails, the file is one
        generation ahead of the database, which the next ``get`` detects and rebuilds."""
        index = self.get(key, tokenizer_hash, alphabet)
        try:
            first = {node_id: index.add(tokens, context) for node_id, (tokens, context) in joining.items()}
            index.generation = _fresh_generation(index.generation)
            index.save(self.path(key))
            state = IndexState(key, index.alphabet, index.depth, index.ntotal, index.generation, first)
            self._store.apply(dataclasses.replace(plan, index=state), based_on)
        except BaseException:
            self._loaded.pop(key, None)
            raise

    def _searchable(self, tokenizer_hash: str):
        return [n for n in self._store.nodes_of(self._store.model_ids_with_tokenizer(tokenizer_hash)) if "search" in n.keep]


def _fresh_generation(*taken: int) -> int:
    """A random generation, not a count: two writers of one lake that share this machine's
    sidecar each number their own next index, and a count would give both the same number for
    different contents, which the check of the sidecar against the catalog could not tell apart."""
    while True:
        generation = 1 + secrets.randbelow(2**31 - 2)  # the catalog's column is a 32-bit INTEGER
        if generation not in taken:
            return generation
