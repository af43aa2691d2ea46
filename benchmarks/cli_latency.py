"""`kvdb search --semantic` end to end: each run a fresh process, as a user's shell starts it.

    .venv/bin/python benchmarks/cli_latency.py [--runs 5] [--db PATH [--about TEXT]] [--no-results]

The archive: the chat files of examples/transcripts ingested with ``--keep
tokens,search,semantic`` by the embedded model (or ``--db``, an archive of your own, which
``--about`` describes; the chunks of its semantic tier are counted). Each
command runs ``--runs`` times in a new interpreter (the CLI's entry point, so every import
counts) and the median wall time is reported, beside the stages a profile of one run splits
it into. Every child runs with one BLAS thread (``OPENBLAS_NUM_THREADS=1``,
``OMP_NUM_THREADS=1``): the shared 2-core machines these numbers come from are loaded, and a
second BLAS thread waiting for a core there added 0.1-0.9 s to a query's forward pass.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb

sys.path.insert(0, str(Path(__file__).parent))
from report import describe, publish

ROOT = Path(__file__).resolve().parents[1]
QUERY = "how long should dough rise"
ENTRY = "import sys; from kvdb.cli.main import main; sys.argv[0] = 'kvdb'; sys.exit(main())"
ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
# the stages of a profile: (label, the file and function whose cumulative time it is)
STAGES = [
    ("imports of the CLI (kvdb, numpy, duckdb, sqlalchemy)", "kvdb/cli/main.py", "<module>"),
    ("opening the archive", "kvdb/archive.py", "open"),
    ("loading the embedder (weights, tokenizer, cached hash)", "model/embedder.py", "__init__"),
    ("the chunk index (its sidecar opened, caught up)", "services/semantic_tier.py", "get"),
    ("embedding the query", "model/embedder.py", "embed"),
]


def kvdb(db: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", ENTRY, "--db", str(db), *args], capture_output=True, text=True, env=ENV, cwd=ROOT
    )


def wall(db: Path, args: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = kvdb(db, *args)
        times.append(time.perf_counter() - start)
        if done.returncode not in (0, 1):
            raise SystemExit(f"kvdb {' '.join(args)} failed: {done.stderr}")
    return statistics.median(times)


def stages(db: Path) -> list[tuple[str, float]]:
    """One run under cProfile in a fresh process: the cumulative seconds of each stage."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "profile"
        script = (
            "import cProfile, sys; sys.argv = ['kvdb', '--db', "
            f"{str(db)!r}, 'search', '--semantic', {QUERY!r}, '-k', '3']\n"
        )
        script += f"cProfile.run({ENTRY.replace('sys.exit(main())', 'main(standalone_mode=False)')!r}, {str(out)!r})"
        subprocess.run([sys.executable, "-c", script], capture_output=True, env=ENV, cwd=ROOT, check=True)
        stats = pstats.Stats(str(out)).stats  # type: ignore[attr-defined]
    found = []
    for label, where, function in STAGES:
        found.append(
            (
                label,
                max(
                    (v[3] for (file, _, name), v in stats.items() if file.endswith(where) and name == function),
                    default=0.0,
                ),
            )
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--db", type=Path, default=None)
    parser.add_argument("--about", default="", help="what the --db archive is, said in the results")
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        db = args.db
        if db is None:
            db = Path(folder) / "small.duckdb"
            chats = sorted(
                str(p) for p in (ROOT / "examples" / "transcripts").iterdir() if p.suffix in (".json", ".jsonl")
            )
            done = kvdb(db, "ingest", *chats, "--keep", "tokens,search,semantic")
            if done.returncode != 0:
                raise SystemExit(f"ingest failed: {done.stderr}")
            kvdb(db, "upkeep", "--only", "semantic")  # ingest queues the embedder's pass (decision 0053)
        sessions = kvdb(db, "sessions", "--all", "--json").stdout.count("\n")
        with contextlib.closing(duckdb.connect(str(db), read_only=True)) as conn:
            (chunks,) = conn.execute("select count(*) from node_chunks").fetchone()  # type: ignore[misc]
        rows = [
            ("`python -c pass`", statistics.median(_python_pass() for _ in range(args.runs))),
            (f'`kvdb search "{QUERY}"` (phrases)', wall(db, ["search", QUERY, "-k", "3"], args.runs)),
            (f'`kvdb search --semantic "{QUERY}"`', wall(db, ["search", "--semantic", QUERY, "-k", "3"], args.runs)),
        ]
        split = stages(db)
    lines = [
        describe("OPENBLAS_NUM_THREADS=1, OMP_NUM_THREADS=1"),
        f"{sessions} conversations, {chunks:,} chunks in the semantic tier "
        f"""({
            args.about
            or args.db
            or "the chat files of examples/transcripts, `--keep tokens,search,semantic`, the embedded SmolLM2"
        }); """
        f"median of {args.runs} fresh processes each, wall time of the whole command.",
        "",
        "| command | p50 s |",
        "|---|---:|",
        *(f"| {name} | {seconds:.2f} |" for name, seconds in rows),
        "",
        "One `search --semantic` under cProfile (which slows it), by stage:",
        "",
        "| stage | s |",
        "|---|---:|",
        *(f"| {label} | {seconds:.2f} |" for label, seconds in split),
    ]
    publish("CLI search --semantic end to end", lines, append=not args.no_results)


def _python_pass() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True, env=ENV)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
