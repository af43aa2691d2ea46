"""Phrase search over the walk index: query points -> candidate slots -> verified, ranked hits.

The index orders positions by their last ``REACH`` tokens (256, the longest phrase a search
takes), so a phrase is one range of that order: its count is the range's length, and its hits
are the range's first live entries. Positions that share only a shorter suffix of the phrase
are the partial matches, ranked by how long a suffix they share: the ranges of a phrase's
suffixes nest, so those sharing exactly s tokens lie between the bounds of s and s + 1. Every
hit is checked against the archived tokens and its context decoded from the blocks it touches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvdb.errors import InvalidArgument
from kvdb.index.segment import REACH
from kvdb.index.walk import KeyRange, SlotMap, WalkIndex

MAX_PHRASE_TOKENS = REACH  # every phrase is then one range of the index's order
# The share of a phrase's tokens a partial hit must match to be shown by default: a hit on one
# word of six ("revenue" of "the city's revenue fell by half") says little about the phrase.
MIN_SHARE = 0.5

Fetch = Callable[[list[tuple[str, int, int]]], list[np.ndarray]]  # [(session_id, start, end)] -> token ids of each
SessionsOf = Callable[[list[str]], dict[str, str]]  # node ids -> a live session through each (absent: none left)


@dataclass(frozen=True)
class Candidates:
    """Positions a phrase may end at, one array entry each, best first within one variant."""

    run: np.ndarray  # index into the SlotMap
    end: np.ndarray  # position of the last matched token on its path
    shared: np.ndarray  # tokens of the phrase's suffix the index says match (checked against the archive)
    variant: np.ndarray  # which tokenization of the phrase

    @classmethod
    def concat(cls, parts: Sequence[Candidates]) -> Candidates:
        return cls(
            *(
                np.concatenate([getattr(p, f) for p in parts]) if parts else np.zeros(0, np.int64)
                for f in ("run", "end", "shared", "variant")
            )
        )

    def __len__(self) -> int:
        return len(self.run)

    def take(self, order: np.ndarray) -> Candidates:
        return Candidates(self.run[order], self.end[order], self.shared[order], self.variant[order])


@dataclass(frozen=True)
class Hit:
    session_id: str
    name: str
    position: int  # first matched token in the session
    match_tokens: int
    query_tokens: int
    exact: bool
    before: str  # context text before the match
    match: str
    after: str
    similarity: float | None = None  # hits by meaning: cosine and BM25 fused; phrase hits rank by shared tokens
    conversation_id: str = ""  # filled by the services, which know conversations
    title: str = ""

    @property
    def score(self) -> float:
        return self.similarity if self.similarity is not None else self.match_tokens / self.query_tokens

    @property
    def context(self) -> str:
        return self.before + self.match + self.after

    @property
    def partial(self) -> bool:
        """A phrase hit that shares only the end of the phrase: shown, but no occurrence of it
        (a hit by meaning is a nearest chunk, neither full nor partial)."""
        return self.similarity is None and not self.exact

    def to_dict(self) -> dict:
        return {
            "session_id": self.session_id,
            "conversation_id": self.conversation_id,
            "title": self.title,
            "name": self.name,
            "position": self.position,
            "match_tokens": self.match_tokens,
            "query_tokens": self.query_tokens,
            "score": round(self.score, 4),
            "exact": self.exact,
            "partial": self.partial,
            "context": self.context,
            "before": self.before,
            "match": self.match,
            "after": self.after,
        }


def least_shared(length: int, min_share: float) -> int:
    """Tokens a partial hit of a phrase of ``length`` tokens must share: ``min_share`` of them, 1 or more."""
    return max(1, math.ceil(min_share * length))


def partial_lookups(variants: Sequence[np.ndarray], depth: int, min_share: float) -> list[np.ndarray]:
    """The suffixes ``candidates`` looks up for the partial matches of each variant: its last
    ``D`` tokens (one key, whose range holds those sharing ``D`` or more), and the shorter ones
    down to the tokens a partial match must share (``least_shared``)."""
    out = []
    for phrase in variants:
        least = least_shared(len(phrase), min_share)
        if least < len(phrase):
            out += [phrase[-s:] for s in range(min(len(phrase), depth), least - 1, -1)]
    return out


def bounded(
    index: WalkIndex, wanted: Iterable[np.ndarray], known: dict[bytes, KeyRange] | None = None
) -> dict[bytes, KeyRange]:
    """The key range of each piece, by its bytes, and of each one's last D tokens (its first
    key), which come with it: every bound of a query found in one pass. ``known``: ranges
    looked up already (the casing walk's), not looked up again."""
    out: dict[bytes, KeyRange] = dict(known or {})
    distinct = {key: piece for piece in wanted if (key := piece.tobytes()) not in out}
    if distinct:
        for (key, piece), (found, first) in zip(distinct.items(), index.ranges(list(distinct.values()))):
            out[key] = found
            out.setdefault(piece[-index.depth :].tobytes(), first)
    return out


def unsuffixed(variants: Sequence[np.ndarray]) -> list[int]:
    """The variants that end with no other: two variants end at one position only when one is a
    suffix of the other, and then the longer's matches are the shorter's too."""
    whole = {phrase.tobytes() for phrase in variants}
    return [
        v for v, phrase in enumerate(variants) if not any(phrase[s:].tobytes() in whole for s in range(1, len(phrase)))
    ]


def candidates(
    index: WalkIndex,
    slots: SlotMap,
    phrase: np.ndarray,
    variant: int,
    limit: int,
    least: int,
    ranges: dict[bytes, KeyRange],
) -> Candidates:
    """Up to ``limit`` candidates, longest shared suffix first (full matches, then partial ones
    sharing at least ``least`` tokens, 1 or more). ``ranges``: the key ranges of the phrase and
    of its ``partial_lookups`` (``bounded``).

    The full matches are taken in index order, a chunk at a time, so a phrase found millions of
    times costs what its first ``limit`` live ones cost."""
    length = len(phrase)
    ranked: list[tuple[np.ndarray, np.ndarray]] = []  # partial matches: (end slots, the tokens each shares), best first
    full = inner = ranges[phrase.tobytes()]
    found = len(full)
    # a casing the archive never uses, nor its last ``least`` tokens (whose range holds every
    # partial match; the first key's, past D tokens)
    if not found and (least >= length or not len(ranges[phrase[-min(least, index.depth) :].tobytes()])):
        return Candidates.concat([])
    # Shorter suffixes. The first key's range holds the entries sharing D tokens or more, in
    # path order: the nearer an entry lies to the phrase's own range, the longer the suffix it
    # shares, so the nearest ones on each side are the best partial matches. Below D tokens,
    # the ranges nest around the longer one's, so the entries sharing exactly s tokens are the
    # two slices between the bounds of s and s + 1.
    if length > index.depth and least < length and found < limit:
        outer = ranges[phrase[-index.depth :].tobytes()]
        near = outer.around(inner, limit)
        same = index.symbols(near, np.arange(index.depth, length)) == phrase[::-1][index.depth :]
        shared = index.depth + np.where(same.all(1), same.shape[1], same.argmin(1))
        best = np.lexsort((near, -shared))[: np.count_nonzero(shared >= least)]  # longest first, ties in slot order
        ranked.append((near[best], shared[best]))
        found += len(best)
        inner = outer
    for s in range(min(length, index.depth + 1) - 1, least - 1, -1):
        if found >= limit:
            break
        outer = ranges[phrase[-s:].tobytes()]
        ends = np.sort(outer.outside(inner, 2 * (limit - found)))
        ranked.append((ends, np.full(len(ends), s)))
        found += len(ends)
        inner = outer

    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (runs, end positions, shared tokens)
    taken = 0

    def take(ends: np.ndarray, shared: np.ndarray) -> None:
        nonlocal taken
        run, local = slots.locate(ends)
        live = run >= 0
        position = np.where(live, slots.start[np.maximum(run, 0)] + local, -1)
        # a match cannot begin before its path does
        keep = np.flatnonzero(live & (position - np.minimum(shared, length) + 1 >= 0))[: limit - taken]
        parts.append((run[keep], position[keep], shared[keep]))
        taken += len(keep)

    for ends in full.chunks(4 * limit):  # full matches in index order, a chunk at a time
        if taken >= limit:
            break
        take(ends, np.full(len(ends), length))
    if ranked and taken < limit:
        take(np.concatenate([ends for ends, _ in ranked]), np.concatenate([shared for _, shared in ranked]))
    if not parts:
        return Candidates.concat([])
    return Candidates(
        np.concatenate([run for run, _, _ in parts]),
        np.concatenate([ends for _, ends, _ in parts]),
        np.concatenate([shared for _, _, shared in parts]),
        np.full(taken, variant),
    )


def count(
    index: WalkIndex,
    slots: SlotMap,
    owned: np.ndarray,
    variants: Sequence[np.ndarray],
    known: dict[bytes, KeyRange] | None = None,
) -> int:
    """How many archived positions end a full match of some variant: each counted once, in a
    node some session uses (``owned``, per run of ``slots``).

    A variant that ends with another is left out (``unsuffixed``). Each other variant is one
    key range, counted in O(log n) when every entry of the index is live (no deleted session's
    slots wait for ``gc``), else by locating its entries."""
    kept = {variants[v].tobytes(): variants[v] for v in unsuffixed(variants)}
    ranges = bounded(index, kept.values(), known)
    live_entries = int(slots.length[owned].sum())
    total = 0
    for found in (ranges[key] for key in kept):
        if live_entries == index.entries:
            total += len(found)
            continue
        for ends in found.chunks(1 << 20):
            run, _ = slots.locate(ends)
            total += int(((run >= 0) & owned[np.maximum(run, 0)]).sum())
    return total


def shared_suffix(window: np.ndarray, phrase: np.ndarray) -> int:
    """How many of ``window``'s last tokens equal ``phrase``'s last tokens."""
    n = min(len(window), len(phrase))
    equal = window[len(window) - n :][::-1] == phrase[len(phrase) - n :][::-1]
    return n if equal.all() else int(np.argmin(equal))


def search(
    index: WalkIndex,
    slots: SlotMap,
    variants: Sequence[np.ndarray],
    names: dict[str, str],
    age: dict[str, int],
    sessions_of: SessionsOf,
    fetch: Fetch,
    decode: Callable[[list[np.ndarray]], list[str]],
    k: int = 10,
    context: int = 32,
    min_share: float = MIN_SHARE,
    group: Callable[[str], str] | None = None,
    known: dict[bytes, KeyRange] | None = None,
) -> list[Hit]:
    """The ``k`` best hits over every tokenization of a phrase, each verified against ``fetch``;
    partial hits only where they match at least ``min_share`` of the phrase's tokens.

    Candidates are checked best first, a batch at a time (a few queries per batch, whatever
    its size), until k hits are confirmed; their contexts are decoded together at the end
    (``decode``: pieces of ids -> their texts). A hit in a node that several sessions share is
    reported once, in the session ``sessions_of`` names. With ``group`` (session -> its group,
    a conversation), a group's candidates after its first hit are skipped before they are fetched.
    ``known``: ranges looked up already (``bounded``).
    """
    if k < 1:
        raise InvalidArgument(f"k must be at least 1, got {k}")
    if context < 0:
        raise InvalidArgument(f"context must be >= 0, got {context}")
    # tokens a hit of each variant must share
    least = [least_shared(len(phrase), min_share) for phrase in variants]
    whole = [len(phrase) for phrase in variants]
    # the partial matches' suffixes too, though the full matches may leave no room for them:
    # bounding them with the phrase's costs less than a second pass over the segments; but
    # where the variants' ranges are ``known`` (a casing walk, which bounded the suffixes of
    # the phrase's own casings), those of the other casings wait until needed
    suffixes = partial_lookups(variants, index.depth, min_share)
    ranges = bounded(index, [*variants, *suffixes] if known is None else variants, known)
    # confirmed: (session, start, shared tokens, phrase tokens, window, and where in it the
    # context before, the match and the context after begin)
    hits: list[tuple[str, int, int, int, np.ndarray, int, int, int]] = []
    seen: set[tuple[str, int]] = set()
    grouped: set[str] = set()  # the groups that have their hit
    # Full matches first; the partial ones only when the full ones leave room for them.
    for sharing in (whole, least):
        if len(hits) >= k or (sharing is least and least == whole):
            break
        if sharing is least:
            ranges = bounded(index, suffixes, ranges)
        pool = Candidates.concat(
            [
                candidates(index, slots, phrase, v, k * len(variants), sharing[v], ranges)
                for v, phrase in enumerate(variants)
            ]
        )
        lengths = np.array(whole)[pool.variant]
        if sharing is least:
            pool = pool.take(np.flatnonzero(pool.shared < lengths))  # the full ones were checked already
            lengths = np.array(whole)[pool.variant]
        # by the share of the phrase matched; ties in archive order, the phrase as typed before
        # its variants (two variants ending at one token are one hit)
        pool = pool.take(np.lexsort((pool.variant, pool.end, pool.run, -pool.shared / lengths)))
        at = 0
        while at < len(pool) and len(hits) < k:
            batch = [
                (int(r), int(e), int(v))
                for r, e, v in zip(*(a[at : at + k - len(hits) + 2] for a in (pool.run, pool.end, pool.variant)))
            ]
            at += len(batch)
            owners = sessions_of(sorted({str(slots.node_ids[run]) for run, _, _ in batch}))
            live = [  # a node every session left, or of a group that has its hit: skip
                c
                for c in batch
                if str(slots.node_ids[c[0]]) in owners
                and (group is None or group(owners[str(slots.node_ids[c[0]])]) not in grouped)
            ]
            spans = [
                (owners[str(slots.node_ids[run])], max(0, end + 1 - len(variants[v]) - context), end + 1 + context)
                for run, end, v in live
            ]
            for (_, end, v), (session_id, lo, _), window in zip(live, spans, fetch(spans)):
                phrase = variants[v]
                shared = shared_suffix(window[: end + 1 - lo], phrase)
                if (
                    shared < least[v]
                    or (session_id, end) in seen
                    or (group is not None and group(session_id) in grouped)
                ):
                    continue
                seen.add((session_id, end))
                if group is not None:
                    grouped.add(group(session_id))
                start = end + 1 - shared
                before, match, after = max(0, start - context) - lo, start - lo, end + 1 - lo
                hits.append((session_id, start, shared, len(phrase), window, before, match, after))
    pieces = [
        part
        for *_, window, before, match, after in hits
        for part in (window[before:match], window[match:after], window[after:])
    ]
    texts = decode(pieces)
    found = [
        Hit(session_id, names.get(session_id, ""), start, shared, length, shared == length, before, match, after)
        for (session_id, start, shared, length, *_), before, match, after in zip(hits, *(texts[i::3] for i in range(3)))
    ]
    # archive order within a grade (``age``: session id -> its place, oldest first); slot order
    # alone is not it (a rebuilt index numbers the slots by node, an incremental one by arrival)
    found.sort(key=lambda h: (not h.exact, -h.score, age.get(h.session_id, len(age)), h.position))
    return found[:k]
