"""A file written whole or not at all: readers of a cache entry or a shipped table never see
half of one, and a killed writer leaves the last whole version where it was."""

from __future__ import annotations

import os
from pathlib import Path


def replace_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` (named by this process, so that two
    writers never share one), then rename it over ``path``; the temporary file never stays."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
