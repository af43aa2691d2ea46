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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvdb.codecs import fractal
from kvdb.errors import CorruptData, StaleWrite
from kvdb.storage import Storage
from kvdb.storage.base import AddTiers, IndexState, ReplaceIndexState, SessionWrite

MAGIC = b"KVDBIDX3"
_LENGTH = struct.Struct("<I")
_KEY = np.dtype("<u8")
_SLOT = np.dtype("<u4")  # up to 2**32 positions per index
REBUILD_ATTEMPTS = 50  # another writer committed first each time: past this, say so instead of trying forever


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
        path) at the next free slots; returns the first of them."""
        first = self.ntotal
        self.extend([(first, tokens, context)], first + len(tokens))
        return first

    def extend(self, runs: list[tuple[int, np.ndarray, np.ndarray | None]], ntotal: int) -> None:
        """Merge slot runs (first slot, tokens, the tokens before them on their path) at or past
        the last slot, then count ``ntotal`` slots: one sort and one merge for them all. Slots no
        run covers are tombstones (a node gone before this copy caught up with it)."""
        runs = sorted(runs, key=lambda run: run[0])
        ends = [first + len(tokens) for first, tokens, _ in runs]
        if any(first < end for (first, _, _), end in zip(runs, [self.ntotal, *ends])) or ntotal < max(ends, default=self.ntotal):
            raise CorruptData("the database's search slot runs overlap, or end past its slot count; run `kvdb index rebuild`")
        per_run = [fractal.walk_keys(tokens, self.alphabet, () if context is None else context) for _, tokens, context in runs]
        keys = np.concatenate(per_run) if per_run else np.zeros(0, _KEY)
        slots = np.concatenate([first + np.arange(len(tokens)) for first, tokens, _ in runs]).astype(_SLOT) if runs else np.zeros(0, _SLOT)
        order = np.argsort(keys, kind="stable")
        at = np.searchsorted(self.keys, keys[order], side="right")
        self.keys = np.insert(self.keys, at, keys[order])
        self.slots = np.insert(self.slots, at, slots[order])
        by_slot = np.zeros(ntotal - self.ntotal, self.tokens.dtype)
        for first, tokens, _ in runs:
            by_slot[first - self.ntotal : first - self.ntotal + len(tokens)] = tokens
        self.tokens = np.concatenate([self.tokens, by_slot])

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
        columns: list[Sequence] = list(zip(*rows)) if rows else [[], [], [], []]
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
    """The search indexes of one archive, one per tokenizer (``key``): each a copy, in memory and
    in a sidecar file, of what the database's slot runs say, caught up with the runs other
    writers committed since (on this machine or another), and built again only when the
    database numbered the slots anew."""

    def __init__(self, storage: Storage):
        self._store = storage
        self._folder = storage.derived_path(".index")
        self._loaded: dict[str, WalkIndex] = {}
        self._checked: dict[str, object] = {}  # key -> the storage version its loaded copy was last checked at
        self.rebuilt: list[str] = []  # keys built afresh by this process (not caught up), in order

    def path(self, key: str) -> Path:
        return self._folder / f"{key}.keys"

    def get(self, key: str, tokenizer_hash: str, version=None) -> WalkIndex:
        """The index as the database has it at ``version`` (the storage's, read once by the
        caller) or later: the copy in memory, else the sidecar's, caught up; an empty one when
        nothing was ever indexed. A read: nothing is written to the database."""
        version = self._store.version() if version is None else version
        index = self._loaded.get(key)
        if index is not None and self._checked.get(key) == version:
            return index
        recorded = self._store.index_generation(key)
        if recorded is None:
            return WalkIndex(fractal.MIN_ALPHABET, 0)
        if index is None or not _prefix_of(index, *recorded):
            index = self._sidecar(key, *recorded)
        index = self._follow(key, tokenizer_hash, index)
        self._loaded[key], self._checked[key] = index, version
        return index

    def ready(self, key: str, tokenizer_hash: str, alphabet: int) -> WalkIndex:
        """``get``, for a writer about to add streams of ``alphabet`` symbols: numbered (a commit)
        when there is no numbering yet, or anew when the streams need a larger alphabet."""
        if self._store.index_generation(key) is None:
            return self.rebuild(key, tokenizer_hash, alphabet)
        index = self.get(key, tokenizer_hash)
        return index if index.alphabet >= alphabet else self.rebuild(key, tokenizer_hash, alphabet)

    def _sidecar(self, key: str, generation: int, ntotal: int) -> WalkIndex | None:
        header = WalkIndex.read_header(self.path(key))
        if header is None or header.generation != generation or header.ntotal > ntotal:
            return None
        try:
            return WalkIndex.load(self.path(key))
        except CorruptData:
            return None

    def _follow(self, key: str, tokenizer_hash: str, index: WalkIndex | None) -> WalkIndex:
        """``index`` with the runs from its last slot on merged in, or, when it is None or the
        database has numbered the slots anew meanwhile, every run from slot 0 into a new copy;
        the sidecar saved when anything was added. Nothing is written to the database."""
        state = self._store.index_state(key, index.ntotal if index is not None else 0)
        assert state is not None  # the caller found the index's row
        if index is not None and index.generation != state.generation:
            state, index = self._store.index_state(key), None
            assert state is not None
        if index is None:
            index = WalkIndex(state.alphabet, state.generation)
            self.rebuilt.append(key)
        elif index.ntotal == state.ntotal:
            return index
        self._merge(index, state.ranges, state.ntotal, self._store.nodes_of(self._store.model_ids_with_tokenizer(tokenizer_hash)))
        self._save(key, index)
        return index

    def _save(self, key: str, index: WalkIndex) -> None:
        """Keep the copy for the next process. The database holds what it is derived from, so a
        sidecar that cannot be written (a read-only folder, a full disk) costs only the next
        process's catching up, never this answer or a commit that landed."""
        try:
            index.save(self.path(key))
        except OSError:
            pass

    def _merge(self, index: WalkIndex, ranges: dict[str, int], ntotal: int, nodes: list) -> None:
        """The runs' keys, from the nodes' tokens read in one go (``nodes``: the rows of the
        index's models): a key is a function of a position's last ``depth`` tokens, so deriving
        it costs less than storing it."""
        shapes = {n.node_id: n for n in nodes}
        wanted = [node_id for node_id in ranges if node_id in shapes]  # a run's node gone already (gc): its slots are tombstones
        tokens = self._store.nodes_tokens(wanted)
        index.extend([(ranges[n], tokens[n], self._context(shapes[n], shapes, tokens, index.depth)) for n in wanted], ntotal)

    def _context(self, node, shapes, tokens: dict[str, np.ndarray], depth: int) -> np.ndarray | None:
        """The ``depth - 1`` tokens before ``node`` on its path: its parent's last ones when they
        were read already, else read."""
        if node.parent_id is None:
            return None
        parent = tokens.get(node.parent_id)
        if parent is not None and len(parent) >= depth - 1:
            return parent[len(parent) - (depth - 1) :]
        return self._store.load_tokens(node.parent_id, max(0, node.start - depth + 1), node.start)

    def rebuild(self, key: str, tokenizer_hash: str, alphabet: int = 0) -> WalkIndex:
        """A new numbering of the index's slots: every node that keeps the search tier, parents
        first, tombstones gone. Built on a snapshot and refused if another commit lands first
        (a node it did not see would lose its slots), then built again, a bounded number of times."""
        for _ in range(REBUILD_ATTEMPTS):
            with self._store.writable():
                version = self._store.version()
                index, ranges = self._numbered(key, tokenizer_hash, alphabet)
                try:
                    self._store.apply(ReplaceIndexState(_state(key, index, ranges)), based_on=version)
                except StaleWrite:
                    continue
            self._save(key, index)
            self._loaded[key], self._checked[key] = index, None
            self.rebuilt.append(key)
            return index
        raise StaleWrite(
            f"the search index {key} was numbered {REBUILD_ATTEMPTS} times and another writer's commit landed first each time; run `kvdb repair` again"
        )

    def _numbered(self, key: str, tokenizer_hash: str, alphabet: int) -> tuple[WalkIndex, dict[str, int]]:
        recorded = self._store.index_generation(key)
        header = WalkIndex.read_header(self.path(key))
        generation = _fresh_generation(recorded[0] if recorded else 0, header.generation if header else 0)
        model_ids = self._store.model_ids_with_tokenizer(tokenizer_hash)
        index = WalkIndex(max(alphabet, self._store.max_alphabet(model_ids), fractal.MIN_ALPHABET), generation)
        nodes = self._store.nodes_of(model_ids)
        searchable = [n for n in nodes if "search" in n.keep]  # parents first
        slots = np.cumsum([0] + [n.n_tokens for n in searchable]).tolist()
        ranges = {n.node_id: first for n, first in zip(searchable, slots)}
        self._merge(index, ranges, slots[-1], nodes)
        return index, ranges

    def compact(self, key: str, tokenizer_hash: str) -> bool:
        """Number the slots anew when tombstones (slots of nodes gc freed) outnumber the live
        ones: every lookup's ranges span them until then."""
        index = self.get(key, tokenizer_hash)
        live = sum(n for _, _, n, _ in self._store.slot_runs(key))
        if index.ntotal <= 2 * live + fractal.DEFAULT_BLOCK:
            return False
        self.rebuild(key, tokenizer_hash)
        return True

    def commit(
        self, key: str, tokenizer_hash: str, plan: SessionWrite | AddTiers, joining: dict[str, tuple[np.ndarray, np.ndarray]], alphabet: int = 0, based_on=None
    ) -> None:
        """Commit a plan whose nodes join the index (``joining``: node id -> its tokens, and the
        tokens before them on its path): a session's new node, or nodes given the search tier.
        They take the next slots; the sidecar is saved once the database has the commit (a
        crash between the two leaves it behind, which the next ``get`` catches up)."""
        index = self.ready(key, tokenizer_hash, alphabet)
        try:
            first = {node_id: index.add(tokens, context) for node_id, (tokens, context) in joining.items()}
            self._store.apply(dataclasses.replace(plan, index=_state(key, index, first)), based_on)
        except BaseException:
            self._loaded.pop(key, None)  # holds slots the database may not have
            raise
        self._checked[key] = None
        self._save(key, index)


def _state(key: str, index: WalkIndex, ranges: dict[str, int]) -> IndexState:
    return IndexState(key, index.alphabet, index.depth, index.ntotal, index.generation, ranges)


def _prefix_of(index: WalkIndex, generation: int, ntotal: int) -> bool:
    """Whether the database's index, ``ntotal`` slots of numbering ``generation``, begins with
    ``index``: slots are only appended within one numbering."""
    return index.generation == generation and index.ntotal <= ntotal


def _fresh_generation(*taken: int) -> int:
    """A random numbering, not a count: two writers of one lake that share this machine's sidecar
    may each number the slots anew, and a count would give both the same number for different
    contents, which the check of the sidecar against the catalog could not tell apart."""
    while True:
        generation = 1 + secrets.randbelow(2**31 - 2)  # the catalog's column is a 32-bit INTEGER
        if generation not in taken:
            return generation
