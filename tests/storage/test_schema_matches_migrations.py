"""The SQLAlchemy table definitions describe the tables a fresh ``alembic upgrade head`` creates.

Both are compared as DuckDB holds them: the migrations run into one empty file, the
definitions are created (``metadata.create_all``) in another, and each file's catalog
(``duckdb_columns()``, ``duckdb_constraints()``) is read back. So types are normalised by
DuckDB itself, the way the archive stores them: ``String`` and ``Text`` are both ``VARCHAR``,
``Integer`` is ``INTEGER``, ``BigInteger`` ``BIGINT``, ``LargeBinary`` ``BLOB``, ``DateTime``
``TIMESTAMP``. Two declarations that land as one DuckDB type read and write the same values;
two that land as different types (``INTEGER`` against ``BIGINT``) do not, and fail here.
Compared per table: column names in order, types, nullability, defaults, primary key and
indexes. Alembic's own ``alembic_version`` table is left out.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

import kvdb.migrations
from kvdb.storage.schema import metadata


def catalog(path: Path) -> dict[str, dict]:
    """Per table: its columns as (name, DuckDB type, nullable, default), in order, its primary
    key, and its indexes as (name, columns)."""
    with duckdb.connect(str(path), read_only=True) as conn:
        columns = conn.execute(
            "select table_name, column_name, data_type, is_nullable, column_default from duckdb_columns() "
            "where database_name = current_database() and schema_name = 'main' order by table_name, column_index"
        ).fetchall()
        keys = dict(
            conn.execute(
                "select table_name, constraint_column_names from duckdb_constraints() "
                "where database_name = current_database() and constraint_type = 'PRIMARY KEY'"
            ).fetchall()
        )
        indexes = conn.execute(
            "select table_name, index_name, expressions from duckdb_indexes() "
            "where database_name = current_database() order by index_name"
        ).fetchall()
    tables: dict[str, dict] = {}
    for table, name, kind, nullable, default in columns:
        tables.setdefault(table, {"columns": [], "primary_key": keys.get(table, []), "indexes": []})["columns"].append(
            (name, kind, nullable, default)
        )
    for table, name, expressions in indexes:
        tables[table]["indexes"].append((name, expressions))
    tables.pop("alembic_version", None)
    return tables


@pytest.fixture(scope="module")
def schemas(tmp_path_factory) -> tuple[dict, dict]:
    """(what the migrations create, what the definitions create)."""
    folder = tmp_path_factory.mktemp("schemas")
    config = Config()
    config.set_main_option("script_location", str(Path(kvdb.migrations.__file__).parent))
    migrated = sa.create_engine(f"duckdb:///{folder / 'migrated.duckdb'}")
    with migrated.begin() as conn:
        config.attributes["connection"] = conn  # what kvdb/migrations/env.py runs on
        command.upgrade(config, "head")
    migrated.dispose()
    declared = sa.create_engine(f"duckdb:///{folder / 'declared.duckdb'}")
    metadata.create_all(declared)
    declared.dispose()
    return catalog(folder / "migrated.duckdb"), catalog(folder / "declared.duckdb")


def test_the_same_tables(schemas):
    migrated, declared = schemas
    assert sorted(declared) == sorted(metadata.tables), "the definitions did not all create their tables"
    assert sorted(migrated) == sorted(declared), (
        f"only the migrations create {sorted(set(migrated) - set(declared))}; "
        f"only the definitions {sorted(set(declared) - set(migrated))}"
    )


@pytest.mark.parametrize("table", sorted(metadata.tables))
def test_a_table_is_what_the_migrations_make_it(schemas, table):
    migrated, declared = schemas
    assert table in migrated, f"table {table} is defined but no migration creates it"
    ours, theirs = declared[table], migrated[table]
    assert ours["primary_key"] == theirs["primary_key"], (
        f"{table}: the definitions' primary key is {ours['primary_key']}, the migrations' {theirs['primary_key']}"
    )
    assert ours["indexes"] == theirs["indexes"], (
        f"{table}: the definitions' indexes are {ours['indexes']}, the migrations' {theirs['indexes']}"
    )
    differ = [(a, b) for a, b in zip(ours["columns"], theirs["columns"]) if a != b]
    assert ours["columns"] == theirs["columns"], (
        f"{table}: (name, type, nullable, default) of the definitions, then of the migrations: {differ} "
        f"(column names {[c[0] for c in ours['columns']]} against {[c[0] for c in theirs['columns']]})"
    )
