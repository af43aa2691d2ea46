"""A search index's segments searched as one: each step of a lookup reads all of them at once.

A lookup bounds every piece in every segment: the sampled keys narrow a bound to one block, the
block's keys are derived from the tokens, and a piece longer than one key binary-searches on by
its further tokens. Done one segment after another, each step was a dozen numpy calls per
segment, and at 1e8 tokens (seven bases and a tail) the calls, not the data they read, were most
of a search's time. Here every segment's rows step together: the arithmetic and the reads of the
run table (one for all segments) are one call a step, and only the reads of a segment's own
arrays (its order, its tokens, its sampled keys) go segment by segment, one slice each
(docs/decisions/0071-segments-searched-as-one.md).

Words: a *slot* numbers a position across the segments; an *entry* is a place in one segment's
``order`` (its covered slots in path order); a *row* is what one step works on, a piece (or a
slot being placed) in one segment, the rows numbered segment by segment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvdb.codecs import fractal
from kvdb.errors import CorruptData, InvalidArgument
from kvdb.index import segment as stored
from kvdb.index.segment import REACH, Runs, Segment, packed

_SCAN = 32  # entries a bound compares at once, once its binary search is down to them
# Depths a comparison reads at once past the first key: most comparisons are settled by the
# first of these windows, and a tie reads the next, twice as deep.
_WINDOW = 32

Bound = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # (a, b, a0, b0), each [segment, piece]


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
        lo = packed(np.where(np.arange(depth) < lengths[:, None], tokens[:, :depth], 0), alphabet)
        # all D tokens: one key
        step = np.array([(alphabet + 1) ** (depth - min(n, depth)) for n in lengths.tolist()], np.uint64)
        past = lo > np.uint64((1 << 64) - 1) - step  # lo + step is 2**64: past every key
        return cls(
            lo, np.where(past, np.uint64((1 << 64) - 1), lo + np.where(past, np.uint64(0), step)), past, tokens, lengths
        )


class Stack:
    """Consecutive segments, the first from slot 0 (or from a slot no link reaches below), with
    one table of their runs."""

    def __init__(self, segments: Sequence[Segment]):
        self.segments = tuple(segments)
        self.alphabet = self.segments[0].alphabet
        self.depth = fractal.key_depth(self.alphabet)
        self.firsts = np.array([segment.first for segment in self.segments], np.int64)
        self.entries = np.array([segment.entries for segment in self.segments], np.int64)
        self.runs = Runs.concat([segment.runs for segment in self.segments])

    @classmethod
    def under(cls, segment: Segment) -> Stack:
        """``segment`` and every one below it (``Segment.below``): what its links may read."""
        chain = [segment]
        while chain[-1].below is not None:
            chain.append(chain[-1].below)
        return cls(chain[::-1])

    def same(self, segments: Sequence[Segment]) -> bool:
        """Whether this stack is of these very segments (an index's tail is replaced at each commit)."""
        return len(segments) == len(self.segments) and all(a is b for a, b in zip(segments, self.segments))

    # reads ----------------------------------------------------------------------------------
    def _parts(self, owner: np.ndarray) -> list[tuple[int, slice | np.ndarray]]:
        """Per segment, the rows ``owner`` gives it: one slice each where ``owner`` ascends (rows
        numbered segment by segment), else their indices."""
        if not owner.size:
            return []
        if owner.size == 1 or bool((owner[1:] >= owner[:-1]).all()):
            cuts = np.searchsorted(owner, np.arange(len(self.segments) + 1)).tolist()
            return [(n, slice(a, b)) for n, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])) if b > a]
        return [(int(n), np.flatnonzero(owner == n)) for n in np.unique(owner)]

    def owner(self, slots: np.ndarray) -> np.ndarray:
        """The segment of each slot."""
        return np.searchsorted(self.firsts, slots, side="right") - 1

    def tokens_at(self, slots: np.ndarray, owner: np.ndarray) -> np.ndarray:
        """The token at each slot, as int64; the slots of a row of ``slots`` (its first axis) lie
        in the segment ``owner`` gives it."""
        out = np.empty(slots.shape, np.int64)
        for n, rows in self._parts(owner):
            segment = self.segments[n]
            out[rows] = segment.tokens[slots[rows] - segment.first]
        return out

    def order_at(self, owner: np.ndarray, entries: np.ndarray) -> np.ndarray:
        """The slot at each entry of its segment's order (``owner``: each one's segment), as int64."""
        out = np.empty(len(entries), np.int64)
        for n, rows in self._parts(owner):
            out[rows] = self.segments[n].order[entries[rows]]
        return out

    def symbols(self, slots: np.ndarray, depths: np.ndarray, owner: np.ndarray | None = None) -> np.ndarray:
        """[slot, depth]: the token ``depth`` places before each covered slot on its path (0: its
        own), read past its run's first slot from the run's context or its link; the alphabet's
        size before the path's start. ``owner``: each slot's segment, where the caller knows it."""
        slots = np.asarray(slots, np.int64)
        depths = np.asarray(depths, np.int64)
        owner = self.owner(slots) if owner is None else owner
        run = np.searchsorted(self.runs.first, slots, side="right") - 1
        local = (slots - self.runs.first[run])[:, None]
        inside = local >= depths[None, :]
        # a slot inside its run lies in its run's segment: the reads keep the slots' segments in order
        own = self.tokens_at(np.where(inside, slots[:, None] - depths[None, :], slots[:, None]), owner)
        if inside.all():
            return own
        rows, columns = np.nonzero(~inside)
        own[rows, columns] = self.read(slots[rows], depths[columns])
        return own

    def read(self, slots: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """The token ``depths[i]`` places before ``slots[i]`` on its path, each pair alone: one
        before its run's first slot from the run's context, or ``depth - local - 1`` before the
        run's link, hop after hop; one below the first segment reads as the path's start."""
        slots, depths = np.array(slots, np.int64), np.array(depths, np.int64)
        out = np.full(len(slots), self.alphabet, np.int64)  # past every hop: before the path's start
        todo = np.flatnonzero(slots >= self.firsts[0])
        runs = self.runs
        while todo.size:
            run = np.searchsorted(runs.first, slots[todo], side="right") - 1
            # a damaged link: no run holds it
            if (run < 0).any() or (slots[todo] >= runs.first[run] + runs.length[run]).any():
                raise CorruptData(
                    "a search index segment links a run to a slot no run holds; run `kvdb repair` to rebuild it"
                )
            back = depths[todo] - (slots[todo] - runs.first[run])  # 1: the token just before the run
            inside = back <= 0
            at = slots[todo[inside]] - depths[todo[inside]]
            out[todo[inside]] = self.tokens_at(at, self.owner(at))
            held = runs.held[run]
            kept = ~inside & (back <= held)
            if kept.any():
                out[todo[kept]] = runs.context[runs.opens[run[kept]] + held[kept] - back[kept]]
            hop = ~inside & ~kept & (runs.link[run] >= 0)
            slots[todo[hop]], depths[todo[hop]] = runs.link[run[hop]], back[hop] - 1
            todo = todo[hop]
            todo = todo[slots[todo] >= self.firsts[0]]
        return out

    def keys_at(self, slots: np.ndarray, owner: np.ndarray | None = None) -> np.ndarray:
        """The walk key of each covered slot: its first ``D`` symbols, packed (``segment.packed``)."""
        return packed(self.symbols(slots, np.arange(self.depth), owner), self.alphabet)

    # bounds ---------------------------------------------------------------------------------
    def _rows(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(segment, piece) of each row of ``count`` pieces in every segment that has entries."""
        full = np.flatnonzero(self.entries > 0)
        return np.repeat(full, count), np.tile(np.arange(count), len(full))

    def lower_bounds(self, keys: np.ndarray, owner: np.ndarray) -> np.ndarray:
        """Per key, how many entries of its segment (``owner``) have a smaller first key: the
        sampled keys narrow it to one block, whose keys are derived from the tokens."""
        keys, owner = np.asarray(keys, np.uint64), np.asarray(owner, np.int64)
        block = np.full(len(keys), -1, np.int64)  # the last block whose first key is smaller
        for n, rows in self._parts(owner):
            block[rows] = np.searchsorted(self.segments[n].samples, keys[rows], side="left") - 1
        base = np.maximum(block, 0) * stored.BLOCK
        size = np.where(block < 0, 0, np.minimum(stored.BLOCK, self.entries[owner] - base))  # entries left to compare
        # two rounds: every STRIDE-th entry of the block, then the entries between the two it
        # falls between (14 keys derived a bound of a 64-entry block, not 63, nor 6 rounds of one)
        stride = max(1, math.isqrt(stored.BLOCK))
        lo = stride * self._smaller(keys, owner, base, stride, size, stride, (stored.BLOCK - 1) // stride) + 1
        return np.where(block < 0, 0, base + lo + self._smaller(keys, owner, base, lo, size, 1, stride - 1))

    def _smaller(
        self,
        keys: np.ndarray,
        owner: np.ndarray,
        base: np.ndarray,
        first: np.ndarray | int,
        size: np.ndarray,
        step: int,
        count: int,
    ) -> np.ndarray:
        """Per key, how many of the entries ``first``, ``first + step``, ... (``count`` of them,
        those below ``size``) of its block (from entry ``base``) have a smaller first key: one
        derivation of them all."""
        at = np.broadcast_to(first, keys.shape)[:, None] + step * np.arange(count)[None, :]
        rows, columns = np.nonzero(at < size[:, None])
        derived = self.keys_at(self.order_at(owner[rows], base[rows] + at[rows, columns]), owner[rows])
        return np.bincount(rows, weights=derived < keys[rows], minlength=len(keys)).astype(np.int64)

    def holds(self, pieces: Pieces) -> np.ndarray:
        """Per piece, whether some entry shares its first key (its last D tokens, or all of a
        shorter one): one bound and one derived key a piece and segment, where ``bounds`` takes two bounds."""
        owner, piece = self._rows(len(pieces.lo))
        at = self.lower_bounds(pieces.lo[piece], owner)
        entries = self.entries[owner]
        first = self.keys_at(self.order_at(owner, np.minimum(at, entries - 1)), owner)
        held = (at < entries) & (pieces.past[piece] | (first < pieces.hi[piece]))
        return np.bincount(piece, weights=held, minlength=len(pieces.lo)) > 0

    def bounds(self, pieces: Pieces) -> Bound:
        """Per segment, per piece, [a, b) in its order: the entries whose last ``len(piece)``
        tokens are it; and [a0, b0), those whose first key it shares (its last D tokens). The
        first key's range comes from the sampled keys; a longer piece then binary-searches it,
        comparing the tokens past the first key."""
        count = len(pieces.lo)
        full = np.flatnonzero(self.entries > 0)
        segments = len(full)
        # pieces in many casings end with few distinct first keys: each is bounded once
        keys, back = np.unique(np.concatenate([pieces.lo, pieces.hi]), return_inverse=True)
        found = (
            self.lower_bounds(np.tile(keys, segments), np.repeat(full, len(keys)))
            .reshape(segments, len(keys))[:, back]
            .reshape(segments, 2, count)
        )
        a0 = found[:, 0]
        b0 = np.where(pieces.past[None, :], self.entries[full][:, None], found[:, 1])
        a, b = a0.copy(), b0.copy()
        deep = np.flatnonzero(pieces.lengths > self.depth)
        if deep.size and segments:
            twice = np.tile(np.concatenate([deep, deep]), segments)  # per segment: the lower bounds, then the upper
            row = np.repeat(np.arange(segments), 2 * len(deep))
            both = self.search(
                a0[row, twice],
                b0[row, twice],
                np.repeat(full, 2 * len(deep)),
                pieces.tokens,
                pieces.lengths,
                twice,
                np.tile(np.repeat([False, True], len(deep)), segments),
            ).reshape(segments, 2, len(deep))
            a[:, deep], b[:, deep] = both[:, 0], both[:, 1]
        out = np.zeros((4, len(self.segments), count), np.int64)  # a segment with no entries: empty ranges
        out[:, full] = a, b, a0, b0
        return out[0], out[1], out[2], out[3]

    def search(
        self,
        lo: np.ndarray,
        hi: np.ndarray,
        owner: np.ndarray,
        query: np.ndarray,
        lengths: np.ndarray,
        piece: np.ndarray,
        after_equal: np.ndarray | bool,
    ) -> np.ndarray:
        """Per row (a range ``[lo, hi)`` of segment ``owner``'s order, and ``piece``, a row of
        ``query``: tokens by depth, newest first, ``lengths`` of them), the first place in the
        range whose entry's path is not smaller (where ``after_equal``: not smaller or equal) in
        tokens ``D`` to ``length - 1`` back; every entry of the range shares the piece's first
        key. All the rows step together, one gather a step, and a range down to ``_SCAN``
        entries is compared whole in one more."""
        lo, hi = np.array(lo, np.int64), np.array(hi, np.int64)
        if not len(lo):
            return lo
        after_equal = np.broadcast_to(after_equal, lo.shape)
        deepest = int(lengths[piece].max())
        windows, top, width = [], self.depth, _WINDOW  # depths compared at once: a tie reads the next window
        while top < deepest:
            windows.append(np.arange(top, min(deepest, top + width)))
            top, width = top + width, 2 * width

        def before(rows: np.ndarray, at: np.ndarray) -> np.ndarray:
            """Whether the entry at ``at[i]`` lies before the place of row ``rows[i]``."""
            segments = owner[rows]
            slots = self.order_at(segments, at)
            which = piece[rows]
            out = after_equal[rows].copy()  # equal in every counted token
            open_ = np.arange(len(slots))
            for depths in windows:
                found = self.symbols(slots[open_], depths, segments[open_])
                want = query[which[open_][:, None], depths[None, :]]
                differ = (found != want) & (depths[None, :] < lengths[which[open_]][:, None])
                settled = differ.any(1)
                first = differ.argmax(1)[:, None]
                out[open_[settled]] = np.take_along_axis(found < want, first, 1)[settled, 0]
                open_ = open_[~settled]
                if not open_.size:
                    break
            return out

        while True:
            open_ = np.flatnonzero(lo < hi)
            if not open_.size:
                return lo
            small = open_[hi[open_] - lo[open_] <= _SCAN]
            if small.size:  # the entries of each range, compared at once
                row, column = np.nonzero(np.arange(_SCAN)[None, :] < (hi[small] - lo[small])[:, None])
                smaller = before(small[row], lo[small][row] + column)
                lo[small] += np.bincount(row, weights=smaller, minlength=len(small)).astype(np.int64)
                hi[small] = lo[small]
            wide = open_[hi[open_] - lo[open_] > _SCAN]
            if wide.size:
                mid = (lo[wide] + hi[wide]) // 2
                right = before(wide, mid)
                lo[wide] = np.where(right, mid + 1, lo[wide])
                hi[wide] = np.where(right, hi[wide], mid)
