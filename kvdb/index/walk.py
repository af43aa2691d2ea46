"""The search index: every archived position, sorted by its walk key.

A position's key is the exact-integer radix walk of its last D tokens (``fractal.walk_keys``),
so the positions whose last s tokens equal a phrase piece are one contiguous range of sorted
keys (the decay law as an interval, the separation property as disjoint intervals), found by
binary search. The keys themselves are derived from the tokens, not stored (``segment``). Index ids are
*slots*: each trie node gets a contiguous run of slots when it
is added, and the database maps runs back to nodes (``search_ranges``). Nodes no session uses
are filtered out at query time; their slots stay as tombstones until the index is rebuilt.
The token at every slot is kept too (2 bytes, or 4 for vocabularies over 65,536), so checking
a hit and showing its context read memory, not the database: derived data, like the rest.

The index is derived data: it lives in sidecar files next to the archive (bases of up to
``SEGMENT_SLOTS`` slots each, and a tail that commits rewrite until it merges into the newest
base or becomes a base itself), bound to the
database by a generation number and the slot count, and is rebuilt from the token streams
whenever it is missing or disagrees with the database. Why sorted keys and not FAISS: see
docs/decisions/0001-sorted-walk-keys-not-faiss.md (measured: a FAISS flat range search scans 16 bytes/token per query
piece).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from kvdb.codecs import fractal
from kvdb.errors import CorruptData
from kvdb.index import sorting
from kvdb.index.segment import REACH, Runs, Segment, held_context, token_dtype
from kvdb.index.stack import Pieces, Stack

# A tail is rewritten at every commit, so it merges into the base once it holds more than
# TAIL_MIN slots and an eighth of the base's: a commit writes O(tail), a merge O(index).
TAIL_MIN = 1 << 20
TAIL_SHARE = 8
# Slots past which a segment is sorted no more: the tail is then kept as a base of its own and a
# new tail begins. Sorting a segment takes tens of bytes a position (``sorting.sorted_slots``), so one
# segment for a whole history sorted 1e8 positions at once in 8.8 GB; a lookup pays a bound per
# segment instead (docs/decisions/0068-bounded-segments.md).
SEGMENT_SLOTS = 1 << 24


def tail_path(path: Path) -> Path:
    return path.with_suffix(".tail")


def base_path(path: Path, number: int) -> Path:
    """Where base ``number`` lies: the first at ``path`` itself (``KEY.keys``), the next ones
    beside it (``KEY.1.keys``, ...)."""
    return path if number == 0 else path.with_suffix(f".{number}{path.suffix}")


@dataclass(frozen=True)
class IndexHeader:
    alphabet: int
    ntotal: int
    generation: int


class Tokens:
    """The token at every slot, tombstones included, across the segments."""

    def __init__(self, stack: Stack):
        self._stack = stack
        self.dtype = token_dtype(stack.alphabet)

    def __len__(self) -> int:
        return self._stack.segments[-1].ntotal

    def __getitem__(self, at):
        if isinstance(at, slice):  # a search's context windows: most lie in one segment
            start, stop, _ = at.indices(len(self))
            parts = [
                s.tokens[max(start, s.first) - s.first : min(stop, s.ntotal) - s.first]
                for s in self._stack.segments
                if s.first < stop and s.ntotal > start
            ]
            return np.array(parts[0]) if len(parts) == 1 else np.concatenate([np.zeros(0, self.dtype), *parts])
        at = np.asarray(at, np.int64)
        flat = at.reshape(-1)
        return self._stack.tokens_at(flat, self._stack.owner(flat)).astype(self.dtype).reshape(at.shape)


@dataclass(frozen=True)
class KeyRange:
    """The entries of each segment whose keys lie in one range: ``[a, b)`` of each segment's
    ``order``. Made from a lookup's arrays without a loop over the segments: a search makes
    tens of them and reads the entries of a few."""

    orders: tuple[np.ndarray, ...]
    a: np.ndarray  # int64, per segment
    b: np.ndarray
    size: int  # entries in all

    def __len__(self) -> int:
        return self.size

    @property
    def parts(self) -> Iterator[tuple[np.ndarray, int, int]]:
        """``(order, a, b)`` per segment."""
        return zip(self.orders, self.a.tolist(), self.b.tolist())

    def slots(self) -> np.ndarray:
        """Their slots, in key order per segment."""
        return np.concatenate([order[a:b] for order, a, b in self.parts]).astype(np.int64)

    def chunks(self, size: int) -> Iterator[np.ndarray]:
        """Its slots in index order, ``size`` at a time."""
        for order, a, b in self.parts:
            for at in range(a, b, size):
                yield np.asarray(order[at : min(at + size, b)], np.int64)

    def any_slot(self) -> int:
        """One slot of the range, -1 when it is empty."""
        return next((int(order[a]) for order, a, b in self.parts if b > a), -1)

    def around(self, inner: KeyRange, limit: int) -> np.ndarray:
        """Up to ``limit`` slots of this range on each side of ``inner`` (a range nested in it),
        per segment, the nearest first."""
        out: list[np.ndarray] = []
        for (order, a, b), (_, ia, ib) in zip(self.parts, inner.parts):
            out += [order[max(a, ia - limit) : ia][::-1], order[ib : min(b, ib + limit)]]
        return np.concatenate(out).astype(np.int64)

    def outside(self, inner: KeyRange, limit: int) -> np.ndarray:
        """Up to ``limit`` slots of this range that ``inner`` (a range nested in it) leaves out."""
        out: list[np.ndarray] = []
        for (order, a, b), (_, ia, ib) in zip(self.parts, inner.parts):
            for lo, hi in ((a, ia), (ib, b)):
                take = min(hi - lo, limit - sum(len(o) for o in out))
                if take > 0:
                    out.append(order[lo : lo + take])
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)


@dataclass(frozen=True)
class Bounds:
    """The bounds ``Stack.bounds`` gives, [segment, piece]: ``[a, b)``, each piece's entries, and
    ``[a0, b0)``, its first key's; ``orders``: each segment's order."""

    orders: tuple[np.ndarray, ...]
    a: np.ndarray
    b: np.ndarray
    a0: np.ndarray
    b0: np.ndarray

    @cached_property
    def _sizes(self) -> tuple[list[int], list[int]]:
        return (self.b - self.a).sum(0).tolist(), (self.b0 - self.a0).sum(0).tolist()

    def sizes(self) -> np.ndarray:
        """How many entries each piece's range holds."""
        return np.array(self._sizes[0], np.int64)

    def range(self, i: int) -> KeyRange:
        return KeyRange(self.orders, self.a[:, i], self.b[:, i], self._sizes[0][i])

    def first(self, i: int) -> KeyRange:
        """The range of piece ``i``'s first key (its last D tokens)."""
        return KeyRange(self.orders, self.a0[:, i], self.b0[:, i], self._sizes[1][i])


class WalkIndex:
    """The slots of every archived position in walk-key order, and the token at every slot, in
    segments of consecutive slots: bases, of which only the newest is rewritten (when the tail
    merges into it), and the tail the commits since then rewrite (6.2 bytes a position;
    docs/decisions/0046-slots-in-key-order.md). A lookup bounds each segment."""

    def __init__(
        self, alphabet: int, generation: int = 0, bases: list[Segment] | None = None, tail: Segment | None = None
    ):
        self.alphabet = alphabet
        self.depth = fractal.key_depth(alphabet)  # tokens one key resolves
        self.reach = REACH  # tokens the order resolves: the longest piece a lookup takes
        self.generation = generation
        self.bases = bases or [Segment.empty(alphabet, generation)]
        self.tail = tail if tail is not None else Segment.empty(alphabet, generation, self.base.ntotal)
        self._stack: Stack | None = None
        self._chain()

    def _chain(self) -> None:
        """Each segment reads the slots before its own (a run's link, its context) in the one below."""
        for below, above in zip(self.segments, self.segments[1:]):
            above.below = below

    @property
    def base(self) -> Segment:
        """The newest base: the one the tail merges into."""
        return self.bases[-1]

    @property
    def segments(self) -> list[Segment]:
        return [*self.bases, self.tail]

    @property
    def stack(self) -> Stack:
        """The segments as one for a lookup, made again once a commit or a merge replaced one."""
        segments = self.segments
        if self._stack is None or not self._stack.same(segments):
            self._stack = Stack(segments)
        return self._stack

    @property
    def ntotal(self) -> int:
        """Slots handed out, tombstones included."""
        return self.tail.ntotal

    @property
    def entries(self) -> int:
        return sum(segment.entries for segment in self.segments)

    @property
    def room(self) -> int:
        """Slots the tail takes before it is sealed as a base."""
        return SEGMENT_SLOTS - _size(self.tail)

    @property
    def tokens(self) -> Tokens:
        return Tokens(self.stack)

    def add(self, tokens: np.ndarray, context: np.ndarray | None = None) -> int:
        """Index ``tokens`` (walked on from ``context``, the tokens just before them on their
        path) at the next free slots; returns the first of them."""
        first = self.ntotal
        self.extend([(first, tokens, context)], first + len(tokens))
        return first

    def extend(
        self,
        runs: list[tuple[int, np.ndarray, np.ndarray | None]],
        ntotal: int,
        parents: dict[int, int] | None = None,
        settle: bool = True,
    ) -> None:
        """Merge slot runs (first slot, tokens, the tokens before them on their path) at or past
        the last slot, then count ``ntotal`` slots: one sort and one merge for them all. Slots no
        run covers are tombstones (a node gone before this copy caught up with it). ``settle``:
        see ``append``.

        A run keeps a link to a slot whose last ``REACH - 1`` tokens are its context, 8 bytes
        for up to 510 of context: its parent's last slot, where ``parents`` (first slot -> that
        slot, in this batch or indexed) knows it, else any slot the index holds with those
        tokens, found by one lookup for the batch. A run with neither, or nearer its path's
        start, keeps its context."""
        runs = sorted(runs, key=lambda run: run[0])
        firsts, lengths = [first for first, _, _ in runs], [len(tokens) for _, tokens, _ in runs]
        self.check_runs(firsts, lengths, ntotal)
        by_slot = np.zeros(ntotal - self.ntotal, token_dtype(self.alphabet))
        for first, tokens, _ in runs:
            by_slot[first - self.ntotal : first - self.ntotal + len(tokens)] = fractal.check_symbols(
                tokens, self.alphabet
            )
        self.append(
            by_slot, self.run_table(firsts, lengths, [context for _, _, context in runs], parents or {}), settle
        )

    def run_table(
        self, firsts: list[int], lengths: list[int], contexts: list[np.ndarray | None], parents: dict[int, int]
    ) -> Runs:
        """The runs ``extend`` describes, each with its link or its context."""
        links = dict(parents)
        width = self.reach - 1
        unknown = [
            (first, np.asarray(context)[-width:])
            for first, context in zip(firsts, contexts)
            if first not in links and context is not None and len(context) >= width
        ]
        for (first, _), (found, _) in zip(unknown, self.ranges([context for _, context in unknown]) if unknown else []):
            links[first] = found.any_slot()
        if unknown:  # a batch's lookups page in most of every base: held, they grew a backfill by its index's size
            for segment in self.bases:
                segment.let_pages_go()
        kept = [
            held_context(None if links.get(first, -1) >= 0 else context, self.alphabet)
            for first, context in zip(firsts, contexts)
        ]
        return Runs.table(firsts, lengths, [links.get(first, -1) for first in firsts], kept, token_dtype(self.alphabet))

    def check_runs(self, firsts: list[int], lengths: list[int], ntotal: int) -> None:
        ends = [first + n for first, n in zip(firsts, lengths)]
        if any(first < end for first, end in zip(firsts, [self.ntotal, *ends])) or ntotal < max(
            ends, default=self.ntotal
        ):
            raise CorruptData(
                "the database's search slot runs overlap, or end past its slot count; run `kvdb index rebuild`"
            )

    def append(self, by_slot: np.ndarray, runs: Runs, settle: bool = True) -> None:
        """Merge ``runs`` (checked, sorted) whose tokens ``by_slot`` holds, slot ``self.ntotal`` on,
        into the tail, in parts that keep it within ``SEGMENT_SLOTS`` (a full tail becomes a
        base); then, unless ``settle`` is False, merge the tail into the newest base once it has
        outgrown it. A long batch passes False until it ends: its merges double the tail, and
        merging it into the base at each eighth re-sorted the base a score of times in a backfill,
        where the batch's end sorts it once (or, into an empty base, not at all)."""
        for start, stop, part in self._parts(len(by_slot), runs):
            self.tail = sorting.extended(self.tail, self.ntotal + stop - start, by_slot[start:stop], part)
            if _size(self.tail) >= SEGMENT_SLOTS:
                self._seal()
        if settle and _size(self.tail) > max(TAIL_MIN, _size(self.base) // TAIL_SHARE):
            self.settle()

    def _parts(self, slots: int, runs: Runs) -> Iterator[tuple[int, int, Runs]]:
        """``append``'s slots ``[start, stop)`` (from ``self.ntotal``) and their runs, cut between
        runs where the tail reaches ``SEGMENT_SLOTS`` slots (or passes them by less than a run),
        to be sealed before the next part joins it; read lazily, as the tail it fills changes."""
        starts = runs.first - self.ntotal
        ends = starts + runs.length
        start, at = 0, 0
        while at < len(runs):
            until = min(len(runs), max(at + 1, int(np.searchsorted(ends, start + self.room, side="left")) + 1))
            stop = slots if until == len(runs) else int(starts[until])
            yield start, stop, runs.take(np.arange(at, until))
            start, at = stop, until
        if start < slots or not len(runs):  # tombstones alone
            yield start, slots, runs.take(np.zeros(0, np.int64))

    def _seal(self) -> None:
        """The tail becomes the newest base (replacing an empty one), and a new tail begins."""
        tail = self.tail
        sealed = Segment(
            self.alphabet, self.generation, tail.first, tail.ntotal, tail.tokens, tail.runs, tail.order, tail.samples
        )  # no ident: it is saved as a base
        if _size(self.base) == 0:
            self.bases[-1] = sealed
        else:
            self.bases.append(sealed)
        self.tail = Segment.empty(self.alphabet, self.generation, sealed.ntotal)
        self._chain()

    def settle(self) -> None:
        """Merge the tail into the newest base; or, where the two would pass ``SEGMENT_SLOTS``
        or the base is empty, make the tail a base. An empty tail leaves the bases as they are
        (a base of its own would be an empty file, a merge a copy of the base to write again)."""
        if _size(self.tail) == 0:
            return
        if _size(self.base) == 0 or _size(self.base) + _size(self.tail) > SEGMENT_SLOTS:
            self._seal()
            return
        self.bases[-1] = sorting.extended(self.base, self.tail.ntotal, np.asarray(self.tail.tokens), self.tail.runs)
        self.tail = Segment.empty(self.alphabet, self.generation, self.base.ntotal)
        self._chain()

    def ranges(self, pieces: Sequence[np.ndarray]) -> list[tuple[KeyRange, KeyRange]]:
        """Per piece (``len(piece) <= reach``), the entries whose last ``len(piece)`` tokens are
        it, and those whose last ``D`` tokens are its last D (the range of its first key, which
        holds its partial matches of D tokens or more): every bound found in one pass per
        segment.

        Ranges nest: the range of a longer suffix of a phrase lies inside that of a shorter one.
        """
        if not pieces:
            return []
        bounds = self.bounds(pieces)
        return [(bounds.range(i), bounds.first(i)) for i in range(len(pieces))]

    def holds(self, pieces: Sequence[np.ndarray]) -> np.ndarray:
        """Per piece, whether some entry ends with its last ``D`` tokens (with all of it, for a
        piece of up to D): a casing walk's first test of hundreds of words' casings."""
        if not pieces:
            return np.zeros(0, bool)
        return self.stack.holds(Pieces.of([piece[-self.depth :] for piece in pieces], self.alphabet))

    def bounds(self, pieces: Sequence[np.ndarray]) -> Bounds:
        """``ranges`` as arrays, each piece's ``KeyRange`` made when asked for: a casing walk
        bounds hundreds of pieces and keeps the ranges of a few."""
        stack = self.stack
        found = stack.bounds(Pieces.of(pieces, self.alphabet))
        return Bounds(tuple(segment.order for segment in stack.segments), *found)

    def symbols(self, slots: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """``Stack.symbols`` of slots in any segment."""
        return self.stack.symbols(slots, depths)

    def within(self, piece: np.ndarray) -> np.ndarray:
        """Sorted slots whose last ``len(piece)`` tokens are ``piece`` (``len(piece) <= reach``)."""
        return np.sort(self.ranges([piece])[0][0].slots())

    # persistence ----------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Each base that changed (a new one has no ident yet), then the tail, each file naming
        the one it follows: a crash between two leaves a file that names another, which is
        ignored with those after it. Then the files of bases this index no longer has.

        A base written is mapped from its file in place of the arrays it was built in: its
        pages are then the page cache's, read as lookups touch them, where a backfill held every
        base it sealed in its own memory (~100 MB a base)."""
        below = None
        for number, segment in enumerate(self.bases):
            if segment.ident is None:
                segment.save(base_path(path, number), base=below)
                self.bases[number] = Segment.load(base_path(path, number))
            below = self.bases[number].ident
        self._chain()
        self.tail.save(tail_path(path), base=below)
        number = len(self.bases)
        while base_path(path, number).exists():
            base_path(path, number).unlink()
            number += 1

    @classmethod
    def load(cls, path: Path, check: bool = False) -> WalkIndex:
        """Map the bases and the tail, each as far as it follows the one before it. ``check``: compare CRCs."""
        base = Segment.load(path, check)
        if base.first != 0:
            raise CorruptData(f"{path} is not the base of a search index")
        bases = [base]
        while (following := _following(base_path(path, len(bases)), bases[-1], check)) is not None:
            bases.append(following)
        return cls(base.alphabet, base.generation, bases, _following(tail_path(path), bases[-1], check))

    @staticmethod
    def read_header(path: Path) -> IndexHeader | None:
        """What the bases and the tail hold, or None when the first base is missing or unreadable."""
        first = Segment.read_header(path)
        if first is None:
            return None
        last, number = first, 1
        while (header := Segment.read_header(base_path(path, number))) is not None and _follows(
            header, last["id"], last["ntotal"], last["generation"]
        ):
            last, number = header, number + 1
        tail = Segment.read_header(tail_path(path))
        ntotal = (
            tail["ntotal"]
            if tail is not None and _follows(tail, last["id"], last["ntotal"], last["generation"])
            else last["ntotal"]
        )
        return IndexHeader(first["alphabet"], ntotal, first["generation"])


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


def _following(path: Path, below: Segment, check: bool) -> Segment | None:
    """The segment at ``path`` when it follows ``below``, by its header and again once mapped
    (another writer may replace the file between the two), else None."""
    if not _follows(Segment.read_header(path), below.ident, below.ntotal, below.generation):
        return None
    segment = Segment.load(path, check)
    header = {"base": segment.base, "first": segment.first, "generation": segment.generation}
    return segment if _follows(header, below.ident, below.ntotal, below.generation) else None


def _size(segment: Segment) -> int:
    """Slots a segment spans, tombstones included."""
    return segment.ntotal - segment.first


def _follows(tail: dict | None, base: str | None, ntotal: int, generation: int) -> bool:
    """Whether a segment's header names the one below and begins where it ends."""
    return (
        tail is not None
        and tail.get("base") == base
        and tail.get("first") == ntotal
        and tail.get("generation") == generation
    )
