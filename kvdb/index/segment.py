"""One file of the search index: the slots of a span of the slot numbering, in path order.

Entries are sorted by their last ``REACH`` tokens (256, the longest phrase a search takes),
newest first: a suffix array of the reversed stream cut at ``REACH`` tokens, so every phrase is
one range. The keys need not be stored: they are functions of the tokens, which the segment
keeps anyway (hits are checked and shown from them). A segment stores the slots in path order
(4 bytes a position), the token at each slot (2, or 4 above 65,536 symbols), the first key
(``D`` tokens) of every ``BLOCK``-th entry, and per slot run a link to its parent's last slot
(or another with the same ``REACH - 1`` tokens), else those tokens: a run's first entries walk
on from its parent node. A lookup binary-searches the
sampled keys, derives the first keys of one block of ``BLOCK`` slots, and a piece longer than
one key then binary-searches that range by its further tokens: 6.2 bytes a position
(docs/decisions/0046-slots-in-key-order.md, 0047-order-past-one-key.md,
0051-order-to-the-longest-phrase.md).

The file is memory-mapped: opening it reads the header, and a query touches the pages it
reads, so a process's memory grows with what it searched, and processes share one copy
through the page cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from kvdb.codecs import fractal
from kvdb.errors import CorruptData, InvalidArgument
from kvdb.index import sidecar

MAGIC = b"KVDBIDX7"  # the sidecar format (sidecar.py)
MAGIC_V6 = b"KVDBIDX6"  # the same arrays end to end, 8-byte aligned: still read
_SCAN = 32  # entries a bound compares at once, once its binary search is down to them
_CHUNK = 1 << 18  # positions whose keys are derived at once when a segment is sorted: ~80 bytes each meanwhile
_LINKS = 1 << 12  # linked runs whose contexts are read at once when a segment is sorted ([runs, REACH - 1] tokens)
# new entries placed at once by binary search ([entries, REACH] tokens read for them, and 32 entries compared each)
_PLACING = 1 << 12
BLOCK = 64  # sorted slots per sampled key: 8 / 64 bytes a position, one block's keys derived per bound
BISECT_KEYS = 32  # bounds past which a block is bisected rather than derived whole
# Tokens of a position's path that set its place: entries are in the order of their last REACH
# tokens, so a phrase up to that long (every phrase a search takes) is one range of the order
# and a count of it is two binary searches (docs/decisions/0051-order-to-the-longest-phrase.md).
REACH = 256
# Depths a comparison reads at once past the first key: most comparisons are settled by the
# first of these windows, and a tie reads the next, twice as deep.
_WINDOW = 32
# Files up to this size are read whole at open to compare their CRC (a tail, or an index of up to
# ~5e6 positions: tens of ms); a larger base is checked by `kvdb verify`, since reading it whole
# would cost what mapping it saves (docs/decisions/0046-slots-in-key-order.md).
CHECK_BYTES = 32 << 20
_SAMPLE = np.dtype("<u8")
_FIRST = np.dtype("<u8")
_SLOT = np.dtype("<u4")  # up to 2**32 positions per index
_HELD = np.dtype("<u4")


def token_dtype(alphabet: int) -> np.dtype:
    return np.dtype("<u2") if alphabet <= 1 << 16 else np.dtype("<u4")


@dataclass(frozen=True)
class Runs:
    """The slot runs a segment holds, by first slot: each is one trie node's tokens."""

    first: np.ndarray  # int64 (stored u8), ascending
    length: np.ndarray  # int64 (stored u4)
    # int64 (stored u8, 2**64 - 1 for none): a slot whose last REACH - 1 tokens are those before
    # the run on its path (its parent's last, or any other with the same tokens), in this
    # segment or the one below; a run with one keeps no context
    link: np.ndarray
    # int64 (stored u4): tokens of context a run without a link keeps: the whole path before it, up to REACH - 1
    held: np.ndarray
    context: np.ndarray  # every run's kept context in turn, oldest token first (stored as the tokens are)

    @classmethod
    def empty(cls, dtype: np.dtype) -> Runs:
        return cls(
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
            np.zeros(0, dtype),
        )

    @classmethod
    def table(
        cls, firsts: list[int], lengths: list[int], links: list[int], contexts: list[np.ndarray], dtype: np.dtype
    ) -> Runs:
        """From each run's first slot, length, link (-1 for none) and kept context (``held_context``; empty with a
        link)."""
        held = np.array([len(c) for c in contexts], np.int64)
        return cls(
            np.array(firsts, np.int64),
            np.array(lengths, np.int64),
            np.array(links, np.int64),
            held,
            np.concatenate([np.zeros(0, dtype), *contexts]).astype(dtype),
        )

    @classmethod
    def concat(cls, parts: list[Runs]) -> Runs:
        return cls(
            *(np.concatenate([getattr(p, f) for p in parts]) for f in ("first", "length", "link", "held", "context"))
        )

    def __len__(self) -> int:
        return len(self.first)

    @cached_property
    def opens(self) -> np.ndarray:
        """Where each run's context begins in ``context``."""
        return np.cumsum(self.held) - self.held

    def take(self, runs: np.ndarray) -> Runs:
        """The runs ``runs`` (ascending indices), their contexts with them."""
        return Runs(
            self.first[runs],
            self.length[runs],
            self.link[runs],
            self.held[runs],
            self.context[_spans(self.opens[runs], self.held[runs])],
        )

    def slots(self) -> np.ndarray:
        """Every slot a run covers, ascending (the slots between runs are tombstones)."""
        if not len(self):
            return np.zeros(0, np.int64)
        starts = np.repeat(self.first - np.concatenate([[0], np.cumsum(self.length)[:-1]]), self.length)
        return starts + np.arange(int(self.length.sum()), dtype=np.int64)


def _spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices ``[start, start + length)`` of every span in turn."""
    return np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))


def held_context(context: np.ndarray | None, alphabet: int) -> np.ndarray:
    """The last ``REACH - 1`` tokens before a run on its path (all of them when the path is
    shorter: the alphabet's size, the symbol ``fractal.walk_keys`` reads before a path starts,
    is implied past them)."""
    before = (
        np.zeros(0, np.int64) if context is None else np.asarray(context)[len(context) - min(len(context), REACH - 1) :]
    )
    return fractal.check_symbols(before, alphabet).astype(token_dtype(alphabet))


@dataclass(frozen=True)
class Pieces:
    """Query pieces of up to ``REACH`` tokens, prepared once for every segment: the range of
    first keys each lies in, and its tokens by depth."""

    lo: np.ndarray  # uint64: the first key's range, [lo, hi)
    hi: np.ndarray  # uint64, clamped below 2**64
    past: np.ndarray  # bool: hi is 2**64, past every key
    tokens: np.ndarray  # [piece, REACH] int64: its tokens newest first, then the alphabet's size
    lengths: np.ndarray  # int64

    @classmethod
    def of(cls, pieces: Sequence[np.ndarray], alphabet: int) -> Pieces:
        """Every piece at once: a query bounds tens of them."""
        depth, width = fractal.key_depth(alphabet), REACH
        lengths = np.array([len(piece) for piece in pieces], np.int64)
        if len(pieces) and not (lengths.min() >= 1 and lengths.max() <= width):
            raise InvalidArgument(f"a piece covers 1 to {width} symbols, got {lengths.min()} to {lengths.max()}")
        tokens = np.full((len(pieces), width), alphabet, np.int64)
        flat = fractal.check_symbols(np.concatenate(pieces) if len(pieces) else np.zeros(0, np.int64), alphabet).astype(
            np.int64
        )
        row = np.repeat(np.arange(len(pieces)), lengths)
        at = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        tokens[row, lengths[row] - 1 - at] = flat  # newest first
        lo = _packed(np.where(np.arange(depth) < lengths[:, None], tokens[:, :depth], 0), alphabet)
        # all D tokens: one key
        step = np.array([(alphabet + 1) ** (depth - min(n, depth)) for n in lengths.tolist()], np.uint64)
        past = lo > np.uint64((1 << 64) - 1) - step  # lo + step is 2**64: past every key
        return cls(
            lo, np.where(past, np.uint64((1 << 64) - 1), lo + np.where(past, np.uint64(0), step)), past, tokens, lengths
        )


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
        self.reach = REACH
        self.generation = generation
        self.first = first
        self.ntotal = ntotal
        self.tokens = tokens  # by slot - first, tombstones included
        self.runs = runs
        self.order = order  # covered slots in key order
        self.samples = samples  # the key of every BLOCK-th entry of ``order``
        self.ident = ident  # names the contents once saved or loaded: a tail records the base it follows
        self.base = base  # a tail's: the ident of the base it follows
        self.below: Segment | None = None  # a tail's base: where the slots before ``first`` lie

    @classmethod
    def empty(cls, alphabet: int, generation: int, first: int = 0) -> Segment:
        return cls(
            alphabet,
            generation,
            first,
            first,
            np.zeros(0, token_dtype(alphabet)),
            Runs.empty(token_dtype(alphabet)),
            np.zeros(0, _SLOT),
            np.zeros(0, _SAMPLE),
        )

    @property
    def entries(self) -> int:
        return len(self.order)

    # keys -----------------------------------------------------------------------------------
    def symbols(self, slots: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """[slot, depth]: the token ``depth`` places before each covered slot on its path (0: its
        own), read past its run's first slot from the run's context or its link; the alphabet's
        size before the path's start."""
        slots = np.asarray(slots, np.int64)
        depths = np.asarray(depths, np.int64)
        run = np.searchsorted(self.runs.first, slots, side="right") - 1
        local = (slots - self.runs.first[run])[:, None]
        inside = local >= depths[None, :]
        own = self.tokens[np.where(inside, slots[:, None] - depths[None, :] - self.first, 0)].astype(np.int64)
        if inside.all():
            return own
        rows, columns = np.nonzero(~inside)
        own[rows, columns] = self._read(slots[rows], depths[columns])
        return own

    def _read(self, slots: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """The token ``depths[i]`` places before ``slots[i]`` on its path, each pair alone: a
        slot below this segment's is read in the segment below, one before its run's first
        from the run's context, or ``depth - local - 1`` before the run's link, hop after hop."""
        slots, depths = np.array(slots, np.int64), np.array(depths, np.int64)
        out = np.full(len(slots), self.alphabet, np.int64)  # past every hop: before the path's start
        todo = np.arange(len(slots))
        while todo.size:
            lower = slots[todo] < self.first
            if lower.any():
                if self.below is not None:
                    out[todo[lower]] = self.below._read(slots[todo[lower]], depths[todo[lower]])
                todo = todo[~lower]
            run = np.searchsorted(self.runs.first, slots[todo], side="right") - 1
            # a damaged link: no run holds it
            if (run < 0).any() or (slots[todo] >= self.runs.first[run] + self.runs.length[run]).any():
                raise CorruptData(
                    "a search index segment links a run to a slot no run holds; run `kvdb repair` to rebuild it"
                )
            back = depths[todo] - (slots[todo] - self.runs.first[run])  # 1: the token just before the run
            inside = back <= 0
            out[todo[inside]] = self.tokens[slots[todo[inside]] - depths[todo[inside]] - self.first]
            held = self.runs.held[run]
            kept = ~inside & (back <= held)
            if kept.any():
                out[todo[kept]] = self.runs.context[self.runs.opens[run[kept]] + held[kept] - back[kept]]
            hop = ~inside & ~kept & (self.runs.link[run] >= 0)
            slots[todo[hop]], depths[todo[hop]] = self.runs.link[run[hop]], back[hop] - 1
            todo = todo[hop]
        return out

    def keys_at(self, slots: np.ndarray) -> np.ndarray:
        """The walk key of each covered slot: its first ``D`` symbols, packed (``_packed``)."""
        return _packed(self.symbols(slots, np.arange(self.depth)), self.alphabet)

    def lower_bounds(self, keys: np.ndarray) -> np.ndarray:
        """Per key, how many entries have a smaller first key: the sampled keys narrow it to one
        block, whose keys are derived from the tokens."""
        keys = np.asarray(keys, np.uint64)
        n = self.entries
        if n == 0:
            return np.zeros(len(keys), np.int64)
        block = np.searchsorted(self.samples, keys, side="left") - 1  # the last block whose first key is smaller
        base = np.maximum(block, 0) * BLOCK
        # many keys (a casing walk's round): bisect each block, six keys derived a bound, not 63
        if len(keys) > BISECT_KEYS:
            lo, hi = np.ones(len(keys), np.int64), np.minimum(BLOCK, n - base)
            while (open_ := np.flatnonzero(lo < hi)).size:
                mid = (lo[open_] + hi[open_]) // 2
                smaller = self.keys_at(np.asarray(self.order[base[open_] + mid], np.int64)) < keys[open_]
                lo[open_], hi[open_] = np.where(smaller, mid + 1, lo[open_]), np.where(smaller, hi[open_], mid)
            return np.where(block < 0, 0, base + lo)
        at = base[:, None] + np.arange(1, BLOCK)
        inside = at < np.minimum(base + BLOCK, n)[:, None]
        derived = self.keys_at(self.order[np.where(inside, at, 0)].reshape(-1)).reshape(at.shape)
        smaller = ((derived < keys[:, None]) & inside).sum(1)
        return np.where(block < 0, 0, base + 1 + smaller)

    def holds(self, pieces: Pieces) -> np.ndarray:
        """Per piece, whether some entry shares its first key (its last D tokens, or all of a
        shorter one): one bound and one derived key a piece, where ``bounds`` takes two bounds."""
        if self.entries == 0:
            return np.zeros(len(pieces.lo), bool)
        at = self.lower_bounds(pieces.lo)
        first = self.keys_at(np.asarray(self.order[np.minimum(at, self.entries - 1)], np.int64))
        return (at < self.entries) & (pieces.past | (first < pieces.hi))

    def bounds(self, pieces: Pieces) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per piece, [a, b) in this segment's order: the entries whose last ``len(piece)`` tokens
        are it; and [a0, b0), those whose first key it shares (its last D tokens). The first
        key's range comes from the sampled keys; a longer piece then binary-searches it,
        comparing the tokens past the first key."""
        if self.entries == 0:
            empty = np.zeros(len(pieces.lengths), np.int64)
            return empty, empty, empty, empty
        found = self.lower_bounds(np.concatenate([pieces.lo, pieces.hi]))
        a0, b0 = found[: len(pieces.lo)], np.where(pieces.past, self.entries, found[len(pieces.lo) :])
        a, b = a0.copy(), b0.copy()
        deep = np.flatnonzero(pieces.lengths > self.depth)
        if deep.size:
            twice = np.concatenate([deep, deep])
            both = self._search(
                a[twice], b[twice], pieces.tokens[twice], pieces.lengths[twice], np.repeat([False, True], len(deep))
            )
            a[deep], b[deep] = both[: len(deep)], both[len(deep) :]
        return a, b, a0, b0

    def _search(
        self, lo: np.ndarray, hi: np.ndarray, query: np.ndarray, lengths: np.ndarray, after_equal: np.ndarray | bool
    ) -> np.ndarray:
        """Per query (tokens by depth, newest first, ``lengths`` of them), the first place in
        ``[lo, hi)`` of ``order`` whose entry's path is not smaller (where ``after_equal``: not
        smaller or equal) in tokens ``D`` to ``length - 1`` back; every entry of ``[lo, hi)``
        shares the query's first key. All the queries step together, one gather a step, and
        a range down to ``_SCAN`` entries is compared whole in one more."""
        lo, hi = np.array(lo, np.int64), np.array(hi, np.int64)
        if not len(lo):
            return lo
        after_equal = np.broadcast_to(after_equal, lo.shape)
        deepest = int(lengths.max())
        windows, top, width = [], self.depth, _WINDOW  # depths compared at once: a tie reads the next window
        while top < deepest:
            windows.append(np.arange(top, min(deepest, top + width)))
            top, width = top + width, 2 * width

        def before(rows: np.ndarray, at: np.ndarray) -> np.ndarray:
            """Whether the entry at ``at`` (per query of ``rows``, one or more each) lies before the query's place."""
            slots = np.asarray(self.order[at.reshape(-1)], np.int64)
            owner = np.repeat(rows, at.shape[1])
            out = after_equal[owner].copy()  # equal in every counted token
            open_ = np.arange(len(slots))
            for depths in windows:
                found = self.symbols(slots[open_], depths)
                want = query[owner[open_][:, None], depths[None, :]]
                differ = (found != want) & (depths[None, :] < lengths[owner[open_]][:, None])
                settled = differ.any(1)
                first = differ.argmax(1)[:, None]
                out[open_[settled]] = np.take_along_axis(found < want, first, 1)[settled, 0]
                open_ = open_[~settled]
                if not open_.size:
                    break
            return out.reshape(at.shape)

        while True:
            open_ = np.flatnonzero(lo < hi)
            if not open_.size:
                return lo
            small = open_[hi[open_] - lo[open_] <= _SCAN]
            if small.size:
                at = lo[small][:, None] + np.arange(_SCAN)
                inside = at < hi[small][:, None]
                lo[small] += (before(small, np.where(inside, at, lo[small][:, None])) & inside).sum(1)
                hi[small] = lo[small]
            wide = open_[hi[open_] - lo[open_] > _SCAN]
            if wide.size:
                mid = (lo[wide] + hi[wide]) // 2
                right = before(wide, mid[:, None])[:, 0]
                lo[wide] = np.where(right, mid + 1, lo[wide])
                hi[wide] = np.where(right, hi[wide], mid)

    # building -------------------------------------------------------------------------------
    def _sorted(self, runs: np.ndarray) -> np.ndarray:
        """The slots of ``runs`` (indices into ``self.runs``) in path order; ties in an order
        the tokens past ``REACH`` give.

        Prefix doubling with pointer jumping over the runs' positions: ``J(i)``, a position's
        predecessor on its path, is the position before it in its run, or at a run's first
        slot its link, where the link lies among these positions; a run without one is laid
        out after its context (kept, or read through a link outside them), whose first
        position has none. The rank of a position's last 2h tokens is the rank of the pair
        (the rank of its last h, that of ``J^h(i)``'s), and ``J^2h = J^h(J^h)``: ``REACH = 2**6 D``
        takes six sorts after the first key's. Past a context every token reads as the padding,
        which is the path's start or lies past ``REACH`` tokens, where the order no longer
        looks. The positions are the runs' own (a linked run's context is not laid out again),
        and the tokens are read where they lie, a chunk at a time, not copied."""
        table = self.runs.take(np.asarray(runs, np.int64))
        owner = np.maximum(np.searchsorted(table.first, table.link, side="right") - 1, 0)
        within = (
            (table.link >= 0)
            & (table.link >= table.first[owner])
            & (table.link < table.first[owner] + table.length[owner])
        )
        table = self._contexts(table, (table.link >= 0) & ~within)
        ext = table.held + table.length
        starts = np.cumsum(ext) - ext  # where each run's context, else its first slot, lies among the positions
        m = int(ext.sum())
        index_type = np.dtype(np.int32 if m < 1 << 31 else np.int64)  # positions and ranks: half the memory
        shift = starts + table.held - table.first  # a slot's position is its run's shift plus the slot
        before = np.arange(-1, m - 1, dtype=index_type)
        before[starts] = -1
        before[starts[within]] = shift[owner[within]] + table.link[within]
        keys = np.empty(m, np.uint64)
        for at in range(0, m, _CHUNK):
            keys[at : at + _CHUNK] = self._layout_keys(table, starts, before, np.arange(at, min(m, at + _CHUNK)))
        rank, pad = _dense(keys, keys == _packed(np.full((1, self.depth), self.alphabet), self.alphabet)[0], index_type)
        del keys
        jump = before
        for _ in range(self.depth - 1):
            jump = np.where(jump >= 0, before[np.maximum(jump, 0)], -1).astype(index_type)
        del before
        h = self.depth
        while h < self.reach and pad is not None:
            pair = rank.astype(np.int64) * (m + 1)
            pair += np.where(jump >= 0, rank[np.maximum(jump, 0)], pad)
            del rank
            rank, pad = _dense(pair, pair == pad * (m + 1) + pad, index_type)
            del pair
            h *= 2
            if h < self.reach and pad is not None:
                jump = np.where(jump >= 0, jump[np.maximum(jump, 0)], -1).astype(index_type)
        del jump
        slots = table.slots()  # derived here, not held through the doubling: 8 bytes a position
        order = np.argsort(rank[np.repeat(shift, table.length) + slots], kind="stable")
        return slots[order].astype(_SLOT)

    def _contexts(self, table: Runs, read: np.ndarray) -> Runs:
        """``table`` with the context of each run ``read`` marks read through its link (up to
        ``REACH - 1`` tokens, fewer where the path starts), a chunk of runs at a time:
        ``_sorted`` lays such a run out after its context."""
        linked = np.flatnonzero(read)
        if not linked.size:
            return table
        width = REACH - 1
        held, tokens = table.held.copy(), []
        for at in range(0, len(linked), _LINKS):
            rows = linked[at : at + _LINKS]
            before = self._read(
                np.repeat(table.first[rows], width), np.tile(np.arange(width, 0, -1), len(rows))
            ).reshape(len(rows), width)  # oldest first
            real = before != self.alphabet  # the padding lies before the path's start only
            held[rows] = real.sum(1)
            tokens.append(before[real])
        opens = np.cumsum(held) - held
        context = np.empty(int(held.sum()), table.context.dtype)
        own = np.flatnonzero(~read)
        context[_spans(opens[own], held[own])] = table.context[_spans(table.opens[own], table.held[own])]
        context[_spans(opens[linked], held[linked])] = np.concatenate(tokens)
        return Runs(table.first, table.length, table.link, held, context)

    def _layout_keys(self, table: Runs, starts: np.ndarray, before: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The first key of each of ``positions`` of ``_sorted``'s layout (``table``'s runs, each
        after its context, from ``starts``; ``before``: each position's predecessor, -1 for
        none): its ``D`` tokens back, from its run's context or slots, the padding past them."""
        keys = np.zeros(len(positions), np.uint64)
        at = positions.astype(np.int64)
        for _ in range(self.depth):
            run = np.searchsorted(starts, np.maximum(at, 0), side="right") - 1
            local, held = at - starts[run], table.held[run]
            from_context = (at >= 0) & (local < held)
            context = (
                table.context[np.where(from_context, table.opens[run] + local, 0)]
                if len(table.context)
                else np.zeros(len(at), np.int64)
            )
            own = self.tokens[np.where((at >= 0) & ~from_context, table.first[run] + local - held - self.first, 0)]
            symbol = np.where(at < 0, self.alphabet, np.where(from_context, context, own)).astype(np.uint64)
            keys = keys * np.uint64(self.alphabet + 1) + symbol
            at = np.where(at >= 0, before[np.maximum(at, 0)], -1)
        return keys

    def _places(self, slots: np.ndarray) -> np.ndarray:
        """Per slot (covered by this segment, not yet in its order), how many entries of the
        order come before it: those with a smaller path, and equal ones (smaller slots)."""
        out = [np.zeros(0, np.int64)]
        for at in range(0, len(slots), _PLACING):
            query = self.symbols(slots[at : at + _PLACING], np.arange(self.reach))
            keys = _packed(query[:, : self.depth], self.alphabet)
            top = keys == np.uint64((1 << 64) - 1)  # (N+1)**D may be 2**64 exactly: the last key has no successor
            lo = self.lower_bounds(keys)
            hi = np.where(top, self.entries, self.lower_bounds(np.where(top, np.uint64(0), keys + np.uint64(1))))
            out.append(self._search(lo, hi, query, np.full(len(query), self.reach), after_equal=True))
        return np.concatenate(out)

    def extended(self, ntotal: int, tokens: np.ndarray, runs: Runs) -> Segment:
        """This segment with ``runs`` (slots past its last; ``tokens``: slots ``self.ntotal`` to
        ``ntotal``) merged in, in path order: new slots are larger, so they go after equal
        paths. A few new entries are placed by binary search (a commit's cost is then the new
        entries and a copy of the order); many are sorted with the old ones afresh."""
        out = Segment(
            self.alphabet,
            self.generation,
            self.first,
            ntotal,
            np.concatenate([self.tokens, tokens]),
            Runs.concat([self.runs, runs]),
            self.order,
            self.samples,
        )
        out.below = self.below
        if int(runs.length.sum()) * BLOCK < self.entries:
            order = out._sorted(np.arange(len(self.runs), len(out.runs)))
            at = out._places(np.asarray(order, np.int64))
            out.order = np.insert(np.asarray(self.order), at, order).astype(_SLOT)
        else:
            out.order = out._sorted(np.arange(len(out.runs)))
        out.samples = out.keys_at(np.asarray(out.order[::BLOCK], np.int64))
        return out

    # persistence ----------------------------------------------------------------------------
    def _arrays(self) -> dict[str, np.ndarray]:
        """The body, in the stored dtypes (docs/formats.md, "Search sidecar")."""
        tokens = token_dtype(self.alphabet)
        return {
            "samples": self.samples.astype(_SAMPLE, copy=False),
            "run_first": self.runs.first.astype(_FIRST),
            "run_link": self.runs.link.astype(_FIRST),
            "order": np.asarray(self.order).astype(_SLOT, copy=False),
            "run_length": self.runs.length.astype(_SLOT),
            "run_held": self.runs.held.astype(_HELD),
            "tokens": np.asarray(self.tokens).astype(tokens, copy=False),
            "run_context": np.asarray(self.runs.context).astype(tokens, copy=False),
        }

    def save(self, path: Path, base: str | None = None) -> None:
        """Write atomically (``sidecar.write``). ``base``: for a tail, the ident of the base it
        follows. The ident names the contents (numbering, span and CRC), so two writers of one
        copy give it the same name."""
        fields = {
            "alphabet": self.alphabet,
            "generation": self.generation,
            "first": self.first,
            "ntotal": self.ntotal,
            "block": BLOCK,
            "reach": REACH,
            "base": base,
        }
        crc = sidecar.write(path, MAGIC, fields, self._arrays())
        self.ident, self.base = _ident(fields | {"crc32": crc}), base

    @staticmethod
    def read_header(path: Path) -> dict | None:
        """The header alone, its ``id`` with it, or None when the file is missing, unreadable or
        of another format."""
        try:
            _, fields = sidecar.header(path, (MAGIC, MAGIC_V6))
            return fields | {"id": _ident(fields)}
        except (OSError, CorruptData, KeyError, TypeError, ValueError):
            return None

    @classmethod
    def load(cls, path: Path, check: bool = False) -> Segment:
        """Map the file; its arrays are views of the mapping, read as queries touch them. The
        CRC is compared when the file is small or ``check`` asks for it (``kvdb verify``)."""
        read = sidecar.read(path, MAGIC, check_up_to=None if check else CHECK_BYTES, older={MAGIC_V6: _layout_v6})
        header, arrays = read.header, read.arrays
        try:
            alphabet, generation, first, ntotal = (header[k] for k in ("alphabet", "generation", "first", "ntotal"))
            fractal.key_depth(alphabet)  # refuses an alphabet no walk key holds
            tokens = token_dtype(alphabet)
            dtypes = {
                "samples": _SAMPLE,
                "run_first": _FIRST,
                "run_link": _FIRST,
                "order": _SLOT,
                "run_length": _SLOT,
                "run_held": _HELD,
                "tokens": tokens,
                "run_context": tokens,
            }
            runs = len(arrays["run_first"])
            fit = (
                all(arrays[name].dtype == dtype and arrays[name].ndim == 1 for name, dtype in dtypes.items())
                and header["block"] == BLOCK
                and header.get("reach") == REACH
                and all(isinstance(c, int) and c >= 0 for c in (generation, first, ntotal))
                and first <= ntotal
                and len(arrays["tokens"]) == ntotal - first
                and len(arrays["samples"]) == -(-len(arrays["order"]) // BLOCK)
                and all(len(arrays[name]) == runs for name in ("run_link", "run_length", "run_held"))
            )
        except (KeyError, TypeError, InvalidArgument) as exc:
            raise CorruptData(f"{path} is not a kvdb search index segment ({exc!r}); {sidecar.REMEDY}") from exc
        if not fit:
            raise CorruptData(f"{path} has arrays its header does not describe; {sidecar.REMEDY}")
        first_slot, length, link, held = (
            arrays[name].astype(np.int64) for name in ("run_first", "run_length", "run_link", "run_held")
        )
        table = Runs(first_slot, length, link, held, arrays["run_context"])
        if int(table.held.sum()) != len(table.context) or (
            runs and (int(table.held.max()) >= REACH or int(table.link.max()) >= ntotal)
        ):
            raise CorruptData(f"{path} has run contexts its header does not count; {sidecar.REMEDY}")
        return cls(
            alphabet,
            generation,
            first,
            ntotal,
            arrays["tokens"],
            table,
            arrays["order"],
            arrays["samples"],
            _ident(header),
            header.get("base"),
        )


def _ident(header: dict) -> str:
    """What names a segment's contents: ``"<generation>-<first>-<ntotal>-<crc32>"`` in hex."""
    return f"{header['generation']:x}-{header['first']:x}-{header['ntotal']:x}-{header['crc32']:08x}"


def _layout_v6(header: dict) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The arrays of a ``KVDBIDX6`` file (kvdb before the sidecar module; same contents, a
    fixed order from the header's counts, 8-byte alignment), still read: at 1e8 tokens a
    rebuild takes minutes."""
    n, runs, tokens = header["entries"], header["runs"], token_dtype(header["alphabet"])
    return {
        "samples": (_SAMPLE, (-(-n // BLOCK),)),
        "run_first": (_FIRST, (runs,)),
        "run_link": (_FIRST, (runs,)),
        "order": (_SLOT, (n,)),
        "run_length": (_SLOT, (runs,)),
        "run_held": (_HELD, (runs,)),
        "tokens": (tokens, (header["ntotal"] - header["first"],)),
        "run_context": (tokens, (header["held"],)),
    }


def _packed(symbols: np.ndarray, alphabet: int) -> np.ndarray:
    """Walk keys of rows of D symbols, newest first: ``Σ_{s<D} c_{i−s} (N+1)^(D−1−s)``, the
    newest most significant."""
    keys = np.zeros(len(symbols), np.uint64)
    for column in symbols.T:
        keys = keys * np.uint64(alphabet + 1) + column.astype(np.uint64)
    return keys


def _dense(values: np.ndarray, padding: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, int | None]:
    """(each value's rank among the distinct values, as ``dtype``; the rank an all-padding window takes:
    that of the values ``padding`` marks, one past the largest when none is; None when every
    value is distinct, and no further key can reorder them)."""
    order = np.argsort(values)
    new = np.ones(len(values), bool)
    for at in range(1, len(values), _CHUNK):  # the sorted values compared a chunk at a time, not copied whole
        stop = min(at + _CHUNK, len(values))
        new[at:stop] = values[order[at:stop]] != values[order[at - 1 : stop - 1]]
    rank = np.empty(len(values), dtype)
    rank[order] = np.cumsum(new, dtype=dtype) - 1
    if new.all():
        return rank, None
    marked = np.flatnonzero(padding)
    return rank, int(rank[marked[0]]) if marked.size else int(rank.max()) + 1
