"""The prefix trie over sessions' token streams.

KV at position i depends only on tokens <= i, so sessions that share a prefix share its KV
exactly, and every tier of that prefix can be stored once. A node's id is the content hash of
the model and the whole token path up to the node's end, so a session's id names its leaf and
cutting a node in two keeps the lower half's id. Finding the longest archived prefix walks down
from the root: one query per node on the path, by (parent, first token).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from kvdb.store import NodeRow, Store


@dataclass(frozen=True)
class PrefixMatch:
    matched: int  # leading tokens of the new stream that are archived already
    node: NodeRow | None  # the node the match ends in; None when nothing matched
    offset: int  # tokens of ``node`` that matched (== node.n_tokens when the match ends at its end)


def path_id(model_id: str, ids: np.ndarray) -> str:
    """Id of the node (or session) whose path holds exactly ``ids``."""
    return hashlib.sha256(model_id.encode() + b":" + np.asarray(ids, dtype="<i4").tobytes()).hexdigest()[:32]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def longest_prefix(store: Store, model_id: str, ids: np.ndarray) -> PrefixMatch:
    best = PrefixMatch(0, None, 0)
    parent = None
    while best.matched < len(ids):
        start = best.matched
        kids = store.children(parent, model_id, int(ids[start]))
        if not kids:
            break
        scored = [
            (common_prefix(store.node_tokens(k.node_id, 0, min(k.n_tokens, len(ids) - start)), ids[start:]), k) for k in kids
        ]
        common, kid = max(scored, key=lambda pair: pair[0])
        best = PrefixMatch(start + common, kid, common)
        if common < kid.n_tokens:
            break
        parent = kid.node_id
    return best
