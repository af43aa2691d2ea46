"""Transcript formats: what every file of examples/transcripts gives through `kvdb ingest` and
`kvdb show`, or (``--throughput``) how fast agent logs parse and render.

    .venv/bin/python benchmarks/formats.py [--no-results]
    .venv/bin/python benchmarks/formats.py --throughput [--mb 100] [--workers 1]
        [--tools claude-code codex-cli gemini-cli] [--no-tokens] [--no-results]

The format table, on the embedded model: the sessions each file gives, their tokens, what was
kept only as a placeholder, and whether every text of the file comes back from `show`. "Text
kept" checks each non-empty string the file holds under a key that carries conversation text
(``tests/support.py``'s TEXT_KEYS: content, text, value, arguments, output, ...): it must appear
in the `show` output of the file's sessions. For a text file the check is `show` equal to the file.

The throughput table (target: 100 MB of agent logs parsed and rendered in 20 s on 2 cores, with
no model weights loaded): for each tool folder of tests/fixtures/exports, its fixtures that read
whole today (sessions, no record skipped) are copied with fresh ids (every UUID replaced, the
same way through one copy) until about ``--mb`` MB, then read in one pass that times, per file,
(a) ``iter_transcripts`` with ``skipped=[]`` (lenient, as the CLI), (b) ``chat.render`` with the
embedded model's transformers tokenizer, (c) its token ids as the ingest takes them. A tool none
of whose fixtures read yet is listed as not read yet. ``--workers N`` splits the files over N
processes; a column is then the slowest worker's time.

Each writes its section of benchmarks/RESULTS.md (in place of its last one) unless ``--no-results``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from report import describe, publish
from support import conversation_texts

REPO = Path(__file__).resolve().parents[1]
TRANSCRIPTS = REPO / "examples" / "transcripts"
EXPORTS = REPO / "tests" / "fixtures" / "exports"
AGENT_LOGS = ("claude-code", "codex-cli", "gemini-cli")  # the tool folders timed by default; --tools names any
TARGET_MB, TARGET_S = 100, 20.0
UUID = re.compile(rb"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
KVDB = Path(sys.executable).with_name("kvdb")
RENDERED = {
    "text": "verbatim",
    "messages": "chat template",
    "openai": "chat template; tool calls and results as <tool_call>/<tool_result> text; name as `name: text`",
    "openai-responses": "chat template; reasoning as <thinking>, calls joined to their assistant turn",
    "chatgpt": "chat template along current_node; other branches as `[branch N]` sessions",
    "anthropic": (
        "chat template; system first; tool_use/tool_result as text, thinking as <thinking>, image as a placeholder"
    ),
    "claude-code": "chat template along the parentUuid chain; named by its summary",
    "lmsys": "chat template",
    "alpaca": "chat template; input after the instruction and a blank line",
    "sharegpt": "chat template; function_call as a tool call, observation as a tool turn",
}


def kvdb(db: Path, *args: str) -> str:
    return subprocess.run([str(KVDB), "--db", str(db), *args], check=True, capture_output=True, text=True).stdout


def kvdb_format(db: Path, session_id: str) -> str:
    """The format a session was read as, from the archive's own record of it."""
    import kvdb as library

    with library.open(db, read_only=True) as archive:
        return archive.session(session_id).metadata["format"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-results", action="store_true", help="print only; do not write RESULTS.md")
    parser.add_argument(
        "--throughput", action="store_true", help="time parsing and rendering agent logs instead of the format table"
    )
    parser.add_argument("--mb", type=float, default=TARGET_MB, help="megabytes of logs per tool (--throughput)")
    parser.add_argument("--workers", type=int, default=1, help="processes to read the files with (--throughput)")
    parser.add_argument(
        "--tools",
        nargs="+",
        default=list(AGENT_LOGS),
        help="fixture folders of tests/fixtures/exports to time, or `all` (--throughput)",
    )
    parser.add_argument("--no-tokens", action="store_true", help="leave out the token ids column (--throughput)")
    parser.add_argument(
        "--note", default="", help="a line to add under the table, such as what else ran on the machine (--throughput)"
    )
    args = parser.parse_args()
    if args.throughput:
        throughput(args)
    else:
        format_table(args.no_results)


def format_table(no_results: bool) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        db = Path(folder) / "formats.duckdb"
        for path in sorted(TRANSCRIPTS.iterdir()):
            results = [json.loads(line) for line in kvdb(db, "ingest", str(path), "--json").splitlines()]
            shown = "".join(kvdb(db, "show", r["session_id"]) for r in results)
            sessions = [
                s
                for s in map(json.loads, kvdb(db, "sessions", "--all", "--json").splitlines())
                if s["session_id"] in {r["session_id"] for r in results}
            ]
            formats = sorted({kvdb_format(db, s["session_id"]) for s in sessions})
            if path.suffix in (".txt", ".md"):
                kept = "yes" if shown == path.read_text(encoding="utf-8") else "NO"
            else:
                raw = (
                    [json.loads(line) for line in path.read_text().splitlines()]
                    if path.suffix == ".jsonl"
                    else json.loads(path.read_text())
                )
                wanted = list(conversation_texts(raw))
                missing = [t for t in wanted if t not in shown]
                kept = f"{len(wanted) - len(missing)}/{len(wanted)}" + (
                    "" if not missing else f" (missing: {missing[:2]})"
                )
            dropped = {}
            for r in results:
                for kind, count in r.get("dropped", {}).items():
                    dropped[kind] = dropped.get(kind, 0) + count
            rows.append(
                (
                    path.name,
                    ", ".join(formats),
                    len(results),
                    sum(r["n_tokens"] for r in results),
                    ", ".join(f"{k}: {v}" for k, v in dropped.items()) or "-",
                    kept,
                    "; ".join(RENDERED[f] for f in formats),
                )
            )
    lines = [
        describe(),
        "",
        "| file | format | sessions | tokens | dropped (placeholders) | text kept (by `show`) | rendered |",
        "|---|---|---:|---:|---|---|---|",
        *(f"| {' | '.join(map(str, row))} |" for row in rows),
        "",
    ]
    publish("Transcript formats", lines, append=not no_results)


def throughput(args) -> None:
    tools = sorted(p.name for p in EXPORTS.iterdir() if p.is_dir()) if args.tools == ["all"] else args.tools
    started = describe()
    rows, left_out = [], []
    for tool in tools:
        readable, unread = fixtures_read(EXPORTS / tool)
        left_out.extend(f"{tool}/{why}" for _, why in unread if readable)
        fixtures = f"{len(readable)}/{len(readable) + len(unread)}"
        if not readable:
            why = unread[0][1] if unread else "no fixtures"
            rows.append(f"| {tool} | {fixtures} | not read yet ({_cell(why)}) |" + " |" * 10)
            continue
        with tempfile.TemporaryDirectory() as folder:
            files = replicate(readable, Path(folder), args.mb * 1e6)
            size = sum(f.stat().st_size for f in files) / 1e6
            counts = timed(files, args.workers, not args.no_tokens)
        parse, render, tokens = counts["seconds"]
        in_target = "yes" if render * TARGET_MB / size <= TARGET_S else "NO"
        cells = [
            tool,
            fixtures,
            f"{size:.1f}",
            len(files),
            counts["sessions"],
            counts["messages"],
            f"{counts['rendered'] / 1e6:.1f}",
            counts["tokens"] if tokens else "-",
            f"{counts['load']:.1f}",
            f"{parse:.1f} ({size / parse:.0f})",
            f"{render:.1f} ({size / render:.0f})",
            f"{tokens:.1f} ({size / tokens:.1f})" if tokens else "-",
            f"{render * TARGET_MB / size:.1f} s: {in_target}",
        ]
        rows.append(f"| {' | '.join(map(str, cells))} |")
        print(rows[-1], flush=True)
    lines = [
        f"{started}; {args.workers} worker process{'es' if args.workers > 1 else ''}; "
        f"load average {os.getloadavg()[0]:.1f} at the end.",
        "Each tool's fixtures that read whole today, copied with fresh ids to about"
        f" {args.mb:g} MB; seconds (MB/s) of one pass: parse (`iter_transcripts`, lenient), + render (`chat.render`, "
        "the embedded model's tokenizer, no weights), + token ids (`tokenizer.encode`, as the ingest does). A column "
        "with several workers is the slowest worker's time. Target: "
        f"{TARGET_MB} MB parsed and rendered in {TARGET_S:g} s.",
        *([args.note] if args.note else []),
        "",
        "| tool | fixtures read | MB | files | sessions | messages | rendered MB | tokens | tokenizer load s | parse "
        "s (MB/s) | + render s (MB/s) | + tokens s (MB/s) | parse + render of 100 MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        *(
            [f"Fixtures left out (they do not read whole yet): {_cell('; '.join(left_out), 1000)}", ""]
            if left_out
            else []
        ),
    ]
    publish("Parse and render throughput of agent logs", lines, append=not args.no_results)


def _cell(text: str, width: int = 160) -> str:
    """``text`` as one table cell: one line, no column bars, at most ``width`` characters."""
    flat = " ".join(text.split()).replace("|", "\\|")
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def fixtures_read(folder: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """(the folder's fixtures that read whole: sessions and no record skipped, [(each other, why)]).
    A fixture read only in part is left out: timing it would time a misreading."""
    from kvdb.errors import TranscriptError
    from kvdb.transcripts import find_transcript_files, iter_transcripts

    readable, unread = [], []
    for path in find_transcript_files([folder]):
        skipped: list[dict] = []
        try:
            sessions = sum(1 for _ in iter_transcripts(path, skipped=skipped))
        except TranscriptError as error:
            unread.append((path, f"{path.name}{'' if error.line is None else f':{error.line}'}: {error.reason}"))
            continue
        if skipped:
            unread.append((path, f"{path.name}: read only in part ({len(skipped)} skipped, {sessions} sessions)"))
        else:
            readable.append(path)
    return readable, unread


def replicate(fixtures: list[Path], folder: Path, size: float) -> list[Path]:
    """Copies of ``fixtures`` in turn until ``size`` bytes, each with its UUIDs replaced by fresh
    ones (one id the same new id through a copy, so links between records hold)."""
    texts = [(path.name, text, set(UUID.findall(text))) for path in fixtures for text in [path.read_bytes()]]
    files, total = [], 0
    while total < size:
        for name, text, found in texts:
            fresh = {old: str(uuid.uuid4()).encode() for old in found}
            path = folder / f"{len(files):06d}-{name}"
            path.write_bytes(UUID.sub(lambda m, fresh=fresh: fresh[m[0]], text) if fresh else text)
            files.append(path)
            total += len(text)
            if total >= size:
                break
    return files


def timed(files: list[Path], workers: int, tokens: bool) -> dict:
    """Counts and (parse, + render, + tokens) seconds over ``files``: in this process, or split
    over ``workers`` processes (each loads the tokenizer; the slowest sets the seconds)."""
    if workers == 1:
        return read_files(files, tokens)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        parts = list(pool.map(read_files, [files[i::workers] for i in range(workers)], [tokens] * workers))
    total = {key: sum(p[key] for p in parts) for key in ("sessions", "messages", "rendered", "tokens")}
    total["load"] = max(p["load"] for p in parts)
    total["seconds"] = tuple(max(p["seconds"][i] for p in parts) for i in range(3))
    return total


def read_files(files: list[Path], tokens: bool) -> dict:
    """One pass over ``files``, each session parsed, rendered and (with ``tokens``) encoded, the
    time of each step summed on its own; seconds are cumulative: parse, + render, + tokens."""
    from kvdb.model import chat
    from kvdb.model import tokenizer as tok
    from kvdb.transcripts import iter_transcripts

    start = time.perf_counter()
    tokenizer = tok.load_full(None)
    load = time.perf_counter() - start
    spent = [0.0, 0.0, 0.0]
    counts = {"sessions": 0, "messages": 0, "rendered": 0, "tokens": 0}
    for path in files:
        sessions = iter_transcripts(path, skipped=[])
        while True:
            start = time.perf_counter()
            session = next(sessions, None)
            parsed = time.perf_counter()
            spent[0] += parsed - start
            if session is None:
                break
            text = session.text if session.text is not None else chat.render(tokenizer, session.messages)
            rendered = time.perf_counter()
            spent[1] += rendered - parsed
            if tokens:
                counts["tokens"] += len(tok.encode(tokenizer, text))
                spent[2] += time.perf_counter() - rendered
            counts["sessions"] += 1
            counts["messages"] += len(session.messages or ())
            counts["rendered"] += len(text.encode("utf-8"))
    return counts | {"load": load, "seconds": (spent[0], spent[0] + spent[1], sum(spent) if tokens else 0.0)}


if __name__ == "__main__":
    main()
