"""Every transcript format of examples/transcripts through `kvdb ingest` and `kvdb show` on the
embedded model: the sessions each file gives, their tokens, what was kept only as a placeholder,
and whether every text of the file comes back from `show`.

    .venv/bin/python benchmarks/formats.py [--no-results]

"Text kept" checks each non-empty string the file holds under a key that carries conversation
text (``tests/support.py``'s TEXT_KEYS: content, text, value, arguments, output, ...): it must appear in the `show` output of the file's sessions. For a text
file the check is `show` equal to the file. Appends a section to benchmarks/RESULTS.md unless
``--no-results``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from report import describe, publish  # noqa: E402
from support import conversation_texts  # noqa: E402 - the same check as the tests'

TRANSCRIPTS = Path(__file__).resolve().parents[1] / "examples" / "transcripts"
KVDB = Path(sys.executable).with_name("kvdb")
RENDERED = {
    "text": "verbatim",
    "messages": "chat template",
    "openai": "chat template; tool calls and results as <tool_call>/<tool_result> text; name as `name: text`",
    "openai-responses": "chat template; reasoning as <thinking>, calls joined to their assistant turn",
    "chatgpt": "chat template along current_node; other branches as `[branch N]` sessions",
    "anthropic": "chat template; system first; tool_use/tool_result as text, thinking as <thinking>, image as a placeholder",
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
    parser.add_argument("--no-results", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        db = Path(folder) / "formats.duckdb"
        for path in sorted(TRANSCRIPTS.iterdir()):
            results = [json.loads(line) for line in kvdb(db, "ingest", str(path), "--json").splitlines()]
            shown = "".join(kvdb(db, "show", r["session_id"]) for r in results)
            sessions = [s for s in map(json.loads, kvdb(db, "sessions", "--json").splitlines()) if s["session_id"] in {r["session_id"] for r in results}]
            formats = sorted({kvdb_format(db, s["session_id"]) for s in sessions})
            if path.suffix in (".txt", ".md"):
                kept = "yes" if shown == path.read_text(encoding="utf-8") else "NO"
            else:
                raw = [json.loads(line) for line in path.read_text().splitlines()] if path.suffix == ".jsonl" else json.loads(path.read_text())
                wanted = list(conversation_texts(raw))
                missing = [t for t in wanted if t not in shown]
                kept = f"{len(wanted) - len(missing)}/{len(wanted)}" + ("" if not missing else f" (missing: {missing[:2]})")
            dropped = {}
            for r in results:
                for kind, count in r.get("dropped", {}).items():
                    dropped[kind] = dropped.get(kind, 0) + count
            rows.append((path.name, ", ".join(formats), len(results), sum(r["n_tokens"] for r in results), ", ".join(f"{k}: {v}" for k, v in dropped.items()) or "-", kept, "; ".join(RENDERED[f] for f in formats)))
    lines = [
        "## Transcript formats (`benchmarks/formats.py`)",
        "",
        describe(),
        "",
        "| file | format | sessions | tokens | dropped (placeholders) | text kept (by `show`) | rendered |",
        "|---|---|---:|---:|---|---|---|",
        *(f"| {' | '.join(map(str, row))} |" for row in rows),
        "",
    ]
    publish(lines, append=not args.no_results)


if __name__ == "__main__":
    main()
