"""An archive's search indexes, one per tokenizer: each a ``WalkIndex`` copied from what the
database's slot runs say, caught up with other writers' commits, numbered anew when it must be,
and given a batch's runs in one merge."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvdb.codecs import fractal
from kvdb.errors import CorruptData, StaleWrite
from kvdb.index.segment import held_context, held_tokens, token_dtype
from kvdb.index.walk import WalkIndex
from kvdb.storage import Storage
from kvdb.storage.base import AddTiers, IndexState, ReplaceIndexState, SessionWrite

REBUILD_ATTEMPTS = 50  # another writer committed first each time: past this, say so instead of trying forever

MERGE_BATCH_TOKENS = 1 << 22  # nodes' tokens read from the database at once when an index is built

# A batch's runs join the copy when the batch ends, or on a commit inside it once they are at
# least this many and fill the tail, which is then sealed as a base: each merge sorts the whole
# tail again (decision 0055), so a backfill sorts each base once (decision 0072).
DEFERRED_MIN = 1 << 18


def index_key(tokenizer_hash: str) -> str:
    """One search index per tokenizer: token ids mean the same thing only under one tokenizer."""
    return tokenizer_hash[:16]


@dataclass
class _Batch:
    """Runs a batch of commits gave slots in the database, to join the copy once it commits."""

    ntotal: int  # the next free slot
    armed: bool = False  # runs wait for a commit, which merges them or leaves them for a later one
    runs: list[tuple[int, np.ndarray, np.ndarray | None]] = dataclasses.field(default_factory=list)
    # a run's first slot -> its parent's last, where the parent is in the batch
    parents: dict[int, int] = dataclasses.field(default_factory=dict)
    # node id -> its last slot, for the runs of the batch
    last: dict[str, int] = dataclasses.field(default_factory=dict)


class Indexes:
    """The search indexes of one archive, one per tokenizer (``key``): each a copy, in memory and
    in a sidecar file, of what the database's slot runs say, caught up with the runs other
    writers committed since (on this machine or another), and built again only when the
    database numbered the slots anew."""

    def __init__(self, storage: Storage):
        self._store = storage
        self._folder = storage.derived_path(".index")
        self._loaded: dict[str, WalkIndex] = {}
        self._checked: dict[str, object] = {}  # key -> the storage version its loaded copy was last checked at
        # key -> the runs the open batch numbered, merged into the copy later (``_committed``)
        self._batches: dict[str, _Batch] = {}
        self.rebuilt: list[str] = []  # keys built afresh by this process (not caught up), in order

    def path(self, key: str) -> Path:
        return self._folder / f"{key}.keys"

    def get(self, key: str, tokenizer_hash: str, version=None) -> WalkIndex:
        """The index as the database has it at ``version`` (the storage's, read once by the
        caller) or later: the copy in memory, else the sidecar's, caught up; an empty one when
        nothing was ever indexed. A read: nothing is written to the database."""
        version = self._store.version() if version is None else version
        index, batch = self._loaded.get(key), self._batches.get(key)
        if index is not None and batch is not None:
            if batch.armed or self._store.index_generation(key) == (index.generation, batch.ntotal):
                return index  # the batch's runs join the copy later, and nobody else numbered slots meanwhile
            self._merge_batch(key)  # another writer's runs follow them
        if index is not None and self._checked.get(key) == version:
            return index
        recorded = self._store.index_generation(key)
        if recorded is None:  # nothing numbered (any more): no copy
            self._loaded.pop(key, None)
            return WalkIndex(fractal.MIN_ALPHABET, 0)
        if index is None or not _prefix_of(index, *recorded):
            index = self._sidecar(key, *recorded)
        index = self._follow(key, tokenizer_hash, index)
        self._loaded[key], self._checked[key] = index, version
        return index

    def ready(self, key: str, tokenizer_hash: str, alphabet: int) -> WalkIndex:
        """``get``, for a writer about to add streams of ``alphabet`` symbols: numbered (a commit)
        when there is no numbering yet, or anew when the streams need a larger alphabet."""
        index = self.get(key, tokenizer_hash)
        numbered = key in self._loaded  # ``get`` keeps a copy of a numbered index only
        return index if numbered and index.alphabet >= alphabet else self.rebuild(key, tokenizer_hash, alphabet)

    def _sidecar(self, key: str, generation: int, ntotal: int) -> WalkIndex | None:
        header = WalkIndex.read_header(self.path(key))
        if header is None or header.generation != generation or header.ntotal > ntotal:
            return None
        try:
            return WalkIndex.load(self.path(key))
        except CorruptData:
            return None

    def _follow(self, key: str, tokenizer_hash: str, index: WalkIndex | None) -> WalkIndex:
        """``index`` with the runs from its last slot on merged in, or, when it is None or the
        database has numbered the slots anew meanwhile, every run from slot 0 into a new copy;
        the sidecar saved when anything was added. Nothing is written to the database."""
        state = self._store.index_state(key, index.ntotal if index is not None else 0)
        assert state is not None  # the caller found the index's row
        if index is not None and index.generation != state.generation:
            state, index = self._store.index_state(key), None
            assert state is not None
        if index is None:
            index = WalkIndex(state.alphabet, state.generation)
            self.rebuilt.append(key)
        elif index.ntotal == state.ntotal:
            return index
        self._merge(
            index,
            state.ranges,
            state.ntotal,
            self._store.nodes_of(self._store.model_ids_with_tokenizer(tokenizer_hash)),
        )
        self._save(key, index)
        return index

    def _save(self, key: str, index: WalkIndex) -> None:
        """Keep the copy for the next process. The database holds what it is derived from, so a
        sidecar that cannot be written (a read-only folder, a full disk) costs only the next
        process's catching up, never this answer or a commit that landed."""
        try:
            index.save(self.path(key))
        except OSError:
            pass

    def _merge(self, index: WalkIndex, ranges: dict[str, int], ntotal: int, nodes: list) -> None:
        """The runs' keys, from the nodes' tokens read a batch at a time into the index's own
        token array (``nodes``: the rows of the index's models): a key is a function of a
        position's last ``depth`` tokens, so deriving it costs less than storing it, and the
        stream is held once, at 2 bytes a token."""
        shapes = {n.node_id: n for n in nodes}
        # a run's node gone already (gc): its slots are tombstones
        wanted = sorted((node_id for node_id in ranges if node_id in shapes), key=ranges.__getitem__)
        firsts, lengths = [ranges[n] for n in wanted], [shapes[n].n_tokens for n in wanted]
        index.check_runs(firsts, lengths, ntotal)
        by_slot = np.zeros(ntotal - index.ntotal, token_dtype(index.alphabet))
        for batch in _batches(wanted, lengths, MERGE_BATCH_TOKENS):
            read = self._store.nodes_tokens(batch)
            for node_id in batch:
                tokens = read.get(node_id)
                if tokens is None or len(tokens) != shapes[node_id].n_tokens:
                    raise CorruptData(
                        f"node {node_id[:12]}'s tokens are missing or not {shapes[node_id].n_tokens} long; "
                        "run `kvdb verify`"
                    )
                first = ranges[node_id] - index.ntotal
                by_slot[first : first + len(tokens)] = fractal.check_symbols(tokens, index.alphabet)
        parents = {  # a parent this merge indexes too: the run links to its last slot
            ranges[n]: ranges[p] + shapes[p].n_tokens - 1
            for n in wanted
            if (p := shapes[n].parent_id) is not None and p in ranges and p in shapes
        }
        contexts = [None if ranges[n] in parents else self._context(shapes[n], index) for n in wanted]
        index.append(by_slot, index.run_table(firsts, lengths, contexts, parents))

    def _context(self, node, index: WalkIndex) -> np.ndarray | None:
        """The ``reach - 1`` tokens before ``node`` on its path, read from the archive: a node
        whose parent this merge does not index (indexed before, or without the search tier)
        links to a slot holding them, or keeps them (``WalkIndex.run_table``)."""
        if node.parent_id is None:
            return None
        return self._store.load_tokens(node.parent_id, max(0, node.start - (index.reach - 1)), node.start)

    def rebuild(self, key: str, tokenizer_hash: str, alphabet: int = 0) -> WalkIndex:
        """A new numbering of the index's slots: every node that keeps the search tier, parents
        first, tombstones gone. Built on a snapshot and refused if another commit lands first
        (a node it did not see would lose its slots), then built again, a bounded number of times."""
        for _ in range(REBUILD_ATTEMPTS):
            with self._store.writable():
                version = self._store.version()
                index, ranges = self._numbered(key, tokenizer_hash, alphabet)
                try:
                    self._store.apply(ReplaceIndexState(_state(key, index, ranges)), based_on=version)
                except StaleWrite:
                    continue
            self._save(key, index)
            self._loaded[key], self._checked[key] = index, None
            self._batches.pop(key, None)  # the numbering holds the batch's runs
            self.rebuilt.append(key)
            return index
        raise StaleWrite(
            f"the search index {key} was numbered {REBUILD_ATTEMPTS} times "
            "and another writer's commit landed first each time; run `kvdb repair` again"
        )

    def _numbered(self, key: str, tokenizer_hash: str, alphabet: int) -> tuple[WalkIndex, dict[str, int]]:
        recorded = self._store.index_generation(key)
        header = WalkIndex.read_header(self.path(key))
        generation = _fresh_generation(recorded[0] if recorded else 0, header.generation if header else 0)
        model_ids = self._store.model_ids_with_tokenizer(tokenizer_hash)
        index = WalkIndex(max(alphabet, self._store.max_alphabet(model_ids), fractal.MIN_ALPHABET), generation)
        nodes = self._store.nodes_of(model_ids)
        searchable = [n for n in nodes if "search" in n.keep]  # parents first
        slots = np.cumsum([0] + [n.n_tokens for n in searchable]).tolist()
        ranges = {n.node_id: first for n, first in zip(searchable, slots)}
        self._merge(index, ranges, slots[-1], nodes)
        index.settle()
        return index, ranges

    def compact(self, key: str, tokenizer_hash: str, any_tombstone: bool = False) -> bool:
        """Number the slots anew when tombstones (slots of nodes gc freed) outnumber the live
        ones: every lookup's ranges span them until then. ``any_tombstone``: when there is any
        (after a delete: each keeps its token in the sidecar until then)."""
        index = self.get(key, tokenizer_hash)
        live = sum(n for _, _, n, _ in self._store.slot_runs(key))
        if index.ntotal <= (live if any_tombstone else 2 * live + fractal.DEFAULT_BLOCK):
            return False
        self.rebuild(key, tokenizer_hash)
        return True

    def commit(
        self,
        key: str,
        tokenizer_hash: str,
        plan: SessionWrite | AddTiers,
        joining: dict[str, tuple[np.ndarray, np.ndarray]],
        alphabet: int = 0,
        based_on=None,
    ) -> None:
        """Commit a plan whose nodes join the index (``joining``: node id -> its tokens, and the
        tokens before them on its path): a session's new node, or nodes given the search tier.
        They take the next slots; the sidecar is saved once the database has the commit (a
        crash between the two leaves it behind, which the next ``get`` catches up), once for a
        batch of commits (``Storage.batch``)."""
        index = self.ready(key, tokenizer_hash, alphabet)
        if self._store.batching:
            self._commit_in_batch(key, index, plan, joining, based_on)
            return
        try:
            first = {node_id: index.add(tokens, context) for node_id, (tokens, context) in joining.items()}
            self._store.apply(dataclasses.replace(plan, index=_state(key, index, first)), based_on)
        except BaseException:
            self._loaded.pop(key, None)  # holds slots the database may not have
            raise
        self._checked[key] = None
        self._save(key, index)

    def _commit_in_batch(
        self, key: str, index: WalkIndex, plan: SessionWrite | AddTiers, joining: dict, based_on
    ) -> None:
        """In a batch (``Storage.batch``) the runs take their slots in the database now and join the
        copy in one merge when the batch commits (``WalkIndex.extend``: one sort and one merge for
        them all; a merge per session cost most of a backfill's time), the sidecar saved then."""
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = _Batch(index.ntotal)
            self._store.after_batch(lambda: self._ended(key))
        first, slot = {}, batch.ntotal
        for node_id, (tokens, _) in joining.items():
            first[node_id], slot = slot, slot + len(tokens)
        self._store.apply(
            dataclasses.replace(
                plan, index=IndexState(key, index.alphabet, index.depth, slot, index.generation, first)
            ),
            based_on,
        )
        parent = plan.node.parent_id if isinstance(plan, SessionWrite) and plan.node is not None else None
        for node_id, (tokens, context) in joining.items():
            held = None if context is None else held_context(context, index.alphabet)
            batch.runs.append((first[node_id], held_tokens(tokens, index.alphabet), held))
            if parent in batch.last:  # its parent joins in this batch too: linked to it, not looked up
                batch.parents[first[node_id]] = batch.last[parent]
            batch.last[node_id] = first[node_id] + len(tokens) - 1
        batch.ntotal = slot
        if not batch.armed:
            batch.armed = True
            self._store.after_commit(lambda: self._committed(key), lambda: self._batches.pop(key, None))

    def _committed(self, key: str) -> None:
        """The batch's runs are in the database: merged now, or, while the batch goes on and they
        do not fill the tail (``DEFERRED_MIN``), with a later commit's. Other processes catch up
        from the database meanwhile, as after a crash."""
        batch, index = self._batches.get(key), self._loaded.get(key)
        if batch is None or index is None:
            return
        batch.armed = False
        if self._store.batching and batch.ntotal - index.ntotal < max(DEFERRED_MIN, index.room):
            return
        self._merge_batch(key, settle=not self._store.batching)

    def _ended(self, key: str) -> None:
        """At the batch's end its committed runs join the copy; runs a failed commit left
        (still ``armed``) are dropped, and the copy catches up with the database on its next use."""
        batch = self._batches.get(key)
        if batch is not None and batch.armed:
            self._batches.pop(key)
        elif batch is not None:
            self._merge_batch(key)

    def _merge_batch(self, key: str, settle: bool = True) -> None:
        batch, index = self._batches.pop(key, None), self._loaded.get(key)
        if batch is None or index is None:  # numbered anew meanwhile (a rebuild holds every run)
            return
        index.extend(batch.runs, batch.ntotal, batch.parents, settle)
        self._checked[key] = None
        self._save(key, index)


def _batches(items: list[str], sizes: list[int], limit: int) -> Iterator[list[str]]:
    """Consecutive runs of ``items`` whose sizes add up to about ``limit`` (at least one each)."""
    batch: list[str] = []
    size = 0
    for item, n in zip(items, sizes):
        if batch and size + n > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch


def _state(key: str, index: WalkIndex, ranges: dict[str, int]) -> IndexState:
    return IndexState(key, index.alphabet, index.depth, index.ntotal, index.generation, ranges)


def _prefix_of(index: WalkIndex, generation: int, ntotal: int) -> bool:
    """Whether the database's index, ``ntotal`` slots of numbering ``generation``, begins with
    ``index``: slots are only appended within one numbering."""
    return index.generation == generation and index.ntotal <= ntotal


def _fresh_generation(*taken: int) -> int:
    """A random numbering, not a count: two writers of one lake that share this machine's sidecar
    may each number the slots anew, and a count would give both the same number for different
    contents, which the check of the sidecar against the catalog could not tell apart."""
    while True:
        generation = 1 + secrets.randbelow(2**31 - 2)  # the catalog's column is a 32-bit INTEGER
        if generation not in taken:
            return generation
