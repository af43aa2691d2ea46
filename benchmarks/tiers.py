"""Storage per tier policy on the same sessions: every byte an archive keeps, per session token.

    .venv/bin/python benchmarks/tiers.py [--sessions 3] [--chars 1500] [--chat 0] [--no-results]

Three archives of the same real-text sessions on the embedded model: the default
(`tokens,search`), with tier L added (`tokens,search,lm`), and tier L as the only copy of the
tokens (`lm`). Reports the bytes of each table (as `kvdb stats` counts them), the search
sidecar and the DuckDB file, the ingest time, and the time to read every session back (a
decode of tier L where it is the only copy), checking the tokens (and a text session's text) come back exactly.
With ``--chat N`` the sessions are instead N conversations of 6 turns after one system prompt
(`sharing.py`'s), archived after every turn: trie nodes of one turn each, where tier L's
per-node overhead weighs most. Writes its table to benchmarks/RESULTS.md, in place of the last
run's of the same workload (real-text sessions, or ``--chat``).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from corpus import real_text
from report import describe, publish

import kvdb
from kvdb.index.trie import common_prefix

POLICIES = ("tokens,search", "tokens,search,lm", "lm")
TIERS = ("tokens", "lm", "logprobs", "metadata")  # as `kvdb stats` counts them; search slot rows are metadata


def run(policy: str, sessions: dict[str, dict], folder: Path, expected: dict[str, np.ndarray] | None) -> dict:
    """One archive of ``sessions`` (name -> ingest arguments) kept as ``policy``; ``expected``:
    each session's tokens from an archive that keeps them (None: this one keeps them)."""
    path = folder / f"{policy.replace(',', '-')}.duckdb"
    with kvdb.open(path) as db:
        assert db.loaded_model is not None  # the model loads outside the timings
        start = time.perf_counter()
        for name, given in sessions.items():
            db.ingest(**given, name=name, keep=policy)
        ingest = time.perf_counter() - start
    with kvdb.open(path, read_only=True) as db:  # a fresh process's view: nothing decoded yet
        start = time.perf_counter()
        tokens = {name: db.tokens(name) for name in sessions}
        read = time.perf_counter() - start
        exact = expected is None or all(np.array_equal(tokens[name], expected[name]) for name in sessions)
        exact = exact and all(db.text(name) == given["text"] for name, given in sessions.items() if "text" in given)
        st = db.stats()
        ce_bits = stored_cross_entropy(db, tokens, st.stored_tokens) if "tokens" in policy else None
    index = sum(p.stat().st_size for p in path.with_name(path.name + ".index").glob("*"))
    return {
        "stats": st,
        "index": index,
        "ingest": ingest,
        "read": read,
        "exact": exact,
        "ce_bits": ce_bits,
        "tokens": tokens,
    }


def stored_cross_entropy(db, tokens: dict[str, np.ndarray], stored: int) -> float:
    """The model's cross-entropy in bits of every token the trie stores once (a session's first
    token at the uniform prior), from the log-probabilities ingest stored: what tier L's bytes
    are measured against. In lexicographic order each session shares with the one before it the
    longest prefix it shares with any, so the positions past that are the ones it adds."""
    ordered = sorted(tokens, key=lambda name: tokens[name].tolist())
    nats, counted, previous = 0.0, 0, np.zeros(0, dtype=np.int64)
    for name in ordered:
        ids = tokens[name]
        shared = common_prefix(previous, ids)
        nats += float(db.logprobs(name)[shared:].sum())
        counted += len(ids) - shared
        previous = ids
    assert counted == stored, f"{counted} tokens counted, the trie stores {stored}"
    return -nats / math.log(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--chars", type=int, default=1500, help="characters of real text per session")
    parser.add_argument(
        "--chat", type=int, default=0, help="N conversations of 6 turns instead, archived after every turn"
    )
    parser.add_argument("--no-results", action="store_true", help="print only; do not write RESULTS.md")
    args = parser.parse_args()
    if args.chat:
        from sharing import conversations

        sessions = {
            f"c{c}t{t}": {"messages": conv[: t + 2]}
            for c, conv in enumerate(conversations(args.chat, 6))
            for t in range(6)
        }
        what = (
            f"{args.chat} conversations of 6 turns of real sentences after one "
            f"system prompt, archived after every turn ({len(sessions)} sessions)"
        )
    else:
        corpus = real_text(args.sessions * args.chars + 10_000)[10_000:]
        sessions = {f"s{i}": {"text": corpus[i * args.chars : (i + 1) * args.chars]} for i in range(args.sessions)}
        what = f"{args.sessions} real-text sessions"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in POLICIES:
            results[policy] = run(policy, sessions, Path(tmp), results[POLICIES[0]]["tokens"] if results else None)
    n = results[POLICIES[0]]["stats"].tokens
    ce_bits = results[POLICIES[0]]["ce_bits"]
    stored = results[POLICIES[0]]["stats"].stored_tokens
    header = (
        "| --keep | "
        + " | ".join(TIERS)
        + " | search sidecar | total | DuckDB file | ingest s | read-back s | exact | lm bits / CE |"
    )
    heading = "Storage per tier policy on a chat workload" if args.chat else "Storage per tier policy"
    lines = [
        f"Run at {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC. "
        f"`{' '.join(['.venv/bin/python', 'benchmarks/tiers.py', *sys.argv[1:]])}` — {describe()}; "
        f"SmolLM2-135M-Instruct; {what}, {n:,} session tokens, {stored:,} stored once in the trie. Bytes per session "
        "token; `total` is every tier plus the search sidecar (the DuckDB file adds its page overhead, large at this "
        "size). Read-back is the tokens of every session from a fresh read-only open, checked against the first "
        "archive's. lm bits / CE: every byte of the stored tier-L payloads (node framing, the coder's flush and each "
        f"root's first token included) over the model's cross-entropy of the tokens stored ({ce_bits / stored:.3f} "
        "bits/token, from the log-probabilities ingest stored).\n",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for policy, r in results.items():
        st = r["stats"]
        per = {tier: st.bytes.get(tier, 0) / st.tokens for tier in TIERS}
        total = sum(per.values()) + r["index"] / st.tokens
        lines.append(
            f"| `{policy}` | "
            + " | ".join(f"{per[t]:.3f}" for t in TIERS)
            + f" | {r['index'] / st.tokens:.3f} | **{total:.3f}** | {st.bytes['file'] / st.tokens:.1f} | "
            f"{r['ingest']:.1f} | {r['read']:.2f} | {r['exact']} | "
            + (f"{8 * st.bytes['lm'] / ce_bits:.4f} |" if st.bytes.get("lm") else "|")
        )
    publish(heading, lines, append=not args.no_results)


if __name__ == "__main__":
    main()
