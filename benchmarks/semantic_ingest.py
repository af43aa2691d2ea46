"""What the semantic tier adds to ingest time: the same sessions ingested into two archives,
one keeping ``tokens,search`` and one those and ``semantic`` (the default), side by side.

    .venv/bin/python benchmarks/semantic_ingest.py [--sessions N] [--no-results]

Sessions: the first N (default 100) target documents of ``benchmarks/retrieval.py`` (Python
functions, text sessions) and every chat of ``examples/transcripts`` (chat sessions, cut into
turns). Each session is ingested into both archives one after the other, the order alternating,
so that the machine's load falls on both alike. The embedder's load (once per process) is
reported apart from the per-session cost; the overhead is the ratio of the totals without it.
The tier is in the default ``--keep`` while it adds at most 15% (issue 32).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from report import describe, publish
from retrieval import retrieval_set

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()

    import kvdb
    from kvdb.model import loading
    from kvdb.model.embedder import Embedder
    from kvdb.transcripts import find_transcript_files, iter_transcripts

    items, _, _ = retrieval_set(300, 0)
    texts = [(item.name, item.document) for item in items[: args.sessions]]
    chats = [
        path
        for path in find_transcript_files([ROOT / "examples" / "transcripts"])
        if any(t.messages is not None for t in iter_transcripts(path))
    ]
    model = loading.load(None)
    start = time.perf_counter()
    embedder = Embedder()
    embedder.embed(["warm up"])
    load_s = time.perf_counter() - start
    without, with_tier = "tokens,search", "tokens,search,semantic"
    seconds = {without: 0.0, with_tier: 0.0}
    tokens = 0
    with tempfile.TemporaryDirectory() as folder:
        archives = {
            keep: kvdb.open(Path(folder) / f"{n}.duckdb", model=model, embedder=embedder)
            for n, keep in enumerate(seconds)
        }
        sessions = [((), {"text": text, "name": name}) for name, text in texts] + [((str(path),), {}) for path in chats]
        for i, (paths, given) in enumerate(sessions):
            order = list(seconds) if i % 2 == 0 else list(seconds)[::-1]
            for keep in order:
                start = time.perf_counter()
                results = archives[keep].ingest(*paths, keep=keep, **given)
                archives[keep].upkeep(only="semantic")  # the embedder's pass, which ingest queues (decision 0053)
                seconds[keep] += time.perf_counter() - start
            tokens += sum(r.n_tokens for r in results)
        for archive in archives.values():
            archive.close()
    base, more = seconds[without], seconds[with_tier]
    lines = [
        describe("torch", "transformers"),
        f"{len(texts)} Python functions of benchmarks/retrieval.py (text sessions) and the {len(chats)} chat files of "
        f"examples/transcripts, {tokens:,} tokens, each ingested into both archives in turn (the order alternating); "
        "the embedded SmolLM2 for both. The embedder (all-MiniLM-L6-v2) "
        f"loads once per process: {load_s:.1f} s, not counted below.",
        "",
        "| --keep | seconds | per 1,000 tokens | overhead |",
        "|---|---:|---:|---:|",
        f"| `{without}` | {base:.1f} | {1e3 * base / tokens:.2f} | |",
        f"| `{with_tier}` | {more:.1f} | {1e3 * more / tokens:.2f} | {100 * (more / base - 1):+.1f}% |",
    ]
    publish("Semantic tier: ingest overhead", lines, append=not args.no_results)


if __name__ == "__main__":
    main()
