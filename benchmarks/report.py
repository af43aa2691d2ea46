"""What every benchmark does with its results: time a call, describe the machine, and publish a
section. A section is a JSON record in benchmarks/results/ (the command and arguments that ran,
when and on which commit, its tables as rows, its raw data where it has some), and RESULTS.md is
rendered from the records: a rerun of the same command replaces its record, a run with other
arguments adds one, so no two sections share a heading.

    .venv/bin/python benchmarks/report.py    # render RESULTS.md again, after editing a record's notes
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvdb.files import replace_whole

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
RECORDS = HERE / "results"
PYTHON = ".venv/bin/python"
# Flags that say where a run keeps its scratch files or how it prints, not what it measures.
_QUIET = {"--json", "--no-results"}
_PLACES = {"--checkpoint", "--workdir", "--work", "--scratch", "--out"}
_PREAMBLE = """# Benchmark results

Rendered by `benchmarks/report.py` from the records in `benchmarks/results/`: one JSON file per
benchmark run and section, with the command and arguments that ran, when and on which commit, the
tables as rows, and the raw measurements where the benchmark has them. A rerun of a command replaces
its section; edit a record's `notes` and run `.venv/bin/python benchmarks/report.py` to render this
file again (`benchmarks/tests/test_report.py` fails when it is stale).
"""


def median_seconds(call, runs: int) -> float:
    """The median wall time of ``runs`` calls: one slow call on a shared machine moves it least."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def describe(*versions: str) -> str:
    """CPU model, cores, memory, Python, the given library versions, and the load average:
    these machines are shared, so the load says how much to trust a timing."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    parts = [f"{cpu}, {os.cpu_count()} cores, {memory:.0f} GiB", f"Python {platform.python_version()}", *versions]
    return "; ".join(parts) + f"; load average {os.getloadavg()[0]:.1f} at start"


def command(argv: list[str]) -> str:
    """The command line that reproduces a run's figures: the script and its arguments, less the
    flags that only choose scratch places or how the run prints."""
    kept, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in _QUIET or flag in _PLACES:
            skip = flag in _PLACES and "=" not in arg
            continue
        kept.append(arg)
    return shlex.join([PYTHON, f"benchmarks/{Path(argv[0]).name}", *kept])


def publish(title: str, body: list[str] | str, *, data: object = None, append: bool = True) -> str:
    """Print a results section, and unless ``append`` is False, record it and render RESULTS.md.
    ``body`` is markdown (paragraphs and tables); ``data``, when given, is the run's measurements
    as JSON-able values, kept beside the tables for whoever wants more than they show."""
    record = {
        "title": title,
        "command": command(sys.argv),
        "measured": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "blocks": blocks("\n".join(body) if isinstance(body, list) else body),
        "notes": [],
        "data": data,
    }
    section = rendered(record)
    print(section)
    if append:
        write(record, RECORDS)
        render()
    return section


def write(record: dict, folder: Path) -> Path:
    """Write ``record`` as its file in ``folder``, in place of an earlier run of the same command
    and title; whole or not at all, so that a killed run leaves the last record as it was."""
    path = folder / f"{key(record)}.json"
    replace_whole(path, (json.dumps(record, indent=1, ensure_ascii=False) + "\n").encode())
    return path


def key(record: dict) -> str:
    """A record's file name: its command less the interpreter (or, for a note, the benchmark it
    is about), then its title, as one slug, so that a folder listing groups each benchmark's sections."""
    run = record["command"] or record.get("benchmark", "")
    run = run.removeprefix(PYTHON).strip().removeprefix("benchmarks/").replace(".py", "", 1)
    slug = re.sub(r"[^a-z0-9]+", "-", f"{run} {record['title']}".lower()).strip("-")
    return slug[:120].rstrip("-")


def render() -> None:
    """Write RESULTS.md from the records, whole."""
    replace_whole(RESULTS, document(RECORDS).encode())


def document(folder: Path) -> str:
    """RESULTS.md: the preamble and every record's section, in file-name order."""
    records = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("*.json"))]
    return "\n".join([_PREAMBLE, *(rendered(r) for r in records)])


def rendered(record: dict) -> str:
    """One section's markdown: a heading with its command, when it ran, its blocks, its notes."""
    where = f" (`{record['command']}`" + (f", at `{record['revision']}`" if record.get("revision") else "") + ")"
    lines = [f"## {record['title']}{where if record['command'] else ''}", ""]
    if record.get("measured") or record.get("commit"):
        lines += [
            f"Measured {record.get('measured') or 'at a date not recorded'} on commit `{record.get('commit')}`.",
            "",
        ]
    for block in [*record["blocks"], *({"text": note} for note in record.get("notes", []))]:
        lines += [*(_table(block) if "rows" in block else [block["text"]]), ""]
    return "\n".join(lines)


def blocks(markdown: str) -> list[dict]:
    """Markdown cut into text blocks and tables; a table is its columns, their alignment and its
    rows of cells, so that a reader of the record gets the figures without parsing markdown."""
    out: list[dict] = []
    lines = markdown.strip("\n").split("\n")
    i = 0
    while i < len(lines):
        if _is_table(lines, i):
            end = i + 2
            while end < len(lines) and lines[end].lstrip().startswith("|"):
                end += 1
            cells = [_cells(line) for line in lines[i:end]]
            align = [("left" if c.startswith(":") else "") + ("right" if c.endswith(":") else "") for c in cells[1]]
            out.append({"columns": cells[0], "align": align, "rows": cells[2:]})
            i = end
            continue
        end = i
        while end < len(lines) and not _is_table(lines, end):
            end += 1
        text = "\n".join(lines[i:end]).strip("\n")
        if text.strip():
            out.append({"text": text})
        i = end
    return out


def _is_table(lines: list[str], i: int) -> bool:
    return (
        lines[i].lstrip().startswith("|")
        and i + 1 < len(lines)
        and re.fullmatch(r"\s*\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*", lines[i + 1]) is not None
    )


def _cells(line: str) -> list[str]:
    """A table row's cells, split at each ``|`` outside backticks and not escaped."""
    row = line.strip().removeprefix("|")
    row = row[:-1] if row.endswith("|") and not row.endswith("\\|") else row
    cells, cell, code, escaped = [], "", False, False
    for ch in row:
        if ch == "|" and not code and not escaped:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
            code ^= ch == "`"
        escaped = ch == "\\" and not escaped
    return [*cells, cell.strip()]


def _table(block: dict) -> list[str]:
    rule = {"": "---", "left": ":---", "right": "---:", "leftright": ":---:"}
    return [
        "| " + " | ".join(block["columns"]) + " |",
        "|" + "|".join(rule[a] for a in block["align"]) + "|",
        *("| " + " | ".join(row) + " |" for row in block["rows"]),
    ]


def _commit() -> str | None:
    """The commit a run measured, with ``+changes`` when tracked files differed from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=HERE, capture_output=True, text=True)
    except OSError:
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


if __name__ == "__main__":
    render()
    print(f"wrote {RESULTS} from {len(list(RECORDS.glob('*.json')))} records in {RECORDS}")
