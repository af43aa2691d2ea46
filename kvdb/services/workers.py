"""Ingest with several worker processes on this machine.

Each worker opens the archive and loads the model once, then takes input files from one shared
queue: a file, not a session, is the unit, since a file's sessions are checked together and
written all or nothing. On a file archive the workers compute at once and take turns with the
file's lock for their commits; on a lake they commit at once, a conflict sending the later
commit back to plan again. Workers on other machines sharing the input folder are kept off the
same file by the claims the ingester takes through the archive.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
from collections.abc import Callable, Iterable
from pathlib import Path

from kvdb.errors import InvalidArgument, TranscriptError, WorkerDied
from kvdb.records import IngestResult, IngestStatus
from kvdb.tiers import DEFAULT_KEEP, DEFAULT_KV_PRESET


def ingest_with_workers(
    location: str | Path,
    paths: Iterable[str | Path],
    workers: int,
    *,
    model: str | None = None,
    keep: str | Iterable[str] = DEFAULT_KEEP,
    kv_preset: str = DEFAULT_KV_PRESET,
    data_path: str | Path | None = None,
    progress: Callable[[int, int], None] | None = None,
    strict: bool = False,
    redact: bool = False,
    key: bytes | None = None,
) -> list[IngestResult]:
    """What ``Archive.ingest(paths)`` returns, in the order the files finish."""
    from kvdb import transcripts

    if workers < 1:
        raise InvalidArgument(f"--workers must be at least 1, got {workers}")
    results: list[IngestResult] = []
    files: list[Path] = []
    for given in paths:
        try:
            files += transcripts.find_transcript_files([given])
        except TranscriptError as exc:
            results.append(IngestResult(None, Path(given).stem, str(given), 0, IngestStatus.FAILED, str(exc)))
    files = list(dict.fromkeys(files))
    from kvdb.storage import open_storage

    # created or migrated once, before workers race to do it
    open_storage(location, data_path=data_path, key=key).close()
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch threads forked mid-use
    tasks, events = context.Queue(), context.Queue()
    for path in files:
        tasks.put(str(path))
    count = max(1, min(workers, len(files)))
    for _ in range(count):
        tasks.put(None)
    threads = max(1, (os.cpu_count() or 1) // count)  # the cores shared out: more threads than cores only contend
    # the key as the parent resolved it (b"": none), through the spawn's pipe: a --key-file's is in no environment
    args = (
        str(location),
        model,
        keep,
        kv_preset,
        None if data_path is None else str(data_path),
        threads,
        strict,
        redact,
        key or b"",
        tasks,
        events,
    )
    processes = [context.Process(target=_work, args=args, daemon=True) for _ in range(count)]
    for p in processes:
        p.start()
    running = count
    try:
        while running:
            try:
                kind, *payload = events.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise WorkerDied(
                        f"an ingest worker died (exit {dead[0].exitcode}); "
                        "what it reported is archived, run the command again for the rest"
                    ) from None
                continue
            if kind == "progress" and progress:
                progress(*payload)
            elif kind == "results":
                results += [IngestResult(**r) for r in payload[0]]
            elif kind == "error":
                raise _rebuilt(*payload)
            elif kind == "done":
                running -= 1
    finally:
        for p in processes:
            if p.is_alive():
                p.terminate()
            p.join()
    return results


def _work(
    location: str,
    model: str | None,
    keep: str | Iterable[str],
    kv_preset: str,
    data_path: str | None,
    threads: int,
    strict: bool,
    redact: bool,
    key: bytes,
    tasks,
    events,
) -> None:
    import dataclasses

    import torch

    import kvdb
    from kvdb.errors import KvdbError

    torch.set_num_threads(threads)
    try:
        with kvdb.open(location, model=model, data_path=data_path, key=key) as archive:
            while (path := tasks.get()) is not None:
                done = archive.ingest(
                    path,
                    keep=keep,
                    kv_preset=kv_preset,
                    progress=lambda d, p: events.put(("progress", d, p)),
                    strict=strict,
                    redact=redact,
                )
                events.put(("results", [dataclasses.asdict(r) for r in done]))
    except KvdbError as exc:
        events.put(("error", type(exc).__name__, str(exc)))
    finally:
        events.put(("done",))


def _rebuilt(name: str, message: str) -> Exception:
    """A worker's typed error, raised again in the parent with its message and exit code."""
    from kvdb import errors

    kind = getattr(errors, name, errors.KvdbError)
    error = kind.__new__(kind)
    Exception.__init__(error, message)
    return error
