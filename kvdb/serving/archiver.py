"""Archiving the journal's exchanges off the response path.

The entries a previous run left over are archived at start, before the server answers (so a
conversation resumes from them at once); then a thread of its own takes each new entry, oldest
first, when no request has used the model for a moment (``ModelGate``), and ingests it with
the server's tiers and with the pass generation made over it (``Computed``): the model runs
again only over what the chat template adds after the reply, so no request waits for it (the
model is held only for an exchange computed whole: one replayed from the journal, or one kept
with tier L or K), and the ingest keeps the exchange's exact cache in the prefix cache. Only then is the entry deleted:
whenever the process dies, an exchange is in the journal, in the archive, or both (archiving it again then
finds it archived). An entry that fails for a reason other than the archive refusing it (a
full disk, say) stays in the journal and is tried again while the server is idle, after 1 s,
then twice as long each time (up to a minute). On stop it finishes the entry in hand and leaves the rest to the
next start. Idle, it does the work ingest queues (the semantic tier, the model's pass: ``kvdb upkeep``), a session
at a time.

An exchange an upstream server answered (``kvdb serve --upstream``, ``relay.py``) is ingested
with no computed pass: with the server's tiers and its exact cache where the upstream named the
archive's own model, else from the archive's tokenizer alone, without tier K or an exact cache
(the KV of a model that did not write it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

from kvdb.errors import KvdbError
from kvdb.services.journal import Journal
from kvdb.services.write_compute import Computed
from kvdb.serving.access import ArchiveAccess
from kvdb.serving.gate import ModelGate
from kvdb.tiers import Tier, parse_keep

log = logging.getLogger("kvdb.serve")
HANDED_OVER = 4  # exchanges waiting with generation's cache in memory (up to ~46 KB a token each for SmolLM2)
UPKEEP_AFTER_S = 2.0  # with no exchange to archive this long, the archiver does the archive's queued work
RETRY_AFTER_S = (1.0, 60.0)  # an entry that failed is tried again after the first, doubling up to the second


class Archiver:
    def __init__(
        self,
        journal: Journal,
        access: ArchiveAccess,
        gate: ModelGate,
        keep: str,
        kv_preset: str,
    ):
        self._journal = journal
        self._access = access
        self._gate = gate
        self._keep = keep
        self._kv_preset = kv_preset
        # tier L codes, and tier K quantizes, with the model
        self._keep_runs_model = bool(parse_keep(keep) & {"lm", "kv"})
        self._queue: queue.Queue[tuple[Path, Computed | None] | None] = queue.Queue()
        self._retry: dict[Path, tuple[float, float]] = {}  # entry -> (when to try it again, the wait after that)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvdb-archiver", daemon=True)

    def start(self) -> None:
        for path in self._journal.pending():
            self._archive_safely(path)
        self._thread.start()

    def submit(self, path: Path, computed: Computed | None = None) -> None:
        """Archive the entry at ``path``, with generation's pass over it (held in memory only for
        the first HANDED_OVER entries waiting: past those, an entry's pass is made again)."""
        self._queue.put((path, computed if self._queue.qsize() < HANDED_OVER else None))

    def stop(self) -> None:
        self._stopping.set()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            wait = min([UPKEEP_AFTER_S, *(max(0.0, at - time.monotonic()) for at, _ in self._retry.values())])
            try:
                task = self._queue.get(timeout=wait)
            except queue.Empty:
                self._retry_due()
                if wait == UPKEEP_AFTER_S:
                    self._upkeep_while_idle()
                continue
            if task is None:
                break
            self._archive_safely(*task)

    def _upkeep_while_idle(self) -> None:
        """The archive's queued work (``kvdb upkeep``: embedding, the model's pass), a session at
        a time, while no exchange waits and no request wants the model: a request waits for the
        session in hand at most, and a read for one archive call."""
        while not self._stopping.is_set() and self._queue.empty():
            try:
                with self._gate.held():
                    report = self._access(lambda a: a.upkeep(limit=1))
            except Exception:  # the queue stays for the next idle moment, or `kvdb upkeep`
                log.exception("upkeep in the server's idle time failed; the work stays queued")
                return
            if not (report.embedded.sessions or report.scored.sessions):
                return

    def _retry_due(self) -> None:
        now = time.monotonic()
        for path in [p for p, (at, _) in self._retry.items() if at <= now]:
            if not path.exists():  # archived or set aside meanwhile (a restart of another server over the archive)
                self._retry.pop(path)
            elif not self._stopping.is_set() and self._queue.empty():
                self._archive_safely(path)

    def _archive_safely(self, path: Path, computed: Computed | None = None) -> None:
        _, after = self._retry.pop(path, (0.0, RETRY_AFTER_S[0]))
        try:
            self._archive(path, computed)
        # the archive refuses it, or it is no entry: retrying cannot help
        except (KvdbError, ValueError, KeyError) as exc:
            log.error("journal entry %s set aside as %s: %s", path.name, self._journal.set_aside(path).name, exc)
        except Exception:  # the worker outlives one bad entry, which stays in the journal, tried again later
            self._retry[path] = (time.monotonic() + after, min(2 * after, RETRY_AFTER_S[1]))
            log.exception(
                "archiving journal entry %s failed; it stays in the journal, tried again in %.0f s "
                "and at the next start",
                path.name,
                after,
            )

    def _archive(self, path: Path, computed: Computed | None) -> None:
        entry = self._journal.read(path)
        source = {entry["kind"]: entry["content"]}
        upstream = entry.get("upstream")  # relayed from an upstream server: no pass of ours over it
        foreign = upstream is not None and not upstream.get("same_model")
        keep = ",".join(sorted(parse_keep(self._keep) - {Tier.KV})) if foreign else self._keep
        # The whole exchange to compute: requests wait for the model meanwhile. Else the model runs
        # over the template's closing tokens only, and no request waits for that.
        whole = computed is None or self._keep_runs_model
        with self._gate.held() if whole else self._gate.idle():
            self._access(
                lambda a: a.ingest(
                    **source,
                    name=entry["name"],
                    keep=keep,
                    kv_preset=self._kv_preset,
                    computed=computed,
                    keep_cache=not foreign,
                    conversation=entry.get("conversation"),  # an entry an older kvdb journalled has none
                    upstream=upstream,
                )
            )
        self._journal.done(path)
