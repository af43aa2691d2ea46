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
import importlib
import os
import re
import uuid
from pathlib import Path

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects import registry

from kvdb.errors import ArchiveError, CorruptData, NewerArchiveError, StaleWrite
from kvdb.storage import schema, sql_apply
from kvdb.storage.base import Plan, utc_now
from kvdb.storage.sql import SqlStorage, quoted
from kvdb.user_cache import cache_dir

registry.register("duckdb", "duckdb_engine", "Dialect")

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
EXTENSIONS = ("postgres", "ducklake")  # wheels duckdb-extension-NAME: DuckDB cannot download here
# How httpfs says an object store could not be reached or refused the request.
UNREACHABLE_DATA = ("Could not connect to server", "HTTP Error", "HTTP PUT", "HTTP GET", "HTTP HEAD", "Could not resolve hostname")
# One row: the lake's own random id (what this machine's derived files are kept under, so that a
# lake made again at the same conninfo never meets the files of the one before) and the commits.
commits = sa.Table("kvdb_commits", sa.MetaData(), sa.Column("lake_id", sa.String, nullable=False), sa.Column("n", sa.BigInteger, nullable=False))
# Input files being ingested, by content: taken in a transaction that updates ``kvdb_commits`` too,
# so two workers claiming at once conflict and one of them is refused.
claims = sa.Table(
    "kvdb_claims",
    sa.MetaData(),
    sa.Column("claim_key", sa.String, nullable=False),
    sa.Column("owner", sa.String, nullable=False),
    sa.Column("until", sa.DateTime, nullable=False),
)


class DuckLake(SqlStorage):
    claims_inputs = True

    def __init__(self, location: str, data_path: str | Path | None = None, read_only: bool = False):
        """Attach the lake at ``location`` (``ducklake:postgres:<libpq conninfo>``), creating it
        under ``data_path`` if its catalog is empty. ``data_path`` is needed only then: the
        catalog remembers it."""
        if not location.startswith(CATALOG_PREFIX):
            raise ArchiveError(f"kvdb keeps a lake's catalog in PostgreSQL: give --db as {CATALOG_PREFIX}<libpq conninfo>, not {_without_password(location)}")
        self.location = location
        self.data_path = None if data_path is None else str(data_path)
        self.read_only = read_only
        self._engine: sa.Engine | None = None
        self._lake_id: str | None = None
        self._catalog: psycopg.Connection | None = None  # libpq, for version() alone
        self.connections = 0
        try:
            self._open_schema()
        except BaseException:
            self.close()
            raise

    # the connection -------------------------------------------------------------------
    @property
    def engine(self) -> sa.Engine:
        if self._engine is None:
            engine = sa.create_engine("duckdb:///:memory:", poolclass=sa.pool.SingletonThreadPool)
            sa.event.listen(engine, "connect", self._attach)
            sa.event.listen(engine, "handle_error", self._lost_catalog)
            self._engine = engine
        return self._engine

    def _attach(self, dbapi_connection, _record) -> None:

        cursor = dbapi_connection.cursor()
        cursor.execute(f"SET extension_directory = '{quoted(cache_dir() / 'duckdb-extensions')}'")
        remote = "://" in (self.data_path or self._catalog_value("select value from ducklake_metadata where key = 'data_path'") or "")
        for name in EXTENSIONS + (("httpfs",) if remote else ()):  # object storage (s3://, https://...) through httpfs
            cursor.execute(f"INSTALL '{quoted(_extension_file(name))}'")
            cursor.execute(f"LOAD {name}")
        secret = _object_store_secret() if remote else None
        if secret is not None:
            cursor.execute(secret)
        options = ["READ_ONLY"] if self.read_only else ["DATA_INLINING_ROW_LIMIT 0"]  # rows go to Parquet, not into the catalog
        if self.data_path is not None and not self.read_only:
            options.append(f"DATA_PATH '{quoted(self.data_path.rstrip('/') + '/')}'")
        try:
            cursor.execute(f"ATTACH '{quoted(self.location)}' AS {ALIAS} ({', '.join(options)})")
        except Exception as exc:  # duckdb's own error family; its first line says what failed
            raise self._unattachable(str(exc)) from exc
        cursor.execute(f"USE {ALIAS}")
        self.connections += 1

    def _unattachable(self, message: str) -> ArchiveError:
        where = self.describe()
        if "does not exist - and creating a new DuckLake is explicitly disabled" in message:
            return ArchiveError(f"no archive at {where}; check --db (or $KVDB_DB), or create it with `kvdb ingest PATH`")
        if "data_path is not set" in message:
            return ArchiveError(f"{where} holds no archive yet: give --data-path DIR (or $KVDB_DATA_PATH) to create one there")
        if "Unable to connect to Postgres" in message:
            reason = message.split('": ', 1)[-1].strip().splitlines()[0]
            return ArchiveError(f"cannot reach the catalog of {where}: {_without_password(reason)}; start PostgreSQL, or check the conninfo in --db")
        return ArchiveError(f"cannot open archive {where}: {_without_password(message.strip().splitlines()[0])}")

    def _lost_catalog(self, context) -> None:
        """PostgreSQL gone mid-command: the transaction in hand is lost whole (a commit either
        landed or did not), and the next command reconnects by itself once the server is back."""
        message = str(context.original_exception)
        if any(sign in message for sign in UNREACHABLE_DATA):
            raise ArchiveError(
                f"cannot reach the data path of {self.describe()} ({message.strip().splitlines()[0]}); check the object store's "
                "address and the AWS_* credentials in the environment. The transaction in progress was not half-written"
            ) from context.original_exception
        if ".parquet" in message:
            raise CorruptData(
                f"a data file of {self.describe()} cannot be read ({message.strip().splitlines()[0]}); `kvdb verify` names the damaged files"
            ) from context.original_exception
        if any(sign in message for sign in LOST_CATALOG):
            raise ArchiveError(
                f"lost the catalog of {self.describe()} (PostgreSQL is down or unreachable); the transaction in progress was "
                "not half-written: run the command again when it is back (it finds what was committed)"
            ) from context.original_exception

    def release(self) -> None:
        """Nothing to let go: DuckLake takes no lock while the model works."""

    def close(self) -> None:
        if self._catalog is not None:
            self._catalog.close()
            self._catalog = None
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def held_for(self) -> float:
        return 0.0

    def version(self) -> int:
        """The lake's snapshot id: it moves with every commit of any writer. Asked of PostgreSQL
        straight through libpq, since every search asks it once (measured: 0.10 ms a round trip,
        against 2.1-3.7 ms through DuckDB, which plans a scan of the catalog each time)."""
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
                        f"cannot reach the catalog of {self.describe()}: {_without_password(str(exc).strip().splitlines()[0])}; start PostgreSQL, or check the conninfo in --db"
                    ) from exc

    def claim(self, key: str, owner: str, lease_seconds: float, steal_from: str | None = None) -> str | None:
        self.check_writable()

        def take(conn) -> str | None:
            held = conn.execute(sa.select(claims.c.owner, claims.c.until).where(claims.c.claim_key == key)).first()
            now = utc_now()
            if held is not None and held.owner not in (owner, steal_from) and held.until > now:
                return held.owner
            conn.execute(commits.update().values(n=commits.c.n + 1))
            conn.execute(claims.delete().where(claims.c.claim_key == key))
            conn.execute(claims.insert().values(claim_key=key, owner=owner, until=now + dt.timedelta(seconds=lease_seconds)))
            return None

        return self._until_no_conflict(take)

    def release_claim(self, key: str, owner: str) -> None:
        self._until_no_conflict(lambda conn: conn.execute(claims.delete().where(claims.c.claim_key == key, claims.c.owner == owner)))

    def _until_no_conflict(self, work, refused: str | None = None):
        """``work(conn)`` in a transaction, again from a fresh snapshot while another commit wins;
        with ``refused``, a conflict is a ``StaleWrite`` saying so instead (its plan is gone)."""
        while True:
            try:
                with self.engine.begin() as conn:
                    return work(conn)
            except sa.exc.DBAPIError as exc:
                if not _conflict(exc):
                    raise
                if refused is not None:
                    raise StaleWrite(refused) from exc

    def data_file_problems(self) -> list[str]:
        """Each Parquet file the catalog lists, checked where it is local: there, of the size the
        catalog recorded, and a Parquet file at both ends (a truncated or overwritten one is
        not). Damage inside a file is what reading its rows (`verify --deep`) finds."""
        problems = []
        with self.engine.connect() as conn:
            for table in [*schema.metadata.sorted_tables, commits, claims]:
                listed = conn.exec_driver_sql(
                    f"select data_file, data_file_size_bytes, delete_file, delete_file_size_bytes from ducklake_list_files('{ALIAS}', '{table.name}')"
                )
                for data_file, data_size, delete_file, delete_size in listed:
                    problems += [f"table {table.name}: {p}" for p in (_file_problem(data_file, data_size), _file_problem(delete_file, delete_size)) if p]
        return problems

    def compact_files(self) -> dict:
        """Adjacent small Parquet files merged into larger ones; then snapshots older than
        ``SNAPSHOT_RETENTION`` expired and the files scheduled for deletion before it deleted
        (a reader still scanning one is given that long: a later gc deletes what this one merged)."""
        self.check_writable()
        older = f"older_than => now() - interval '{SNAPSHOT_RETENTION}'"
        with self.engine.connect() as conn:  # the maintenance calls commit by themselves
            merged = conn.exec_driver_sql(f"call ducklake_merge_adjacent_files('{ALIAS}')").fetchall()
            conn.exec_driver_sql(f"select count(*) from ducklake_expire_snapshots('{ALIAS}', {older})").scalar_one()  # count(*): no timestamps to convert
            deleted = conn.exec_driver_sql(f"select count(*) from ducklake_cleanup_old_files('{ALIAS}', {older})").scalar_one()
        return {"data_files_merged": sum(int(r[2]) for r in merged), "data_files_written": sum(int(r[3]) for r in merged), "data_files_deleted": int(deleted)}

    def derived_path(self, suffix: str) -> Path:

        if self._lake_id is None:
            with self.engine.connect() as conn:
                self._lake_id = conn.execute(sa.select(commits.c.lake_id)).scalar_one()
        return cache_dir() / "lakes" / self._lake_id / f"archive{suffix}"

    def footprint(self) -> int:
        """The data files' bytes (the catalog's rows are counted in ``byte_counts``)."""
        with self.engine.connect() as conn:
            return int(conn.exec_driver_sql(f"select coalesce(sum(file_size_bytes), 0) from ducklake_table_info('{ALIAS}')").scalar_one())

    def describe(self) -> str:
        return _without_password(self.location)

    # writes ---------------------------------------------------------------------------
    def apply(self, plan: Plan, based_on=None) -> dict | None:
        """A plan made on a snapshot (``based_on``) is refused once another commit lands first;
        one that reads what it touches inside its transaction (registering a model, a rebuilt
        index's state, a delete) is run again from a fresh snapshot instead, which is what it
        would have done had it come second."""
        self.check_writable()

        def commit(conn) -> dict | None:
            if based_on is not None and _snapshot(conn) != based_on:  # the transaction's snapshot: what it reads
                raise StaleWrite(f"another writer committed to {self.describe()} since this write was planned; plan again")
            conn.execute(commits.update().values(n=commits.c.n + 1))
            return sql_apply.apply(conn, plan)

        refused = None if based_on is None else f"another writer committed to {self.describe()} meanwhile; plan again on a fresh snapshot"
        return self._until_no_conflict(commit, refused)

    # schema ---------------------------------------------------------------------------
    def schema_revision(self) -> str | None:
        with self.engine.connect() as conn:
            return _revision(conn)

    def _open_schema(self) -> None:
        with self.engine.begin() as conn:
            revision = _revision(conn)
            if revision == schema.REVISION:
                return
            if revision is not None:
                raise NewerArchiveError(f"{self.describe()} has schema revision {revision}; this kvdb reads {schema.REVISION} (upgrade kvdb to open it)")
            if self.read_only:
                raise ArchiveError(f"no archive at {self.describe()}; check --db (or $KVDB_DB), or create it with `kvdb ingest PATH`")
            if conn.exec_driver_sql(f"select count(*) from information_schema.tables where table_catalog = '{ALIAS}'").scalar_one():
                raise ArchiveError(f"{self.describe()} is a DuckLake but not a kvdb archive; choose another --db")
            for table in [*_keyless(schema.metadata), commits, claims]:
                conn.execute(sa.schema.CreateTable(table))
            conn.execute(commits.insert().values(lake_id=uuid.uuid4().hex, n=0))
            conn.exec_driver_sql("create table alembic_version (version_num varchar not null)")
            conn.exec_driver_sql(f"insert into alembic_version values ('{schema.REVISION}')")


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
    return int(conn.exec_driver_sql(f"select id from ducklake_current_snapshot('{ALIAS}')").scalar_one())


def _conflict(exc: sa.exc.DBAPIError) -> bool:
    return "conflict" in str(exc.orig).lower()


def _keyless(metadata: sa.MetaData) -> list[sa.Table]:
    """The schema's tables as DuckLake takes them: the same columns, no keys and no indexes."""
    bare = sa.MetaData()
    return [
        sa.Table(t.name, bare, *[sa.Column(c.name, c.type, nullable=c.nullable and not c.primary_key, server_default=c.server_default) for c in t.columns])
        for t in metadata.sorted_tables
    ]


def _revision(conn) -> str | None:
    found = conn.exec_driver_sql(
        f"select count(*) from information_schema.tables where table_catalog = '{ALIAS}' and table_name = 'alembic_version'"
    ).scalar_one()
    return conn.exec_driver_sql("select version_num from alembic_version").scalar() if found else None


def _extension_file(name: str) -> Path:
    try:
        module = importlib.import_module(f"duckdb_extension_{name}")
    except ImportError as exc:
        raise ArchiveError(f"DuckLake archives need the DuckDB extension {name}: pip install duckdb-extension-{name}==1.5.5") from exc
    assert module.__file__ is not None  # a package installed from a wheel, not a namespace
    return next(Path(module.__file__).parent.glob(f"extensions/*/{name}.duckdb_extension"))


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
