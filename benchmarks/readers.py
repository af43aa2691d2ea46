"""Readers beside one long ingest: does `kvdb search` keep working while `kvdb ingest` runs?

    .venv/bin/python benchmarks/readers.py [--sessions 8] [--chars 3000] [--no-results]

One `kvdb ingest` process archives a .jsonl of long real-text sessions on the embedded model
while another process runs `kvdb search` (which opens the archive read-only) back to back
until the ingest ends. DuckDB admits one writing process or several read-only ones; the
ingest holds the file only while it touches it, so each search should wait at most about a
session's commit. Reports the searches run, how many failed, their wall times (process start
included, so the tokenizer load is in them), and how many sessions each search already saw.
Writes its table to benchmarks/RESULTS.md, in place of the last run's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from corpus import real_text
from report import describe, publish

KVDB = str(Path(sys.executable).with_name("kvdb"))


def pair(env: dict) -> tuple[float, int, int]:
    """(wall seconds, search exit code, sessions listed or -1) of one `kvdb search` and one `kvdb sessions`."""
    t = time.monotonic()
    search = subprocess.run([KVDB, "search", "the", "-k", "1", "--json"], env=env, capture_output=True, text=True)
    listed = subprocess.run([KVDB, "sessions", "--all", "--json"], env=env, capture_output=True, text=True)
    return time.monotonic() - t, search.returncode, len(listed.stdout.splitlines()) if listed.returncode == 0 else -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--chars", type=int, default=3000, help="characters of real text per session")
    parser.add_argument("--no-results", action="store_true", help="print only; do not write RESULTS.md")
    args = parser.parse_args()
    corpus = real_text(args.sessions * args.chars + 50_000)[50_000:]
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, KVDB_DB=str(Path(tmp) / "readers.duckdb"))
        seed = Path(tmp) / "seed.txt"
        seed.write_text("A first session, so that searches have an archive: the harbour lights at dusk.\n")
        subprocess.run([KVDB, "ingest", str(seed)], env=env, check=True, capture_output=True)
        batch = Path(tmp) / "batch.jsonl"
        with batch.open("w") as f:
            for i in range(args.sessions):
                text = corpus[i * args.chars : (i + 1) * args.chars]
                f.write(json.dumps({"name": f"long{i}", "messages": [{"role": "user", "content": text}]}) + "\n")
        idle = [pair(env)[0] for _ in range(3)]  # the same pair with nothing else running
        started = time.monotonic()
        writer = subprocess.Popen(
            [KVDB, "ingest", str(batch), "--json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        searches = []  # (wall seconds, exit code, sessions seen)
        while writer.poll() is None:
            searches.append(pair(env))
        ingest_seconds = time.monotonic() - started
        ingested = [json.loads(line) for line in writer.stdout.read().splitlines()]
    walls = [s[0] for s in searches]
    failed = [s for s in searches if s[1] not in (0, 1) or s[2] < 0]
    seen = sorted({s[2] for s in searches})
    lines = [
        f"Run at {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC. "
        f"`{' '.join(['.venv/bin/python', 'benchmarks/readers.py', *sys.argv[1:]])}` — {describe()}; "
        f"SmolLM2-135M-Instruct; one `kvdb ingest` of {args.sessions} sessions "
        f"({sum(r['n_tokens'] for r in ingested):,} tokens) while another process runs `kvdb search` then `kvdb "
        "sessions` back to back. Wall times include each process's start and tokenizer load.\n",
        "| ingest s (incl. model load) | search + sessions pairs | failed | wall s per pair, median / max | same "
        "pair, idle machine (median of 3) | sessions seen by the readers |",
        "|---:|---:|---:|---:|---:|---|",
        f"| {ingest_seconds:.1f} | {len(searches)} | {len(failed)} | {statistics.median(walls):.2f} / {max(walls):.2f} "
        f"| {statistics.median(idle):.2f} | {', '.join(map(str, seen))} |",
    ]
    publish("Readers beside one long ingest", lines, append=not args.no_results)


if __name__ == "__main__":
    main()
