"""How a segment's entries are put in path order: new runs sorted by prefix doubling, and placed
by binary search into an order that holds many more (``extended``).

The sort reads a run's context through its link in the segments below (``stack.Stack``), and
placing bounds each new entry in the segment's own order (docs/decisions/0046-slots-in-key-order.md,
0068-bounded-segments.md).
"""

from __future__ import annotations

import numpy as np

from kvdb.index import segment as stored
from kvdb.index.segment import REACH, Runs, Segment, packed, spans
from kvdb.index.stack import Stack

_CHUNK = 1 << 18  # positions whose keys are derived at once when a segment is sorted: ~80 bytes each meanwhile
_LINKS = 1 << 12  # linked runs whose contexts are read at once when a segment is sorted ([runs, REACH - 1] tokens)
# new entries placed at once by binary search ([entries, REACH] tokens read for them, and 32 entries compared each)
_PLACING = 1 << 12


def extended(segment: Segment, ntotal: int, tokens: np.ndarray, runs: Runs) -> Segment:
    """``segment`` with ``runs`` (slots past its last; ``tokens``: slots ``segment.ntotal`` to
    ``ntotal``) merged in, in path order: new slots are larger, so they go after equal
    paths. A few new entries are placed by binary search (a commit's cost is then the new
    entries and a copy of the order); many are sorted with the old ones afresh."""
    out = Segment(
        segment.alphabet,
        segment.generation,
        segment.first,
        ntotal,
        np.concatenate([segment.tokens, tokens]),
        Runs.concat([segment.runs, runs]),
        segment.order,
        segment.samples,
    )
    out.below = segment.below
    stack = Stack.under(out)  # taken before the order changes: placing bounds the old one
    if int(runs.length.sum()) * stored.BLOCK < segment.entries:
        order = sorted_slots(out, stack, np.arange(len(segment.runs), len(out.runs)))
        at = _places(stack, np.asarray(order, np.int64))
        out.order = np.insert(np.asarray(segment.order), at, order).astype(stored.SLOT)
    else:
        out.order = sorted_slots(out, stack, np.arange(len(out.runs)))
    out.samples = stack.keys_at(np.asarray(out.order[:: stored.BLOCK], np.int64))
    return out


def _places(stack: Stack, slots: np.ndarray) -> np.ndarray:
    """Per slot (covered by the stack's top segment, not yet in its order), how many entries of
    the order come before it: those with a smaller path, and equal ones (smaller slots)."""
    top = len(stack.segments) - 1
    out = [np.zeros(0, np.int64)]
    for at in range(0, len(slots), _PLACING):
        query = stack.symbols(slots[at : at + _PLACING], np.arange(REACH))
        keys = packed(query[:, : stack.depth], stack.alphabet)
        owner = np.full(len(keys), top)
        last = keys == np.uint64((1 << 64) - 1)  # (N+1)**D may be 2**64 exactly: the last key has no successor
        lo = stack.lower_bounds(keys, owner)
        hi = np.where(
            last, stack.entries[top], stack.lower_bounds(np.where(last, np.uint64(0), keys + np.uint64(1)), owner)
        )
        rows = np.arange(len(query))
        out.append(stack.search(lo, hi, owner, query, np.full(len(query), REACH), rows, after_equal=True))
    return np.concatenate(out)


def sorted_slots(segment: Segment, stack: Stack, runs: np.ndarray) -> np.ndarray:
    """The slots of ``runs`` (indices into ``segment.runs``) in path order; ties in an order the
    tokens past ``REACH`` give. ``stack``: the segment and those below it, where links lead.

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
    table = segment.runs.take(np.asarray(runs, np.int64))
    owner = np.maximum(np.searchsorted(table.first, table.link, side="right") - 1, 0)
    within = (
        (table.link >= 0) & (table.link >= table.first[owner]) & (table.link < table.first[owner] + table.length[owner])
    )
    table = _contexts(stack, table, (table.link >= 0) & ~within)
    ext = table.held + table.length
    starts = np.cumsum(ext) - ext  # where each run's context, else its first slot, lies among the positions
    m = int(ext.sum())
    index_type = np.dtype(np.int32 if m < 1 << 31 else np.int64)  # positions and ranks: half the memory
    shift = starts + table.held - table.first  # a slot's position is its run's shift plus the slot
    before = np.arange(-1, m - 1, dtype=index_type)
    before[starts] = -1
    before[starts[within]] = shift[owner[within]] + table.link[within]
    keys = [np.empty(m, np.uint64)]  # handed to _dense, which lets it go
    for at in range(0, m, _CHUNK):
        keys[0][at : at + _CHUNK] = _layout_keys(segment, table, starts, before, np.arange(at, min(m, at + _CHUNK)))
    padding = packed(np.full((1, segment.depth), segment.alphabet), segment.alphabet)[0]
    rank, pad = _dense(keys, padding, index_type)
    jump = before
    for _ in range(segment.depth - 1):
        jump = _followed(before, jump, -1, index_type)
    del before
    h = segment.depth
    while h < REACH and pad is not None:
        pairs = [rank.astype(np.int64)]  # handed to _dense, which lets it go
        pairs[0] *= m + 1
        pairs[0] += _followed(rank, jump, pad, index_type)
        del rank
        rank, pad = _dense(pairs, pad * (m + 1) + pad, index_type)
        h *= 2
        if h < REACH and pad is not None:
            jump = _followed(jump, jump, -1, index_type)
    del jump
    own = np.ones(m, bool)  # the runs' own positions, in slot order; a context's are not sorted
    own[spans(starts, table.held)] = False
    last = rank[own]
    del rank, own
    order = np.argsort(last, kind="stable")
    del last
    return table.slots().astype(stored.SLOT)[order]  # derived here, not held through the doubling


def _contexts(stack: Stack, table: Runs, read: np.ndarray) -> Runs:
    """``table`` with the context of each run ``read`` marks read through its link (up to
    ``REACH - 1`` tokens, fewer where the path starts), a chunk of runs at a time:
    ``sorted_slots`` lays such a run out after its context."""
    linked = np.flatnonzero(read)
    if not linked.size:
        return table
    width = REACH - 1
    held, tokens = table.held.copy(), []
    for at in range(0, len(linked), _LINKS):
        rows = linked[at : at + _LINKS]
        before = stack.read(np.repeat(table.first[rows], width), np.tile(np.arange(width, 0, -1), len(rows))).reshape(
            len(rows), width
        )  # oldest first
        real = before != stack.alphabet  # the padding lies before the path's start only
        held[rows] = real.sum(1)
        tokens.append(before[real])
    opens = np.cumsum(held) - held
    context = np.empty(int(held.sum()), table.context.dtype)
    own = np.flatnonzero(~read)
    context[spans(opens[own], held[own])] = table.context[spans(table.opens[own], table.held[own])]
    context[spans(opens[linked], held[linked])] = np.concatenate(tokens)
    return Runs(table.first, table.length, table.link, held, context)


def _layout_keys(
    segment: Segment, table: Runs, starts: np.ndarray, before: np.ndarray, positions: np.ndarray
) -> np.ndarray:
    """The first key of each of ``positions`` of ``sorted_slots``' layout (``table``'s runs, each
    after its context, from ``starts``; ``before``: each position's predecessor, -1 for
    none): its ``D`` tokens back, from its run's context or slots, the padding past them."""
    keys = np.zeros(len(positions), np.uint64)
    at = positions.astype(np.int64)
    for _ in range(segment.depth):
        run = np.searchsorted(starts, np.maximum(at, 0), side="right") - 1
        local, held = at - starts[run], table.held[run]
        from_context = (at >= 0) & (local < held)
        context = (
            table.context[np.where(from_context, table.opens[run] + local, 0)]
            if len(table.context)
            else np.zeros(len(at), np.int64)
        )
        own = segment.tokens[np.where((at >= 0) & ~from_context, table.first[run] + local - held - segment.first, 0)]
        symbol = np.where(at < 0, segment.alphabet, np.where(from_context, context, own)).astype(np.uint64)
        keys = keys * np.uint64(segment.alphabet + 1) + symbol
        at = np.where(at >= 0, before[np.maximum(at, 0)], -1)
    return keys


def _followed(values: np.ndarray, pointers: np.ndarray, missing: int, dtype: np.dtype) -> np.ndarray:
    """``values`` at each of ``pointers``, ``missing`` where it is -1, a chunk at a time: a step
    of pointer jumping that holds no temporary array of every position."""
    out = np.empty(len(pointers), dtype)
    for at in range(0, len(pointers), _CHUNK):
        chunk = pointers[at : at + _CHUNK]
        out[at : at + _CHUNK] = np.where(chunk >= 0, values[np.maximum(chunk, 0)], missing)
    return out


def _dense(handed: list[np.ndarray], padding: int, dtype: np.dtype) -> tuple[np.ndarray, int | None]:
    """(each value's rank among the distinct values, as ``dtype``; the rank an all-padding window
    takes: that of the value ``padding``, one past the largest when no value is it; None when every
    value is distinct, and no further key can reorder them).

    The values are handed over in a list, and let go once their order is known: they are the
    largest array of a sort (8 bytes a position), and the ranks are derived without them."""
    values = handed.pop()
    found = np.flatnonzero(values == padding)
    order = np.argsort(values)
    new = np.ones(len(values), bool)
    for at in range(1, len(values), _CHUNK):  # the sorted values compared a chunk at a time, not copied whole
        stop = min(at + _CHUNK, len(values))
        new[at:stop] = values[order[at:stop]] != values[order[at - 1 : stop - 1]]
    del values
    distinct = bool(new.all())
    counts = np.cumsum(new, dtype=dtype)
    del new
    counts -= 1
    rank = np.empty(len(counts), dtype)
    rank[order] = counts
    del order, counts
    if distinct:
        return rank, None
    return rank, int(rank[found[0]]) if found.size else int(rank.max()) + 1
