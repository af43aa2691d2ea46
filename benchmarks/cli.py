"""CLI startup: the wall time of each command that must not load the model, as a fresh process,
beside ``python -c "import duckdb"`` (the floor any command pays).

    .venv/bin/python benchmarks/cli.py [--reps 7] [--before DIR] [--label TEXT] [--no-results]

First builds a small archive with the CLI (``kvdb ingest`` of a few transcripts from
examples/transcripts; ingest scores every token, so it loads the embedded model, once), then
times, in one run and round-robin, ``--reps`` repetitions of each command (median): ``--help``,
``sessions``, ``show SESSION --end 10``, lexical ``search``, ``stats``, ``prefixes``, ``verify``,
``delete`` and ``gc``. ``delete`` and ``gc`` run on a fresh copy of the archive each repetition
(the copy is not timed; ``gc`` gets a copy with one session already deleted, so it has
prefixes to free). Each command also runs once untimed, in-process through the click entry
point, to record which of torch, transformers, sqlalchemy and alembic it imported (that run is
the warm-up). Target: every command within 6x the baseline.

The CLI timed is this checkout's (the folder above this script), whatever is installed.
``--before DIR`` also times the CLI of another source tree (a checkout, or ``git archive`` of a
commit, unpacked) side by side, e.g. the code before a change. Prints the table and records it
(benchmarks/results/, rendered into RESULTS.md) in place of the last run with the same arguments,
unless ``--no-results``.
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
from report import describe, publish

REPO = Path(__file__).resolve().parents[1]
TRANSCRIPTS = REPO / "examples" / "transcripts"
INGESTED = ("sessions.jsonl", "chat.jsonl", "story.txt", "notes.md")  # 3 sessions sharing a system prompt, and 3 more
PHRASE = "lighthouse keeper"  # in story.txt
TARGET = 6.0  # at most this many times the baseline
FLOOR = "import duckdb, numpy, click"  # what any command of this stack imports before its own code
# none belongs on a command that needs no model and no migration
HEAVY = ("torch", "transformers", "sqlalchemy", "alembic")
# Runs the click entry point in-process, then writes which heavy modules it imported to $KVDB_BENCH_IMPORTS.
PROBE = (
    "import json, os, sys\n"
    "from kvdb_main import main\n"
    "try:\n"
    "    main(sys.argv[1:], prog_name='kvdb', standalone_mode=False)\n"
    "except SystemExit:\n"
    "    pass\n"
    "finally:\n"
    f"    json.dump({{m: m in sys.modules for m in {HEAVY!r}}}, open(os.environ['KVDB_BENCH_IMPORTS'], 'w'))\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per command and tree")
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="also time the CLI of this source tree, side by side (e.g. a git archive of the last release)",
    )
    parser.add_argument("--label", default="", help="what --before is, said in the heading")
    parser.add_argument("--no-results", action="store_true", help="print only; do not write RESULTS.md")
    args = parser.parse_args()
    started = time.monotonic()
    trees = {"after": REPO, **({"before": args.before} if args.before else {})}
    with tempfile.TemporaryDirectory(prefix="kvdb-cli-bench-") as tmp:
        tmp = Path(tmp)
        envs = {name: _env(tmp / name, source) for name, source in trees.items()}
        made = {name: _archives(tmp / name, env) for name, env in envs.items()}  # an older kvdb opens no newer schema
        listed = made["after"][2]
        session = listed[-1]["session_id"]  # a content hash: the same in every tree
        # (label, argv, the archive each repetition starts from (0: as ingested, 1: one session deleted), fresh copy per
        # repetition)
        commands = [
            ("kvdb --help", ["--help"], 0, False),
            ("kvdb sessions", ["sessions"], 0, False),
            ("kvdb show SESSION --end 10", ["show", session, "--end", "10"], 0, False),
            (f'kvdb search "{PHRASE}"', ["search", PHRASE], 0, False),
            ("kvdb stats", ["stats"], 0, False),
            ("kvdb prefixes", ["prefixes"], 0, False),
            ("kvdb verify", ["verify"], 0, False),
            ("kvdb delete SESSION", ["delete", session], 0, True),
            ("kvdb gc", ["gc"], 1, True),
        ]
        imports = {
            (label, name): _imports(
                argv, _copy(made[name][which], tmp / "probe") if fresh else made[name][which], env, tmp
            )
            for label, argv, which, fresh in commands
            for name, env in envs.items()
        }
        times: dict = {}
        baseline, floor = [], []
        for _rep in range(args.reps):  # round-robin, so a noisy moment falls on every command alike
            baseline.append(_timed([sys.executable, "-c", "import duckdb"], envs["after"], tmp))
            floor.append(_timed([sys.executable, "-c", FLOOR], envs["after"], tmp))
            for label, argv, which, fresh in commands:
                for name, env in envs.items():
                    db = _copy(made[name][which], tmp / f"rep-{name}") if fresh else made[name][which]
                    times.setdefault((label, name), []).append(_timed([*KVDB, "--db", str(db), *argv], env, tmp))
    base_median = statistics.median(baseline)
    before = (
        f"; before: the CLI from {args.before}{' (' + args.label + ')' if args.label else ''}" if args.before else ""
    )
    lines = [
        f"Run at {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC. "
        f"`{shlex.join(['.venv/bin/python', 'benchmarks/cli.py', *sys.argv[1:]])}` — "
        f"""{
            describe(
                *(
                    f"{name} {_version(name)}"
                    for name in ("duckdb", "sqlalchemy", "torch", "transformers", "tokenizers")
                )
            )
        }; """
        f"after: this checkout's CLI{before}; archive of {len(listed)} sessions "
        f"({sum(s['n_tokens'] for s in listed):,} tokens) ingested from examples/transcripts with "
        f"SmolLM2-135M-Instruct; each command a fresh process, {args.reps} repetitions, round-robin over commands and "
        "trees; delete and gc on a fresh copy each time (copy not timed); imports seen by one in-process run of the "
        "click entry point"
        f"""{
            "; PYTHONDONTWRITEBYTECODE set, so kvdb compiles its own modules at each start"
            if os.environ.get("PYTHONDONTWRITEBYTECODE")
            else ""
        }. """
        f'Target: every command at most {TARGET:g}x the baseline `python -c "import duckdb"` '
        f"(median {base_median:.3f} s, min {min(baseline):.3f} s). Benchmark run {time.monotonic() - started:.0f} s.\n",
    ]
    names = list(trees)[::-1]  # before first, when there is one
    header = " | ".join(f"{n} median s | {n} x baseline | {n} imports {', '.join(HEAVY)}" for n in names)
    lines += [f"| command | {header} | after within target |", "|---|" + "---:|---:|---|" * len(names) + "---|"]
    lines.append(
        '| `python -c "import duckdb"` (baseline) | '
        + " | ".join(f"{base_median:.3f} | 1.0 | " for _ in names)
        + " |  |"
    )
    floor_median = statistics.median(floor)
    lines.append(
        f'| `python -c "{FLOOR}"` (the stack\'s floor) | '
        + " | ".join(f"{floor_median:.3f} | {floor_median / base_median:.1f} | " for _ in names)
        + " |  |"
    )
    for label, *_ in commands:
        cells = []
        for name in names:
            median = statistics.median(times[(label, name)])
            heavy = ", ".join(m for m in HEAVY if imports[(label, name)][m]) or "none"
            cells.append(f"{median:.3f} | {median / base_median:.1f} | {heavy}")
        within = statistics.median(times[(label, "after")]) / base_median <= TARGET
        lines.append(f"| `{label}` | {' | '.join(cells)} | {'yes' if within else 'no'} |")
    publish("CLI startup", lines, append=not args.no_results)


def _env(tmp: Path, source: Path) -> dict:
    """The environment that runs the CLI of ``source``: its ``kvdb`` package linked into a folder
    on the path, with the names a tree from before one package tree (decision 0067) installed its
    CLI and migrations under, and ``kvdb_main``, which names its console script's ``main``."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVDB_DB", "KVDB_MODEL", "PYTHONPATH")}
    tmp.mkdir(parents=True, exist_ok=True)
    env["KVDB_BENCH_IMPORTS"] = str(tmp / "imports.json")
    shim = tmp / "source"
    shim.mkdir()
    before_0067 = (source / "cli").is_dir()
    for name, folder in (
        ("kvdb", "kvdb"),
        *((("kvdb_cli", "cli"), ("kvdb_migrations", "migrations")) if before_0067 else ()),
    ):
        (shim / name).symlink_to(source.resolve() / folder)
    entry = "kvdb_cli.main" if before_0067 else "kvdb.cli.main"
    (shim / "kvdb_main.py").write_text(f"from {entry} import main  # noqa: F401\n")
    env["PYTHONPATH"] = str(shim)
    return env


# the console script of the tree on PYTHONPATH (_env)
KVDB = [sys.executable, "-c", "import sys; from kvdb_main import main; sys.argv[0] = 'kvdb'; sys.exit(main())"]


def _archives(folder: Path, env: dict) -> tuple[Path, Path, list[dict]]:
    """The archive the commands run on, made by the tree's own CLI, a copy of it with its first
    session deleted (gc's starting point: its prefixes unreferenced), and its sessions as listed."""
    base = folder / "base" / "archive.duckdb"
    base.parent.mkdir(parents=True)
    _kvdb(["ingest", *(str(TRANSCRIPTS / name) for name in INGESTED)], base, env)
    listed = [json.loads(line) for line in _kvdb(["sessions", "--json"], base, env).splitlines()]
    deleted = _copy(base, folder / "deleted")
    _kvdb(["delete", listed[0]["session_id"]], deleted, env)
    return base, deleted, listed


def _kvdb(argv: list[str], db: Path, env: dict) -> str:
    """Run one command for the set-up (not timed); its stdout."""
    run = subprocess.run([*KVDB, "--db", str(db), *argv], env=env, cwd=db.parent, capture_output=True, text=True)
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
    subprocess.run(
        [sys.executable, "-c", PROBE, "--db", str(db), *argv], env=env, cwd=cwd, capture_output=True, check=True
    )
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
