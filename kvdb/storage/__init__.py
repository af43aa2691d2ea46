"""Where an archive's tables live. One backend per engine, all behind :class:`Storage`."""

from __future__ import annotations

from pathlib import Path

from kvdb.storage.base import Storage


def open_storage(location: str | Path, read_only: bool = False, lock_timeout: float | None = None) -> Storage:
    """The backend for ``location``: today every location is a DuckDB file."""
    from kvdb.storage.duckdb_file import DuckDBFile

    return DuckDBFile(location, lock_timeout, read_only)
