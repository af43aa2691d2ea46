"""CLI start-up: the wall time of each command that must not load the model, as a fresh process,
beside ``python -c "import duckdb"`` (the floor any command pays).

    .venv/bin/python benchmarks/cli.py [--reps 3] [--source DIR] [--label TEXT] [--no-results]

First builds a small archive with the CLI (``kvdb ingest`` of a few transcripts from
examples/transcripts on the embedded model), then times, in one run, ``--reps`` repetitions of
each command (median and min): ``--help``, ``sessions``, ``show``, lexical ``search``, ``stats``,
``prefixes``, ``verify``, ``delete`` and ``gc``. ``delete`` and ``gc`` run on a fresh copy of
the archive each repetition (the copy is not timed; ``gc`` gets a copy with one session already
deleted, so it has prefixes to free). Each command also runs once untimed, in-process through
the click entry point, to record whether it imported torch or transformers (that run is the
warm-up). Target: every command within 6x the baseline.

``--source DIR`` runs the CLI from another source tree (a checkout, or ``git archive`` of a
commit, unpacked), e.g. to measure the code before a change. Appends a section to
benchmarks/RESULTS.md unless ``--no-results``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from report import describe, publish  # noqa: E402

TRANSCRIPTS = Path(__file__).resolve().parents[1] / "examples" / "transcripts"
INGESTED = ("sessions.jsonl", "chat.jsonl", "story.txt", "notes.md")  # 3 sessions sharing a system prompt, and 3 more
PHRASE = "lighthouse keeper"  # in story.txt
TARGET = 6.0  # at most this many times the baseline
HEAVY = ("torch", "transformers")
# Runs the click entry point in-process, then writes which heavy modules it imported to $KVDB_BENCH_IMPORTS.
PROBE = (
    "import json, os, sys\n"
    "from kvdb_cli.main import main\n"
    "try:\n"
    "    main(sys.argv[1:], prog_name='kvdb', standalone_mode=False)\n"
    "except SystemExit:\n"
    "    pass\n"
    "finally:\n"
    f"    json.dump({{m: m in sys.modules for m in {HEAVY!r}}}, open(os.environ['KVDB_BENCH_IMPORTS'], 'w'))\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per command")
    parser.add_argument("--source", type=Path, default=None, help="run the CLI from this source tree instead of the installed one")
    parser.add_argument("--label", default="", help="said in the heading, e.g. 'before the architecture refactor'")
    parser.add_argument("--no-results", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvdb-cli-bench-") as tmp:
        tmp = Path(tmp)
        env = _env(tmp, args.source)
        base = tmp / "base" / "archive.duckdb"
        base.parent.mkdir()
        _kvdb(["ingest", *(str(TRANSCRIPTS / name) for name in INGESTED)], base, env)
        listed = [json.loads(line) for line in _kvdb(["sessions", "--json"], base, env).splitlines()]
        session = listed[-1]["session_id"]
        deleted = _copy(base, tmp / "deleted")  # gc's starting point: one session gone, its prefixes unreferenced
        _kvdb(["delete", listed[0]["session_id"]], deleted, env)
        commands = [  # (label, argv, archive each repetition starts from, fresh copy per repetition)
            ("kvdb --help", ["--help"], base, False),
            ("kvdb sessions", ["sessions"], base, False),
            ("kvdb show SESSION", ["show", session], base, False),
            (f'kvdb search "{PHRASE}"', ["search", PHRASE], base, False),
            ("kvdb stats", ["stats"], base, False),
            ("kvdb prefixes", ["prefixes"], base, False),
            ("kvdb verify", ["verify"], base, False),
            ("kvdb delete SESSION", ["delete", session], base, True),
            ("kvdb gc", ["gc"], deleted, True),
        ]
        baseline = [_timed([sys.executable, "-c", "import duckdb"], env, tmp) for _ in range(args.reps)]
        rows = []
        for label, argv, archive, fresh in commands:
            imports = _imports(argv, _copy(archive, tmp / "probe") if fresh else archive, env, tmp)
            times = []
            for i in range(args.reps):
                db = _copy(archive, tmp / f"rep{i}") if fresh else archive
                times.append(_timed([_kvdb_script(), "--db", str(db), *argv], env, tmp))
            rows.append((label, times, imports))
    base_median = statistics.median(baseline)
    lines = [
        f"\n## CLI start-up per command{', ' + args.label if args.label else ''} ({time.strftime('%Y-%m-%d')})\n",
        f"`{shlex.join(['.venv/bin/python', 'benchmarks/cli.py', *sys.argv[1:]])}` — "
        f"{describe(*(f'{name} {_version(name)}' for name in ('duckdb', 'torch', 'transformers', 'tokenizers')))}; "
        f"{'CLI from ' + str(args.source) if args.source else 'installed CLI'}; archive of {len(listed)} sessions "
        f"({sum(s['n_tokens'] for s in listed):,} tokens) ingested from examples/transcripts with SmolLM2-135M-Instruct; "
        f"each command a fresh process, {args.reps} repetitions; delete and gc on a fresh copy each time (copy not timed); "
        f"imports seen by one in-process run of the click entry point"
        f"{'; PYTHONDONTWRITEBYTECODE set, so kvdb compiles its own modules at each start' if os.environ.get('PYTHONDONTWRITEBYTECODE') else ''}. "
        f"Target: every command at most {TARGET:g}x the baseline `python -c \"import duckdb\"` "
        f"(median {base_median:.3f} s, min {min(baseline):.3f} s). Benchmark run {time.monotonic() - started:.0f} s.\n",
        "| command | median s | min s | x baseline (median) | within target | imports torch | imports transformers |",
        "|---|---:|---:|---:|---|---|---|",
        f"| `python -c \"import duckdb\"` (baseline) | {base_median:.3f} | {min(baseline):.3f} | 1.0 |  |  |  |",
    ]
    for label, times, imports in rows:
        ratio = statistics.median(times) / base_median
        lines.append(
            f"| `{label}` | {statistics.median(times):.3f} | {min(times):.3f} | {ratio:.1f} | {'yes' if ratio <= TARGET else 'no'} "
            f"| {'yes' if imports['torch'] else 'no'} | {'yes' if imports['transformers'] else 'no'} |"
        )
    if args.no_results:
        print("\n".join(lines))
    else:
        publish(lines)


def _env(tmp: Path, source: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KVDB_DB", "KVDB_MODEL", "PYTHONPATH")}
    env["KVDB_BENCH_IMPORTS"] = str(tmp / "imports.json")
    if source is not None:  # the import names the editable install maps to folders of another name
        shim = tmp / "source"
        shim.mkdir()
        for name, folder in (("kvdb", "kvdb"), ("kvdb_cli", "cli"), ("kvdb_migrations", "migrations")):
            (shim / name).symlink_to(source.resolve() / folder)
        env["PYTHONPATH"] = str(shim)
    return env


def _kvdb_script() -> str:
    return str(Path(sys.executable).with_name("kvdb"))


def _kvdb(argv: list[str], db: Path, env: dict) -> str:
    """Run one command for the set-up (not timed); its stdout."""
    run = subprocess.run([_kvdb_script(), "--db", str(db), *argv], env=env, cwd=db.parent, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"kvdb {' '.join(argv)} failed ({run.returncode}): {run.stderr.strip()}")
    return run.stdout


def _timed(cmd: list[str], env: dict, cwd: Path) -> float:
    """Wall seconds of one fresh process (cwd outside the repository, so --source is what imports)."""
    start = time.perf_counter()
    run = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed ({run.returncode}): {run.stderr.strip()}")
    return seconds


def _imports(argv: list[str], db: Path, env: dict, cwd: Path) -> dict:
    out = Path(env["KVDB_BENCH_IMPORTS"])
    out.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-c", PROBE, "--db", str(db), *argv], env=env, cwd=cwd, capture_output=True, check=True)
    return json.loads(out.read_text())


def _copy(db: Path, folder: Path) -> Path:
    """A fresh copy of the archive's folder (the file, its .wal and its sidecars); the copy's archive path."""
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(db.parent, folder)
    return folder / db.name


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


if __name__ == "__main__":
    main()
