"""Following agent logs as they grow (`kvdb watch`): each file that changed is ingested again,
which stores only its new turns (the trie holds the rest, and the prefix cache the last cache of
a conversation this process saw growing), and recorded in a checkpoint in the archive
(``watched_files``: its size and modification time), so a watcher started again reads only the
files that changed since.

- A JSON Lines log whose last line has no newline yet is being written: it waits (status
  ``waiting``) until a later change ends the line.
- A log rewritten or cut shorter is ingested as it now is: a new version of its conversation,
  a fork of the old one, which stays.
- Events come from ``watchfiles`` (the operating system's notifications, not a polling loop),
  gathered for ``DEBOUNCE_MS``: many files changed at once are one pass.
- A turn costs what is new, not the log's length, but for reading and rendering the log again:
  no model runs (its work is queued for upkeep), the rendered text's pieces but the last are
  tokenized already (``tokenizer.encode``), a log past the model's context finds its unchanged
  parts in one read, and a pass takes the archive once (a file's checkpoint is written on the
  hold its ingest committed on).
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kvdb.errors import ArchiveLocked, InvalidArgument, TranscriptError
from kvdb.records import IngestResult, IngestStatus, WatchedFile
from kvdb.services.forgetting import FORGOTTEN
from kvdb.storage import Storage
from kvdb.storage.base import PutWatchedFiles, WatchedFileRow, utc_now
from kvdb.transcripts.files import SUPPORTED_SUFFIXES, find_transcript_files

log = logging.getLogger("kvdb.watch")
LOCKED_RETRY_S = 1.0  # a pass the archive's lock refused is tried again after this
DEBOUNCE_MS = 200  # changes gathered into one pass: an agent writes a turn's lines within milliseconds
IDLE_MS = 2000  # no change this long: the watcher starts the archive's queued work (kvdb upkeep) beside it


@dataclass(frozen=True)
class AgentHome:
    """Where an agent keeps its logs, found as the agent itself finds them: its own variable
    moves them (and lets a test point them at a temporary folder)."""

    variable: str  # the environment variable the agent reads for its home
    moved: str  # its home under that variable's folder
    homes: tuple[str, ...]  # its homes without the variable: the first is named when none exists
    logs: tuple[str, ...]  # the folders of its logs in its home


AGENT_FOLDERS = {
    # PROJECT/SESSION.jsonl
    "claude-code": AgentHome("CLAUDE_CONFIG_DIR", ".", ("~/.claude", "~/.config/claude"), ("projects",)),
    # YYYY/MM/DD/rollout-*.jsonl
    "codex": AgentHome("CODEX_HOME", ".", ("~/.codex",), ("sessions", "archived_sessions")),
    "gemini": AgentHome("GEMINI_CLI_HOME", ".gemini", ("~/.gemini",), ("tmp",)),  # PROJECT_HASH/chats/session-*.json(l)
}


def agent_folders(agent: str) -> list[Path]:
    """Every folder where ``agent`` may have written its logs, whether or not it exists."""
    if agent not in AGENT_FOLDERS:
        raise InvalidArgument(f"unknown agent {agent!r}; --from takes {', '.join(AGENT_FOLDERS)}")
    home = AGENT_FOLDERS[agent]
    moved = os.environ.get(home.variable)
    homes = [Path(moved).expanduser() / home.moved] if moved else [Path(h).expanduser() for h in home.homes]
    return [h / logs for h in homes for logs in home.logs]


def agent_sources(agent: str | None, paths: Iterable[str | Path] = (), *, follow: bool = False) -> list[str | Path]:
    """What ``ingest`` (and with ``follow``, ``watch``) reads: ``paths``, and with ``agent`` the
    folders of that agent that exist. An ingest given ``paths`` reads them alone (a copy of the
    agent's folder, from a backup or another machine, is no reason to read this machine's too);
    a watcher follows both, since it is meant to catch everything the agent writes from now on,
    and leaves out an agent folder that does not exist yet. Refused before anything opens: an
    agent without ``paths`` whose folders are all missing, which names them and what to do."""
    given = list(paths)  # as typed: a file's errors name it so
    if agent is None:
        if not given:
            raise InvalidArgument(
                f"give the files or folders to read, or --from {'|'.join(AGENT_FOLDERS)} for an agent's own"
            )
        return given
    if given and not follow:
        return given
    folders = agent_folders(agent)
    found = [f for f in folders if f.exists()]
    if not found and not given:
        home = AGENT_FOLDERS[agent]
        # each home's first folder: where its logs begin
        named = " or ".join(str(f) for f in folders[:: len(home.logs)])
        raise InvalidArgument(
            f"no {agent} logs at {named}: {agent} has not run as this user, or keeps them elsewhere; "
            f"give their folder as PATH (--from {agent} PATH), or set {home.variable} as {agent} itself reads it"
        )
    return [*given, *found]


Heard = Callable[[list[IngestResult]], None]
# ingest(path, heard): archive one file; ``heard`` is given its results once they are committed,
# with the archive still held (the watcher writes the file's checkpoint there, on the same hold)
Ingest = Callable[[Path, Heard], list[IngestResult]]


class Watching:
    def __init__(self, storage: Storage, readmit_forgotten: bool = False):
        self._storage = storage
        self._readmit = readmit_forgotten  # archive the files a delete left a tombstone for (kvdb.services.forgetting)

    def watched(self) -> list[WatchedFile]:
        return [_record(r) for r in self._storage.watched_files()]

    def pass_over(
        self, roots: Iterable[str | Path], ingest: Ingest, only: set[Path] | None = None
    ) -> list[IngestResult]:
        """Ingest every transcript file under ``roots`` (or the files ``only`` names, found
        there by a change) that changed since the checkpoint, and checkpoint each; the results
        of those ingested, and of those left waiting."""
        files = [p.resolve() for p in find_transcript_files(_existing(roots))] if only is None else sorted(only)
        results: list[IngestResult] = []
        checkpointed: set[Path] = set()

        def checkpoint(path: Path, stat: os.stat_result, found: list[IngestResult], last: bool = False) -> None:
            """The file's checkpoint, once: as soon as its ingest has committed, on the same hold
            of the archive (letting it go and taking it again costs a pass of its own), else ``last``."""
            if path not in checkpointed and (found or last):
                status, detail = _summary(found)
                self._storage.apply(
                    PutWatchedFiles(
                        [WatchedFileRow(str(path), stat.st_size, stat.st_mtime_ns, utc_now(), status, detail)]
                    )
                )
                checkpointed.add(path)

        try:
            known = {r.path: r for r in self._storage.watched_files()}
            for path in files:
                try:
                    stat = path.stat()
                except FileNotFoundError:  # gone since it was listed (a log rotated away)
                    continue
                seen = known.get(str(path))
                if seen is not None and seen.status == FORGOTTEN:
                    if not self._readmit:
                        continue  # its sessions were deleted: a tombstone, however it grows
                    seen = None
                if (
                    seen is not None
                    and (seen.size, seen.mtime_ns) == (stat.st_size, stat.st_mtime_ns)
                    and seen.status != IngestStatus.WAITING
                ):
                    continue
                found = _ingest_one(path, stat, ingest, functools.partial(checkpoint, path, stat))
                results.extend(found)
                checkpoint(path, stat, found, last=True)  # a file that waits, or failed before its ingest said anything
        finally:
            self._storage.release()  # between passes, other processes read (and write) the archive
        return results

    def follow(
        self,
        roots: Iterable[str | Path],
        ingest: Ingest,
        stop: threading.Event,
        heard: Callable[[list[IngestResult]], None],
        idle: Callable[[], None] | None = None,
    ) -> None:
        """A pass over ``roots``, then one for the files each change touches, until ``stop`` is set;
        ``heard`` is given each pass's results; ``idle()`` is called after ``IDLE_MS`` without a
        change (the watcher starts ``kvdb upkeep`` beside it then)."""
        from watchfiles import watch  # imported by the watcher alone

        folders = _existing(roots)

        def attempt(only: set[Path] | None) -> None:
            while not stop.is_set():  # another process holding the file only delays a pass
                try:
                    heard(self.pass_over(folders, ingest, only))
                    return
                except ArchiveLocked as exc:
                    log.warning("%s; trying again in %g s", exc, LOCKED_RETRY_S)
                    stop.wait(LOCKED_RETRY_S)

        attempt(None)
        changes_or_idle = watch(
            *folders,
            stop_event=stop,
            debounce=DEBOUNCE_MS,
            step=50,
            recursive=True,
            raise_interrupt=False,
            rust_timeout=IDLE_MS,
            yield_on_timeout=True,
        )
        for changes in changes_or_idle:
            touched = {path for path in (Path(p).resolve() for _, p in changes) if _is_listed(path, folders)}
            if touched:  # those files alone: the folders are not walked again at each change
                attempt(touched)
            elif not changes and idle is not None:
                self._idle(idle)

    def _idle(self, idle: Callable[[], None]) -> None:
        try:
            idle()
        except ArchiveLocked as exc:  # another process writes: the work waits for the next idle moment
            log.warning("%s; the queued work waits", exc)
        finally:
            self._storage.release()


def _ingest_one(path: Path, stat: os.stat_result, ingest: Ingest, heard: Heard) -> list[IngestResult]:
    if path.suffix.lower() == ".jsonl" and stat.st_size and not _ends_line(path, stat.st_size):
        return [
            IngestResult(None, path.stem, str(path), 0, IngestStatus.WAITING, "its last line is still being written")
        ]
    try:
        return ingest(path, heard)
    except TranscriptError as exc:
        return [IngestResult(None, path.stem, str(path), 0, IngestStatus.FAILED, str(exc))]


def _is_listed(path: Path, folders: list[Path]) -> bool:
    """Whether a pass over ``folders`` lists ``path``: a transcript's suffix, and nothing hidden
    below the folder (as ``find_transcript_files`` walks)."""
    if path.suffix.lower() not in SUPPORTED_SUFFIXES:
        return False
    for folder in (f.resolve() for f in folders):
        if path.is_relative_to(folder):
            return not any(part.startswith(".") for part in path.relative_to(folder).parts)
    return False


def _existing(roots: Iterable[str | Path]) -> list[Path]:
    out = [Path(r).expanduser() for r in roots]
    missing = [str(p) for p in out if not p.exists()]
    if missing:
        raise InvalidArgument(
            f"nothing to watch at {', '.join(missing)}; "
            "give folders or files that exist (or the agent's folder with --from)"
        )
    return out


def _ends_line(path: Path, size: int) -> bool:
    with open(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1) == b"\n"


def _summary(results: list[IngestResult]) -> tuple[str, str | None]:
    """One status for a file's results: the first failure, else what happened to most of it."""
    for r in results:
        if r.status in (IngestStatus.FAILED, IngestStatus.WAITING):
            return r.status.value, r.error
    changed = [r for r in results if r.status in (IngestStatus.INGESTED, IngestStatus.UPDATED)]
    return (changed[0] if changed else results[0]).status.value if results else IngestStatus.EMPTY.value, None


def _record(row: WatchedFileRow) -> WatchedFile:
    modified = dt.datetime.fromtimestamp(row.mtime_ns / 1e9, dt.UTC).replace(tzinfo=None)
    return WatchedFile(row.path, row.size, modified, row.checked_at, row.status, row.detail)
