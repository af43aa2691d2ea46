"""`kvdb watch`: seconds from a line written to searchable, for a turn appended to an agent log
of about 1k, 20k and 100k tokens, and the watcher's CPU while idle. One command:

    .venv/bin/python benchmarks/watch.py [--sizes 1000,20000,100000] [--repeats 3] [--idle 30] [--gap 0]

It starts `kvdb watch` (the embedded model, default tiers: no model runs on ingest, its work is
queued for upkeep) over a temporary folder as a process of its own, writes each log whole and
waits until it is archived, then appends a user turn and an assistant turn holding a phrase found
nowhere else, `--repeats` times, timing each from the write to the first `Archive.search` (a
read-only archive in this process, polled every 20 ms) that finds the phrase; the median and the
largest of the repeats. `--gap`: seconds of quiet before each turn, past the watcher's 2 s idle
wait, so that the queued work (`kvdb upkeep`, in a process beside it) runs when the turn comes.
The watcher's own report of each ingest (`--json`: its `seconds`) is read from its output;
"latency less ingest" is the latency less that ingest's seconds.
Idle CPU: the watcher's user and system time (/proc) over `--idle` seconds with nothing written,
as a share of one core. It writes RESULTS.md "kvdb watch".
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from report import describe, publish

import kvdb
from kvdb.model import tokenizer as tok

KVDB = str(Path(sys.executable).with_name("kvdb"))
WORDS = (
    "harbour ledger keeper lamp storm tide ship anchor chart compass rope sail mast deck hull keel rudder wind fog "
    "beacon test module function error patch commit branch merge "
    "review build deploy cache index query schema table column"
).split()


def turn_text(k: int, words: int) -> str:
    return " ".join(WORDS[(k * 7 + i * 3) % len(WORDS)] for i in range(words)) + "."


def write_log(path: Path, tokens: int, tokenizer) -> int:
    """A JSON Lines chat of about ``tokens`` tokens; its token count (of the text, roughly)."""
    lines, total, k = [], 0, 0
    while total < tokens:
        # no two logs share a part
        message = {
            "role": "user" if k % 2 == 0 else "assistant",
            "content": f"log {tokens}, turn {k}: {turn_text(k, 120)}",
        }
        total += len(tok.encode(tokenizer, message["content"])) + 5
        lines.append(json.dumps(message) + "\n")
        k += 1
    path.write_text("".join(lines), encoding="utf-8")
    return total


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,20000,100000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle", type=float, default=30.0)
    parser.add_argument(
        "--gap",
        type=float,
        default=0.0,
        help="seconds of quiet before each appended turn (past 2 s, upkeep runs beside the watcher)",
    )
    parser.add_argument("--no-results", action="store_true", help="print the table, leave RESULTS.md as it is")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvdb-watch-"))
    logs, db = work / "logs", work / "archive.duckdb"
    logs.mkdir()
    tokenizer = tok.load()
    with kvdb.open(db):  # created before the watcher, so the reader below can open it
        pass
    watcher = subprocess.Popen(
        [KVDB, "--db", str(db), "watch", str(logs), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    reports: queue.Queue[dict] = queue.Queue()
    threading.Thread(target=lambda: [reports.put(json.loads(line)) for line in watcher.stdout], daemon=True).start()
    reader = kvdb.open(db, read_only=True)
    reader.release()

    def searchable(phrase: str, timeout: float = 900.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = any(h.exact for h in reader.search(phrase, k=1, case_sensitive=True))
            reader.release()  # the watcher writes between these reads
            if found:
                return time.monotonic()
            time.sleep(0.02)
        raise TimeoutError(phrase)

    def reports_of(path: Path, timeout: float = 900.0) -> list[dict]:
        """The watcher's reports of ``path`` from its next pass: one a session, so one a part
        for a log past the model's context (a pass's reports are printed together)."""
        deadline, out = time.monotonic() + timeout, []
        while not out:
            found = reports.get(timeout=max(0.1, deadline - time.monotonic()))
            if found["source"] == str(path.resolve()):
                out.append(found)
        while True:
            try:
                found = reports.get(timeout=1.0)
            except queue.Empty:
                return out
            if found["source"] == str(path.resolve()):
                out.append(found)

    rows = []
    try:
        for size in sizes:
            log = logs / f"agent-{size}.jsonl"
            tokens = write_log(log, size, tokenizer)
            first = reports_of(log)
            failed = [r for r in first if r["status"] != "ingested"]
            if failed:
                rows.append(
                    (
                        size,
                        tokens,
                        len(first),
                        None,
                        None,
                        None,
                        None,
                        f"{failed[0]['status']}: {failed[0].get('error')}",
                    )
                )
                continue
            latencies, ingests = [], []
            for r in range(args.repeats):
                phrase = f"zqx{size}marker{r}"
                turns = [
                    {"role": "user", "content": f"And the {phrase}?"},
                    {"role": "assistant", "content": f"The {phrase} is in the ledger."},
                ]
                time.sleep(args.gap)
                written = time.monotonic()
                with open(log, "a", encoding="utf-8") as f:
                    f.write("".join(json.dumps(t) + "\n" for t in turns))
                found = searchable(phrase)
                latencies.append(found - written)
                # the parts before the last are "unchanged"
                ingests.append(sum(r.get("seconds", 0.0) for r in reports_of(log)))
            latency, ingest = statistics.median(latencies), statistics.median(ingests)
            rows.append((size, tokens, len(first), latency, max(latencies), ingest, latency - ingest, ""))
        before, started = cpu_seconds(watcher.pid), time.monotonic()
        time.sleep(args.idle)
        idle = (cpu_seconds(watcher.pid) - before) / (time.monotonic() - started)
    finally:
        reader.close()
        watcher.terminate()
        watcher.wait(timeout=120)
    lines = [
        f"`.venv/bin/python benchmarks/watch.py --sizes {args.sizes} --repeats {args.repeats} --idle {args.idle:g} "
        f"--gap {args.gap:g}`; {describe(f'kvdb {kvdb.__version__}')}.",
        "",
        "A turn (a user line and an assistant line, 2 lines) appended to a JSON Lines log the watcher follows; "
        "latency: from the write to the first search that finds it (median and largest of the repeats); ingest: the "
        "watcher's own report of that ingest (no model runs: the new turns' tokens and search entries; their "
        "log-probabilities and semantic chunks are queued for upkeep). A log past the model's context is archived in "
        "parts (decision 0049); the rest of the latency is the watcher's notice of the change, reading and rendering "
        "the log again (its pieces but the last tokenized already), one read that finds the parts that did not change, "
        "taking and letting go of the archive, and the search's poll.",
        "",
        "| asked tokens | log tokens | parts | latency s | max latency s | ingest s | latency less ingest s | |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for size, tokens, parts, latency, worst, ingest, aside, note in rows:
        cells = (
            [f"{latency:.2f}", f"{worst:.2f}", f"{ingest:.2f}", f"{aside:.2f}"]
            if latency is not None
            else ["", "", "", ""]
        )
        lines.append(f"| {size:,} | {tokens:,} | {parts} | {' | '.join(cells)} | {note} |")
    lines += ["", f"Idle: the watcher took {100 * idle:.2f}% of one core over {args.idle:g} s with nothing written."]
    publish("kvdb watch", lines, append=not args.no_results)


if __name__ == "__main__":
    main()
