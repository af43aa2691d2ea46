"""The semantic tier's index, kept between processes: each chunk's node, span and vector, the
vector index over them and the BM25 index over their words, in one sidecar file per embedder.

Rows are only appended. A node's rows are read again when the database holds another number of
chunks for it than the index does (a node new, split, or given the tier), and its old rows
become tombstones, as do those of nodes no session uses any more: excluded from both
retrievers' candidates, and from BM25's counts, so a query scores what a fresh build would.
When tombstones outnumber the live rows, or the rows outgrow the flat scan (or the cells the
inverted file was trained with), the owner builds it afresh. The byte layout is in
docs/formats.md ("Semantic sidecar").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvdb.errors import CorruptData
from kvdb.index import ranking, sidecar
from kvdb.index import vectors as vector_ops

MAGIC = b"KVDBCHK1"  # the sidecar format (sidecar.py), which this file's layout became unchanged
VERSION = 1
# Arrays whose bytes the CRC covers: all but the vectors, the inverted file and the postings, whose
# sizes alone are checked (a CRC reads every byte, gigabytes at 1e6 chunks at each open, where a
# query reads a few pages of them). A flipped bit there moves a score until `kvdb repair`.
CHECKED = (
    "node_ids",
    "row_node",
    "spans",
    "live",
    "bm25.words",
    "bm25.df",
    "bm25.lengths",
    "bm25.gone",
    "bm25.segment_sizes",
)
# an inverted file is trained again at this many times the rows it was trained for (its cells' count doubles)
REGROW = 4


@dataclass(frozen=True)
class ChunkHeader:
    embedder: str
    rows: int
    live: int


class Appended:
    """Rows as a base (the sidecar's, memory-mapped) and the rows appended since, in a buffer that
    doubles: an append copies neither (a catch-up that concatenated copied every vector: 768 MB
    at 1e6 chunks). Indexed by an array of rows; ``whole()`` joins the two for a save."""

    def __init__(self, base: np.ndarray):
        self.base = base
        self._tail = np.empty((0, *base.shape[1:]), base.dtype)
        self._n = 0

    def __len__(self) -> int:
        return len(self.base) + self._n

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.base.shape[1:])

    def extend(self, rows: np.ndarray) -> None:
        self._tail = _room(self._tail, self._n, len(rows))
        self._tail[self._n : self._n + len(rows)] = rows
        self._n += len(rows)

    def __getitem__(self, rows) -> np.ndarray:
        if np.ndim(rows) == 0 and not isinstance(rows, slice):
            row = int(rows) + (len(self) if int(rows) < 0 else 0)
            return self.base[row] if row < len(self.base) else self._tail[row - len(self.base)]
        if isinstance(rows, slice) or np.asarray(rows).dtype == bool:  # a range, a mask: rare, the whole joined
            return self.whole()[rows]
        rows = np.asarray(rows, np.int64)
        out = np.empty((len(rows), *self.base.shape[1:]), self.base.dtype)
        low = rows < len(self.base)
        out[low] = self.base[rows[low]]
        out[~low] = self._tail[rows[~low] - len(self.base)]
        return out

    def whole(self) -> np.ndarray:
        return np.concatenate((self.base, self._tail[: self._n])) if self._n else self.base

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.whole(), dtype)


class ChunkIndex:
    """The chunks of one embedder: node (a number into ``node_ids``), span on the path, fp16
    vector and liveness per row, the vector index and the BM25 index, rows numbered alike.
    Each per-row array is the first ``rows`` of a buffer that doubles, so appends copy nothing
    already there (``Appended`` keeps the vectors, the bulk, in the sidecar's mapping)."""

    def __init__(self, embedder: str, dim: int):
        self.embedder = embedder
        self.node_ids: list[str] = []
        self._numbers: dict[str, int] = {}
        self._n = 0
        self._row_node = np.zeros(0, np.int64)
        self._spans = np.zeros((0, 2), np.int64)
        self._live = np.zeros(0, dtype=bool)
        self.vectors = Appended(np.zeros((0, dim), np.float16))
        self.words = ranking.BM25()
        self.index = vector_ops.build(np.zeros((0, dim), np.float32))
        self.trained_for = 0  # rows when the inverted file was trained; 0: a flat scan
        self.unsaved = 0  # rows appended or made tombstones since the file was read or written

    @classmethod
    def build(
        cls, embedder: str, nodes: Sequence[str], spans: np.ndarray, vectors: np.ndarray, texts: Sequence[str]
    ) -> ChunkIndex:
        """The index of these rows, the vector index chosen (and trained) for their number."""
        built = cls(embedder, vectors.shape[1])
        built.index = vector_ops.build(vectors)
        built.trained_for = len(vectors) if vector_ops.trained(built.index) else 0
        built._rows(nodes, spans, vectors, texts)
        built.unsaved = built.rows
        return built

    @property
    def rows(self) -> int:
        return self._n

    @property
    def row_node(self) -> np.ndarray:
        return self._row_node[: self._n]

    @property
    def spans(self) -> np.ndarray:
        return self._spans[: self._n]

    @property
    def live(self) -> np.ndarray:
        return self._live[: self._n]

    def counts(self) -> dict[str, int]:
        """Live rows per node: what the database's ``chunk_counts`` says when this is up to date."""
        per = np.bincount(self.row_node[self.live], minlength=len(self.node_ids))
        return {self.node_ids[i]: int(per[i]) for i in np.flatnonzero(per).tolist()}

    def outgrown(self, adding: int) -> bool:
        """Whether, ``adding`` rows more, a fresh build is due: tombstones outnumber live rows,
        or the rows pass the flat scan's limit or the cells the inverted file was trained for."""
        live = int(self.live.sum()) + adding
        total = self.rows + adding
        return total - live > live or total > max(vector_ops.FLAT_UP_TO, REGROW * self.trained_for)

    def append(self, nodes: Sequence[str], spans: np.ndarray, vectors: np.ndarray, texts: Sequence[str]) -> None:
        if not len(nodes):
            return
        vector_ops.add(self.index, vectors)
        self._rows(nodes, spans, vectors, texts)
        self.unsaved += len(nodes)

    def _rows(self, nodes: Sequence[str], spans: np.ndarray, vectors: np.ndarray, texts: Sequence[str]) -> None:
        numbers = self._numbers
        for node_id in dict.fromkeys(nodes):
            if node_id not in numbers:
                numbers[node_id] = len(self.node_ids)
                self.node_ids.append(node_id)
        n, added = self._n, len(nodes)
        self._row_node, self._spans, self._live = (
            _room(a, n, added) for a in (self._row_node, self._spans, self._live)
        )
        self._row_node[n : n + added] = np.fromiter(map(numbers.__getitem__, nodes), np.int64, added)
        self._spans[n : n + added] = np.asarray(spans, np.int64).reshape(-1, 2)
        self._live[n : n + added] = True
        self.vectors.extend(np.asarray(vectors, np.float16))
        self._n = n + added
        self.words.add(texts)

    def drop(self, nodes: Sequence[str]) -> None:
        """Make the rows of ``nodes`` tombstones."""
        rows = self.rows_of(nodes)
        self.live[rows] = False
        self.words.remove(rows)
        self.unsaved += len(rows)

    def rows_of(self, nodes: Sequence[str]) -> np.ndarray:
        """The live rows of ``nodes``."""
        numbers = [self._numbers[n] for n in nodes if n in self._numbers]
        return np.flatnonzero(self.live & np.isin(self.row_node, numbers))

    def node_of(self, row: int) -> str:
        return self.node_ids[int(self.row_node[row])]

    def nearest(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, inner products) of the ``k`` live rows nearest ``query``, best first."""
        scores, rows = vector_ops.nearest(self.index, query[None], k, self.live)
        keep = rows[0] >= 0
        return rows[0][keep], scores[0][keep]

    # persistence ----------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write atomically (``sidecar.write``): a crash leaves the old file or the new one."""
        arrays = {
            "node_ids": np.array(self.node_ids, dtype="S") if self.node_ids else np.zeros(0, "S1"),
            "row_node": self.row_node,
            "spans": self.spans,
            "live": self.live,
            "vectors": self.vectors.whole(),
            **{f"bm25.{name}": a for name, a in self.words.arrays().items()},
        }
        if self.trained_for:
            arrays["faiss"] = vector_ops.to_bytes(self.index)
        fields = {
            "version": VERSION,
            "embedder": self.embedder,
            "dim": self.vectors.shape[1],
            "rows": self.rows,
            "live": int(self.live.sum()),
            "trained_for": self.trained_for,
            "bm25": {"k1": self.words.k1, "b": self.words.b},
        }
        sidecar.write(path, MAGIC, fields, arrays, CHECKED)
        self.unsaved = 0

    @classmethod
    def load(cls, path: Path) -> ChunkIndex:
        """The sidecar, its arrays memory-mapped (an open reads the header, the node ids and,
        for the vector index, the vectors or the inverted file)."""
        read = sidecar.read(path, MAGIC, checked=CHECKED)
        header, arrays = read.header, read.arrays
        try:
            if header.get("version") != VERSION:
                raise CorruptData(f"{path}: version {header.get('version')!r}, not {VERSION}; {sidecar.REMEDY}")
            loaded = cls(header["embedder"], header["dim"])
            loaded.node_ids = np.asarray(arrays["node_ids"]).astype(str).tolist()
            loaded._numbers = {n: i for i, n in enumerate(loaded.node_ids)}
            loaded._row_node, loaded._spans, loaded.vectors = (
                arrays["row_node"],
                arrays["spans"],
                Appended(arrays["vectors"]),
            )
            loaded._live = np.array(arrays["live"])  # written in place (tombstones): a copy of its own
            loaded._n = len(loaded._live)
            loaded.words = ranking.BM25.from_arrays(
                {n[len("bm25.") :]: a for n, a in arrays.items() if n.startswith("bm25.")}, **header["bm25"]
            )
            loaded.trained_for = header["trained_for"]
            loaded.index = (
                vector_ops.read(_reader(arrays["faiss"]))
                if loaded.trained_for
                else vector_ops.build(loaded.vectors.base)
            )
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: FAISS refusing its bytes
            raise CorruptData(f"{path}: damaged ({exc}); {sidecar.REMEDY}") from exc
        if loaded.index.ntotal != loaded.rows or len(loaded.words) != loaded.rows or loaded.rows != header["rows"]:
            raise CorruptData(f"{path}: its parts disagree on the number of chunks; {sidecar.REMEDY}")
        return loaded

    @staticmethod
    def read_header(path: Path) -> ChunkHeader | None:
        """The header alone, or None when the file is missing, unreadable or of another version."""
        try:
            _, header = sidecar.header(path, (MAGIC,))
            return (
                ChunkHeader(header["embedder"], header["rows"], header["live"])
                if header.get("version") == VERSION
                else None
            )
        except (OSError, CorruptData, KeyError, TypeError):
            return None


def _reader(data: np.ndarray) -> Callable[[int], bytes]:
    """``read(n)`` over mapped bytes, as a file's: FAISS reads its index through one, with no
    second copy of the whole (GBs at 1e6 chunks)."""
    view, at = data.data, 0  # uint8, one dimension

    def read(n: int) -> bytes:
        nonlocal at
        chunk = view[at : at + n].tobytes()
        at += len(chunk)
        return chunk

    return read


def _room(buffer: np.ndarray, used: int, more: int) -> np.ndarray:
    """``buffer`` (its first ``used`` rows kept) with room for ``more`` rows: itself where it has it,
    else a buffer twice as large (appends cost amortised O(rows appended))."""
    if used + more <= len(buffer) and buffer.flags.writeable:
        return buffer
    grown = np.empty((max(used + more, 2 * len(buffer), 16), *buffer.shape[1:]), buffer.dtype)
    grown[:used] = buffer[:used]
    return grown
