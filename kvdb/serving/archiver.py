"""Archiving the journal's exchanges off the response path.

The entries a previous run left over are archived at start, before the server answers (so a
conversation resumes from them at once); then a thread of its own takes each new entry, oldest
first, when no request has used the model for a moment (``ModelGate.held``), ingests it with the server's tiers, keeps the exchange's exact cache in the prefix cache, and
only then deletes the entry: whenever the process dies, an exchange is in the journal, in the
archive, or both (archiving it again then finds it archived). On stop it finishes the entry in
hand and leaves the rest to the next start.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np

from kvdb.errors import KvdbError
from kvdb.serving.access import ArchiveAccess
from kvdb.serving.gate import ModelGate
from kvdb.serving.journal import Journal

log = logging.getLogger("kvdb.serve")


class Archiver:
    def __init__(
        self,
        journal: Journal,
        access: ArchiveAccess,
        gate: ModelGate,
        keep: str,
        exact_cache: Callable[[np.ndarray], object],
        remember: Callable[[np.ndarray, object], None],
    ):
        self._journal = journal
        self._access = access
        self._gate = gate
        self._keep = keep
        self._exact_cache = exact_cache  # the exact cache of an archived session's tokens (model work: under the gate)
        self._remember = remember  # where the server looks first for the next turn
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvdb-archiver", daemon=True)

    def start(self) -> None:
        for path in self._journal.pending():
            self._archive_safely(path)
        self._thread.start()

    def submit(self, path: Path) -> None:
        self._queue.put(path)

    def stop(self) -> None:
        self._stopping.set()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            path = self._queue.get()
            if path is None:
                break
            self._archive_safely(path)

    def _archive_safely(self, path: Path) -> None:
        try:
            self._archive(path)
        except (KvdbError, ValueError, KeyError) as exc:  # the archive refuses it, or it is no entry: retrying cannot help
            log.error("journal entry %s set aside as %s: %s", path.name, self._journal.set_aside(path).name, exc)
        except Exception:  # the worker outlives one bad entry, which stays for the next start
            log.exception("archiving journal entry %s failed; it stays in the journal for the next start", path.name)

    def _archive(self, path: Path) -> None:
        entry = self._journal.read(path)
        source = {entry["kind"]: entry["content"]}
        with self._gate.held():
            result = self._access(lambda a: a.ingest(**source, name=entry["name"], keep=self._keep))[0]
            ids = self._access(lambda a: a.tokens(cast(str, result.session_id)))
            cache = self._exact_cache(ids)
            self._access(lambda a: a.keep_cache(ids, cache))
        self._remember(ids, cache)
        self._journal.done(path)
