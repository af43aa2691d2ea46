"""Forgetting: what a delete owes beyond its rows, so that after `kvdb gc` no byte of a deleted
session's text or token ids is left in any file the archive wrote.

A delete takes the sessions' rows at once; their nodes, the sidecars derived from them (the phrase
index's tokens, the chunk index's words), the exact caches and the database's freed pages keep
their bytes until gc. So a delete queues a ``forget`` mark per session (``pending_work``, which
outlives the session's row) and gc, finding marks, does what an ordinary gc skips for its cost:
the phrase indexes numbered anew wherever a slot is a tombstone, the chunk sidecars built again,
the attention-sink caches (keyed by content, not by node) emptied, and the storage's files
rewritten (a DuckDB file copied even when little of it is free; a lake's data files with deleted
rows written again and the replaced ones deleted once no reader needs them). The marks go when
that is done; a lake keeps them while replaced files wait for readers (``kvdb gc --now``).

A source file whose sessions are all deleted gets a tombstone in `kvdb watch`'s checkpoint
(status ``forgotten``): watch does not archive it again, however it grows, unless asked
(``--readmit-forgotten``). The tombstone keeps the file's path, nothing of its text.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvdb.errors import CorruptData, InvalidArgument
from kvdb.records import DeletedSource
from kvdb.services.journal import Journal
from kvdb.storage import Storage
from kvdb.storage.base import RECORD_LINE, DeleteSession, PutWatchedFiles, Queue, SessionRow, WatchedFileRow, utc_now

FORGET_WORK = "forget"  # pending_work: a deleted session whose bytes gc has not erased yet
FORGOTTEN = "forgotten"  # watched_files status: a tombstone
TOMBSTONE_DETAIL = "deleted from the archive; `kvdb watch --readmit-forgotten` archives it again"


def source_file(source: str) -> str | None:
    """The file a session was archived from (a record's line number dropped); None for text or
    messages given directly."""
    if source.startswith("<"):
        return None
    return re.sub(RECORD_LINE, "", source)


def _spellings(file: str) -> list[str]:
    """The ways a session's source may name ``file``: as given, absolute, resolved (through
    links), and relative to the working folder (a source is recorded as its path was given)."""
    absolute, resolved = os.path.abspath(file), str(Path(file).resolve())
    return list(dict.fromkeys([file, absolute, resolved, os.path.relpath(absolute), os.path.relpath(resolved)]))


class Forgetting:
    def __init__(self, storage: Storage):
        self._storage = storage

    def deleted(self, rows: list[SessionRow]) -> None:
        """After ``rows`` were deleted: their forget marks, and a tombstone for each source file
        no session is left from."""
        if not rows:
            return
        self._storage.apply(Queue([r.session_id for r in rows], FORGET_WORK))
        self._purge_journal(rows)
        files = {f for f in (source_file(r.source) for r in rows) if f is not None}
        if not files:
            return
        self.tombstone([f for f in files if not self._storage.sessions_from(_spellings(f))])

    def _purge_journal(self, rows: list[SessionRow]) -> None:
        """The serve journal's entries set aside as failed (never archived, kept for a person to
        look at) that name a deleted conversation: they hold its text."""
        names = {v for r in rows for v in (r.session_id, r.conversation_id, r.name) if v}
        for path in Journal.beside(self._storage.derived_path).set_aside_entries():
            try:
                entry = Journal.read(path)
            except (OSError, ValueError, CorruptData):
                continue
            if isinstance(entry, dict) and (entry.get("conversation") in names or entry.get("name") in names):
                path.unlink(missing_ok=True)

    def tombstone(self, files: list[str]) -> None:
        """Mark ``files`` forgotten in watch's checkpoint, under the path watch follows them by."""
        if not files:
            return
        known = {r.path: r for r in self._storage.watched_files()}
        rows = []
        for f in files:
            path = str(Path(f).resolve())
            seen = known.get(path) or known.get(f)
            try:
                stat = os.stat(path)
                size, mtime = stat.st_size, stat.st_mtime_ns
            except OSError:
                size, mtime = (seen.size, seen.mtime_ns) if seen is not None else (0, 0)
            rows.append(WatchedFileRow(path, size, mtime, utc_now(), FORGOTTEN, TOMBSTONE_DETAIL))
        self._storage.apply(PutWatchedFiles(rows))

    def delete_source(self, path: str | Path) -> DeletedSource:
        """Every session archived from the file ``path`` (each version of its conversations),
        and its tombstone."""
        given = os.fspath(path)
        rows = self._storage.sessions_from(_spellings(given))
        if not rows:
            raise InvalidArgument(
                f"no session was archived from {given}; `kvdb sessions` lists the sessions and their sources"
            )
        with self._storage.batch():
            for r in rows:
                self._storage.apply(DeleteSession(r.session_id))
        self.deleted(rows)
        self.tombstone([given])
        return DeletedSource(given, len(rows), len({r.conversation_id or r.session_id for r in rows}))

    def pending(self) -> list[str]:
        """The deleted sessions whose bytes gc has yet to erase."""
        return self._storage.queued(FORGET_WORK)
