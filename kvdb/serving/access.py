"""The server's one Archive, used from one thread: every call is handed to that thread and
waited for. DuckDB then sees one connection in the process, calls never interleave, and a call
holds the archive only while it runs, so a read waits for at most the archive call before it,
never for generation (which runs on other threads, between archive calls)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvdb.archive import Archive

T = TypeVar("T")


class ArchiveAccess:
    def __init__(self, archive: Archive):
        self._archive = archive
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvdb-archive")
        self._calls = 0  # submitted and not finished
        self._count = threading.Lock()

    def __call__(self, call: Callable[[Archive], T]) -> T:
        with self._count:
            self._calls += 1
        try:
            return self._thread.submit(call, self._archive).result()
        finally:
            with self._count:
                self._calls -= 1

    @property
    def busy(self) -> bool:
        """Whether a call is running or waiting (a reply may choose not to wait behind it)."""
        return self._calls > 0

    def close(self) -> None:
        self(Archive.close)
        self._thread.shutdown()
