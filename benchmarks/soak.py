"""Soak: one process ingests sessions while another searches and restores, both through the
`kvdb` command line as users would run them, for a fixed time. DuckDB admits one writing
process or several read-only ones per file: the readers open read-only, the writer holds the
file only while it touches it, and each waits for the other (KVDB_LOCK_TIMEOUT) when they meet.

    .venv/bin/python benchmarks/soak.py [--seconds 120] [--model PATH] [--no-results]

Reports commands run, errors, and sessions lost (reported ingested but absent at the end,
or failing `kvdb verify --deep`). Writes its table to benchmarks/RESULTS.md, in place of the last
run's. By default it uses a tiny random model (mechanics, not quality), so it finishes in
minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from conftest import make_tiny_model
from report import describe, publish

KVDB = str(Path(sys.executable).with_name("kvdb"))


def run(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KVDB, *args, "--json"], env=env, capture_output=True, text=True, timeout=300)


def writer(env: dict, folder: Path, deadline: float, log: dict) -> None:
    i = 0
    while time.monotonic() < deadline:
        path = folder / f"s{i:04d}.txt"
        path.write_text(f"Soak session {i}: the harbour lights were lit at dusk and ship {i * 13} came home.\n")
        out = run(env, "ingest", str(path))
        log["ingest"] += 1
        if out.returncode != 0:
            log["errors"].append(f"ingest {i}: exit {out.returncode}: {out.stderr.strip()[-200:]}")
        else:
            log["reported"].update(json.loads(line)["session_id"] for line in out.stdout.splitlines() if line.strip())
        i += 1


def reader(env: dict, deadline: float, log: dict) -> None:
    i = 0
    while time.monotonic() < deadline:
        search = run(env, "search", "harbour lights", "-k", "3")
        log["search"] += 1
        if search.returncode not in (0, 1):  # 1: no match yet
            log["errors"].append(f"search: exit {search.returncode}: {search.stderr.strip()[-200:]}")
        elif search.stdout.strip():
            session = json.loads(search.stdout.splitlines()[0])["session_id"]
            restore = run(env, "restore", session, "--max-new-tokens", "2")
            log["restore"] += 1
            if restore.returncode != 0:
                log["errors"].append(f"restore: exit {restore.returncode}: {restore.stderr.strip()[-200:]}")
        i += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--model", default=None, help="model folder or id (default: a tiny random Llama made here)")
    parser.add_argument("--no-results", action="store_true", help="print only; do not write RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.model or str(make_tiny_model(tmp / "model"))
        env = dict(os.environ, KVDB_DB=str(tmp / "soak.duckdb"), KVDB_MODEL=model, KVDB_LOCK_TIMEOUT="60")
        (tmp / "in").mkdir()
        log = {"ingest": 0, "search": 0, "restore": 0, "errors": [], "reported": set()}
        deadline = time.monotonic() + args.seconds
        threads = [
            threading.Thread(target=writer, args=(env, tmp / "in", deadline, log)),
            threading.Thread(target=reader, args=(env, deadline, log)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sessions = {json.loads(line)["session_id"] for line in run(env, "sessions").stdout.splitlines() if line.strip()}
        verify = run(env, "verify", "--deep")
    lost = log["reported"] - sessions
    lines = [
        f"Run at {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC. "
        f"`{' '.join(['.venv/bin/python', 'benchmarks/soak.py', *sys.argv[1:]])}` — {describe()}; "
        f"{'tiny random Llama' if args.model is None else args.model}; two processes at a time through the `kvdb` CLI, "
        f"{args.seconds:g} s.\n",
        "| ingest commands | search commands | restore commands | "
        "errors | sessions reported | sessions lost | verify --deep |",
        "|---:|---:|---:|---:|---:|---:|---|",
        f"| {log['ingest']} | {log['search']} | {log['restore']} | {len(log['errors'])} | {len(log['reported'])} | "
        f"{len(lost)} | {'ok' if verify.returncode == 0 else 'FAILED'} |",
        *(f"\n- {e}" for e in log["errors"][:10]),
    ]
    publish("Soak: ingest beside search and restore", lines, append=not args.no_results)
    sys.exit(1 if log["errors"] or lost or verify.returncode else 0)


if __name__ == "__main__":
    main()
