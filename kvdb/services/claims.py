"""Claims on input files, where workers on other machines may share the input folder (a lake):
a file is claimed while it is archived, renewed after each session, so that they pass it by.
A file archive claims nothing, and so reads no file a second time to name its claim."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from kvdb.storage import Storage

CLAIM_LEASE_SECONDS = 600.0  # a claim outlives a dead worker by this long at most; renewed after each session


class InputClaims:
    def __init__(self, storage: Storage):
        self._storage = storage
        self.owner = f"{socket.gethostname()}:{os.getpid()}"  # who holds this process's claims

    @property
    def needed(self) -> bool:
        return self._storage.claims_inputs

    @contextlib.contextmanager
    def held(self, path: Path, keep: frozenset[str]) -> Iterator[tuple[str | None, Callable[[], object] | None]]:
        """(None, renew) while this process holds the claim on ``path`` for ``keep``; (the
        holder, None) when another live worker does. ``renew()`` extends the lease."""
        key = _claim_key(path, keep)
        holder = self._storage.claim(key, self.owner, CLAIM_LEASE_SECONDS)
        if holder is not None and _gone_from_here(holder):  # a worker of this machine that died holding it
            holder = self._storage.claim(key, self.owner, CLAIM_LEASE_SECONDS, steal_from=holder)
        if holder is not None:
            yield holder, None
            return
        try:
            yield None, lambda: self._storage.claim(key, self.owner, CLAIM_LEASE_SECONDS)
        finally:
            self._storage.release_claim(key, self.owner)


def _gone_from_here(owner: str) -> bool:
    """Whether a claim's owner (host:pid) is a process of this machine that no longer runs."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _claim_key(path: Path, keep: frozenset[str]) -> str:
    """A file's content and the tiers asked for: the same file under another mount point is the
    same claim; the same file ingested for other tiers is another."""
    digest = hashlib.sha256(",".join(sorted(keep)).encode() + b"\0")
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
