"""The DuckLake backend: an archive whose catalog is a PostgreSQL database and whose data are
Parquet files under a data path (a folder every machine mounts, or object storage), so that
processes on many machines read and write one archive at once, under snapshot isolation.

DuckLake has no primary keys, unique constraints or indexes, and lets two transactions that
only insert into a table both commit. What a file's keys guarantee is kept here instead:

- the tables are those of :mod:`kvdb.storage.schema`, created without keys or indexes;
- the schema revision is the one row of ``alembic_version``, as in a file: a lake at another
  revision than this kvdb knows is refused (``NewerArchiveError``), exactly as a file is;
- every kvdb commit also updates the one row of ``kvdb_commits``. DuckLake refuses to commit
  the later of two transactions that changed a table, so two kvdb commits that overlap in time
  conflict however disjoint their rows, and the later is refused with ``StaleWrite``: its plan
  was made on a snapshot that is gone, and the caller makes it again on a fresh one. The lake's
  snapshot id is this storage's ``version()``.

Files derived from the archive (the search sidecars, the prefix cache, a server's journal)
are kept on this machine, under the kvdb cache directory, keyed by the lake.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import uuid
from pathlib import Path

import duckdb
import psycopg

from kvdb.errors import ArchiveError, CorruptData, NewerArchiveError, StaleWrite
from kvdb.storage import edits
from kvdb.storage.base import utc_now
from kvdb.storage.engine import REVISION, Engine, first_line, load_extensions, quoted, revision, transaction
from kvdb.storage.literals import literal_connection
from kvdb.user_cache import cache_dir

ALIAS = "lake"
CATALOG_PREFIX = "ducklake:postgres:"
SNAPSHOT_RETENTION = "1 hour"  # what `kvdb gc` leaves of the files a merge replaced, for readers still scanning them
# How DuckDB's postgres extension says the catalog went away (no error code of its own).
LOST_CATALOG = (
    "Unable to connect to Postgres",
    "server closed the connection",
    "terminating connection",
    'Failed to execute query "ROLLBACK"',
    'Failed to execute query "COMMIT"',
    "no connection to the server",
)
ABORTED = "Current transaction is aborted"  # may be a lost catalog: ``DuckLake._catalog_answers`` tells
EXTENSIONS = ("postgres", "ducklake")  # wheels duckdb-extension-NAME: DuckDB cannot download here
# How httpfs says an object store could not be reached or refused the request.
UNREACHABLE_DATA = (
    "Could not connect to server",
    "HTTP Error",
    "HTTP PUT",
    "HTTP GET",
    "HTTP HEAD",
    "Could not resolve hostname",
)
# Two tables of kvdb's own beside the schema's. ``kvdb_commits``, one row: the lake's own random
# id (what this machine's derived files are kept under, so that a lake made again at the same
# conninfo never meets the files of the one before) and the commits. ``kvdb_claims``: input
# files being ingested, by content, taken in a transaction that updates ``kvdb_commits`` too, so
# two workers claiming at once conflict and one of them is refused.
OWN_TABLES = {
    "kvdb_commits": "lake_id varchar not null, n bigint not null",
    "kvdb_claims": "claim_key varchar not null, owner varchar not null, until timestamp not null",
}
COUNT_COMMIT = "update kvdb_commits set n = n + 1"


class DuckLake(Engine):
    claims_inputs = True

    def __init__(self, location: str, data_path: str | Path | None = None, read_only: bool = False):
        """Attach the lake at ``location`` (``ducklake:postgres:<libpq conninfo>``), creating it
        under ``data_path`` if its catalog is empty. ``data_path`` is needed only then: the
        catalog remembers it."""
        if not location.startswith(CATALOG_PREFIX):
            raise ArchiveError(
                f"kvdb keeps a lake's catalog in PostgreSQL: give --db as {CATALOG_PREFIX}<libpq conninfo>, "
                f"not {_without_password(location)}"
            )
        self.location = location
        self.data_path = None if data_path is None else str(data_path)
        self.read_only = read_only
        self._conn: duckdb.DuckDBPyConnection | None = None
        self._lake_id: str | None = None
        self._catalog: psycopg.Connection | None = None  # libpq, for version() alone
        self.connections = 0
        try:
            self._open_schema()
        except BaseException:
            self.close()
            raise

    # the connection -------------------------------------------------------------------
    def connection(self) -> duckdb.DuckDBPyConnection:
        if self._conn is None:
            conn = duckdb.connect(":memory:")
            try:
                self._attach(conn)
            except BaseException:
                conn.close()
                raise
            self._conn = literal_connection(conn)
        return self._conn

    def _attach(self, cursor: duckdb.DuckDBPyConnection) -> None:
        remote = "://" in (
            self.data_path or self._catalog_value("select value from ducklake_metadata where key = 'data_path'") or ""
        )
        # object storage (s3://, https://...) through httpfs
        load_extensions(cursor, EXTENSIONS + (("httpfs",) if remote else ()))
        secret = _object_store_secret() if remote else None
        if secret is not None:
            cursor.execute(secret)
        # rows go to Parquet, not into the catalog
        options = ["READ_ONLY"] if self.read_only else ["DATA_INLINING_ROW_LIMIT 0"]
        if self.data_path is not None and not self.read_only:
            options.append(f"DATA_PATH '{quoted(self.data_path.rstrip('/') + '/')}'")
        try:
            cursor.execute(f"ATTACH '{quoted(self.location)}' AS {ALIAS} ({', '.join(options)})")
        except duckdb.Error as exc:  # its first line says what failed
            raise self._unattachable(str(exc)) from exc
        cursor.execute(f"USE {ALIAS}")
        self.connections += 1

    def _unattachable(self, message: str) -> ArchiveError:
        where = self.describe()
        if "does not exist - and creating a new DuckLake is explicitly disabled" in message:
            return ArchiveError(
                f"no archive at {where}; check --db (or $KVDB_DB), or create it with `kvdb ingest PATH`"
            )
        if "data_path is not set" in message:
            return ArchiveError(
                f"{where} holds no archive yet: give --data-path DIR (or $KVDB_DATA_PATH) to create one there"
            )
        if "Unable to connect to Postgres" in message:
            reason = message.split('": ', 1)[-1].strip().splitlines()[0]
            return ArchiveError(
                f"cannot reach the catalog of {where}: {_without_password(reason)}; "
                "start PostgreSQL, or check the conninfo in --db"
            )
        return ArchiveError(f"cannot open archive {where}: {_without_password(message.strip().splitlines()[0])}")

    def explain(self, exc: duckdb.Error) -> Exception | None:
        """PostgreSQL gone mid-command: the transaction in hand is lost whole (a commit either
        landed or did not), and the next command reconnects by itself once the server is back."""
        message = str(exc)
        if any(sign in message for sign in UNREACHABLE_DATA):
            return ArchiveError(
                f"cannot reach the data path of {self.describe()} ({first_line(exc)}); check the object store's "
                "address and the AWS_* credentials in the environment. The transaction in progress was not half-written"
            )
        if ".parquet" in message:
            return CorruptData(
                f"a data file of {self.describe()} cannot be read ({first_line(exc)}); "
                "`kvdb verify` names the damaged files"
            )
        if any(sign in message for sign in LOST_CATALOG) or (ABORTED in message and not self._catalog_answers()):
            return ArchiveError(
                f"lost the catalog of {self.describe()} (PostgreSQL is down or unreachable); "
                "the transaction in progress was "
                "not half-written: run the command again when it is back (it finds what was committed)"
            )
        return None

    def _catalog_answers(self) -> bool:
        """Whether PostgreSQL takes a new connection now. DuckLake reports a connection it lost
        inside a transaction as that transaction being aborted, the same words as any earlier
        failure: only asking the server tells the two apart."""
        try:
            psycopg.connect(self.location.removeprefix(CATALOG_PREFIX), autocommit=True, connect_timeout=5).close()
        except psycopg.Error:
            return False
        return True

    def release(self) -> None:
        """Nothing to let go: DuckLake takes no lock while the model works."""

    def close(self) -> None:
        if self._catalog is not None:
            self._catalog.close()
            self._catalog = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def held_for(self) -> float:
        return 0.0

    def version(self) -> int:
        """The lake's snapshot id: it moves with every commit of any writer. Asked of PostgreSQL
        straight through libpq, since every search asks it once: through DuckDB, which plans a
        scan of the catalog each time, a round trip costs many times more (decision 0021)."""
        return int(self._catalog_value("select max(snapshot_id) from ducklake_snapshot"))

    def _catalog_value(self, query: str):
        """One value from the catalog's own tables through libpq; None where the lake has none yet."""
        for attempt in (1, 2):  # a connection that PostgreSQL dropped (a restart) is made again, once
            try:
                if self._catalog is None or self._catalog.closed:
                    self._catalog = psycopg.connect(self.location.removeprefix(CATALOG_PREFIX), autocommit=True)
                row = self._catalog.execute(query).fetchone()
                return None if row is None else row[0]
            except psycopg.errors.UndefinedTable:
                return None
            except psycopg.Error as exc:  # OperationalError: down or unreachable; others: a conninfo libpq refuses
                self._catalog = None
                if attempt == 2 or not isinstance(exc, psycopg.OperationalError):
                    raise ArchiveError(
                        f"cannot reach the catalog of {self.describe()}: "
                        f"{_without_password(str(exc).strip().splitlines()[0])}; "
                        "start PostgreSQL, or check the conninfo in --db"
                    ) from exc

    def claim(self, key: str, owner: str, lease_seconds: float, steal_from: str | None = None) -> str | None:
        def take(conn) -> str | None:
            held = conn.execute("select owner, until from kvdb_claims where claim_key = ?", [key]).fetchone()
            now = utc_now()
            if held is not None and held[0] not in (owner, steal_from) and held[1] > now:
                return held[0]
            conn.execute(COUNT_COMMIT)
            conn.execute("delete from kvdb_claims where claim_key = ?", [key])
            conn.execute(
                "insert into kvdb_claims (claim_key, owner, until) values (?, ?, ?)",
                [key, owner, now + dt.timedelta(seconds=lease_seconds)],
            )
            return None

        return self._until_no_conflict(take)

    def release_claim(self, key: str, owner: str) -> None:
        self._until_no_conflict(
            lambda conn: conn.execute("delete from kvdb_claims where claim_key = ? and owner = ?", [key, owner])
        )

    def _until_no_conflict(self, work, refused: str | None = None):
        """``work(conn)`` in a transaction, again from a fresh snapshot while another commit wins;
        with ``refused``, a conflict is a ``StaleWrite`` saying so instead (its plan is gone)."""
        while True:
            try:
                with transaction(self.connection()) as conn:
                    return work(conn)
            except duckdb.Error as exc:
                if not _conflict(exc):
                    raise
                if refused is not None:
                    raise StaleWrite(refused) from exc

    def data_file_problems(self) -> list[str]:
        """Each Parquet file the catalog lists, checked where it is local: there, of the size the
        catalog recorded, and a Parquet file at both ends (a truncated or overwritten one is
        not). Damage inside a file is what reading its rows (`verify --deep`) finds."""
        problems = []
        conn = self.connection()
        for table in [*edits.TABLES, *OWN_TABLES]:
            listed = conn.execute(
                "select data_file, data_file_size_bytes, delete_file, delete_file_size_bytes "
                f"from ducklake_list_files('{ALIAS}', '{table}')"
            ).fetchall()
            for data_file, data_size, delete_file, delete_size in listed:
                problems += [
                    f"table {table}: {p}"
                    for p in (_file_problem(data_file, data_size), _file_problem(delete_file, delete_size))
                    if p
                ]
        return problems

    def compact_files(self, forget: bool = False, now: bool = False) -> dict:
        """Adjacent small Parquet files merged into larger ones (with ``forget``, every file that
        has deleted rows written again without them first); then snapshots older than
        ``SNAPSHOT_RETENTION`` (``now``: all but the current one) expired and the files scheduled
        for deletion before it deleted (a reader still scanning one is given that long: a later
        gc deletes what this one merged). ``data_files_kept``: the files still waiting so."""
        older = "older_than => now()" if now else f"older_than => now() - interval '{SNAPSHOT_RETENTION}'"
        conn = self.connection()  # the maintenance calls commit by themselves
        rewritten = (
            conn.execute(f"call ducklake_rewrite_data_files('{ALIAS}', delete_threshold => 0)").fetchall()
            if forget
            else []
        )
        merged = conn.execute(f"call ducklake_merge_adjacent_files('{ALIAS}')").fetchall()
        # count(*): no timestamps to convert
        conn.execute(f"select count(*) from ducklake_expire_snapshots('{ALIAS}', {older})").fetchall()
        meta = f"__ducklake_metadata_{ALIAS}"
        (scheduled,) = conn.execute(f"select count(*) from {meta}.ducklake_files_scheduled_for_deletion").fetchone()  # type: ignore[misc]
        (deleted,) = conn.execute(f"select count(*) from ducklake_cleanup_old_files('{ALIAS}', {older})").fetchone()  # type: ignore[misc]
        (ended,) = conn.execute(  # type: ignore[misc]
            f"select (select count(*) from {meta}.ducklake_data_file where end_snapshot is not null)"
            f" + (select count(*) from {meta}.ducklake_delete_file where end_snapshot is not null)"
        ).fetchone()
        # what older snapshots still read, and what waits to be deleted
        kept = int(scheduled) - int(deleted) + int(ended)
        return {
            "data_files_merged": sum(int(r[2]) for r in [*rewritten, *merged]),
            "data_files_written": sum(int(r[3]) for r in [*rewritten, *merged]),
            "data_files_deleted": int(deleted),
            "data_files_kept": int(kept or 0),
        }

    def derived_path(self, suffix: str) -> Path:
        if self._lake_id is None:
            (self._lake_id,) = self.connection().execute("select lake_id from kvdb_commits").fetchone()  # type: ignore[misc]
        return cache_dir() / "lakes" / self._lake_id / f"archive{suffix}"

    def footprint(self) -> int:
        """The data files' bytes (the catalog's rows are counted in ``byte_counts``)."""
        query = f"select coalesce(sum(file_size_bytes), 0) from ducklake_table_info('{ALIAS}')"
        (size,) = self.connection().execute(query).fetchone()  # type: ignore[misc]
        return int(size)

    def describe(self) -> str:
        return _without_password(self.location)

    # writes ---------------------------------------------------------------------------
    def write(self, work, based_on=None):
        """Work planned on a snapshot (``based_on``) is refused once another commit lands first;
        work that reads what it touches inside its transaction (registering a model, a rebuilt
        index's state, a delete) is run again from a fresh snapshot instead, which is what it
        would have done had it come second."""

        def commit(conn):
            if based_on is not None and _snapshot(conn) != based_on:  # the transaction's snapshot: what it reads
                raise StaleWrite(
                    f"another writer committed to {self.describe()} since this write was planned; plan again"
                )
            conn.execute(COUNT_COMMIT)
            return work(conn)

        refused = (
            None
            if based_on is None
            else f"another writer committed to {self.describe()} meanwhile; plan again on a fresh snapshot"
        )
        return self._until_no_conflict(commit, refused)

    # schema ---------------------------------------------------------------------------
    def _upgrade(self, found: str) -> None:
        """A lake of an older revision gets the tables added since, in one commit. A lake has no
        alembic (its tables carry no keys): each revision that only adds tables is listed in
        ``LAKE_UPGRADES``; any other change needs an upgrade written here."""
        if self.read_only:
            raise ArchiveError(
                f"{self.describe()} has schema revision {found}; "
                "open it once with a command that writes (`kvdb ingest`, `kvdb repair`) "
                f"to upgrade it to {REVISION}"
            )
        added = tuple(name for since, names in LAKE_UPGRADES.items() if since >= found for name in names)
        with transaction(self.connection()) as conn:
            for statement in _keyless_tables(added):
                conn.execute(statement)
            if "conversation_sessions" in added:
                _group_conversations(conn)
            if found < "0012":  # the columns that list conversations in SQL
                _fill_conversations(conn, altered="conversations" not in added)
            if found < "0014":  # migration 0014's key of a node among its parent's children
                from kvdb.migrations._frozen_0014_child_keys import FIRST_TOKEN_KEY

                conn.execute("alter table nodes add column child_key varchar")
                conn.execute(f"update nodes set child_key = {FIRST_TOKEN_KEY}")
            conn.execute("update alembic_version set version_num = ?", [REVISION])

    def schema_revision(self) -> str | None:
        return revision(self.connection(), ALIAS)

    def _open_schema(self) -> None:
        found = self.schema_revision()
        if found == REVISION:
            return
        if found in LAKE_UPGRADES:
            self._upgrade(found)
            return
        if found is not None:
            raise NewerArchiveError(
                f"{self.describe()} has schema revision {found}; this kvdb reads {REVISION} (upgrade kvdb to open it)"
            )
        if self.read_only:
            raise ArchiveError(
                f"no archive at {self.describe()}; check --db (or $KVDB_DB), or create it with `kvdb ingest PATH`"
            )
        try:
            with transaction(self.connection()) as conn:
                (tables,) = conn.execute(
                    f"select count(*) from information_schema.tables where table_catalog = '{ALIAS}'"
                ).fetchone()
                if tables:
                    raise ArchiveError(f"{self.describe()} is a DuckLake but not a kvdb archive; choose another --db")
                for statement in _keyless_tables():
                    conn.execute(statement)
                for name, columns in OWN_TABLES.items():
                    conn.execute(f"create table {name} ({columns})")
                conn.execute("insert into kvdb_commits (lake_id, n) values (?, 0)", [uuid.uuid4().hex])
                conn.execute("create table alembic_version (version_num varchar not null)")
                conn.execute("insert into alembic_version values (?)", [REVISION])
        except duckdb.Error as exc:  # an object store nobody answers at, say: the creation rolled back whole
            raise (
                self.explain(exc) or ArchiveError(f"cannot create archive {self.describe()}: {first_line(exc)}")
            ) from exc


def _file_problem(path: str | None, size: int | None) -> str | None:
    if path is None or "://" in path:  # object storage: only reading it tells
        return None
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(-4, 2)
            tail = f.read(4)
            actual = f.seek(0, 2)
    except FileNotFoundError:
        return f"data file {path} is missing"
    except OSError as exc:
        return f"data file {path} is unreadable: {exc.strerror or exc}"
    if size is not None and actual != size:
        return f"data file {path} holds {actual} bytes, the catalog recorded {size}"
    if head != b"PAR1" or tail != b"PAR1":
        return f"data file {path} is not a whole Parquet file"
    return None


def _snapshot(conn) -> int:
    (snapshot,) = conn.execute(f"select id from ducklake_current_snapshot('{ALIAS}')").fetchone()
    return int(snapshot)


def _conflict(exc: duckdb.Error) -> bool:
    return "conflict" in str(exc).lower()


# revision -> the tables the next revisions add (revisions that only add tables upgrade a lake)
LAKE_UPGRADES = {
    "0007": ("node_chunks",),
    "0008": ("conversations", "conversation_sessions"),
    "0009": ("watched_files",),
    "0010": ("pending_work",),
    "0011": (),
    "0012": (),  # 0013 adds indexes only, which a lake has none of
    "0013": (),  # 0014 adds a column to nodes (``_upgrade``)
}


def _group_conversations(conn) -> None:
    """Migration 0009's grouping of the sessions an older kvdb wrote, on a lake."""
    from kvdb.migrations import _frozen_0009_conversations as frozen

    sessions = conn.execute("select session_id, name, source, created_at from sessions").fetchall()
    parents = dict(conn.execute("select node_id, parent_id from nodes").fetchall())
    grouped = frozen.groups(sessions, parents)
    if grouped:
        conn.executemany(
            "insert into conversations (conversation_id) values (?)", [[c] for c in sorted(set(grouped.values()))]
        )
        conn.executemany("insert into conversation_sessions values (?, ?)", list(grouped.items()))


def _fill_conversations(conn, altered: bool) -> None:
    """Migration 0012 on a lake: the columns added (``altered``: to a table older than them) and filled."""
    from kvdb.migrations import _frozen_0012_conversation_listing as frozen

    if altered:
        for name, kind in frozen.COLUMNS:
            conn.execute(f"alter table conversations add column {name} {kind}")
    frozen.fill(lambda query, params: conn.execute(query, params).fetchall())


def _keyless_tables(only: tuple[str, ...] | None = None) -> list[str]:
    """The schema's tables as DuckLake takes them: the same columns, no keys and no indexes
    (written by SQLAlchemy from kvdb.storage.schema, imported only to create a lake)."""
    import sqlalchemy as sa
    from duckdb_engine import Dialect

    from kvdb.storage import schema

    bare, dialect = sa.MetaData(), Dialect()
    tables = [
        sa.Table(
            t.name,
            bare,
            *[
                sa.Column(c.name, c.type, nullable=c.nullable and not c.primary_key, server_default=c.server_default)
                for c in t.columns
            ],
        )
        for t in schema.metadata.sorted_tables
        if only is None or t.name in only
    ]
    return [str(sa.schema.CreateTable(t).compile(dialect=dialect)) for t in tables]


def _object_store_secret() -> str | None:
    """An S3 secret from the environment's AWS_* variables (the names the AWS tools read), or
    None where they give no key: httpfs then reads public objects only. ``AWS_ENDPOINT_URL``
    names another S3-compatible store (MinIO and the like: path-style URLs)."""
    env = os.environ
    if not env.get("AWS_ACCESS_KEY_ID") or not env.get("AWS_SECRET_ACCESS_KEY"):
        return None
    options = {"KEY_ID": env["AWS_ACCESS_KEY_ID"], "SECRET": env["AWS_SECRET_ACCESS_KEY"]}
    if env.get("AWS_SESSION_TOKEN"):
        options["SESSION_TOKEN"] = env["AWS_SESSION_TOKEN"]
    if env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"):
        options["REGION"] = env.get("AWS_REGION") or env["AWS_DEFAULT_REGION"]
    flags = []
    if env.get("AWS_ENDPOINT_URL"):
        scheme, _, host = env["AWS_ENDPOINT_URL"].rpartition("://")
        options.update(ENDPOINT=host.rstrip("/"), URL_STYLE="path")
        flags.append(f"USE_SSL {'false' if scheme == 'http' else 'true'}")
    body = ", ".join(["TYPE s3", *(f"{k} '{quoted(v)}'" for k, v in options.items()), *flags])
    return f"CREATE OR REPLACE SECRET kvdb_s3 ({body})"


def _without_password(text: str) -> str:
    return re.sub(r"(password\s*=\s*)('[^']*'|\S+)", r"\1***", text)
