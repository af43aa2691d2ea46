"""The user cache folder: what kvdb can build again (the converted embedded model, shipped
codebooks, fingerprints and weight hashes, DuckDB extensions, a lake's sidecars), never an
archive's own data. ``KVDB_CACHE`` moves it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kvdb.files import replace_whole


def cache_dir() -> Path:
    import platformdirs

    return Path(os.environ.get("KVDB_CACHE") or platformdirs.user_cache_dir("kvdb"))


def stamp_key(folder: Path, *extra) -> str:
    """A key that changes when a file directly in ``folder`` changes (or ``extra`` does)."""
    stamp = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
    return hashlib.sha256(json.dumps([str(folder.resolve()), stamp, *extra]).encode()).hexdigest()[:32]


def read_cached(kind: str, key: str) -> str | None:
    path = cache_dir() / kind / f"{key}.txt"
    return path.read_text().strip() if path.is_file() else None


def write_cached(kind: str, key: str, text: str) -> None:
    replace_whole(cache_dir() / kind / f"{key}.txt", text.encode())
