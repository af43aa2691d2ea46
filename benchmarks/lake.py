"""An archive on DuckLake against one in a file, side by side in one run:

- ingest throughput of 1, 2 and 4 workers (`kvdb ingest --workers N`) on a lake, against one
  process on a file, with the embedded model (CPU-bound model work); and one worker held to one
  thread, since one process already uses both cores of 2 through torch's threads, while each of
  N workers gets cores/N;
- search p50/p95 at 1e6 archived tokens (``--scales 1e6,1e7`` for more), the lake a `kvdb copy`
  of the file, the queries interleaved between the two;
- the storage bytes per token of each: the file; the lake's Parquet files and its catalog;
- with ``--parts machines``: two machines (two cache folders) on one lake of
  ``--machines-scale`` tokens, each committing sessions the other then finds, their hits
  checked against a file archive given the same sessions.

    .venv/bin/python benchmarks/lake.py [--files 24] [--words 400] [--scales 1e6] [--queries 60]
        [--parts ingest,search,machines] [--machines-scale 1e8] [--no-results]

PostgreSQL is a cluster of the benchmark's own (tests/postgres.py: a temporary folder, a unix
socket, removed after). Appends a section to benchmarks/RESULTS.md unless ``--no-results``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from corpus import real_text  # noqa: E402
from postgres import Cluster  # noqa: E402
from report import describe, publish  # noqa: E402
from search import build_archive  # noqa: E402

import kvdb  # noqa: E402
from kvdb.model import tokenizer as tok  # noqa: E402
from kvdb.storage import open_storage  # noqa: E402
from kvdb.user_cache import cache_dir  # noqa: E402

KVDB = Path(sys.executable).with_name("kvdb")
SESSION_TOKENS = 4000


def ingest_runs(cluster: Cluster, folder: Path, tmp: Path, workers: list[int]) -> list[dict]:
    """One `kvdb ingest` per configuration, each into a new archive, timed whole (model loads included)."""
    plans = [("file", 1, str(tmp / "ingest.duckdb"), {})]
    # what one core does: workers' scaling
    plans += [("lake, 1 thread", 1, f"ducklake:postgres:{cluster.new_database()}", {"OMP_NUM_THREADS": "1"})]
    plans += [("lake", n, f"ducklake:postgres:{cluster.new_database()}", {}) for n in workers]
    rows = []
    for i, (backend, n, where, env) in enumerate(plans):
        began = time.perf_counter()
        out = subprocess.run(
            [
                str(KVDB),
                "--db",
                where,
                "--data-path",
                str(tmp / f"data-{i}"),
                "ingest",
                "--workers",
                str(n),
                str(folder),
                "--json",
            ],
            capture_output=True,
            text=True,
            check=True,
            env=dict(os.environ, **env),
        )
        seconds = time.perf_counter() - began
        results = [json.loads(line) for line in out.stdout.splitlines()]
        tokens = sum(r["n_tokens"] for r in results if r["status"] == "ingested")
        busy = sum(r.get("seconds", 0.0) for r in results)  # each session's own time: model work and its commit
        rows.append(
            {
                "backend": backend,
                "workers": n,
                "seconds": seconds,
                "tokens": tokens,
                "sessions": len(results),
                "tok_s": tokens / seconds,
                "busy": busy,
            }
        )
        print(f"ingest {backend} x{n}: {seconds:.1f} s, {tokens / seconds:.0f} tok/s", file=sys.stderr, flush=True)
    return rows


SCORING = """
import sys, time, numpy as np, torch
from kvdb.model import loading as model, tokenizer as tok
loaded = model.load(None)
ids = np.asarray(tok.encode(loaded.tokenizer, sys.argv[1]), dtype=np.int64)
model.score(loaded.model, ids[:64])
began, n = time.perf_counter(), 0
while time.perf_counter() - began < float(sys.argv[2]):
    model.score(loaded.model, ids)
    n += len(ids)
print(n / (time.perf_counter() - began))
"""


def core_scaling(text: str, seconds: float = 30.0) -> tuple[float, float]:
    """What the cores allow: the model's scoring pass (what ingest spends its time on), tokens/s
    of one process on one thread alone, and of two such processes at once (summed)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-c", SCORING, text, str(seconds)]
    one = float(subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout)
    pair = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    return one, sum(float(p.communicate()[0]) for p in pair)


def model_load_seconds() -> float:
    began = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "from kvdb.model import loading; loading.load(None)"], check=True, capture_output=True
    )
    return time.perf_counter() - began


def search_scale(cluster: Cluster, n_tokens: int, ids: np.ndarray, queries: list[str], tmp: Path) -> dict:
    sessions = [ids[i : i + SESSION_TOKENS] for i in range(0, n_tokens - SESSION_TOKENS + 1, SESSION_TOKENS)]
    path = tmp / f"search-{n_tokens}.duckdb"
    tok_hash = tok.fingerprint(tok.load(None))
    build_archive(path, tok_hash, sessions)
    where = f"ducklake:postgres:{cluster.new_database()}"
    open_storage(where, data_path=tmp / f"search-data-{n_tokens}").close()
    empty_catalog = catalog_bytes(where)  # an empty lake's catalog: PostgreSQL's own tables and DuckLake's
    began = time.perf_counter()
    with kvdb.open(path, read_only=True) as file:
        file.copy_to(where, data_path=tmp / f"search-data-{n_tokens}")
    copy_s = time.perf_counter() - began
    times = {"file": [], "lake": []}
    with kvdb.open(path, read_only=True) as file, kvdb.open(where, read_only=True) as lake:
        began = time.perf_counter()
        lake.search(queries[0], k=10)  # this machine's sidecar is built from the lake's rows, once
        first_s = time.perf_counter() - began
        file.search(queries[0], k=10)
        for q in queries:
            for name, archive in (("file", file), ("lake", lake)):
                t = time.perf_counter()
                hits = archive.search(q, k=10)
                times[name].append(time.perf_counter() - t)
            assert [h.to_dict() for h in file.search(q, k=10)] == [h.to_dict() for h in hits], q
    catalog = catalog_bytes(where) - empty_catalog
    store = open_storage(where, read_only=True)
    try:
        parquet = store.footprint()
    finally:
        store.close()
    total = len(sessions) * SESSION_TOKENS
    return {
        "tokens": total,
        "file_p50": pct(times["file"], 50),
        "file_p95": pct(times["file"], 95),
        "lake_p50": pct(times["lake"], 50),
        "lake_p95": pct(times["lake"], 95),
        "copy_s": copy_s,
        "first_s": first_s,
        "file_bpt": path.stat().st_size / total,
        "parquet_bpt": parquet / total,
        "catalog_bpt": catalog / total,
    }


def machines_scale(
    cluster: Cluster, n_tokens: int, ids: np.ndarray, texts: list[str], queries: list[str], tmp: Path
) -> dict:
    """Two machines on one lake of ``n_tokens``: each keeps its own copy of the search index (its
    own cache folder), commits new sessions in turn, and searches the other's; a file archive
    given the same sessions answers every query alike."""
    sessions = [ids[i : i + SESSION_TOKENS] for i in range(0, n_tokens - SESSION_TOKENS + 1, SESSION_TOKENS)]
    path = tmp / f"machines-{n_tokens}.duckdb"
    build_archive(path, tok.fingerprint(tok.load(None)), sessions)
    where, data_path = f"ducklake:postgres:{cluster.new_database()}", tmp / f"machines-data-{n_tokens}"
    began = time.perf_counter()
    with kvdb.open(path, read_only=True) as file:
        file.copy_to(where, data_path=data_path)
    copy_s = time.perf_counter() - began
    models = cache_dir() / "models"  # the converted embedded model, shared: not what is measured
    machines, out = {}, {"tokens": len(sessions) * SESSION_TOKENS, "copy_s": copy_s, "rounds": []}
    with kvdb.open(path) as file:
        for name in ("a", "b"):
            cache = tmp / f"cache-{name}"
            cache.mkdir()
            (cache / "models").symlink_to(models, target_is_directory=True)
            os.environ["KVDB_CACHE"] = str(cache)  # read when an archive opens: each machine's index folder
            machines[name] = kvdb.open(where, data_path=data_path)
            began = time.perf_counter()
            machines[name].search(queries[0], k=10)  # this machine's copy of the index, built from the lake's rows
            out[f"{name}_first_s"] = time.perf_counter() - began
        try:
            for i, text in enumerate(texts):
                writer, reader = ("a", "b") if i % 2 == 0 else ("b", "a")
                # the lake holds the real text already, tiled: a phrase only the new session holds
                phrase = f"commit marker {i}{writer}zq"
                text = f"{phrase}. {text}"
                began = time.perf_counter()
                machines[writer].ingest(text=text, name=f"new-{i}")
                ingest_s = time.perf_counter() - began
                file.ingest(text=text, name=f"new-{i}")
                began = time.perf_counter()
                hits = machines[reader].search(phrase, k=10)  # catches up with the writer's commit first
                catch_up_s = time.perf_counter() - began
                assert [h.name for h in hits if h.exact] == [f"new-{i}"], (phrase, [h.to_dict() for h in hits])
                compared = 0
                for q in [phrase, *queries]:
                    expected = [h.to_dict() for h in file.search(q, k=10)]
                    for machine in machines.values():
                        assert [h.to_dict() for h in machine.search(q, k=10)] == expected, (q, writer)
                    compared += 1
                out["rounds"].append(
                    {"writer": writer, "ingest_s": ingest_s, "catch_up_s": catch_up_s, "compared": compared}
                )
                print(f"machines at {n_tokens:.0e}: {out['rounds'][-1]}", file=sys.stderr, flush=True)
        finally:
            for machine in machines.values():
                machine.close()
    return out


def catalog_bytes(where: str) -> int:
    store = open_storage(where, read_only=True)
    try:
        (size,) = (
            store.engine.connection()
            .execute(
                "select * from postgres_query('__ducklake_metadata_lake', "
                "'select pg_database_size(current_database())')"
            )
            .fetchone()
        )
        return int(size)
    finally:
        store.close()


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=24)
    parser.add_argument("--words", type=int, default=400)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--scales", default="1e6")
    parser.add_argument("--queries", type=int, default=60)
    parser.add_argument(
        "--parts",
        default="ingest,search",
        help="which parts to run (ingest, search, machines): a part alone for a rerun",
    )
    parser.add_argument(
        "--machines-scale", default="1e6", help="archived tokens of the machines part (two machines, one lake)"
    )
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    workers = [int(w) for w in args.workers.split(",")]
    scales = [int(float(s)) for s in args.scales.split(",")]
    words = real_text(max(args.files * args.words * 8, 12_000_000)).split()
    rng = np.random.default_rng(0)
    cluster = Cluster().start()
    try:
        with tempfile.TemporaryDirectory() as folder:
            tmp = Path(folder)
            inputs = tmp / "inputs"
            inputs.mkdir()
            for i in range(args.files):
                (inputs / f"s{i:03}.txt").write_text(" ".join(words[i * args.words : (i + 1) * args.words]))
            load_s = model_load_seconds() if "ingest" in parts else 0.0
            ingest = ingest_runs(cluster, inputs, tmp, workers) if "ingest" in parts else []
            ceiling = core_scaling(" ".join(words[: args.words])) if "ingest" in parts else None
            tokenizer = tok.load(None)
            ids = np.asarray(tok.encode(tokenizer, " ".join(words)), dtype=np.int64)
            queries = []
            while len(queries) < args.queries:
                at = int(rng.integers(0, len(words) - 4))
                queries.append(" ".join(words[at : at + int(rng.integers(2, 5))]))
            searches = []
            for n in scales if "search" in parts else []:
                if len(ids) < n:
                    ids = np.tile(ids, n // len(ids) + 1)  # past the real text: it again (the index sees repeats)
                searches.append(search_scale(cluster, n, ids, queries, tmp))
                print(f"search at {n:.0e}: {searches[-1]}", file=sys.stderr, flush=True)
            machines = None
            if "machines" in parts:
                n = int(float(args.machines_scale))
                if len(ids) < n:
                    ids = np.tile(ids, n // len(ids) + 1)
                texts = [" ".join(words[-(i + 1) * args.words : len(words) - i * args.words]) for i in range(4)]
                machines = machines_scale(cluster, n, ids, texts, queries, tmp)
    finally:
        cluster.stop()
    command = (
        f"Command: `.venv/bin/python benchmarks/lake.py --files {args.files} --words {args.words} --workers "
        f"{args.workers} --scales {args.scales} --queries {args.queries} --parts {args.parts} --machines-scale "
        f"{args.machines_scale}`. PostgreSQL 15 on a unix socket on this machine; Parquet files on local disk."
    )
    # each part's section has a heading of its own: a rerun of one part replaces its section alone
    if ingest or searches:
        lines = [describe(), "", command, ""]
        lines += ingest_table(args, load_s, ingest, ceiling) if ingest else []
        lines += search_table(args, searches) if searches else []
        publish("DuckLake against a file", lines, append=not args.no_results)
    if machines:
        publish(
            "Two machines on one lake",
            [describe(), "", command, "", *machines_table(args, machines)],
            append=not args.no_results,
        )


def ingest_table(args, load_s: float, ingest: list[dict], ceiling: tuple[float, float]) -> list[str]:
    one = next(r for r in ingest if r["backend"] == "lake" and r["workers"] == 1)
    thread = next(r for r in ingest if r["backend"] == "lake, 1 thread")
    two = next((r for r in ingest if r["backend"] == "lake" and r["workers"] == 2), None)
    return [
        f"Ingest: {args.files} files of {args.words} words of real text, embedded model, default tiers; wall time of "
        f"the whole `kvdb ingest` (each worker loads the model: {load_s:.1f} s for one process).",
        "",
        "| archive | workers | seconds | tokens | tokens/s | vs 1 worker "
        "on the lake | sessions' own s, summed (model work and commits) |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['backend']} | {r['workers']} | {r['seconds']:.1f} | {r['tokens']} | {r['tok_s']:.0f} | "
            f"{r['tok_s'] / one['tok_s']:.2f}x | {r['busy']:.1f} |"
            for r in ingest
        ),
        "",
        *([f"2 workers against 1 worker held to one thread: {two['tok_s'] / thread['tok_s']:.2f}x."] if two else []),
        f"What the cores allow: the model's scoring pass on one thread, {ceiling[0]:.0f} tokens/s in one process "
        f"alone, {ceiling[1]:.0f} in two processes at once ({ceiling[1] / ceiling[0]:.2f}x).",
        "",
    ]


def search_table(args, searches: list[dict]) -> list[str]:
    return [
        f"Search: {args.queries} phrases of 2-4 words from the text, k=10, file and lake queried in turn; sessions of "
        f"{SESSION_TOKENS} tokens; the lake is a `kvdb copy` of "
        "the file, and every query's hits are checked equal on both.",
        "",
        "| tokens | file p50 ms | file p95 ms | lake p50 ms | lake p95 ms | lake / file "
        "p50 | copy s | lake's first search s (this machine's copy of the index built) | "
        "file B/token | lake Parquet B/token | lake catalog B/token (over an empty lake's) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {s['tokens']:.0e} | {s['file_p50'] * 1e3:.1f} | {s['file_p95'] * 1e3:.1f} | {s['lake_p50'] * 1e3:.1f} "
            f"| {s['lake_p95'] * 1e3:.1f} | {s['lake_p50'] / s['file_p50']:.2f}x | {s['copy_s']:.1f} | "
            f"{s['first_s']:.1f} | {s['file_bpt']:.2f} | {s['parquet_bpt']:.2f} | {s['catalog_bpt']:.2f} |"
            for s in searches
        ),
        "",
    ]


def machines_table(args, m: dict) -> list[str]:
    return [
        f"Two machines on one lake of {m['tokens']:,} archived tokens (`--parts machines --machines-scale "
        f"{args.machines_scale}`): a `kvdb copy` of a file archive ({m['copy_s']:.0f} s), then machines a and b, each "
        f"with its own cache folder and so its own copy of the search index. They ingest {len(m['rounds'])} texts of "
        f"{args.words} words in turn (embedded model), the same texts go into the file archive, and after each commit "
        "the other machine searches a phrase only the new session holds (its first search catches its copy up with the "
        "commit). Both machines' hits equal the file's on every query, checked after each commit.",
        "",
        "Each machine's first search (its copy of the index built from the "
        f"lake's rows): a {m['a_first_s']:.1f} s, b {m['b_first_s']:.1f} s.",
        "",
        "| commit | writer | ingest s | the other's first search after "
        "it s (catch-up) | queries compared on a, b and the file |",
        "|---:|---|---:|---:|---:|",
        *(
            f"| {i + 1} | {r['writer']} | {r['ingest_s']:.1f} | {r['catch_up_s']:.2f} | {r['compared']} |"
            for i, r in enumerate(m["rounds"])
        ),
        "",
    ]


if __name__ == "__main__":
    main()
