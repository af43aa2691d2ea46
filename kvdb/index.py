"""The search index: FAISS over the dense-walk points of archived token streams.

Point ``i`` of a stream is the fractal walk of its last ``capacity`` tokens, so positions whose
last s tokens agree lie within ``decay(s)`` of each other and a phrase's occurrences are the
points within ``match_radius(len)`` of its query point. FAISS ids are *slots*: each session
gets a contiguous run of slots when it is added, and the database maps slot runs back to
sessions (``search_ranges``). Deleting a session drops its run from the database only; its
points stay in FAISS as tombstones, filtered out at query time, until the index is rebuilt.

The index is derived data: it lives in a sidecar file next to the archive, bound to the
database by a generation number and the slot count, and is rebuilt from the token streams
whenever it is missing or disagrees with the database.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from kvdb import fractal
from kvdb.errors import CorruptData

DIM = 4  # float32 points of 4 dims: 16 bytes a token, 3 tokens resolved for a 49,152 vocabulary
MAGIC = b"KVDBIDX1"
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class IndexHeader:
    alphabet: int
    dim: int
    ntotal: int
    generation: int


class WalkIndex:
    """An exact L2 index (IndexFlatL2) over walk points; flat beat IVF/HNSW here, see docs/design.md."""

    def __init__(self, alphabet: int, dim: int = DIM, generation: int = 0, faiss_index=None):
        self.alphabet = alphabet
        self.dim = dim
        self.generation = generation
        self.geometry = fractal.geometry(alphabet, dim)
        self.capacity = self.geometry.capacity(np.float32)
        self.faiss = faiss_index if faiss_index is not None else faiss.IndexFlatL2(dim)

    @property
    def ntotal(self) -> int:
        return int(self.faiss.ntotal)

    def add(self, tokens: np.ndarray, context: np.ndarray | None = None) -> int:
        """Append the points of ``tokens`` (walked on from ``context``, the tokens just before
        them on their path); returns the first slot they occupy."""
        first = self.ntotal
        if len(tokens):
            context = np.zeros(0, np.int64) if context is None else np.asarray(context)[max(0, len(context) - (self.capacity - 1)) :]
            walked = fractal.walk(np.concatenate([context, tokens]), self.alphabet, np.float32, self.dim)
            self.faiss.add(walked[len(context) :])
        return first

    def within(self, phrase: np.ndarray) -> np.ndarray:
        """Slots whose last ``len(phrase)`` tokens are ``phrase`` (``len(phrase) <= capacity``), sorted."""
        query = fractal.query_point(phrase, self.alphabet, np.float32, self.dim)[None]
        radius = self.geometry.match_radius(len(phrase))
        _, _, ids = self.faiss.range_search(query, float(radius) ** 2)  # IndexFlatL2 works in squared L2
        return np.sort(ids.astype(np.int64))

    # persistence ----------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename): a crash leaves the old file or the new one."""
        body = faiss.serialize_index(self.faiss).tobytes()
        header = json.dumps(
            {"alphabet": self.alphabet, "dim": self.dim, "ntotal": self.ntotal, "generation": self.generation, "crc32": zlib.crc32(body)}
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
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LENGTH.size:
            raise CorruptData(f"{path} is not a kvdb search index")
        (length,) = _LENGTH.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _LENGTH.size
        try:
            header = json.loads(data[start : start + length])
        except ValueError as exc:
            raise CorruptData(f"{path}: damaged header") from exc
        body = data[start + length :]
        if zlib.crc32(body) != header.get("crc32"):
            raise CorruptData(f"{path} failed its CRC32 check")
        index = faiss.deserialize_index(np.frombuffer(body, dtype=np.uint8))
        return cls(header["alphabet"], header["dim"], header["generation"], index)

    @staticmethod
    def read_header(path: Path) -> IndexHeader | None:
        """The header alone (no points read), or None when the file is missing or unreadable."""
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + _LENGTH.size)
                if len(head) < len(MAGIC) + _LENGTH.size or not head.startswith(MAGIC):
                    return None
                (length,) = _LENGTH.unpack_from(head, len(MAGIC))
                header = json.loads(f.read(length))
            return IndexHeader(header["alphabet"], header["dim"], header["ntotal"], header["generation"])
        except (OSError, ValueError, KeyError):
            return None


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
