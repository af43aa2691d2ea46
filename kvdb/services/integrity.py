"""Checking an archive, and repairing what can be derived again: every stored block's
integrity, the trie's shape and reference counts, the search index against the database, and
(deep) a lossless decode of every token stream.

Each problem is one line a user can act on. What can be derived again (the search index) is
what `repair` rebuilds; what cannot (a damaged token block) is reported with the sessions it
breaks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvdb.codecs import code_layout, fractal
from kvdb.codecs.entropy_coded import PAYLOAD
from kvdb.errors import CorruptData, KvdbError
from kvdb.index import trie
from kvdb.index.indexes import Indexes, index_key
from kvdb.model import lmcode
from kvdb.model.prefix_cache import PrefixCache
from kvdb.records import RepairReport, VerifyReport
from kvdb.services import shipped_codebooks
from kvdb.services.housekeeping import live_paths
from kvdb.storage import Storage
from kvdb.storage.base import NodeRow

if TYPE_CHECKING:
    from kvdb.services.semantic_tier import ChunkIndexes

SAMPLE = 64  # blobs per tier checked without --deep


class Integrity:
    def __init__(
        self, storage: Storage, indexes: Indexes, prefix_cache: PrefixCache, chunk_indexes: Callable[[], ChunkIndexes]
    ):
        self._storage = storage
        self._indexes = indexes
        self._prefix_cache = prefix_cache
        self._chunk_indexes = chunk_indexes  # the semantic tier's, made on first use (it imports FAISS)

    def verify(self, deep: bool = False) -> VerifyReport:
        """A search index behind or ahead of the database (a crash between writing the two) is
        what opening the index detects and rebuilds anyway; verify does that first and notes it.
        So for the semantic tier's: caught up, then its sidecar checked against the database."""
        before = len(self._indexes.rebuilt)
        for tok_hash in self._storage.tokenizer_hashes():
            self._indexes.get(index_key(tok_hash), tok_hash)
        notes = [
            f"search index {key} was missing or disagreed with the database; rebuilt"
            for key in self._indexes.rebuilt[before:]
        ]
        indexes = {key: self._indexes.path(key) for key in self._storage.index_keys()}
        report = verify(self._storage, indexes, deep, notes, self._prefix_cache.entries())
        try:
            self._check_chunk_indexes(report)
        except KvdbError as exc:  # the rows it is derived from are damaged: reported above
            report.problems.append(f"semantic index: not derived ({exc})")
        return report

    def _check_chunk_indexes(self, report: VerifyReport) -> None:
        from kvdb.index.chunk_index import ChunkIndex

        embedders = self._storage.chunk_embedders()
        if not embedders:
            return
        chunk_indexes = self._chunk_indexes()
        before = len(chunk_indexes.rebuilt)
        view = trie.TrieView.load(self._storage)
        for embedder_id in embedders:
            chunk_indexes.get(embedder_id, view)
            chunk_indexes.flush(embedder_id)
            report.checked["semantic indexes"] += 1
            header = ChunkIndex.read_header(chunk_indexes.path(embedder_id))
            if header is None or header.live != sum(self._storage.chunk_counts(embedder_id).values()):
                report.problems.append(
                    f"semantic index {embedder_id}: {chunk_indexes.path(embedder_id)} is missing or stale "
                    "(run `kvdb repair`)"
                )
        report.notes.extend(
            f"semantic index {e} was missing or unreadable; rebuilt" for e in chunk_indexes.rebuilt[before:]
        )

    def repair(self) -> RepairReport:
        """Rebuild what can be derived (the search indexes, the semantic tier's; the prefix
        cache loses the entries it would never resume); report what cannot."""
        rebuilt = []
        for tok_hash in self._storage.tokenizer_hashes():
            self._indexes.rebuild(index_key(tok_hash), tok_hash)
            rebuilt.append(index_key(tok_hash))
        embedders = self._storage.chunk_embedders()
        if embedders:
            view = trie.TrieView.load(self._storage)
            for embedder_id in embedders:
                if self._chunk_indexes().rebuild(embedder_id, view) is not None:
                    rebuilt.append(f"semantic {embedder_id}")
        pruned = self._prefix_cache.prune(live_paths(self._storage))
        return RepairReport(tuple(rebuilt), pruned, tuple(self.verify(deep=True).problems))


def verify(
    store: Storage, index_paths, deep: bool = False, notes: Sequence[str] = (), prefix_entries: dict | None = None
) -> VerifyReport:
    """``index_paths``: key -> sidecar path of each search index the archive should have;
    ``prefix_entries``: node id -> the positions each prefix-cache entry says it holds."""
    report = VerifyReport(notes=list(notes))
    report.problems.extend(store.data_file_problems())
    if report.problems:  # the rows below live in those files: reading them would only fail again
        return report
    shapes = {n.node_id: (n, a, b) for n, a, b in store.node_shapes()}
    _check_blobs(store, report, shapes, deep)
    _check_trie(store, report, shapes, deep)
    _check_indexes(store, report, index_paths)
    _check_references(store, report)
    _check_prefix_cache(report, shapes, prefix_entries or {})
    if deep:
        _check_kv_streams(store, report, shapes)
    return report


def _check_kv_streams(store: Storage, report: VerifyReport, shapes) -> None:
    """Each node's tier-K streams hold its positions' codes (a cache that kept only its last window
    once stored fewer positions than the node): ``code_layout.check_streams``."""
    books = {}
    for codebook_id, _, data in store.stored_blobs("codebooks"):
        try:
            if shipped_codebooks.is_reference(data):  # the centroids, where this machine has built them
                built = shipped_codebooks.cached(shipped_codebooks.Reference.from_bytes(data))
                if built is not None:
                    books[codebook_id] = built
            else:
                books[codebook_id] = code_layout.read_codebooks(data)
        except (KvdbError, ValueError, KeyError):
            pass  # reported by the blob check
    for node, _, _ in shapes.values():
        stored = store.node_kv(node.node_id) if "kv" in node.keep else None
        if stored is None:
            continue
        report.checked["kv streams"] += 1
        codebook_id, streams = stored
        if codebook_id not in books:
            continue  # a missing or damaged codebook is reported by the reference and blob checks
        try:
            code_layout.check_streams(books[codebook_id], streams, node.n_tokens)
        except CorruptData as exc:
            report.problems.append(f"KV codes of node {node.node_id[:12]}: {exc}")


def _check_prefix_cache(report: VerifyReport, shapes, entries: dict) -> None:
    """An entry must hold every position of its node's path: ingest would pass over one that
    does not (a sliding-window cache saved by kvdb 0.1.0 held only the last window)."""
    for node_id, positions in entries.items():
        report.checked["prefix-cache entries"] += 1
        node = shapes.get(node_id)
        if node is not None and positions != node[0].end:
            report.problems.append(
                f"prefix-cache entry {node_id[:12]} holds {positions} positions, its path {node[0].end}; "
                "it is never resumed (run `kvdb repair` or `kvdb gc` to delete it)"
            )


def _check_references(store: Storage, report: VerifyReport) -> None:
    """Model and codebook references: a session whose model row is gone cannot be checked
    against the model it is opened with; KV codes without their codebooks cannot be restored."""
    report.checked["references"] += 1
    for what, row_id, kind, missing in store.dangling_references():
        report.problems.append(f"{what} {row_id[:12]} names {kind} {missing[:12]}, which is not stored")


def _check_blobs(store: Storage, report: VerifyReport, shapes, deep: bool) -> None:
    sample = None if deep else SAMPLE
    for node_id, block_no, data in store.stored_blobs("tokens", sample):
        report.checked["token blocks"] += 1
        _guard(report, f"token block {block_no} of node {node_id[:12]}", fractal.block_count, data, shapes[node_id][1])
    for node_id, alphabet, data in store.stored_blobs("kv", sample):
        report.checked["kv blocks"] += 1
        if alphabet != PAYLOAD:  # an entropy-coded payload's blocks are raw bytes: the streams check decodes it
            _guard(report, f"KV code block of node {node_id[:12]}", fractal.block_count, data, alphabet)
    for node_id, _, data in store.stored_blobs("lm", sample):
        report.checked["lm payloads"] += 1
        _guard(report, f"tier L payload of node {node_id[:12]}", lmcode.payload_version, data)
    for codebook_id, _, data in store.stored_blobs("codebooks"):
        report.checked["codebooks"] += 1
        # a reference to shipped codebooks stands for centroids this machine builds; its own bytes are checked
        read = (
            shipped_codebooks.Reference.from_bytes
            if shipped_codebooks.is_reference(data)
            else code_layout.read_codebooks
        )
        _guard(report, f"codebooks {codebook_id[:12]}", read, data)


def _check_trie(store: Storage, report: VerifyReport, shapes, deep: bool) -> None:
    sessions = store.list_sessions()
    through: Counter[str] = Counter()
    lengths = store.logprob_lengths()
    for node, _, _ in shapes.values():
        report.checked["nodes"] += 1
        parent = shapes.get(node.parent_id) if node.parent_id else None
        if node.parent_id and parent is None:
            report.problems.append(f"node {node.node_id[:12]} names a parent {node.parent_id[:12]} that is not stored")
        elif parent is not None and parent[0].end != node.start:
            report.problems.append(
                f"node {node.node_id[:12]} starts at {node.start}, its parent ends at {parent[0].end}"
            )
        # none: tier L only (recomputed), or tokens the model has not scored yet (pending_work)
        held = lengths.get(node.node_id)
        if held is not None and held != (node.n_tokens if "tokens" in node.keep else None):
            report.problems.append(
                f"node {node.node_id[:12]} has {lengths.get(node.node_id)} log-probabilities for {node.n_tokens} tokens"
            )
        if not node.keep & {"tokens", "lm"}:
            report.problems.append(
                f"node {node.node_id[:12]} holds neither token blocks nor tier L: "
                f"tokens [{node.start}, {node.end}) are lost"
            )
    for session in sessions:
        report.checked["sessions"] += 1
        path: list[NodeRow] = []
        node_id: str | None = session.session_id
        while node_id is not None and node_id in shapes and len(path) <= len(shapes):
            path.append(shapes[node_id][0])
            node_id = shapes[node_id][0].parent_id
        if not path or path[0].node_id != session.session_id or node_id is not None:
            report.problems.append(
                f"session {session.session_id[:12]} ({session.name}): its trie path is broken; it cannot be read"
            )
            continue
        through.update(n.node_id for n in path)
        if path[0].end != session.n_tokens:
            report.problems.append(
                f"session {session.session_id[:12]} ({session.name}) says {session.n_tokens} tokens, "
                f"its path holds {path[0].end}"
            )
        if deep and not all("tokens" in n.keep for n in path):
            # decoding tier L needs the model; `kvdb restore --mode decode` (or `show`) does it, and
            # checks the tokens against the node ids
            report.checked["sessions held in tier L (framing checked, not decoded)"] += 1
        elif deep:
            try:
                ids = store.load_tokens(session.session_id)
            except (KvdbError, KeyError) as exc:
                report.problems.append(
                    f"session {session.session_id[:12]} ({session.name}): tokens do not decode: {exc}"
                )
                continue
            if trie.path_id(session.model_id, ids) != session.session_id:
                report.problems.append(
                    f"session {session.session_id[:12]} ({session.name}): decoded tokens do not match its content hash"
                )
    for node, _, _ in shapes.values():
        if node.refcount != through[node.node_id]:
            report.problems.append(
                f"node {node.node_id[:12]} counts {node.refcount} sessions, {through[node.node_id]} run through it"
            )


def _check_indexes(store: Storage, report: VerifyReport, index_paths) -> None:
    from kvdb.index.walk import WalkIndex

    for key, path in index_paths.items():
        state = store.index_state(key)
        if state is None:
            continue
        report.checked["search indexes"] += 1
        header = WalkIndex.read_header(path)
        if header is None or (header.generation, header.ntotal) != (state.generation, state.ntotal):
            report.problems.append(
                f"search index {key}: {path} is missing or stale (run `kvdb repair` or `kvdb index rebuild`)"
            )
            continue
        try:
            WalkIndex.load(path, check=True)
        except KvdbError as exc:
            report.problems.append(f"search index {key}: {exc} (run `kvdb repair`)")


def _guard(report: VerifyReport, what: str, check, *args) -> None:
    try:
        check(*args)
    except KvdbError as exc:
        report.problems.append(f"{what}: {exc}")
    except (ValueError, KeyError, IndexError) as exc:
        report.problems.append(f"{what}: unreadable ({type(exc).__name__}: {exc})")
