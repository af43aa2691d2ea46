"""Ranking kernels for hybrid search: BM25 over chunk texts and the fusion of scored lists.
(Reciprocal-rank fusion and a rerank by the archive's LM were measured against these and lost:
they live in benchmarks/rankers.py.)

Kernels take and return arrays; none reads or writes the archive. Chunks are numbered in the
order they are added (0, 1, ...); callers map those ids to sessions and positions.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

# words ------------------------------------------------------------------------------------------

# a run of capitals before a capitalised word (HTTP in HTTPServer), a word with at most one
# leading capital, a run of capitals, a run of digits; underscores, dots and all else separate.
# Non-ASCII letters count as lower case: code rarely capitalises them, and prose keeps its words whole.
_WORD = re.compile(r"[A-Z]+(?=[A-Z][^\W\dA-Z_])|[A-Z]?[^\W\dA-Z_]+|[A-Z]+|\d+")


def words(text: str) -> list[str]:
    """The lower-cased words of ``text``, identifiers split where code joins words
    (``snake_case``, ``camelCase``, ``HTTPServer``, ``os.path.join``): a docstring says
    "split the path" where the code says ``splitpath`` or ``split_path``, and only the parts can meet."""
    return [w.lower() for w in _WORD.findall(text)]


# BM25 -------------------------------------------------------------------------------------------


@dataclass
class _Segment:
    """Postings of consecutive chunks, term-major: the chunks and counts of ``terms[i]`` are
    ``docs[starts[i]:starts[i + 1]]`` and ``tf[...]`` (chunks ascending within a term)."""

    terms: np.ndarray  # int64, sorted, unique
    starts: np.ndarray  # int64, len(terms) + 1
    docs: np.ndarray  # int64 chunk ids
    tf: np.ndarray  # float64 term counts in the chunk

    def expanded_terms(self) -> np.ndarray:
        return np.repeat(self.terms, np.diff(self.starts))


def _segment(terms: np.ndarray, docs: np.ndarray, tf: np.ndarray) -> _Segment:
    """A segment from postings already sorted by (term, chunk)."""
    edges = np.flatnonzero(np.diff(terms)) + 1
    starts = np.concatenate(([0], edges, [len(terms)])).astype(np.int64)
    return _Segment(terms[starts[:-1]] if len(terms) else terms, starts, docs, tf)


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, e)`` over the pairs, without a loop over them."""
    lengths = ends - starts
    total = int(lengths.sum())
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return offsets + np.arange(total)


class BM25:
    """Okapi BM25 over chunk texts, appendable.

    score(q, d) = Σ_{t ∈ q} idf(t) · tf(t, d) · (k1 + 1) / (tf(t, d) + k1 · (1 − b + b · |d| / avgdl)),
    idf(t) = ln(1 + (N − df(t) + 0.5) / (df(t) + 0.5))   (Lucene's, never negative).

    Each :meth:`add` writes a segment of postings and updates the document frequencies and
    lengths; idf and avgdl are read at query time, so scores after any sequence of adds equal
    those of one build over all the chunks. Segments merge as a binary counter does (the last
    two when the older holds at most twice the newer's postings), so a chunk's postings are
    rewritten O(log n) times and a query visits O(log n) segments.
    """

    def __init__(self, k1: float = 1.2, b: float = 0.75):
        self.k1, self.b = k1, b
        self.vocab: dict[str, int] = {}
        self.df = np.zeros(0, np.int64)
        self.lengths = np.zeros(0, np.int64)  # words per chunk
        # chunks removed: their postings stay until a rebuild, their words no longer count
        self.gone = np.zeros(0, dtype=bool)
        self.segments: list[_Segment] = []

    def __len__(self) -> int:
        return len(self.lengths)

    def add(self, texts: Sequence[str]) -> np.ndarray:
        """Index ``texts`` as the next chunks; their ids."""
        first, n = len(self.lengths), len(texts)
        split = [words(text) for text in texts]
        lengths = np.fromiter(map(len, split), np.int64, n)
        flat = list(chain.from_iterable(split))
        vocab = self.vocab
        terms = np.fromiter((vocab.setdefault(w, len(vocab)) for w in flat), np.int64, len(flat))
        local = np.repeat(np.arange(n, dtype=np.int64), lengths)
        pairs, tf = np.unique(terms * max(n, 1) + local, return_counts=True)  # sorted by (term, chunk)
        segment = _segment(pairs // max(n, 1), first + pairs % max(n, 1), tf.astype(np.float64))
        self.df = np.concatenate((self.df, np.zeros(len(vocab) - len(self.df), np.int64)))
        self.df[segment.terms] += np.diff(segment.starts)
        self.lengths = np.concatenate((self.lengths, lengths))
        self.gone = np.concatenate((self.gone, np.zeros(n, dtype=bool)))
        if len(segment.docs):
            self.segments.append(segment)
        while len(self.segments) > 1 and len(self.segments[-2].docs) <= 2 * len(self.segments[-1].docs):
            newer = self.segments.pop()
            self.segments[-1] = _merged(self.segments[-1], newer)
        return np.arange(first, first + n)

    def remove(self, ids: np.ndarray) -> None:
        """Take chunks out of the counts (document frequencies, N, the mean length), so scores
        equal those of a build over the chunks left; their ids stay taken and score 0."""
        ids = np.asarray(ids, np.int64)
        leaving = np.zeros(len(self.lengths), dtype=bool)
        leaving[ids] = True
        leaving &= ~self.gone
        if not leaving.any():
            return
        for seg in self.segments:
            hit = leaving[seg.docs]
            if hit.any():
                self.df = self.df - np.bincount(seg.expanded_terms()[hit], minlength=len(self.df))
        self.gone = self.gone | leaving

    def scores(self, query: str) -> np.ndarray:
        """BM25 of ``query`` against every chunk (float64, one per chunk; 0 where no word meets,
        and for removed chunks)."""
        out = np.zeros(len(self.lengths))
        n = len(self.lengths) - int(self.gone.sum())
        qt, qtf, _ = self._query(query)
        if not len(qt) or not n:
            return out
        df = self.df[qt]
        idf = np.log1p((n - df + 0.5) / (df + 0.5)) * qtf  # a word said twice counts twice
        avgdl = self.lengths[~self.gone].mean()
        for hit, counts, docs, tf in self._postings(qt):
            w = np.repeat(idf[hit], counts)
            norm = self.k1 * (1 - self.b + self.b * self.lengths[docs] / avgdl)
            out += np.bincount(docs, weights=w * tf * (self.k1 + 1) / (tf + norm), minlength=len(out))
        out[self.gone] = 0.0
        return out

    def ceiling(self, query: str) -> float:
        """What no chunk's score reaches: every word of ``query`` held without bound,
        Σ idf(t) · (k1 + 1), a word nothing holds at the highest idf. A score over it is the
        share of the query's word weight a chunk holds, in [0, 1): one scale for any query and
        any list of hits, which a scaling over the list (min-max) is not (decision 0058)."""
        n = len(self.lengths) - int(self.gone.sum())
        qt, qtf, unknown = self._query(query)
        return _ceiling(self.df[qt], qtf, unknown, n, self.k1)

    def grouped(self, query: str, groups: np.ndarray, n_groups: int) -> tuple[np.ndarray, float]:
        """BM25 of ``query`` against groups of chunks, each group one document of its chunks'
        words together (a session: ``groups[chunk]`` its number, -1 for a chunk of none), with
        the groups' own counts (N, df, lengths); and that level's ``ceiling``. Equal to a build
        over the groups' joined texts, from the chunks' postings: no index of its own."""
        out = np.zeros(n_groups)
        groups = np.where(self.gone, -1, np.asarray(groups, np.int64))
        inside = groups >= 0
        lengths = np.bincount(groups[inside], weights=self.lengths[inside], minlength=n_groups)
        n = int((lengths > 0).sum())
        qt, qtf, unknown = self._query(query)
        if not n:
            return out, 0.0
        found_terms, found_docs, found_tf = [], [], []
        for hit, counts, docs, tf in self._postings(qt) if len(qt) else ():
            found_terms.append(np.repeat(np.flatnonzero(hit), counts))
            found_docs.append(docs)
            found_tf.append(tf)
        if not found_docs:
            return out, _ceiling(np.zeros(len(qt), np.int64), qtf, unknown, n, self.k1)
        term, docs, tf = (np.concatenate(a) for a in (found_terms, found_docs, found_tf))
        group = groups[docs]
        kept = group >= 0
        pairs, where = np.unique(term[kept] * n_groups + group[kept], return_inverse=True)
        tf = np.bincount(where, weights=tf[kept], minlength=len(pairs))
        term, group = pairs // n_groups, pairs % n_groups
        df = np.bincount(term, minlength=len(qt))
        idf = np.log1p((n - df + 0.5) / (df + 0.5)) * qtf
        avgdl = lengths[lengths > 0].mean()
        norm = self.k1 * (1 - self.b + self.b * lengths[group] / avgdl)
        out += np.bincount(group, weights=idf[term] * tf * (self.k1 + 1) / (tf + norm), minlength=n_groups)
        return out, _ceiling(df, qtf, unknown, n, self.k1)

    def _postings(self, qt: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Per segment holding any of the words ``qt`` (sorted ids): which of them it holds, how
        many postings each has there, and those postings' chunks and counts."""
        for seg in self.segments:
            at = np.minimum(np.searchsorted(seg.terms, qt), len(seg.terms) - 1)
            hit = seg.terms[at] == qt
            if not hit.any():
                continue
            starts, ends = seg.starts[at[hit]], seg.starts[at[hit] + 1]
            rows = _ranges(starts, ends)
            yield hit, ends - starts, seg.docs[rows], seg.tf[rows]

    def _query(self, query: str) -> tuple[np.ndarray, np.ndarray, int]:
        """The query's known words (ids, sorted) and how often it says each, and how many of its
        words the index has never seen."""
        said = words(query)
        known = [self.vocab[w] for w in said if w in self.vocab]
        if not known:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), len(said)
        qt, qtf = np.unique(np.asarray(known, np.int64), return_counts=True)
        return qt, qtf, len(said) - len(known)

    def arrays(self) -> dict[str, np.ndarray]:
        """The index as flat arrays (for a file): the words in id order, newline-separated
        (a word never holds one), and the segments concatenated with their sizes."""
        words_ = sorted(self.vocab, key=self.vocab.__getitem__)
        segments = self.segments or [_segment(*(np.zeros(0, t) for t in (np.int64, np.int64, np.float64)))]
        return {
            "words": np.frombuffer("\n".join(words_).encode(), np.uint8),
            "df": self.df,
            "lengths": self.lengths,
            "gone": self.gone,
            "segment_sizes": np.array([(len(s.terms), len(s.docs)) for s in segments], np.int64).reshape(-1, 2),
            "terms": np.concatenate([s.terms for s in segments]),
            "starts": np.concatenate([s.starts for s in segments]),
            "docs": np.concatenate([s.docs for s in segments]),
            "tf": np.concatenate([s.tf for s in segments]),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], k1: float = 1.2, b: float = 0.75) -> BM25:
        """The index :meth:`arrays` gave. The postings stay as given (memory-mapped, a query
        reads only its words' pages); the small arrays it updates in place are copied."""
        index = cls(k1, b)
        text = bytes(arrays["words"]).decode()
        index.vocab = {w: i for i, w in enumerate(text.split("\n"))} if text else {}
        index.df, index.lengths, index.gone = (np.array(arrays[name]) for name in ("df", "lengths", "gone"))
        t = p = 0
        for i, (n_terms, n_postings) in enumerate(np.asarray(arrays["segment_sizes"]).tolist()):
            if n_postings:  # a segment's starts hold one more than its terms
                starts = arrays["starts"][t + i : t + i + n_terms + 1]
                index.segments.append(
                    _Segment(
                        arrays["terms"][t : t + n_terms],
                        starts,
                        arrays["docs"][p : p + n_postings],
                        arrays["tf"][p : p + n_postings],
                    )
                )
            t, p = t + n_terms, p + n_postings
        return index


def _ceiling(df: np.ndarray, qtf: np.ndarray, unknown: int, n: int, k1: float) -> float:
    """Σ idf(t) · (k1 + 1) over the query's words (``df`` of those known, ``unknown`` more at df 0)."""
    if not n:
        return 0.0
    idf = np.log1p((n - df + 0.5) / (df + 0.5)) * qtf
    return float((k1 + 1) * (idf.sum() + unknown * np.log1p((n + 0.5) / 0.5)))


def _merged(older: _Segment, newer: _Segment) -> _Segment:
    """One segment of two whose chunks are consecutive (``older``'s first): a stable sort by
    term keeps each term's chunks ascending."""
    terms = np.concatenate((older.expanded_terms(), newer.expanded_terms()))
    order = np.argsort(terms, kind="stable")
    return _segment(
        terms[order], np.concatenate((older.docs, newer.docs))[order], np.concatenate((older.tf, newer.tf))[order]
    )


def top_k(scores: np.ndarray, k: int, floor: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(ids, scores) of the ``k`` highest ``scores`` above ``floor``, best first, ties to the lower
    id (BM25's 0 is "no word met"; a cosine passes ``-inf``)."""
    kept = np.flatnonzero(scores > floor)
    if len(kept) > k:
        cut = -np.partition(-scores[kept], k - 1)[k - 1]
        kept = kept[scores[kept] >= cut]  # every tie at the cut, trimmed after the sort
    order = np.lexsort((kept, -scores[kept]))[:k]
    return kept[order], scores[kept[order]]


# fusion -----------------------------------------------------------------------------------------


def _ranked(ids: np.ndarray, fused: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.lexsort((ids, -fused))
    return ids[order], fused[order]


def normalised(scores: np.ndarray, how: str = "minmax") -> np.ndarray:
    """``scores`` on a common scale: "minmax" maps them onto [0, 1] (all equal: all 1), "zscore"
    to (s − mean) / std (all equal: all 0)."""
    scores = np.asarray(scores, np.float64)
    if not len(scores):
        return scores
    if how == "minmax":
        span = scores.max() - scores.min()
        return (scores - scores.min()) / span if span > 0 else np.ones_like(scores)
    if how == "zscore":
        std = scores.std()
        return (scores - scores.mean()) / std if std > 0 else np.zeros_like(scores)
    raise ValueError(f"unknown normalisation {how!r} (minmax, zscore)")


def weighted(
    results: Sequence[tuple[np.ndarray, np.ndarray]], weights: Sequence[float] | None = None, how: str = "minmax"
) -> tuple[np.ndarray, np.ndarray]:
    """Weighted-score fusion of (ids, scores) candidate lists: (ids, fused scores) best first,
    fused(d) = Σ_r w_r · norm_r(d), each list normalised on its own (:func:`normalised`).

    An id a list does not hold gets that list's lowest normalised score: a candidate list is
    its retriever's best, so what it left out scored at most that."""
    given = np.ones(len(results)) if weights is None else np.asarray(weights, np.float64)
    lists = [(np.asarray(ids, np.int64), normalised(scores, how)) for ids, scores in results]
    if not sum(len(ids) for ids, _ in lists):
        return np.zeros(0, np.int64), np.zeros(0)
    uniq = np.unique(np.concatenate([ids for ids, _ in lists]))
    fused = np.zeros(len(uniq))
    for w, (ids, norm) in zip(given, lists):
        column = np.full(len(uniq), norm.min() if len(norm) else 0.0)
        column[np.searchsorted(uniq, ids)] = norm
        fused += w * column
    return _ranked(uniq, fused)
