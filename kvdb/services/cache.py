"""Values derived from the tables, kept until the storage's version moves."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

from kvdb.storage import Storage

T = TypeVar("T")


class DerivedCache:
    def __init__(self, storage: Storage):
        self._storage = storage
        self._values: dict = {}
        self._version: object = None
        self._pinned: object = None

    @contextlib.contextmanager
    def pinned(self):
        """The version read once for the gets inside: the values of one answer agree with one
        another, and a lake is asked for its snapshot once (a catalog round trip each)."""
        self._pinned = self._storage.version()
        try:
            yield self._pinned
        finally:
            self._pinned = None

    def get(self, key, compute: Callable[[], T]) -> T:
        version = self._storage.version() if self._pinned is None else self._pinned
        if version != self._version:
            self._values.clear()
            self._version = version
        if key not in self._values:
            self._values[key] = compute()
        return self._values[key]
