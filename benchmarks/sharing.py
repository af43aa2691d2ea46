"""Prefix sharing on a chat workload: conversations with one common system prompt, archived
after every turn (as a chat app would), on the embedded model.

    .venv/bin/python benchmarks/sharing.py [--conversations 4] [--turns 6] [--cli-conversations 2 --cli-turns 8]
        [--no-results]

Reports tokens summed over sessions against tokens stored once, the bytes of the token tier
against what per-session storage would take, and the ingest time of each appended turn next
to the conversation's length (the claim: time follows the turn, not the conversation): once
in one process, and once with every turn ingested by its own `kvdb ingest` process, with the
on-disk prefix cache and without it, side by side. Writes its tables to benchmarks/RESULTS.md,
in place of the last run's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from corpus import real_text
from report import publish

import kvdb
from kvdb.codecs import fractal
from kvdb.model import chat
from kvdb.model import tokenizer as tok

SYSTEM = "You are a patient assistant for a software licensing help desk. Quote the licence text when it helps."


def conversations(n: int, turns: int) -> list[list[dict]]:
    """Turns made of real sentences: user questions and assistant answers of 1-3 sentences."""
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", real_text(400_000)) if 40 < len(s.strip()) < 300]
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(turns):
            role = "user" if t % 2 == 0 else "assistant"
            picked = rng.choice(len(sentences), size=1 if role == "user" else 3, replace=False)
            messages.append({"role": role, "content": " ".join(sentences[i] for i in picked)})
        out.append(messages)
    return out


def per_process_turns(convs: list[list[dict]], cache_mb: int) -> list[tuple[int, int, int, int, float]]:
    """(conversation, turn, session tokens, new tokens, ingest seconds) with every turn archived by
    a `kvdb ingest` process of its own; seconds as the CLI reports them (model load excluded)."""
    rows = []
    kvdb_script = Path(sys.executable).parent / "kvdb"
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, KVDB_DB=str(Path(tmp) / "cli.duckdb"), KVDB_PREFIX_CACHE_MB=str(cache_mb))
        for c, messages in enumerate(convs):
            for t in range(1, len(messages)):
                path = Path(tmp) / f"c{c}t{t}.json"
                path.write_text(json.dumps({"messages": messages[: t + 1]}))
                done = subprocess.run(
                    [str(kvdb_script), "ingest", str(path), "--json"],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                [r] = [json.loads(line) for line in done.stdout.splitlines()]
                rows.append((c, t, r["n_tokens"], r["new_tokens"], r["seconds"]))
    return rows


def summary(rows) -> tuple[float, float, float]:
    """(median ms per new token after each conversation's first two turns, correlation of time
    with new tokens, with session length)."""
    later = [r for r in rows if r[1] > 2]
    new, secs, length = (np.array([r[k] for r in later], dtype=float) for k in (3, 4, 2))
    per_new = statistics.median(r[4] / max(r[3], 1) * 1e3 for r in later)
    return per_new, float(np.corrcoef(new, secs)[0, 1]), float(np.corrcoef(length, secs)[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument(
        "--cli-conversations", type=int, default=2, help="conversations for the one-process-per-turn runs"
    )
    parser.add_argument("--cli-turns", type=int, default=8)
    parser.add_argument("--no-results", action="store_true", help="print only; do not write RESULTS.md")
    args = parser.parse_args()
    convs = conversations(args.conversations, args.turns)
    with tempfile.TemporaryDirectory() as tmp, kvdb.open(Path(tmp) / "bench.duckdb") as db:
        lm = db.loaded_model
        rows = []  # (conversation, turn, session tokens, new tokens, seconds)
        per_session_bytes = 0
        alphabet = max(lm.model.config.vocab_size, len(lm.tokenizer))
        for c, messages in enumerate(convs):
            for t in range(1, len(messages)):
                prefix = messages[: t + 1]
                stored = db.stats().stored_tokens
                start = time.perf_counter()
                [r] = db.ingest(messages=prefix, name=f"c{c}t{t}")
                seconds = time.perf_counter() - start
                rows.append((c, t, r.n_tokens, db.stats().stored_tokens - stored, seconds))
                ids = np.asarray(tok.encode(lm.tokenizer, chat.render(lm.tokenizer, prefix)))
                per_session_bytes += sum(len(b) for b in fractal.encode_blocks(ids, alphabet)) + 12
        st = db.stats()
    per_new, corr_new, corr_len = summary(rows)
    lines = [
        f"Run at {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC. "
        f"`{' '.join(['.venv/bin/python', 'benchmarks/sharing.py', *sys.argv[1:]])}` — {platform.machine()}, "
        f"{os.cpu_count()} cores; SmolLM2-135M-Instruct; {args.conversations} conversations × {args.turns} turns of "
        "real sentences after one common system prompt, each conversation "
        f"archived after every turn ({len(rows)} sessions, one process).\n",
        "| measure | value |",
        "|---|---|",
        f"| sessions | {st.sessions} |",
        f"| tokens summed over sessions | {st.tokens:,} |",
        f"| tokens stored once (trie) | {st.stored_tokens:,} ({st.stored_tokens / st.tokens:.1%}) |",
        f"| trie nodes | {st.nodes} |",
        f"| token tier bytes, trie | {st.bytes['tokens']:,} ({st.bytes_per_token['tokens']:.3f} B per session token) |",
        f"| token tier bytes, one stream per session | {per_session_bytes:,} "
        f"({per_session_bytes / st.tokens:.3f} B per session token) |",
        f"| ingest time per new token, turns 3 and later (median) | {per_new:.2f} ms |",
        f"| correlation of ingest time with new tokens / with session length | {corr_new:.2f} / {corr_len:.2f} |",
        "",
        "| conversation | turn | session tokens | new tokens stored | ingest s |",
        "|---:|---:|---:|---:|---:|",
        *[f"| {c} | {t} | {n} | {k} | {s:.3f} |" for c, t, n, k, s in rows],
    ]
    cli_convs = conversations(args.cli_conversations, args.cli_turns)
    arms = {"prefix cache on": per_process_turns(cli_convs, 1024), "prefix cache off": per_process_turns(cli_convs, 0)}
    lines += [
        f"\n### Every turn in its own process ({args.cli_conversations} "
        f"conversations × {args.cli_turns} turns, `kvdb ingest --json` per turn)\n",
        "Seconds are the ingest's own (`seconds` in the JSON), without the process's model load. The prefix cache "
        "keeps the exact KV of a conversation seen growing (from its "
        "second archived turn on); summaries cover turns 3 and later.\n",
        "| arm | median ms per new token | corr. with new tokens | corr. with session length | total ingest s |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {arm} | {summary(r)[0]:.2f} | {summary(r)[1]:.2f} | {summary(r)[2]:.2f} | {sum(x[4] for x in r):.2f} |"
            for arm, r in arms.items()
        ],
        "",
        "| conversation | turn | session tokens | new tokens | s, cache on | s, cache off |",
        "|---:|---:|---:|---:|---:|---:|",
        *[f"| {a[0]} | {a[1]} | {a[2]} | {a[3]} | {a[4]:.3f} | {b[4]:.3f} |" for a, b in zip(*arms.values())],
    ]
    publish("Prefix sharing on a chat workload", lines, append=not args.no_results)


if __name__ == "__main__":
    main()
