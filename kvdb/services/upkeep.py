"""The work that ingest leaves for later (decision 0053).

Ingest archives the default tiers at the tokenizer's speed and queues, per session, what a
model's pass makes (``pending_work``): the semantic tier (the embedder's), embedded first, since
search by meaning covers a session only once it is done; then the log-probabilities of the nodes
on its path (the language model's: d_T, ``kvdb prefixes``). One pass over a session gives them and its exact
cache, which warms the prefix cache, so a restore of recent work resumes instead of prefilling. Sessions go newest
first; caches are kept while the prefix cache has room, so the newest stay warm rather than being
the first a full cache evicts. The embedder's work goes a group of sessions at a time, their
chunks embedded in one call (decision 0054); the language model's a session at a time. Each
session's work commits with its row off the queue: a run killed at any point loses at most the
sessions it was computing, and the next run goes on from the queue.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from kvdb.errors import InvalidArgument, StaleWrite
from kvdb.index import trie
from kvdb.model.prefix_cache import PrefixCache
from kvdb.records import Pending, Queued, UpkeepReport
from kvdb.services.ingesting import COMMIT_ATTEMPTS
from kvdb.services.models import ModelProvider
from kvdb.services.reading import Reader
from kvdb.services.write_compute import WriteCompute
from kvdb.services.write_plan import missing_tiers, plan_session
from kvdb.storage import Storage
from kvdb.storage.base import AddTiers, Chunks, NodeRow, NodeTiers, PutLogprobs, SessionRow
from kvdb.storage.edits import LOGPROBS_WORK, SEMANTIC_WORK
from kvdb.tiers import Tier

if TYPE_CHECKING:
    from kvdb.services.semantic_tier import SemanticTier

# progress(tokens done, tokens queued when the run began)
Progress = Callable[[int, int], None]
BATCH = 64  # sessions read from the queue at a time
WARM_SHARE = 0.9  # of the prefix cache's budget: past it, sessions get their log-probabilities and no cache
# chunks per embedder call: a group of sessions is read, embedded without the archive's lock, then committed
# a session at a time; one release of the file a group, not one a session (each costs a reconnect, decision 0054)
GROUP_CHUNKS = 256
SEMANTIC_ONLY = frozenset({Tier.SEMANTIC})
NICENESS = 10  # a watcher's background upkeep gives way to the user's own work

NodeKey = tuple[str, int, int]  # a node and its span: a node another writer cut keeps its id, not its start
# a session, its tokens, its lacking nodes cut
Prepared = tuple[SessionRow, np.ndarray, list[tuple[NodeKey, tuple[np.ndarray, list[str]]]]]


def _key(node: NodeRow) -> NodeKey:
    return (node.node_id, node.start, node.end)


class Upkeep:
    def __init__(
        self,
        storage: Storage,
        models: ModelProvider,
        reader: Reader,
        compute: WriteCompute,
        semantic: Callable[[], SemanticTier],
        prefix_cache: PrefixCache,
    ):
        self._storage = storage
        self._models = models
        self._reader = reader
        self._compute = compute
        self._semantic = semantic  # the archive's tier, its embedder loaded on first use
        self._prefix_cache = prefix_cache

    def pending(self) -> Pending:
        return Pending.from_counts(self._storage.pending_counts())

    def run(
        self,
        limit: int | None = None,
        progress: Progress | None = None,
        stop: Callable[[], bool] | None = None,
        only: str | None = None,
    ) -> UpkeepReport:
        """Do the queued work, newest session first, the embedder's before the language model's
        (search by meaning before d_T): all of it (or the ``only`` kind: ``semantic`` or
        ``logprobs``), or ``limit`` sessions of each, or until ``stop()`` says so between two
        sessions (a watcher's next change, a server's next request)."""
        kinds = (SEMANTIC_WORK, LOGPROBS_WORK)
        if only is not None and only not in kinds:
            raise InvalidArgument(f"no queued work {only!r}; upkeep does {' or '.join(kinds)}")
        began = time.perf_counter()
        self._storage.check_writable()
        self._models.described()  # the tokenizer loaded before the first read, not while the archive is held (seconds)
        pending = self.pending()
        if progress is not None:
            progress(
                0,
                {None: pending.tokens, SEMANTIC_WORK: pending.semantic.tokens, LOGPROBS_WORK: pending.logprobs.tokens}[
                    only
                ],
            )
        done = {SEMANTIC_WORK: [0, 0], LOGPROBS_WORK: [0, 0]}
        warmed = 0
        try:
            for work in (w for w in kinds if only in (None, w)):
                with self._storage.batch():  # each session's work and its row off the queue land together
                    warmed += self._drain(work, limit, done[work], progress, stop)
        finally:
            self._storage.release()
        return self._report(done, warmed, began)

    def _drain(self, work: str, limit: int | None, done: list[int], progress: Progress | None, stop) -> int:
        """The queue of ``work``, newest first (``done``: sessions and tokens, counted up): the
        embedder's a group of sessions at a time, the language model's a session at a time;
        how many caches were kept."""
        warmed = 0
        while limit is None or done[0] < limit:
            queued = self._storage.pending_sessions(work, BATCH if limit is None else min(BATCH, limit - done[0]))
            if not queued:
                break
            steps: Iterator[Callable[[], list[tuple[SessionRow, bool]]]] = (
                (functools.partial(self._embed, group) for group in self._groups(queued))
                if work == SEMANTIC_WORK
                else (functools.partial(self._scored, row) for row in queued)
            )
            for step in steps:
                if stop is not None and stop():
                    return warmed
                for row, kept in step():
                    warmed += kept
                    done[0] += 1
                    done[1] += row.n_tokens
                    if progress is not None:
                        progress(row.n_tokens, 0)
        return warmed

    def _groups(self, queued: list[SessionRow]) -> Iterator[list[Prepared]]:
        """The queued sessions, in order, as groups for one embedder call each: every session
        read and its lacking nodes cut (``SemanticTier.cut``) while the archive is held, a group
        closed once it holds ``GROUP_CHUNKS`` chunks. A node that sessions of one group share
        (copies of a conversation) is cut for the first of them only."""
        tokenizer = self._models.described().tokenizer
        group: list[Prepared] = []
        cut: set[NodeKey] = set()
        chunks = 0
        # one walk up for them all, not two a session
        paths = self._storage.session_paths([row.session_id for row in queued])
        for row in queued:
            path = paths.get(row.session_id) or self._storage.node_path(row.session_id)
            ids = self._reader.path_tokens(row, path=path)
            lacking = [n for n, _ in missing_tiers(path, SEMANTIC_ONLY) if _key(n) not in cut]
            cut.update(map(_key, lacking))
            nodes = list(
                zip(map(_key, lacking), self._semantic().cut(tokenizer, ids, [(n.start, n.end) for n in lacking]))
            )
            group.append((row, ids, nodes))
            chunks += sum(len(texts) for _, (_, texts) in nodes)
            if chunks >= GROUP_CHUNKS:
                yield group
                group, cut, chunks = [], set(), 0
        if group:
            yield group

    def _embed(self, group: list[Prepared]) -> list[tuple[SessionRow, bool]]:
        """The semantic tier of a group's sessions: their chunks embedded in one call, without
        the archive's lock; then each session's committed with it off the queue, so that a run
        killed at any point leaves each session embedded and off the queue, or neither."""
        nodes = [node for _, _, session_nodes in group for node in session_nodes]
        self._storage.before_compute()
        computed = dict(zip((key for key, _ in nodes), self._semantic().embedded([cut for _, cut in nodes])))
        for row, ids, _ in group:
            self._commit(row, ids, computed)
        return [(row, False) for row, _, _ in group]

    def _commit(self, row: SessionRow, ids: np.ndarray, computed: dict[NodeKey, Chunks]) -> None:
        """A session's lacking nodes given their chunks, on a plan made now: a node another
        session of the group committed lacks nothing any more, and one another writer cut
        meanwhile (a key not computed) is embedded here."""
        for _ in range(COMMIT_ATTEMPTS):
            plan = plan_session(self._storage, row.model_id, ids, SEMANTIC_ONLY, self._node_tokens)
            lacking = [n for n, _ in plan.lacking]
            new = [n for n in lacking if _key(n) not in computed]
            if new:
                self._storage.before_compute()
                made = self._semantic().chunks(self._models.described().tokenizer, ids, [(n.start, n.end) for n in new])
                computed.update(zip(map(_key, new), made))
            edit = AddTiers(
                {n.node_id: NodeTiers(chunks=computed[_key(n)]) for n in lacking}, done=(row.session_id, SEMANTIC_WORK)
            )
            try:
                self._storage.apply(edit, plan.version)
                return
            except StaleWrite:  # another writer changed the path meanwhile: read it again
                continue
        raise StaleWrite(
            f"{COMMIT_ATTEMPTS} commits of session {row.session_id[:12]}'s semantic tier found another writer's first; "
            "run upkeep again"
        )

    def _node_tokens(self, node: NodeRow) -> np.ndarray:
        return self._storage.node_tokens(node.node_id)

    def _scored(self, row: SessionRow) -> list[tuple[SessionRow, bool]]:
        return [(row, self._score(row))]

    def _score(self, row: SessionRow) -> bool:
        """One session's pass of the language model, committed; whether its cache was kept."""
        path = self._storage.node_path(row.session_id)
        unscored = self._storage.unscored([n.node_id for n in path])
        if not unscored:  # another session's pass scored its path meanwhile
            self._storage.apply(PutLogprobs(row.session_id, {}))
            return False
        loaded = self._models.for_session(row)
        ids = self._reader.path_tokens(row, path=path)
        scored, cache = self._compute.owed(loaded, ids, path, [n for n in path if n.node_id in unscored])
        self._storage.apply(PutLogprobs(row.session_id, scored))
        if self._prefix_cache.size() >= WARM_SHARE * self._prefix_cache.budget:
            return False
        self._prefix_cache.save(row.session_id, cache, trie.ends_deepest_first(path))
        return True

    def _report(self, done: dict[str, list[int]], warmed: int, began: float) -> UpkeepReport:
        embedded, scored = (Queued(*done[work]) for work in (SEMANTIC_WORK, LOGPROBS_WORK))
        return UpkeepReport(embedded, scored, warmed, round(time.perf_counter() - began, 3), self.pending())


class BackgroundUpkeep:
    """``Upkeep`` in a process of its own beside a watcher, so a watched turn never waits for a
    session's pass (seconds of the model for a long one): started when the watcher is idle and
    work is queued, at a lower priority, until the queue is done; stopped with the watcher (it
    resumes from the queue next time). It takes the archive's lock only to read and commit."""

    def __init__(self, location, model: str | None, data_path, embedder: str | None, key: bytes | None = None):
        # b"": no key
        self._args = (str(location), model, None if data_path is None else str(data_path), embedder, key or b"")
        self._process: Any = None  # a spawn context's Process

    def running(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def start(self) -> None:
        if self.running():
            return
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch threads forked mid-use
        self._process = context.Process(target=_upkeep_process, args=self._args, daemon=True, name="kvdb-upkeep")
        self._process.start()

    def stop(self) -> None:
        if self.running():
            self._process.terminate()  # the session in hand is lost; the queue holds it for the next run
            self._process.join()


def _upkeep_process(location: str, model: str | None, data_path: str | None, embedder: str | None, key: bytes) -> None:
    import os

    import kvdb

    os.nice(NICENESS)
    with kvdb.open(location, model=model, data_path=data_path, embedder=embedder, key=key) as archive:
        archive.upkeep()
