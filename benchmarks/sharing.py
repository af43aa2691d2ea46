"""Prefix sharing on a chat workload: conversations with one common system prompt, archived
after every turn (as a chat app would), on the embedded model.

    .venv/bin/python benchmarks/sharing.py [--conversations 4] [--turns 6]

Reports tokens summed over sessions against tokens stored once, the bytes of the token tier
against what per-session storage would take, and the ingest time of each appended turn next
to the conversation's length (the claim: time follows the turn, not the conversation).
Appends a table to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import kvdb  # noqa: E402
from corpus import real_text  # noqa: E402
from kvdb import fractal  # noqa: E402
from kvdb import model as lm_ops  # noqa: E402
from report import publish  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    convs = conversations(args.conversations, args.turns)
    with tempfile.TemporaryDirectory() as tmp, kvdb.open(Path(tmp) / "bench.duckdb") as db:
        lm = db.lm
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
                ids = np.asarray(lm_ops.encode_text(lm.tokenizer, lm_ops.render_messages(lm.tokenizer, prefix)))
                per_session_bytes += sum(len(b) for b in fractal.encode_blocks(ids, alphabet)) + 12
        st = db.stats()
    new = np.array([r[3] for r in rows], dtype=float)
    secs = np.array([r[4] for r in rows])
    length = np.array([r[2] for r in rows], dtype=float)
    later = [r for r in rows if r[1] > 1]  # turns after the first of each conversation
    per_new = statistics.median(r[4] / max(r[3], 1) * 1e3 for r in later)
    corr_new = float(np.corrcoef(new[1:], secs[1:])[0, 1])
    corr_len = float(np.corrcoef(length[1:], secs[1:])[0, 1])
    lines = [
        f"\n## Prefix sharing on a chat workload ({time.strftime('%Y-%m-%d')})\n",
        f"`{' '.join(['.venv/bin/python', 'benchmarks/sharing.py', *sys.argv[1:]])}` — {platform.machine()}, {os.cpu_count()} cores; "
        f"SmolLM2-135M-Instruct; {args.conversations} conversations × {args.turns} turns of real sentences after one common system "
        f"prompt, each conversation archived after every turn ({len(rows)} sessions, one process).\n",
        "| measure | value |",
        "|---|---|",
        f"| sessions | {st.sessions} |",
        f"| tokens summed over sessions | {st.tokens:,} |",
        f"| tokens stored once (trie) | {st.stored_tokens:,} ({st.stored_tokens / st.tokens:.1%}) |",
        f"| trie nodes | {st.nodes} |",
        f"| token tier bytes, trie | {st.bytes['tokens']:,} ({st.bytes_per_token['tokens']:.3f} B per session token) |",
        f"| token tier bytes, one stream per session | {per_session_bytes:,} ({per_session_bytes / st.tokens:.3f} B per session token) |",
        f"| ingest time per new token, turns after the first (median) | {per_new:.2f} ms |",
        f"| correlation of ingest time with new tokens / with session length | {corr_new:.2f} / {corr_len:.2f} |",
        "",
        "| conversation | turn | session tokens | new tokens stored | ingest s |",
        "|---:|---:|---:|---:|---:|",
        *[f"| {c} | {t} | {n} | {k} | {s:.3f} |" for c, t, n, k, s in rows],
    ]
    publish(lines)


if __name__ == "__main__":
    main()
