"""What encrypting an archive costs (issue 55, item 2): ingest, search and restore, an encrypted
archive against a plain one built alike, side by side in one run.

    nice -n 10 .venv/bin/python benchmarks/encryption.py [--sessions 16] [--chars 4000] [--queries 40]
        [--restores 4] [--no-results]

Both archives take the same sessions of real text (``corpus.py``), in turns (which one goes
first alternates), with the default tiers, then the semantic tier's upkeep (the embedder's pass
and its chunk sidecar). Then, the archives in turns again: a fresh read-only open and its first
phrase search, 3 times (the sidecars read: mapped where plain, read and decrypted where
encrypted); ``--queries`` phrase searches; ``--restores`` exact restores of a session's first
``RESTORED`` tokens (its tokens read, then a prefill of the embedded model). Then `kvdb sessions`
as a process, the whole command (the key's scrypt and DuckDB's key included), 3 times. Prints a
RESULTS.md section and records it, unless ``--no-results``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cryptography
import duckdb

sys.path.insert(0, str(Path(__file__).parent))
from corpus import real_text
from report import describe, publish

import kvdb

KEY = "benchmark key: a passphrase, stretched by scrypt"
KVDB = str(Path(sys.executable).with_name("kvdb"))
SIDES = ("plain", "encrypted")
RESTORED = 256  # tokens a restore prefills: what it reads from the archive is what differs, not the model's pass


def key_of(side: str) -> str:
    return KEY if side == "encrypted" else ""  # "": plain, whatever $KVDB_KEY says


def footprint(db: Path) -> tuple[int, int]:
    """Bytes of the database file, and of every file beside it."""
    beside = [p for p in db.parent.rglob("*") if p.is_file() and p != db]
    return db.stat().st_size, sum(p.stat().st_size for p in beside)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--chars", type=int, default=4000, help="characters a session")
    parser.add_argument("--queries", type=int, default=40)
    parser.add_argument("--restores", type=int, default=4)
    parser.add_argument("--no-results", action="store_true", help="print only; do not write RESULTS.md")
    args = parser.parse_args()

    text = real_text(args.sessions * args.chars)
    texts = [text[i * args.chars : (i + 1) * args.chars] for i in range(args.sessions)]
    words = text.split()
    rng = random.Random(0)
    queries = [" ".join(words[i : i + 3]) for i in (rng.randrange(len(words) - 3) for _ in range(args.queries))]
    folder = Path(tempfile.mkdtemp(prefix="kvdb-encryption-bench-"))
    dbs = {side: folder / side / "a.duckdb" for side in SIDES}
    machine = describe(f"DuckDB {duckdb.__version__}", f"cryptography {cryptography.__version__}")
    from kvdb.model import loading

    loaded = loading.load(None)  # the embedded model, shared: its load is no archive's cost
    archives = {side: kvdb.open(dbs[side], model=loaded, key=key_of(side)) for side in SIDES}
    ingest = dict.fromkeys(SIDES, 0.0)
    tokens = dict.fromkeys(SIDES, 0)
    ids: dict[str, list[str]] = {side: [] for side in SIDES}
    for i, body in enumerate(texts):
        for side in SIDES if i % 2 == 0 else reversed(SIDES):
            began = time.perf_counter()
            [result] = archives[side].ingest(text=body, name=f"s{i:03d}")
            ingest[side] += time.perf_counter() - began
            assert result.session_id is not None, result.error
            tokens[side] += result.n_tokens
            ids[side].append(result.session_id)
    upkeep = {}
    for side in SIDES:
        began = time.perf_counter()
        archives[side].upkeep(only="semantic")
        upkeep[side] = time.perf_counter() - began
        archives[side].close()

    first: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(3):  # a fresh open each time (the key's stretch is once per process: the last row has it)
        for side in SIDES if i % 2 == 0 else reversed(SIDES):
            began = time.perf_counter()
            with kvdb.open(dbs[side], model=loaded, read_only=True, key=key_of(side)) as archive:
                archive.search(queries[0])
            first[side].append(time.perf_counter() - began)
    readers = {side: kvdb.open(dbs[side], model=loaded, read_only=True, key=key_of(side)) for side in SIDES}
    searches: dict[str, list[float]] = {side: [] for side in SIDES}
    restores: dict[str, list[float]] = {side: [] for side in SIDES}
    for i, q in enumerate(queries):
        for side in SIDES if i % 2 == 0 else reversed(SIDES):
            began = time.perf_counter()
            readers[side].search(q)
            searches[side].append(time.perf_counter() - began)
    for i in range(args.restores):
        for side in SIDES if i % 2 == 0 else reversed(SIDES):
            began = time.perf_counter()
            readers[side].restore(ids[side][i], at=RESTORED, mode="exact")
            restores[side].append(time.perf_counter() - began)
    for side in SIDES:
        readers[side].close()
    sizes = {side: footprint(dbs[side]) for side in SIDES}

    listing = {}
    env = {k: v for k, v in os.environ.items() if k not in ("KVDB_DB", "KVDB_KEY")}
    for side in SIDES:
        times = []
        for _ in range(3):
            began = time.perf_counter()
            subprocess.run(
                [KVDB, "--db", str(dbs[side]), "sessions"],
                env=env | ({"KVDB_KEY": KEY} if side == "encrypted" else {}),
                check=True,
                capture_output=True,
            )
            times.append(time.perf_counter() - began)
        listing[side] = statistics.median(times)

    def row(label: str, values: dict, unit: str = "s", digits: int = 3) -> str:
        p, e = values["plain"], values["encrypted"]
        return (
            f"| {label} | {p:.{digits}f} {unit} | {e:.{digits}f} {unit} | {e / p:.2f}x ({e - p:+.{digits}f} {unit}) |"
        )

    n = tokens["plain"]
    lines = [
        f"({machine}). Two archives of the same {args.sessions} sessions of real text ({n:,} tokens, the embedded "
        "model's tokenizer), one plain and one encrypted (`KVDB_KEY`), ingested in turns with the default tiers "
        "(tokens, search, semantic); then each one's upkeep (the semantic tier), a fresh read-only open with its first "
        f"phrase search (3 times), {args.queries} phrase searches and {args.restores} exact restores of a session's "
        f"first {RESTORED} tokens (the archives in turns, which first alternating), "
        "and `kvdb sessions` as a process (3 times, the key's scrypt included).",
        "",
        "| step | plain | encrypted | encrypted / plain |",
        "|---|---|---|---|",
        row(f"ingest, {args.sessions} sessions (total)", ingest),
        row("upkeep (semantic tier)", upkeep),
        row("open + first search, median of 3", {s: statistics.median(v) for s, v in first.items()}),
        row("phrase search, median", {s: 1000 * statistics.median(v) for s, v in searches.items()}, "ms", 2),
        row(f"exact restore of {RESTORED} tokens, median", {s: statistics.median(v) for s, v in restores.items()}),
        row("`kvdb sessions`, whole process", listing),
        row("database file", {s: v[0] / 2**20 for s, v in sizes.items()}, "MiB", 2),
        row("files beside it", {s: v[1] / 2**20 for s, v in sizes.items()}, "MiB", 2),
        "",
    ]
    publish("Encryption at rest: its cost (issue 55 item 2)", lines, append=not args.no_results)


if __name__ == "__main__":
    main()
