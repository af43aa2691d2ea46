"""Chunks for the semantic tier: the spans of a session's tokens embedded one text each.

A chat is cut at its turns, a text session is one turn; a turn longer than ``WINDOW`` tokens
is cut into windows of ``WINDOW`` that overlap by ``OVERLAP``, starting from the turn's start.
A chunk's span depends only on the tokens up to its end, so two sessions sharing a prefix
share the chunks that end in it, and the trie stores those once (decisions/0037).
"""

from __future__ import annotations

import numpy as np

# tokens per chunk at most: 256 found more than 64 or 128 and as much as 512 (decision 0036;
# benchmarks/chunk_sizes.py, at tag studies-2026-12-06)
WINDOW = 256
OVERLAP = 64


def spans(turns: list[tuple[int, int]], window: int = WINDOW, overlap: int = OVERLAP) -> np.ndarray:
    """[n, 2] spans [start, stop) of the chunks of turns [a, b), in order, none empty."""
    if not 0 <= overlap < window:
        raise ValueError(f"overlap must be in [0, window), got {overlap} of {window}")
    out = []
    for a, b in turns:  # a few turns per session, not tokens
        if b <= a:
            continue
        starts = np.arange(a, max(a + 1, b - overlap), window - overlap, dtype=np.int64)
        out.append(np.stack([starts, np.minimum(starts + window, b)], axis=1))
    return np.concatenate(out) if out else np.zeros((0, 2), dtype=np.int64)


def ending_in(chunks: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Which chunks (a mask) have their last token in positions [lo, hi): those a node [lo, hi)
    holds. A mask, so that what goes with each chunk (its text) is picked alike."""
    return (chunks[:, 1] > lo) & (chunks[:, 1] <= hi)
