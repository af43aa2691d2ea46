"""The DuckDB-file backend: one archive in one file, and the file's lock.

DuckDB admits one writing process, or any number of read-only ones, per file. A storage holds
that lock while its connection is open; ``release`` lets it go (the next call takes it again)
so that long work between queries blocks nobody; a process that waits for the lock says so
with a ``.wanted`` file beside the archive, which the holder looks for at the end of each hold.
What that means for staleness is this module's business alone: after a release, another
process may have written, which the file's size and modification time (and its ``.wal``'s) tell.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

import duckdb

from kvdb import sealing
from kvdb.errors import ArchiveError, ArchiveKeyError, ArchiveLocked, ArchiveReadOnly, StaleWrite
from kvdb.storage.base import hold_seconds
from kvdb.storage.engine import REVISION, Engine, first_line, load_extensions, quoted, revision, transaction
from kvdb.storage.literals import literal_connection

SEALED_CATALOG = "kvdb"  # an encrypted file's name in its connection (a plain one's is its file's stem)
COMPACT_MIN_BYTES = 1 << 20  # gc rewrites the file only to give back at least this much (and a quarter of it)


class DuckDBFile(Engine):
    def __init__(
        self, path: str | Path, lock_timeout: float | None = None, read_only: bool = False, key: bytes | None = None
    ):
        """Open (creating and migrating as needed). While another process holds the file, wait up
        to ``lock_timeout`` seconds (``$KVDB_LOCK_TIMEOUT``, default 10), then raise ArchiveLocked.
        A read-only storage of an older archive upgrades it first; of a missing one, refuses.
        ``key``: an encrypted archive's (``kvdb.sealing``), which a new archive is created under."""
        self.path = Path(path)
        if self.path.exists() and self.path.is_dir():
            raise ArchiveError(
                f"{self.path} is a directory; give the path of an archive file (e.g. {self.path}/archive.duckdb)"
            )
        # reading creates nothing: a typo in --db must not leave an archive behind
        if read_only and not self.path.exists():
            raise ArchiveError(
                f"no archive at {self.path}; check --db (or $KVDB_DB), or create it with `kvdb ingest PATH`"
            )
        if not read_only:
            _check_writable(self.path)
        self._key = key
        self.seal = sealing.open_seal(self.path, key, create=not read_only and not self.path.exists())
        sealing.register(self.path, self.seal)
        self.timeout = float(os.environ.get("KVDB_LOCK_TIMEOUT", 10)) if lock_timeout is None else lock_timeout
        self.read_only = read_only
        self._conn: duckdb.DuckDBPyConnection | None = None
        self._released: tuple | None = None  # the file's state when this storage last let it go
        self._held_since = 0.0
        self._epoch = 0  # moves on each own write, and when the file changed while let go
        self.connections = 0  # connections opened so far (each one costs a reconnect, decision 0012)
        self._batching = False  # inside ``batch()``: writes share the transaction the first began
        self._open = False  # a batch's transaction is open on the connection
        self._committed: list = []  # what waits for the batch's commit (``after_commit``)
        self._ended: list = []  # what waits for the batch's end (``after_batch``)
        self._let_go_seconds = 0.0  # how long the last let-go of the file took
        try:
            if self.schema_revision() != REVISION:
                self._migrate()
        except BaseException:  # a refused file (foreign, newer) is let go: the next open of it must not find it held
            self.release()
            raise

    def connection(self) -> duckdb.DuckDBPyConnection:
        if self._conn is None:
            self._conn = literal_connection(self._connect())
        return self._conn

    def _connect(self) -> duckdb.DuckDBPyConnection:
        deadline = time.monotonic() + self.timeout
        asked = False
        while True:
            try:
                conn = self.open_connection()
            except duckdb.Error as exc:  # duckdb raises its own IOException family for locks and bad files
                message = first_line(exc)
                if "lock" not in message.lower():
                    raise self._unopenable(message) from exc
                asked = self._ask_for_the_file()
                if time.monotonic() >= deadline:
                    holder = re.search(r"PID (\d+)", message)
                    who = f"process {holder.group(1)}" if holder else "another process"
                    raise ArchiveLocked(
                        f"archive {self.path} is in use by {who} (DuckDB allows one writing process, or several "
                        f"read-only ones); waited {self.timeout:g}s — retry when it is done, or raise KVDB_LOCK_TIMEOUT"
                    ) from exc
                time.sleep(0.1)
                continue
            if asked:  # got it: the ask is withdrawn (another waiter still locked out asks again)
                self._let_go_of_the_ask()
            self.connections += 1
            self._held_since = time.monotonic()
            self._check_file()
            return conn

    def open_connection(self) -> duckdb.DuckDBPyConnection:
        """A new connection to the file, the archive's catalog in use. An encrypted file is
        attached to an in-memory database with its key; writing it needs httpfs's OpenSSL
        (DuckDB's own crypto only reads), which each writing connection loads (decision 0063)."""
        if self.seal is None:
            return duckdb.connect(str(self.path), read_only=self.read_only)
        conn = duckdb.connect(":memory:")
        try:
            if not self.read_only:
                load_extensions(conn, ("httpfs",))
            mode = ", READ_ONLY" if self.read_only else ""
            conn.execute(
                f"ATTACH '{quoted(self.path)}' AS {SEALED_CATALOG} (ENCRYPTION_KEY '{self.seal.database_key}'{mode})"
            )
            conn.execute(f"USE {SEALED_CATALOG}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _unopenable(self, message: str) -> ArchiveError:
        """Why DuckDB refused the file (for another reason than its lock), naming it as the user
        gave it: DuckDB's message names it by its absolute path. A file without DuckDB's magic
        number is no archive at all, whatever DuckDB's words for that."""
        try:
            with self.path.open("rb") as f:
                foreign = f.read(12)[8:12] != b"DUCK"
        except OSError:  # unreadable: DuckDB's message says why
            foreign = False
        if foreign:
            return ArchiveError(
                f"{self.path} is not a kvdb archive (not a DuckDB database file); check --db (or $KVDB_DB)"
            )
        # encrypted, its seal file gone or another's
        if "without a key" in message or "Wrong encryption key" in message:
            seal = sealing.seal_path(self.path)
            return ArchiveKeyError(
                f"{self.path} is encrypted, and {seal.name} beside it is missing or not its own: "
                "restore it from where the archive came from"
            )
        return ArchiveError(
            f"cannot open archive {self.path}: {message.replace(str(self.path.resolve()), str(self.path))}"
        )

    def release(self) -> None:
        """Let the file go; a batch's writes so far are committed first (the next write begins anew)."""
        if self._conn is not None:
            self._commit_batch()
            began = time.monotonic()
            self._conn.close()  # a checkpoint: the cost ``hold_seconds`` keeps to a share of a hold
            self._let_go_seconds = time.monotonic() - began
            self._conn = None
            self._released = self._file_state()
            self._let_go_of_the_ask()  # asked for, and given

    @property
    def _wanted(self) -> Path:
        """A file another process touches while it waits for the lock (see ``wanted``)."""
        return self.path.with_name(self.path.name + ".wanted")

    def _ask_for_the_file(self) -> bool:
        try:
            self._wanted.touch()
        except OSError:  # a folder this process cannot write to: it waits out the holder's hold, as before
            return False
        return True

    def _let_go_of_the_ask(self) -> None:
        with contextlib.suppress(OSError):
            self._wanted.unlink(missing_ok=True)

    def wanted(self) -> bool:
        return self._wanted.exists()

    def keep(self) -> None:
        """Commit the batch so far and hold on: DuckDB writes its log into the file only when
        it outgrows ``checkpoint_threshold`` then, where a let-go writes it every time."""
        self._commit_batch()
        self._held_since = time.monotonic()

    @contextlib.contextmanager
    def batch(self):
        """One transaction for every write inside: a transaction's begin and commit cost as much as
        two statements, and a source of many sessions made three commits a session (decision 0053). It commits
        at the end, or earlier once a hold has lasted its time (``keep``, or ``release`` when
        another process waits) or before long work (``release``). A write that fails
        rolls back the whole batch since its last commit: the caller's source fails whole."""
        if self._batching:
            yield
            return
        self._batching = True
        try:
            try:
                yield
            except BaseException:
                self._rollback_batch()
                raise
            finally:
                self._batching = False
            self._commit_batch()
        finally:
            ended, self._ended = self._ended, []
            for then in ended:
                then()

    @property
    def batching(self) -> bool:
        return self._batching

    def after_commit(self, then, undo=None) -> None:
        if self._open:
            self._committed.append((then, undo))
        else:
            then()

    def after_batch(self, then) -> None:
        if self._batching:
            self._ended.append(then)
        else:
            then()

    def reading(self):
        if self._batching and not self._open:  # a batch's reads share its transaction too
            self.connection().begin()
            self._open = True
        return contextlib.nullcontext(self.connection()) if self._open else transaction(self.connection())

    def _commit_batch(self) -> None:
        if self._open:
            assert self._conn is not None
            self._conn.commit()
            self._open = False
            waiting, self._committed = self._committed, []
            for then, _ in waiting:
                then()

    def _rollback_batch(self) -> None:
        if self._open:
            undone, self._open, self._committed = self._committed, False, []
            for _, undo in undone:
                if undo is not None:
                    undo()
            with contextlib.suppress(duckdb.Error):
                assert self._conn is not None
                self._conn.rollback()
            self._epoch += 1  # what was read inside the batch is gone

    def close(self) -> None:
        self.release()

    def compact_files(self, forget: bool = False, now: bool = False) -> dict:
        """One file: its write-ahead log is written into it (a checkpoint), and where its free
        blocks are over a quarter of it (and over COMPACT_MIN_BYTES), or hold deleted rows that
        must be forgotten (``forget``: DuckDB reuses freed blocks without zeroing them), it is
        copied into a new file that takes its place, since DuckDB never gives them back. The copy
        replaces the file while this storage still holds the old one's lock, so no writer can come
        between; a crash before the rename leaves the old file whole and a staging file to ignore."""
        conn = self.connection()
        conn.execute("checkpoint")
        database, block_size, free_blocks = conn.execute(
            "select database_name, block_size, free_blocks from pragma_database_size() "
            "where database_name = current_database()"
        ).fetchone()  # type: ignore[misc]
        before = self.path.stat().st_size
        if not (forget and int(free_blocks)) and int(free_blocks) * int(block_size) < max(
            COMPACT_MIN_BYTES, before // 4
        ):
            return {"file_bytes": before}
        staging = self.path.with_name(f".{self.path.name}.compacting-{os.getpid()}")
        staging.unlink(missing_ok=True)
        try:
            sealed = "" if self.seal is None else f" (encryption_key '{self.seal.database_key}')"
            conn.execute(f"attach '{quoted(staging)}' as kvdb_compacted{sealed}")
            conn.execute(f'copy from database "{_quoted_name(database)}" to kvdb_compacted')
            conn.execute("detach kvdb_compacted")
            os.replace(staging, self.path)
        except (duckdb.Error, OSError) as exc:  # a full disk, say: the archive file was not touched
            message = first_line(exc)
            self.release()  # not to keep the half-made copy attached
            raise ArchiveError(
                f"gc freed what no session uses, but could not rewrite {self.path} smaller ({message}); "
                "the archive is whole, run gc again with more free disk"
            ) from exc
        finally:
            staging.unlink(missing_ok=True)
        self.release()  # the next call opens the new file
        return {"file_bytes_before": before, "file_bytes": self.path.stat().st_size}

    def hold_seconds(self) -> float:
        return hold_seconds(self._let_go_seconds)

    def held_for(self) -> float:
        return time.monotonic() - self._held_since if self._conn is not None else 0.0

    def version(self) -> int:
        if self._conn is None:
            self._check_file()
        return self._epoch

    def write(self, work, based_on=None):
        """The file's lock is held from the connection on: nobody else commits meanwhile."""
        if not self._batching:
            with transaction(self.connection()) as conn:
                if based_on is not None and self.version() != based_on:
                    raise StaleWrite(f"{self.path} changed while this write was planned; plan again")
                result = work(conn)
            self._epoch += 1
            return result
        conn = self.connection()
        if based_on is not None and self.version() != based_on:
            raise StaleWrite(f"{self.path} changed while this write was planned; plan again")
        if not self._open:
            conn.begin()
            self._open = True
        try:
            result = work(conn)
        except BaseException:
            self._rollback_batch()
            raise
        self._epoch += 1
        return result

    def _check_file(self) -> None:
        """Nobody else can write while this storage holds the file; once it let go, whoever
        opened the file for writing changed its size and modification time, or its log's."""
        if self._released is not None and self._released != self._file_state():
            self._epoch += 1
            self._released = self._file_state()

    def _file_state(self) -> tuple:
        def state(path: Path):
            try:
                st = path.stat()
            except FileNotFoundError:
                return None
            return st.st_size, st.st_mtime_ns

        return state(self.path), state(self.path.with_name(self.path.name + ".wal"))

    def data_file_problems(self) -> list[str]:
        """None: the one file is checked by opening it, and its blocks by DuckDB's checksums."""
        return []

    def derived_path(self, suffix: str) -> Path:
        return self.path.with_name(self.path.name + suffix)

    def footprint(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def describe(self) -> str:
        return str(self.path)

    # schema ---------------------------------------------------------------------------
    def schema_revision(self) -> str | None:
        return revision(self.connection())

    def _migrate(self) -> None:
        """Alembic, on this storage's own connection (the lock stays held). A read-only storage
        has its file upgraded by a writable one first, then reads on."""
        if self.read_only:
            self.release()
            DuckDBFile(self.path, self.timeout, key=self._key).close()
            return
        from kvdb.storage import migrate

        migrate.upgrade(self.connection(), str(self.path))


def _check_writable(path: Path) -> None:
    """DuckDB opens a file it cannot write and fails only at the first commit, when it creates
    its log beside the file: after the model has loaded and the work is done, as an internal
    error. The folder (the log's, the indexes', the caches') and the file are checked at open."""
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ArchiveReadOnly(
            f"cannot create the folder {folder} for archive {path} ({exc.strerror}); "
            "give --db a path in a folder you can write to"
        ) from None
    fix = "make it writable, or move the archive; commands that only read (sessions, search, show, mcp) still work"
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ArchiveReadOnly(
            f"archive {path} is in a folder this process cannot write to "
            f"({folder}: DuckDB writes its log {path.name}.wal there); {fix}"
        )
    if path.exists() and not os.access(path, os.W_OK):
        raise ArchiveReadOnly(f"archive {path} is read-only to this process; {fix}")


def _quoted_name(name: str) -> str:
    return name.replace('"', '""')
