"""Where an archive's tables live: one :class:`Storage` of rows and plans over the engine that holds them."""

from __future__ import annotations

from pathlib import Path
from typing import TypeGuard

from kvdb.errors import ArchiveKeyError
from kvdb.storage.sql import Storage

LAKE_PREFIX = "ducklake:"


def is_lake(location) -> TypeGuard[str]:
    """A DuckLake location (``ducklake:postgres:<conninfo>``) rather than a file's path."""
    return isinstance(location, str) and location.startswith(LAKE_PREFIX)


def open_storage(
    location: str | Path,
    read_only: bool = False,
    lock_timeout: float | None = None,
    data_path: str | Path | None = None,
    key: bytes | None = None,
) -> Storage:
    """The backend for ``location``: a DuckLake for ``ducklake:...``, else a DuckDB file.
    ``key``: an encrypted archive's (``kvdb.sealing``); None for a plain one."""
    if is_lake(location):
        if key is not None:
            raise ArchiveKeyError(
                "a DuckLake archive cannot be encrypted under a key "
                "(DuckLake's ENCRYPTED mode keeps each data file's key in its catalog, "
                "in plain); unset $KVDB_KEY and drop --key-file for a lake, or keep the archive in a file"
            )
        from kvdb.storage.ducklake import DuckLake

        return Storage(DuckLake(location, data_path, read_only))
    from kvdb.storage.duckdb_file import DuckDBFile

    return Storage(DuckDBFile(location, lock_timeout, read_only, key))
