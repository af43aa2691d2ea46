"""Typed errors. Every message says what went wrong and what the user can do about it.

The CLI prints ``str(error)`` as one line on stderr and exits with ``error.exit_code``.
"""


class KvdbError(Exception):
    """Base class of every error kvdb raises on purpose."""

    exit_code = 1


class TranscriptError(KvdbError):
    """A transcript file could not be read; names the file and, where known, the line."""

    exit_code = 2

    def __init__(self, path, message, line=None):
        self.path = str(path)
        self.line = line
        self.reason = message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


class EmptyTranscript(TranscriptError):
    """A transcript file with nothing to archive (no text; an agent log of summaries alone):
    reported ``empty``, not ``failed``. Nothing in it was malformed."""


class FormatPluginError(KvdbError):
    """A package's ``kvdb.formats`` entry point failed to load or to register its formats."""

    exit_code = 2


class SessionNotFound(KvdbError):
    """No session matches what the user typed (id, id prefix or name)."""

    exit_code = 3


class AmbiguousSession(KvdbError):
    """What the user typed matches more than one session."""

    exit_code = 3


class ModelNotFound(KvdbError):
    """The requested model (or the embedded default) is not installed."""

    exit_code = 4


class UnsupportedModel(KvdbError):
    """The model's architecture keeps its attention state in a form kvdb cannot archive."""

    exit_code = 4


class ModelMismatch(KvdbError):
    """A session is restored with a model other than the one it was archived with."""

    exit_code = 4


class ArchiveError(KvdbError):
    """The archive file cannot be opened or is not a kvdb archive."""

    exit_code = 5


class ArchiveReadOnly(ArchiveError):
    """The archive is to be written, but its file or its folder is not writable by this process
    (DuckDB creates its log beside the file, kvdb its indexes and caches): refused at open, not
    at the first commit after the model loaded. Commands that only read still work."""


class ArchiveLocked(ArchiveError):
    """Another process holds the archive file (DuckDB admits one process at a time)."""

    exit_code = 6


class StaleWrite(ArchiveError):
    """Another writer committed while this plan was made (a lake admits many): plan again."""

    exit_code = 6


class ArchiveKeyError(ArchiveError):
    """An encrypted archive opened without its key or with a wrong one, or a plain archive
    given a key: nothing of it was read. The message says which, and where the key goes."""

    exit_code = 7


class WorkerDied(KvdbError):
    """An ingest worker process ended without a word (killed, or out of memory)."""


class NewerArchiveError(ArchiveError):
    """The archive was written by a newer kvdb whose schema this version does not know."""


class CorruptData(ArchiveError):
    """A stored block failed its integrity check."""


class InvalidArgument(KvdbError):
    """An argument is out of range or malformed (a position past the end, an empty text...)."""

    exit_code = 2


def check_count(name: str, value, least: int = 0) -> int:
    """``value``, if it is an integer of at least ``least``. The library checks its counts,
    positions and pages here rather than clamping them (a k of -1 gave one hit, an offset of -3
    a page from 0 that named the wrong next offset), so that the CLI, HTTP and MCP, which pass
    them on, refuse the same values in the same words."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidArgument(f"{name} must be an integer of at least {least}, got {value!r}")
    return value


class TierMissing(InvalidArgument):
    """What was asked needs a tier that no session in the archive was stored with (semantic
    search needs tier K); the message says how to store it."""


class ContextTooLong(InvalidArgument):
    """A prompt, with the reply asked for, would not fit in the model's context."""


class Busy(KvdbError):
    """The model's queue is full, or a request waited for the model longer than the queue
    allows, or the server is shutting down: retry later."""

    exit_code = 75  # EX_TEMPFAIL


class InvalidQuery(InvalidArgument):
    """SQL that ``Archive.sql`` cannot run: DuckDB's reason on one line (a syntax error, an
    unknown view or column), or more than one statement."""


class QueryRefused(InvalidQuery):
    """SQL that would change the archive: ``Archive.sql`` only reads (docs/sql.md)."""


class UpstreamError(KvdbError):
    """The upstream server that ``kvdb serve --upstream`` forwards to could not be reached, or
    broke off its reply; the message names it and what to check."""


class UpstreamTimeout(UpstreamError):
    """The upstream server accepted a request but sent no reply in time."""
