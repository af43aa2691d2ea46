"""What differs between the engines an archive's tables live in: the small protocol under the
one repository of reads and plans (:class:`kvdb.storage.sql.Storage`).

Both engines are DuckDB: a file, or DuckLake attached to an in-memory DuckDB (catalog in
PostgreSQL, data in Parquet files). So the SQL is shared whole, and an engine says only how
to reach a connection and how its files, locks and commits behave.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb

from kvdb.errors import ArchiveError
from kvdb.storage.base import hold_seconds
from kvdb.user_cache import cache_dir

# DuckDB's Python client looks for pandas six times a statement (to tell a DataFrame parameter),
# and where pandas is not installed each look is a failed import through every sys.path entry:
# a large share of an ingest's time in the database (decision 0053). Marked absent once, the
# look costs nothing; where pandas is installed nothing changes.
if importlib.util.find_spec("pandas") is None:
    sys.modules.setdefault("pandas", None)  # type: ignore[arg-type]

# The migration the tables of kvdb.storage.schema correspond to, the head of kvdb/migrations/versions:
# an archive at it opens without importing alembic or SQLAlchemy.
REVISION = "0014"


class Engine(abc.ABC):
    """Where the tables live. The repository calls ``connection()`` for every read and
    ``write(work)`` for every plan; everything else here is about files and locks."""

    read_only: bool
    claims_inputs = False  # whether workers on other machines may share its input files, which are then claimed

    @abc.abstractmethod
    def connection(self) -> duckdb.DuckDBPyConnection:
        """The connection, made if there is none (a file's lock is taken, a lake attached)."""

    @abc.abstractmethod
    def write(self, work: Callable[[duckdb.DuckDBPyConnection], Any], based_on=None) -> Any:
        """``work(conn)`` in one write transaction, committed whole. ``based_on``: the
        ``version()`` the work was planned at; if anything was committed since, it is refused
        with ``StaleWrite`` (plan again), however the engine admits writers."""

    def batch(self) -> contextlib.AbstractContextManager:
        """Writes that share one transaction: an ingest's sessions of one source. An engine
        whose writers conflict per commit (a lake) commits each write alone."""
        return contextlib.nullcontext()

    @property
    def batching(self) -> bool:
        """Whether writes now share a transaction (``batch``) that commits later."""
        return False

    def after_commit(self, then: Callable[[], None], undo: Callable[[], None] | None = None) -> None:
        """Call ``then`` once what was written so far is committed (at once outside a batch), or
        ``undo`` if it is rolled back: derived data follows only what the database holds."""
        then()

    def after_batch(self, then: Callable[[], None]) -> None:
        """Call ``then`` when the batch ends, committed or not (at once outside a batch)."""
        then()

    def reading(self) -> contextlib.AbstractContextManager[duckdb.DuckDBPyConnection]:
        """A connection for the statements of one read, which see one snapshot."""
        return transaction(self.connection())

    @abc.abstractmethod
    def version(self) -> object:
        """A value that changes whenever what this process read may be stale: after its own
        writes, and after any other process may have written."""

    @abc.abstractmethod
    def release(self) -> None:
        """Hand back the engine's lock (if it has one) until the next call needs it."""

    @abc.abstractmethod
    def held_for(self) -> float:
        """Seconds the current hold of the lock has lasted (0 when not held)."""

    def hold_seconds(self) -> float:
        """How long a hold may last before short work lets go (``base.hold_seconds``)."""
        return hold_seconds(0.0)

    def wanted(self) -> bool:
        """Whether another process waits for the lock: a hold past its time is let go only
        then. An engine that cannot tell says it does."""
        return True

    def keep(self) -> None:
        """Commit what the batch wrote so far and hold on (nobody waits); an engine that
        cannot hold on lets go."""
        self.release()

    @abc.abstractmethod
    def close(self) -> None: ...

    def explain(self, exc: duckdb.Error) -> Exception | None:
        """An error DuckDB raised in the engine's own terms (a catalog gone, a data file
        unreadable), or None to let it through."""
        return None

    @abc.abstractmethod
    def compact_files(self, forget: bool = False, now: bool = False) -> dict:
        """Merge the engine's small files (a lake's commits leave some Parquet files each, which
        every scan opens) or give its free space back; delete what no snapshot in use reads;
        what it did, in counts. ``forget``: rows were deleted since the last gc, and no byte of
        them may stay in a file (free pages, replaced data files); ``now``: without waiting for
        readers of older snapshots."""

    @abc.abstractmethod
    def data_file_problems(self) -> list[str]:
        """The files holding the archive's rows that are missing or damaged, each named, for an
        engine whose rows live in files of their own (a lake's Parquet files)."""

    @abc.abstractmethod
    def derived_path(self, suffix: str) -> Path:
        """Where a file or folder derived from the archive lives (".index", ".prefix")."""

    @abc.abstractmethod
    def footprint(self) -> int:
        """Bytes the engine takes on disk for the tables (pages and overhead included)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The archive's location, as error messages name it."""

    def claim(self, key: str, owner: str, lease_seconds: float, steal_from: str | None = None) -> str | None:
        """Take (or renew) the claim on ``key`` (an input file) for ``owner`` until the lease
        ends: None when taken, else the owner who holds it (unless it is ``steal_from``, known
        dead). Where workers on many machines share one input folder, this is how each file
        goes to one of them; an engine of one machine (``claims_inputs`` False) has none."""
        raise NotImplementedError(f"{type(self).__name__} does not claim input files")

    def release_claim(self, key: str, owner: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not claim input files")


@contextlib.contextmanager
def transaction(conn: duckdb.DuckDBPyConnection):
    """One transaction on ``conn``: committed when the block ends, rolled back when it raises."""
    conn.begin()
    try:
        yield conn
    except BaseException:
        with contextlib.suppress(duckdb.Error):  # a connection DuckDB already gave up on has nothing to roll back
            conn.rollback()
        raise
    conn.commit()


def revision(conn: duckdb.DuckDBPyConnection, catalog: str | None = None) -> str | None:
    """The schema revision alembic recorded (without alembic: its import alone would cost a
    read-only command most of its time); None where no ``alembic_version`` table exists."""
    where = "table_name = 'alembic_version'" + (f" and table_catalog = '{quoted(catalog)}'" if catalog else "")
    (found,) = conn.execute(f"select count(*) from information_schema.tables where {where}").fetchone()  # type: ignore[misc]
    row = conn.execute("select version_num from alembic_version").fetchone() if found else None
    return None if row is None else row[0]


def load_extensions(cursor: duckdb.DuckDBPyConnection, names) -> None:
    """DuckDB extensions installed from their wheels (duckdb-extension-NAME: DuckDB cannot
    download here) into kvdb's cache folder, and loaded into ``cursor``'s database."""
    cursor.execute(f"SET extension_directory = '{quoted(cache_dir() / 'duckdb-extensions')}'")
    for name in names:
        cursor.execute(f"INSTALL '{quoted(_extension_file(name))}'")
        cursor.execute(f"LOAD {name}")


def _extension_file(name: str) -> Path:
    try:
        module = importlib.import_module(f"duckdb_extension_{name}")
    except ImportError as exc:
        raise ArchiveError(
            f"this archive needs the DuckDB extension {name}: pip install duckdb-extension-{name}=={duckdb.__version__}"
        ) from exc
    assert module.__file__ is not None  # a package installed from a wheel, not a namespace
    return next(Path(module.__file__).parent.glob(f"extensions/*/{name}.duckdb_extension"))


def quoted(text) -> str:
    """A value inside a SQL string literal, for the statements DuckDB takes no parameters in (ATTACH, SET)."""
    return str(text).replace("'", "''")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
