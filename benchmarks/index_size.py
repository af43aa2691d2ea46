"""The search index's bytes per token by the size of the trie's nodes, and what its runs' links
save. One command:

    .venv/bin/python benchmarks/index_size.py [--tokens 1000000] [--turns 50,200,1000,5000]

A conversation archived turn by turn (a log that `kvdb watch` follows, a chat) is a chain of
nodes, one per turn, each a run of the index with the path before it. Each row indexes
``--tokens`` random tokens (SmolLM2's 49,152 ids) as conversations of 20 turns of one size, and
as sessions of one node each (no path before them), three ways:

- at once, every run linked to its parent's last slot (`kvdb repair`, a new copy's first build);
- at once, each run keeping its context instead (the format before links: up to 255 tokens);
- node by node, as commits add them: a run links to a slot the index holds with its 255 tokens
  of context, and one whose path is shorter keeps it.

Bytes are the files `WalkIndex.save` writes (base and tail). It writes RESULTS.md "Search index
size by node size".
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from report import describe, publish

import kvdb
from kvdb.index.walk import WalkIndex

ALPHABET = 49_152
TURNS_PER_CONVERSATION = 20


def conversations(tokens: int, turn: int | None, rng: np.random.Generator) -> tuple[list, dict[int, int], int]:
    """(runs as ``WalkIndex.extend`` takes them, each run's parent's last slot, slots):
    conversations of ``turn``-token turns, or one-node sessions of 5,000 tokens (``None``)."""
    runs, parents, slot = [], {}, 0
    while slot < tokens:
        path = np.zeros(0, np.int64)
        for _ in range(TURNS_PER_CONVERSATION if turn else 1):
            node = rng.integers(0, ALPHABET, turn or 5_000)
            runs.append((slot, node, path if len(path) else None))
            if len(path):
                parents[slot] = slot - 1
            path = np.concatenate([path, node])
            slot += len(node)
    return runs, parents, slot


def saved_bytes(index: WalkIndex) -> int:
    with tempfile.TemporaryDirectory() as folder:
        index.save(Path(folder) / "i.keys")
        return sum(f.stat().st_size for f in Path(folder).iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--turns", default="50,200,1000,5000", help="turn sizes in tokens, comma-separated")
    parser.add_argument("--no-results", action="store_true", help="print only; do not write RESULTS.md")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for turn in [None, *(int(t) for t in args.turns.split(","))]:
        runs, parents, slots = conversations(args.tokens, turn, rng)
        cells = []
        for way in ("linked", "kept", "commits"):
            index = WalkIndex(ALPHABET)
            started = time.perf_counter()
            if way == "commits":
                for run in runs:
                    index.extend([run], run[0] + len(run[1]))
            else:
                index.extend(runs, slots, parents if way == "linked" else None)
            index.settle()
            cells.append((saved_bytes(index) / slots, time.perf_counter() - started))
        rows.append((turn, len(runs), slots, cells))
        print(f"turn {turn}: " + ", ".join(f"{b:.3f} B/token in {s:.1f} s" for b, s in cells), flush=True)
    lines = [
        "## Search index size by node size",
        "",
        f"`.venv/bin/python benchmarks/index_size.py --tokens {args.tokens} --turns {args.turns}`; {describe(f'kvdb {kvdb.__version__}')}.",
        "",
        f"Random tokens of a 49,152-id vocabulary, as conversations of {TURNS_PER_CONVERSATION} turns of one size (each turn a "
        "node under the last), or as sessions of one 5,000-token node. Bytes per token of the index files "
        "(`KVDBIDX6`: 4-byte slot and 2-byte token a position, a sampled key per 64, and per run 24 bytes with a "
        "link, or 16 bytes and its context of up to 255 tokens at 2 bytes each). Seconds include the sort.",
        "",
        "| nodes | runs | tokens | linked to the parent (built at once) | s | context kept (built at once) | s | node by node (commits) | s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for turn, runs_n, slots, cells in rows:
        name = "one per session, 5,000 tokens" if turn is None else f"turns of {turn:,} tokens"
        lines.append(f"| {name} | {runs_n:,} | {slots:,} | " + " | ".join(f"{b:.3f} | {s:.1f}" for b, s in cells) + " |")
    publish(lines, append=not args.no_results)


if __name__ == "__main__":
    main()
