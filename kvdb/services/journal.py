"""The serve journal: each completed exchange of ``kvdb serve`` as one file, durable before its reply's last bytes
are sent, until the archive has committed it. A folder next to the archive
(``<archive>.serve/``); entries are written to a temp name, fsynced, renamed and the folder
fsynced, so an entry either exists whole or not at all, and a power cut or kill -9 after a reply
loses nothing: the next start archives what is left. Names sort by time, so replay keeps order.
Beside an encrypted archive each entry is sealed (``kvdb/sealing.py``).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from kvdb import sealing
from kvdb.errors import ArchiveError

SUFFIX = ".serve"  # the journal's folder beside the archive
FAILED = ".failed"  # an entry the archive refused, set aside (kept, never retried)


class Journal:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._count = itertools.count()

    @classmethod
    def beside(cls, derived_path: Callable[[str], Path]) -> Journal:
        """The journal of an archive whose ``derived_path`` names the files beside it: the one
        place that says where serve writes it and a forget looks for it."""
        return cls(derived_path(SUFFIX))

    def write(self, entry: dict) -> Path:
        name = f"{time.time_ns():020d}-{os.getpid()}-{next(self._count):06d}.json"
        tmp, path = self.folder / f".{name}.tmp", self.folder / name
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with sealing.writing(tmp, sync=True) as f:
                f.write(json.dumps(entry, ensure_ascii=False).encode())
            os.replace(tmp, path)
            self._sync_folder()
        except OSError as exc:  # the reply is not sent: it could not be kept
            tmp.unlink(missing_ok=True)
            raise ArchiveError(
                f"cannot write the serve journal {self.folder} ({exc.strerror or exc}); "
                "free disk space or fix its permissions"
            ) from exc
        return path

    def pending(self) -> list[Path]:
        """The entries not archived yet, oldest first; temp files of a write cut short (their
        reply was never sent) are removed."""
        if not self.folder.is_dir():
            return []
        for tmp in self.folder.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        return sorted(self.folder.glob("*.json"))

    def set_aside_entries(self) -> list[Path]:
        """The entries the archive refused, kept for a person to look at: a forget reads them too."""
        return sorted(self.folder.glob(f"*{FAILED}")) if self.folder.is_dir() else []

    @staticmethod
    def read(path: Path) -> dict:
        """``CorruptData`` for an entry that fails its authentication (an encrypted archive's)."""
        with sealing.reading(path) as f:
            return json.loads(f.read().decode("utf-8"))

    def done(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        self._sync_folder()

    def set_aside(self, path: Path) -> Path:
        aside = path.with_name(path.name + FAILED)
        os.replace(path, aside)
        return aside

    def _sync_folder(self) -> None:
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
