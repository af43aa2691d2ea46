"""The work that ingest leaves for later (decision 0053).

Ingest archives the default tiers at the tokenizer's speed and queues, per session, what a
model's pass makes (``pending_work``): the semantic tier (the embedder's), embedded first, since
search by meaning covers a session only once it is done; then the log-probabilities of the nodes
on its path (the language model's: d_T, ``kvdb prefixes``). One pass over a session gives them and its exact cache, which warms the
prefix cache, so a restore of recent work resumes instead of prefilling. Sessions go newest
first; caches are kept while the prefix cache has room, so the newest stay warm rather than being
the first a full cache evicts. Each session commits alone: a run killed at any point loses at
most the session it was computing, and the next run goes on from the queue.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from kvdb.errors import InvalidArgument, StaleWrite
from kvdb.index import trie
from kvdb.model.prefix_cache import PrefixCache
from kvdb.records import Pending, Queued, UpkeepReport
from kvdb.services.ingesting import COMMIT_ATTEMPTS
from kvdb.services.models import ModelProvider
from kvdb.services.reading import Reader
from kvdb.services.write_compute import WriteCompute
from kvdb.services.write_plan import plan_session
from kvdb.storage import Storage
from kvdb.storage.base import PutLogprobs, SessionRow
from kvdb.storage.edits import LOGPROBS_WORK, SEMANTIC_WORK
from kvdb.tiers import Tier

# progress(tokens done, tokens queued when the run began)
Progress = Callable[[int, int], None]
BATCH = 64  # sessions read from the queue at a time
WARM_SHARE = 0.9  # of the prefix cache's budget: past it, sessions get their log-probabilities and no cache
NICENESS = 10  # a watcher's background upkeep gives way to the user's own work


class Upkeep:
    def __init__(self, storage: Storage, models: ModelProvider, reader: Reader, compute: WriteCompute, prefix_cache: PrefixCache):
        self._storage = storage
        self._models = models
        self._reader = reader
        self._compute = compute
        self._prefix_cache = prefix_cache

    def pending(self) -> Pending:
        return Pending.from_counts(self._storage.pending_counts())

    def run(self, limit: int | None = None, progress: Progress | None = None, stop: Callable[[], bool] | None = None, only: str | None = None) -> UpkeepReport:
        """Do the queued work, newest session first, the embedder's before the language model's
        (search by meaning before d_T): all of it (or the ``only`` kind: ``semantic`` or
        ``logprobs``), or ``limit`` sessions of each, or until ``stop()`` says so between two
        sessions (a watcher's next change, a server's next request)."""
        kinds = {SEMANTIC_WORK: self._embed, LOGPROBS_WORK: self._score}
        if only is not None and only not in kinds:
            raise InvalidArgument(f"no queued work {only!r}; upkeep does {' or '.join(kinds)}")
        began = time.perf_counter()
        self._storage.check_writable()
        pending = self.pending()
        if progress is not None:
            progress(0, {None: pending.tokens, SEMANTIC_WORK: pending.semantic.tokens, LOGPROBS_WORK: pending.logprobs.tokens}[only])
        done = {SEMANTIC_WORK: [0, 0], LOGPROBS_WORK: [0, 0]}
        warmed = 0
        try:
            for work, one in ((w, kinds[w]) for w in kinds if only in (None, w)):
                with self._storage.batch():  # each session's work and its row off the queue land together
                    warmed += self._drain(work, one, limit, done[work], progress, stop)
        finally:
            self._storage.release()
        return self._report(done, warmed, began)

    def _drain(self, work: str, one: Callable[[SessionRow], bool], limit: int | None, done: list[int], progress: Progress | None, stop) -> int:
        """The queue of ``work``, a session at a time (``done``: sessions and tokens, counted up);
        how many caches were kept."""
        warmed = 0
        while limit is None or done[0] < limit:
            queued = self._storage.pending_sessions(work, BATCH if limit is None else min(BATCH, limit - done[0]))
            if not queued:
                break
            for row in queued:
                if stop is not None and stop():
                    return warmed
                warmed += one(row)
                done[0] += 1
                done[1] += row.n_tokens
                if progress is not None:
                    progress(row.n_tokens, 0)
        return warmed

    def _embed(self, row: SessionRow) -> bool:
        """The semantic tier of the nodes on the session's path that lack it, committed with the
        session off the queue (the tokenizer and the embedder; no language model)."""
        for _ in range(COMMIT_ATTEMPTS):
            ids = self._reader.path_tokens(row)
            plan = plan_session(self._storage, row.model_id, ids, frozenset({Tier.SEMANTIC}), lambda node: self._storage.node_tokens(node.node_id))
            edit, _, _ = self._compute.tiers(self._models.described(), plan, None)
            try:
                self._storage.apply(dataclasses.replace(edit, done=(row.session_id, SEMANTIC_WORK)), plan.version)
                return False
            except StaleWrite:  # another writer changed the path meanwhile: read it again
                continue
        raise StaleWrite(f"{COMMIT_ATTEMPTS} commits of session {row.session_id[:12]}'s semantic tier found another writer's first; run upkeep again")

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

    def __init__(self, location, model: str | None, data_path, embedder: str | None):
        self._args = (str(location), model, None if data_path is None else str(data_path), embedder)
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


def _upkeep_process(location: str, model: str | None, data_path: str | None, embedder: str | None) -> None:
    import os

    import kvdb

    os.nice(NICENESS)
    with kvdb.open(location, model=model, data_path=data_path, embedder=embedder) as archive:
        archive.upkeep()
