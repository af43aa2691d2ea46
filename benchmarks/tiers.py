"""Storage per tier policy on the same sessions: every byte an archive keeps, per session token.

    .venv/bin/python benchmarks/tiers.py [--sessions 3] [--chars 1500]

Three archives of the same real-text sessions on the embedded model: the default
(`tokens,search`), with tier L added (`tokens,search,lm`), and tier L as the only copy of the
tokens (`lm`). Reports the bytes of each table (as `kvdb stats` counts them), the search
sidecar and the DuckDB file, the ingest time, and the time to read every session back (a
decode of tier L where it is the only copy), checking the text comes back exactly.
Appends a table to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import kvdb  # noqa: E402
from corpus import real_text  # noqa: E402
from report import describe, publish  # noqa: E402

POLICIES = ("tokens,search", "tokens,search,lm", "lm")
TIERS = ("tokens", "lm", "logprobs", "metadata")  # as `kvdb stats` counts them; search slot rows are metadata


def run(policy: str, texts: list[str], folder: Path) -> dict:
    path = folder / f"{policy.replace(',', '-')}.duckdb"
    with kvdb.open(path) as db:
        db.loaded_model  # the model loads outside the timings
        start = time.perf_counter()
        for i, text in enumerate(texts):
            db.ingest(text=text, name=f"s{i}", keep=policy)
        ingest = time.perf_counter() - start
    with kvdb.open(path, read_only=True) as db:  # a fresh process's view: nothing decoded yet
        start = time.perf_counter()
        exact = all(db.text(f"s{i}") == text for i, text in enumerate(texts))
        read = time.perf_counter() - start
        st = db.stats()
        # the model's cross-entropy of every session (the first token at the uniform prior), from
        # the log-probabilities ingest stored: what tier L's bytes are measured against
        ce_bits = -sum(float(db.logprobs(f"s{i}").sum()) for i in range(len(texts))) / math.log(2) if "tokens" in policy else None
    index = sum(p.stat().st_size for p in path.with_name(path.name + ".index").glob("*"))
    return {"stats": st, "index": index, "ingest": ingest, "read": read, "exact": exact, "ce_bits": ce_bits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--chars", type=int, default=1500, help="characters of real text per session")
    args = parser.parse_args()
    corpus = real_text(args.sessions * args.chars + 10_000)[10_000:]
    texts = [corpus[i * args.chars : (i + 1) * args.chars] for i in range(args.sessions)]
    with tempfile.TemporaryDirectory() as tmp:
        results = {policy: run(policy, texts, Path(tmp)) for policy in POLICIES}
    n = results[POLICIES[0]]["stats"].tokens
    ce_bits = results[POLICIES[0]]["ce_bits"]
    header = "| --keep | " + " | ".join(TIERS) + " | search sidecar | total | DuckDB file | ingest s | read-back s | exact | lm bits / CE |"
    lines = [
        f"\n## Storage per tier policy ({time.strftime('%Y-%m-%d')})\n",
        f"`{' '.join(['.venv/bin/python', 'benchmarks/tiers.py', *sys.argv[1:]])}` — {describe()}; SmolLM2-135M-Instruct; "
        f"{args.sessions} real-text sessions, {n:,} tokens. Bytes per session token; `total` is every tier plus the "
        "search sidecar (the DuckDB file adds its page overhead, large at this size). Read-back is `text()` of every "
        "session from a fresh read-only open. lm bits / CE: every byte of the stored tier-L payloads (headers and each "
        f"session's first token included) over the model's cross-entropy of the sessions ({ce_bits / n:.3f} bits/token, "
        "from the log-probabilities ingest stored).\n",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for policy, r in results.items():
        st = r["stats"]
        per = {tier: st.bytes.get(tier, 0) / st.tokens for tier in TIERS}
        total = sum(per.values()) + r["index"] / st.tokens
        lines.append(
            f"| `{policy}` | " + " | ".join(f"{per[t]:.3f}" for t in TIERS)
            + f" | {r['index'] / st.tokens:.3f} | **{total:.3f}** | {st.bytes['file'] / st.tokens:.1f} | {r['ingest']:.1f} | {r['read']:.2f} | {r['exact']} | "
            + (f"{8 * st.bytes['lm'] / ce_bits:.4f} |" if st.bytes.get("lm") else "|")
        )
    publish(lines)


if __name__ == "__main__":
    main()
