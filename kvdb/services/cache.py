"""Values derived from the tables, kept until the storage's version moves."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from kvdb.storage import Storage

T = TypeVar("T")


class DerivedCache:
    def __init__(self, storage: Storage):
        self._storage = storage
        self._values: dict = {}
        self._version: object = None

    def get(self, key, compute: Callable[[], T]) -> T:
        version = self._storage.version()
        if version != self._version:
            self._values.clear()
            self._version = version
        if key not in self._values:
            self._values[key] = compute()
        return self._values[key]
