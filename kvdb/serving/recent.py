"""The caches of the last conversations this process computed, in memory, by their token ids:
where a next turn resumes first, without a query or a disk read. A lookup gives a view of the
prefix it shares with the entry, no copy (``capture.prefix_view``); entries go least recently
used first once they pass the byte budget."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvdb.index import trie
from kvdb.model import capture

if TYPE_CHECKING:
    from transformers import DynamicCache

DEFAULT_BUDGET_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Recent:
    ids: np.ndarray
    cache: DynamicCache
    approximate: bool  # built on a tier-K restore somewhere before: not the exact cache of ids
    nbytes: int


class RecentCaches:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self.budget = budget_bytes
        self._entries: OrderedDict[int, Recent] = OrderedDict()
        self._lock = threading.Lock()
        self._next = 0

    def best(self, ids: np.ndarray, limit: int, exact_only: bool = False) -> tuple[int, DynamicCache, bool] | None:
        """(positions held, a cache of ids[:positions], approximate) from the entry sharing the
        longest prefix with ``ids``, at most ``limit`` positions; None when none shares any."""
        with self._lock:
            scored = [
                (min(trie.common_prefix(e.ids, ids), limit), key)
                for key, e in self._entries.items()
                if not (exact_only and e.approximate)
            ]
            held, key = max(scored, default=(0, None), key=lambda pair: pair[0])
            if not held:
                return None
            assert key is not None  # held > 0 came from an entry
            self._entries.move_to_end(key)
            entry = self._entries[key]
        return held, capture.prefix_view(entry.cache, held), entry.approximate

    def put(self, ids: np.ndarray, cache, approximate: bool = False) -> None:
        """Keep ``cache`` (the cache of ``ids``, taken over: the caller must not change it); an
        entry whose ids it extends is dropped, holding nothing more."""
        ids = np.asarray(ids, dtype=np.int64)
        nbytes = sum(
            layer.keys.nbytes + layer.values.nbytes
            for layer in cache.layers
            if getattr(layer, "keys", None) is not None
        )
        if nbytes > self.budget or not len(ids):
            return
        with self._lock:
            for key in [
                k
                for k, e in self._entries.items()
                if trie.common_prefix(e.ids, ids) == len(e.ids) and (e.approximate or not approximate)
            ]:
                del self._entries[key]
            self._entries[self._next] = Recent(ids, cache, approximate, nbytes)
            self._next += 1
            while sum(e.nbytes for e in self._entries.values()) > self.budget:
                self._entries.popitem(last=False)
