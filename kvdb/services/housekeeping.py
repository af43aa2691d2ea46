"""Keeping an archive small and movable: freeing what no session uses, and copying it whole."""

from __future__ import annotations

from kvdb.errors import CorruptData
from kvdb.index.walk import Indexes, index_key
from kvdb.model.prefix_cache import PrefixCache
from kvdb.records import CopyReport, GcReport
from kvdb.storage import Storage
from kvdb.storage.base import CollectGarbage, ImportRows


def live_paths(storage: Storage) -> dict[str, int]:
    """Node id -> the positions its path holds: what a prefix-cache entry must match."""
    return {n.node_id: n.end for n, _, _ in storage.node_shapes()}


class Housekeeping:
    def __init__(self, storage: Storage, indexes: Indexes, prefix_cache: PrefixCache):
        self._storage = storage
        self._indexes = indexes
        self._prefix_cache = prefix_cache

    def gc(self) -> GcReport:
        """Free the trie nodes (and every tier stored for them) that no session uses any more,
        and the prefix-cache entries of the conversations they held (a deleted session's KV
        must not outlive it on disk). A search index whose freed slots then outnumber its live
        ones is numbered anew, and the engine's small files are merged."""
        freed = self._storage.apply(CollectGarbage())
        assert freed is not None  # CollectGarbage returns what it freed
        return GcReport(
            **freed,
            prefix_cache_entries=self._prefix_cache.prune(live_paths(self._storage)) + self._prefix_cache.trim().entries,
            renumbered_indexes=tuple(key for key, tok_hash in self._index_keys() if self._indexes.compact(key, tok_hash)),
            **self._storage.compact_files(),
        )

    def _index_keys(self) -> list[tuple[str, str]]:
        indexed = set(self._storage.index_keys())
        return [(index_key(t), t) for t in self._storage.tokenizer_hashes() if index_key(t) in indexed]

    def copy_to(self, target: Storage) -> CopyReport:
        """Every row into ``target`` (an empty archive, of either backend) in one transaction,
        then each table's content hash compared on both sides. The search sidecars and the
        prefix cache are derived, and rebuilt there on first use."""
        from kvdb.storage import schema

        counts = target.apply(ImportRows({t.name: self._storage.table_rows(t.name) for t in schema.metadata.sorted_tables}))
        assert counts is not None  # ImportRows returns the rows copied per table
        source, copied = self._storage.content_hashes(), target.content_hashes()
        differing = sorted(name for name in source if source[name] != copied[name])
        if differing:
            raise CorruptData(f"the copy in {target.describe()} differs from {self._storage.describe()} in {', '.join(differing)}; delete it and copy again")
        return CopyReport(self._storage.describe(), target.describe(), counts, source)
