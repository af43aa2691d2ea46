"""What was worked out lately, remembered per owner (a tokenizer, an index): a bounded map whose
least recently used entries go first, safe across a server's threads, and held weakly by its
owner, so that a tokenizer or an index let go takes what was remembered of it along."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any


class Recent:
    def __init__(self, size: int):
        self.size = size  # entries kept per owner
        self._owners: weakref.WeakKeyDictionary[Any, OrderedDict] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, owner, keys: Sequence[Hashable]) -> list:
        """Each key's value, None where it is not remembered; those found count as used."""
        with self._lock:
            known = self._owners.setdefault(owner, OrderedDict())
            found = [known.get(key) for key in keys]
            for key, value in zip(keys, found):
                if value is not None:
                    known.move_to_end(key)
        return found

    def put(self, owner, items: Iterable[tuple[Hashable, Any]]) -> None:
        """Remember ``items`` as the latest used, forgetting the least recently used past ``size``."""
        with self._lock:
            known = self._owners.setdefault(owner, OrderedDict())
            for key, value in items:
                known[key] = value
                known.move_to_end(key)
            while len(known) > self.size:
                known.popitem(last=False)

    def count(self, owner) -> int:
        with self._lock:
            return len(self._owners.get(owner, ()))
