"""One file of the search index: the slots of a span of the slot numbering, sorted by walk key.

Sorted walk keys are a suffix array of the reversed stream cut at ``D`` tokens, so the keys
need not be stored: a slot's key is a function of its last ``D`` tokens, which the segment
keeps anyway (hits are checked and shown from them). A segment stores the slots in key order
(4 bytes a position), the token at each slot (2, or 4 above 65,536 symbols), every
``BLOCK``-th key of the sorted order, and per slot run the ``D - 1`` tokens before it on its
path (a run's first keys walk on from its parent node). A lookup binary-searches the sampled
keys, then derives the keys of one block of ``BLOCK`` slots: 6.2 bytes a position, against 14
when every key was stored (docs/decisions/0046-slots-in-key-order.md).

The file is memory-mapped: opening it reads the header, and a query touches the pages it
reads, so a process's memory grows with what it searched, and processes share one copy
through the page cache.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvdb.codecs import fractal
from kvdb.errors import CorruptData, InvalidArgument

MAGIC = b"KVDBIDX4"
BLOCK = 64  # sorted slots per sampled key: 8 / 64 bytes a position, one block's keys derived per bound
_LENGTH = struct.Struct("<I")
_ALIGN = 8
# Files up to this size are read whole at open to compare their CRC (a tail, or an index of up to
# ~5e6 positions: tens of ms); a larger base is checked by `kvdb verify`, since reading it whole
# would cost what mapping it saves (docs/decisions/0046-slots-in-key-order.md).
CHECK_BYTES = 32 << 20
_CHUNK = 1 << 22  # slots whose keys are derived at once when a segment is built: bounds temporary memory
_SAMPLE = np.dtype("<u8")
_FIRST = np.dtype("<u8")
_SLOT = np.dtype("<u4")  # up to 2**32 positions per index
_CONTEXT = np.dtype("<u4")  # the padding symbol is the alphabet's size, one past a u2 at 65,536


def token_dtype(alphabet: int) -> np.dtype:
    return np.dtype("<u2") if alphabet <= 1 << 16 else np.dtype("<u4")


@dataclass(frozen=True)
class Runs:
    """The slot runs a segment holds, by first slot: each is one trie node's tokens."""

    first: np.ndarray  # int64 (stored u8), ascending
    length: np.ndarray  # int64 (stored u4)
    context: np.ndarray  # [runs, D - 1] int64 (stored u4): the tokens before the run on its path, oldest first; the alphabet's size where the path is shorter

    @classmethod
    def empty(cls, depth: int) -> Runs:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, depth - 1), np.int64))

    @classmethod
    def table(cls, firsts: list[int], lengths: list[int], contexts: list[np.ndarray], depth: int) -> Runs:
        """From each run's first slot, length and padded context (``padded_context``)."""
        return cls(np.array(firsts, np.int64), np.array(lengths, np.int64), np.stack(contexts) if contexts else cls.empty(depth).context)

    @classmethod
    def concat(cls, parts: list[Runs]) -> Runs:
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("first", "length", "context")))

    def __len__(self) -> int:
        return len(self.first)

    def slots(self) -> np.ndarray:
        """Every slot a run covers, ascending (the slots between runs are tombstones)."""
        if not len(self):
            return np.zeros(0, np.int64)
        starts = np.repeat(self.first - np.concatenate([[0], np.cumsum(self.length)[:-1]]), self.length)
        return starts + np.arange(int(self.length.sum()), dtype=np.int64)


def padded_context(context: np.ndarray | None, alphabet: int, depth: int) -> np.ndarray:
    """The ``depth - 1`` tokens before a run, padded on the left with the alphabet's size, the
    symbol ``fractal.walk_keys`` reads before the start of a path."""
    before = np.zeros(0, np.int64) if context is None else fractal.check_symbols(context, alphabet).astype(np.int64)[-(depth - 1) :]
    return np.concatenate([np.full(depth - 1 - len(before), alphabet, np.int64), before])


class Segment:
    """Slots ``[first, ntotal)`` of one numbering: their tokens, their runs, and the covered ones
    sorted by (walk key, slot)."""

    def __init__(
        self,
        alphabet: int,
        generation: int,
        first: int,
        ntotal: int,
        tokens: np.ndarray,
        runs: Runs,
        order: np.ndarray,
        samples: np.ndarray,
        ident: str | None = None,
        base: str | None = None,
    ):
        self.alphabet = alphabet
        self.depth = fractal.key_depth(alphabet)
        self.generation = generation
        self.first = first
        self.ntotal = ntotal
        self.tokens = tokens  # by slot - first, tombstones included
        self.runs = runs
        self.order = order  # covered slots in key order
        self.samples = samples  # the key of every BLOCK-th entry of ``order``
        self.ident = ident  # names the contents once saved or loaded: a tail records the base it follows
        self.base = base  # a tail's: the ident of the base it follows
        self._mapping: mmap.mmap | None = None

    @classmethod
    def empty(cls, alphabet: int, generation: int, first: int = 0) -> Segment:
        depth = fractal.key_depth(alphabet)
        return cls(alphabet, generation, first, first, np.zeros(0, token_dtype(alphabet)), Runs.empty(depth), np.zeros(0, _SLOT), np.zeros(0, _SAMPLE))

    @property
    def entries(self) -> int:
        return len(self.order)

    # keys -----------------------------------------------------------------------------------
    def keys_at(self, slots: np.ndarray) -> np.ndarray:
        """The walk key of each covered slot: ``Σ_{s<D} c_{i−s} (N+1)^(D−1−s)``, newest token most
        significant, the tokens before a run read from its context."""
        slots = np.asarray(slots, np.int64)
        run = np.searchsorted(self.runs.first, slots, side="right") - 1
        local = slots - self.runs.first[run]
        base = np.uint64(self.alphabet + 1)
        keys = np.zeros(len(slots), np.uint64)
        for back in range(self.depth):
            inside = local >= back
            own = self.tokens[np.where(inside, slots - back - self.first, 0)]
            before = self.runs.context[run, np.clip(self.depth - 1 - back + local, 0, self.depth - 2)]
            keys = keys * base + np.where(inside, own, before).astype(np.uint64)
        return keys

    def lower_bounds(self, keys: np.ndarray) -> np.ndarray:
        """Per key, how many entries have a smaller one: the sampled keys narrow it to one block,
        whose keys are derived from the tokens."""
        keys = np.asarray(keys, np.uint64)
        n = self.entries
        if n == 0:
            return np.zeros(len(keys), np.int64)
        block = np.searchsorted(self.samples, keys, side="left") - 1  # the last block whose first key is smaller
        at = np.maximum(block, 0)[:, None] * BLOCK + np.arange(1, BLOCK)
        inside = at < np.minimum((np.maximum(block, 0) + 1) * BLOCK, n)[:, None]
        derived = self.keys_at(self.order[np.where(inside, at, 0)].reshape(-1)).reshape(at.shape)
        smaller = ((derived < keys[:, None]) & inside).sum(1)
        return np.where(block < 0, 0, np.maximum(block, 0) * BLOCK + 1 + smaller)

    def bounds(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per pair, [a, b) in key order: the entries with ``lo <= key < hi`` (Python ints;
        ``hi`` up to 2**64, past every key)."""
        past = np.array([h >= 1 << 64 for h in hi], bool)
        ends = np.array([min(h, (1 << 64) - 1) for h in hi], np.uint64)
        found = self.lower_bounds(np.concatenate([np.array(list(lo), np.uint64), ends]))
        return found[: len(lo)], np.where(past, self.entries, found[len(lo) :])

    # building -------------------------------------------------------------------------------
    def _sorted(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(``slots`` sorted by key, their keys); ties keep the slots' order."""
        keys = self._keys_in_chunks(slots)
        order = np.argsort(keys, kind="stable")
        return slots[order].astype(_SLOT), keys[order]

    def _keys_in_chunks(self, slots: np.ndarray) -> np.ndarray:
        keys = np.empty(len(slots), np.uint64)
        for at in range(0, len(slots), _CHUNK):
            keys[at : at + _CHUNK] = self.keys_at(slots[at : at + _CHUNK])
        return keys

    def extended(self, ntotal: int, tokens: np.ndarray, runs: Runs) -> Segment:
        """This segment with ``runs`` (slots past its last; ``tokens``: slots ``self.ntotal`` to
        ``ntotal``) merged in, in (key, slot) order: new slots are larger, so they go after
        equal keys. A few new entries find their places by ``lower_bounds`` (a commit's cost
        is then the new entries and a copy of the order, not deriving every key); many derive
        the old keys in one pass and merge."""
        out = Segment(
            self.alphabet,
            self.generation,
            self.first,
            ntotal,
            np.concatenate([self.tokens, tokens]),
            Runs.concat([self.runs, runs]),
            np.zeros(0, _SLOT),
            np.zeros(0, _SAMPLE),
        )
        order, new = out._sorted(runs.slots())
        if len(new) * BLOCK < self.entries:
            top = new == np.uint64((1 << 64) - 1)  # (N+1)**D may be 2**64 exactly: the last key has no successor
            at = np.where(top, self.entries, self.lower_bounds(np.where(top, np.uint64(0), new + np.uint64(1))))
            out.order = np.insert(np.asarray(self.order), at, order).astype(_SLOT)
            out.samples = out.keys_at(np.asarray(out.order[::BLOCK], np.int64))
            return out
        old = out._keys_in_chunks(np.asarray(self.order, np.int64))
        at = np.searchsorted(old, new, side="right")
        out.order = np.insert(np.asarray(self.order), at, order).astype(_SLOT)
        out.samples = np.ascontiguousarray(np.insert(old, at, new)[::BLOCK])
        return out

    # persistence ----------------------------------------------------------------------------
    def _arrays(self) -> list[np.ndarray]:
        """The body in file order: 8-byte arrays first, so every array starts aligned."""
        return [
            self.samples.astype(_SAMPLE, copy=False),
            self.runs.first.astype(_FIRST),
            np.asarray(self.order).astype(_SLOT, copy=False),
            self.runs.length.astype(_SLOT),
            self.runs.context.astype(_CONTEXT).reshape(-1),
            np.asarray(self.tokens).astype(token_dtype(self.alphabet), copy=False),
        ]

    def save(self, path: Path, base: str | None = None) -> None:
        """Write atomically (temp file + rename): a crash leaves the old file or the new one.
        ``base``: for a tail, the ident of the base it follows. The ident names the contents
        (numbering, span and CRC), so two writers of one copy give it the same name."""
        arrays = self._arrays()
        crc = 0
        for array in arrays:
            crc = zlib.crc32(array.tobytes(), crc)
        self.ident, self.base = f"{self.generation:x}-{self.first:x}-{self.ntotal:x}-{crc:08x}", base
        fields = {
            "alphabet": self.alphabet,
            "generation": self.generation,
            "first": self.first,
            "ntotal": self.ntotal,
            "entries": self.entries,
            "runs": len(self.runs),
            "block": BLOCK,
            "id": self.ident,
            "base": self.base,
            "crc32": crc,
        }
        header = json.dumps(fields).encode()
        header += b" " * (-(len(MAGIC) + _LENGTH.size + len(header)) % _ALIGN)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC + _LENGTH.pack(len(header)) + header)
            for array in arrays:
                f.write(array.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @staticmethod
    def read_header(path: Path) -> dict | None:
        """The header alone, or None when the file is missing, unreadable or of another format."""
        try:
            with open(path, "rb") as f:
                return _header(f)[0]
        except OSError:
            return None

    @classmethod
    def load(cls, path: Path, check: bool = False) -> Segment:
        """Map the file; its arrays are views of the mapping, read as queries touch them. The
        header and the arrays come from one open file, so a file renamed over this one meanwhile
        is never half read. The CRC is compared when the file is small or ``check`` asks for it
        (``kvdb verify``)."""
        try:
            f = open(path, "rb")
        except OSError as exc:
            raise CorruptData(f"{path} cannot be read ({exc.strerror})") from exc
        with f:
            header, start = _header(f)
            size = os.fstat(f.fileno()).st_size
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if header is not None and size else None
        counts = [header.get(f) for f in ("alphabet", "generation", "first", "ntotal", "entries", "runs")] if header is not None else []
        if header is None or header["block"] != BLOCK or not all(isinstance(c, int) and c >= 0 for c in counts) or header["first"] > header["ntotal"]:
            raise CorruptData(f"{path} is not a kvdb search index segment")
        alphabet = header["alphabet"]
        try:
            depth = fractal.key_depth(alphabet)
        except InvalidArgument as exc:
            raise CorruptData(f"{path}: {exc}") from exc
        n, runs, slots = header["entries"], header["runs"], header["ntotal"] - header["first"]
        shapes: list[tuple[np.dtype, int]] = [
            (_SAMPLE, -(-n // BLOCK)),
            (_FIRST, runs),
            (_SLOT, n),
            (_SLOT, runs),
            (_CONTEXT, runs * (depth - 1)),
            (token_dtype(alphabet), slots),
        ]
        if size != start + sum(dtype.itemsize * count for dtype, count in shapes):
            raise CorruptData(f"{path} has {size} bytes where its header promises another length; it is rebuilt from the archive")
        check = check or size <= CHECK_BYTES
        arrays, at, crc = [], start, 0
        for dtype, count in shapes:
            array = np.frombuffer(mapping, dtype, count, at) if count and mapping is not None else np.zeros(0, dtype)
            if check:
                crc = zlib.crc32(array.tobytes(), crc)
            arrays.append(array)
            at += dtype.itemsize * count
        if check and crc != header["crc32"]:
            raise CorruptData(f"{path} failed its integrity check")
        samples, first, order, length, context, tokens = arrays
        run_table = Runs(first.astype(np.int64), length.astype(np.int64), context.reshape(runs, depth - 1).astype(np.int64))
        segment = cls(alphabet, header["generation"], header["first"], header["ntotal"], tokens, run_table, order, samples, header["id"], header.get("base"))
        segment._mapping = mapping
        return segment


def _header(f) -> tuple[dict | None, int]:
    """(the header of an open segment file, where its body starts); None when it is not one."""
    head = f.read(len(MAGIC) + _LENGTH.size)
    if len(head) < len(MAGIC) + _LENGTH.size or not head.startswith(MAGIC):
        return None, 0
    (length,) = _LENGTH.unpack_from(head, len(MAGIC))
    try:
        header = json.loads(f.read(length))
    except ValueError:
        return None, 0
    wanted = ("alphabet", "generation", "first", "ntotal", "entries", "runs", "block", "id", "crc32")
    return (header if isinstance(header, dict) and all(k in header for k in wanted) else None), len(MAGIC) + _LENGTH.size + length
