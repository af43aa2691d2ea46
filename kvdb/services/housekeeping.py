"""Keeping an archive small and movable: freeing what no session uses, and copying it whole."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvdb.errors import CorruptData
from kvdb.index.indexes import Indexes, index_key
from kvdb.model.prefix_cache import PrefixCache
from kvdb.records import CopyReport, GcReport
from kvdb.services.forgetting import FORGET_WORK, Forgetting
from kvdb.storage import Storage
from kvdb.storage.base import CollectGarbage, Dequeue, ImportRows, Queue

if TYPE_CHECKING:
    from kvdb.services.semantic_tier import ChunkIndexes


def live_paths(storage: Storage) -> dict[str, int]:
    """Node id -> the positions its path holds: what a prefix-cache entry must match."""
    return {n.node_id: n.end for n, _, _ in storage.node_shapes()}


class Housekeeping:
    def __init__(
        self,
        storage: Storage,
        indexes: Indexes,
        prefix_cache: PrefixCache,
        chunk_indexes: Callable[[], ChunkIndexes] | None = None,
        sinks: PrefixCache | None = None,
    ):
        self._storage = storage
        self._indexes = indexes
        self._prefix_cache = prefix_cache
        self._chunk_indexes = chunk_indexes  # the semantic tier's, made on first use (it imports FAISS)
        self._sinks = sinks

    def gc(self, now: bool = False) -> GcReport:
        """Free the trie nodes (and every tier stored for them) that no session uses any more,
        and the prefix-cache entries of the conversations they held (a deleted session's KV
        must not outlive it on disk). A search index whose freed slots then outnumber its live
        ones is numbered anew, and the engine's small files are merged.

        After a delete (its ``forget`` marks, ``kvdb.services.forgetting``) it also erases what
        an ordinary gc leaves for its cost: every index holding a freed slot is numbered anew,
        the chunk sidecars are built again, the attention-sink caches emptied and the storage's
        files rewritten (``now``: a lake's replaced files deleted without waiting for readers)."""
        forgetting = Forgetting(self._storage).pending()
        freed = self._storage.apply(CollectGarbage())
        assert freed is not None  # CollectGarbage returns what it freed
        pruned = self._prefix_cache.prune(live_paths(self._storage)) + self._prefix_cache.trim().entries
        renumbered = tuple(
            key
            for key, tok_hash in self._index_keys()
            if self._indexes.compact(key, tok_hash, any_tombstone=bool(forgetting))
        )
        if forgetting:
            self._rebuild_chunk_indexes()
            if self._sinks is not None:
                # keyed by content: computed again on the next restore
                shutil.rmtree(self._sinks.folder, ignore_errors=True)
            self._storage.apply(Dequeue(forgetting, FORGET_WORK))  # before a file's copy, which then holds no mark
        try:
            files = self._storage.compact_files(forget=bool(forgetting), now=now)
        except BaseException:
            if forgetting:  # the copy failed: the next gc erases again
                self._storage.apply(Queue(forgetting, FORGET_WORK))
            raise
        # a lake's replaced files still hold the rows: the marks wait for them
        if forgetting and files.get("data_files_kept"):
            self._storage.apply(Queue(forgetting, FORGET_WORK))
        return GcReport(
            **freed, prefix_cache_entries=pruned, renumbered_indexes=renumbered, forgotten=len(forgetting), **files
        )

    def _rebuild_chunk_indexes(self) -> None:
        """Each chunk sidecar holding a tombstone or a node gc freed (their words stay in it) built
        again from the chunks the database holds, or removed when none are left."""
        from kvdb.index.chunk_index import ChunkIndex

        folder = self._storage.derived_path(".index")
        found = sorted(folder.glob("chunks-*.vec")) if folder.is_dir() else []
        if not found or self._chunk_indexes is None:
            return
        for path in found:
            try:
                index: ChunkIndex | None = ChunkIndex.load(path)
            except (OSError, CorruptData):
                index = None
            if index is not None:
                counts = self._storage.chunk_counts(index.embedder)
                if bool(index.live.all()) and all(counts.get(node_id) == n for node_id, n in index.counts().items()):
                    continue  # nothing of a deleted session in it
                if self._chunk_indexes().rebuild(index.embedder) is not None:
                    continue
            path.unlink(missing_ok=True)

    def _index_keys(self) -> list[tuple[str, str]]:
        indexed = set(self._storage.index_keys())
        return [(index_key(t), t) for t in self._storage.tokenizer_hashes() if index_key(t) in indexed]

    def copy_to(self, target: Storage) -> CopyReport:
        """Every row into ``target`` (an empty archive, of either backend) in one transaction,
        then each table's content hash compared on both sides. The search sidecars and the
        prefix cache are derived, and rebuilt there on first use."""
        from kvdb.storage import schema

        counts = target.apply(
            ImportRows({t.name: self._storage.table_rows(t.name) for t in schema.metadata.sorted_tables})
        )
        assert counts is not None  # ImportRows returns the rows copied per table
        source, copied = self._storage.content_hashes(), target.content_hashes()
        differing = sorted(name for name in source if source[name] != copied[name])
        if differing:
            raise CorruptData(
                f"the copy in {target.describe()} differs from {self._storage.describe()} in {', '.join(differing)}; "
                "delete it and copy again"
            )
        return CopyReport(self._storage.describe(), target.describe(), counts, source)
