"""Alembic, for the archives whose schema is behind this kvdb's: imported only then (it and
SQLAlchemy cost more than a read-only command's whole budget: decision 0031)."""

from __future__ import annotations

import importlib.util

import duckdb
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.ddl.impl import DefaultImpl
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from duckdb_engine import ConnectionWrapper

from kvdb.errors import ArchiveError, NewerArchiveError


class DuckDBImpl(DefaultImpl):
    """Alembic has no DuckDB dialect of its own; declaring this registers one (importing is enough)."""

    __dialect__ = "duckdb"
    transactional_ddl = True


def script_directory() -> tuple[ScriptDirectory, Config]:
    spec = importlib.util.find_spec("kvdb.migrations")
    assert spec is not None and spec.submodule_search_locations is not None  # a package installed with kvdb
    location = spec.submodule_search_locations[0]
    config = Config()
    config.set_main_option("script_location", location)
    return ScriptDirectory.from_config(config), config


class _Borrowed(ConnectionWrapper):
    """The storage's own DuckDB connection, lent to SQLAlchemy: closing it is the storage's."""

    def close(self) -> None:
        pass


def upgrade(raw: duckdb.DuckDBPyConnection, where: str) -> None:
    """Bring the schema on ``raw`` to the head revision in one transaction, refusing newer and
    foreign databases."""
    engine = sa.create_engine("duckdb://", creator=lambda: _Borrowed(raw), poolclass=sa.pool.StaticPool)
    try:
        with engine.begin() as conn:
            _upgrade(conn, where)
    finally:
        engine.dispose()


def _upgrade(conn: sa.Connection, where: str) -> None:
    script, config = script_directory()
    current = MigrationContext.configure(conn).get_current_revision()
    if current == script.get_current_head():
        return
    if current is not None and current not in {rev.revision for rev in script.walk_revisions()}:
        raise NewerArchiveError(
            f"{where} was written by a newer kvdb (schema revision {current}); upgrade kvdb to open it"
        )
    if current is None and sa.inspect(conn).get_table_names():
        raise ArchiveError(f"{where} is a DuckDB file but not a kvdb archive; choose another --db path")
    config.attributes["connection"] = conn
    command.upgrade(config, "head")
