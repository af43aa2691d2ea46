"""Phrase search in any casing (issue 54, item 1): recall and latency of ``Archive.search`` on a
set of proper nouns, acronyms and camel-case names, typed in lower, upper, title case and as
written, in an archive of ``--tokens`` tokens (``search.py``'s corpus, the set planted in it).

    .venv/bin/python benchmarks/casing.py [--tokens 1e6] [--reps 3] [--json] [--archive PATH]

Ground truth: every place a session's decoded text holds the phrase in any casing, between word
edges (a regular expression, ignoring case), and the token sequences of the casings so found
(each as written and after a space) located in the token stream. Recall is of
``search(phrase, k=occurrences + 5, each_occurrence=True)``'s full matches; "no exact-casing loss"
checks that every case-sensitive hit of the phrase as written is among the default search's;
``count`` must equal the default search's full matches. Latency: k = 10, the phrase's first
call alone, then the median of ``--reps``, for the default search, the case-sensitive one and
the count. Prints; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from report import describe, median_seconds
from search import Truth, build_archive, make_corpus, pct, scale_sessions, vocab_tables

import kvdb
from kvdb.model import tokenizer as T

SET = {
    "proper nouns": [
        "Tokyo to Kyoto", "New York City", "Osaka Castle", "United Nations", "Mount Fuji", "Buenos Aires",
        "Hugging Face", "Microsoft Word",
    ],
    "acronyms": [
        "JR Pass", "NASA", "the FBI and the CIA", "HTTP request", "USB cable", "GPU memory", "JSON file", "SQL query",
        "PDF export", "NATO summit",
    ],
    "camel case": [
        "iPhone", "iPad Pro", "eBay", "macOS", "JavaScript", "TypeScript", "PostgreSQL", "YouTube", "GitHub Actions",
        "ChatGPT", "OpenAI", "LinkedIn", "PayPal", "WordPress", "SQLite", "DuckDB", "LaTeX", "McDonald", "PowerPoint",
        "PlayStation", "FedEx", "NumPy", "PyTorch", "TensorFlow", "WiFi", "AirBnB", "MySQL", "GraphQL", "NoSQL",
        "AutoCAD",
    ],
    "outside the casings looked for": ["XMLHttpRequest", "getElementById"],
}  # fmt: skip
COPIES = 3  # planted as written; one more in upper case, one in lower case


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def typed_forms(phrase: str) -> dict[str, str]:
    return {
        "lower": phrase.lower(),
        "upper": phrase.upper(),
        "title": " ".join(w[:1].upper() + w[1:].lower() for w in phrase.split(" ")),
        "as written": phrase,
    }


def plant(sessions: list[np.ndarray], tok, space: np.ndarray, rng: np.random.Generator) -> None:
    """Each phrase of the set, after a space, at word starts of random sessions: ``COPIES`` as
    written, one in upper and one in lower case."""
    for phrases in SET.values():
        for phrase in phrases:
            for text in [phrase] * COPIES + [phrase.upper(), phrase.lower()]:
                ids = np.asarray(T.encode(tok, " " + text), np.int64)
                s = int(rng.integers(len(sessions)))
                starts = np.flatnonzero(space[sessions[s][1:-1]]) + 1
                at = int(rng.choice(starts)) if len(starts) else len(sessions[s])
                sessions[s] = np.concatenate([sessions[s][:at], ids, sessions[s][at:]])


def truth_of(phrase: str, texts: list[str], truth: Truth, tok) -> set[tuple[int, int]]:
    """(session, end token) of every casing of ``phrase`` the text holds between word edges."""
    pattern = re.compile(r"(?<![^\W_])" + re.escape(phrase) + r"(?![^\W_])", re.IGNORECASE)
    written = {m.group(0) for text in texts for m in pattern.finditer(text)}
    variants = [np.asarray(T.encode(tok, p + w), np.int64) for w in written for p in ("", " ")]
    return truth.token_occurrences(variants) if variants else set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=1e6)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--archive", type=Path, help="build the archive here, or reuse the one there (the same --tokens and --seed)"
    )
    args = parser.parse_args()
    n = int(args.tokens)
    rng = np.random.default_rng(args.seed)
    tok = T.load()
    tok_hash = T.fingerprint(tok)
    space, _ = vocab_tables(tok)
    corpus = make_corpus(tok, n, rng, 1)
    sessions = scale_sessions(corpus, n)
    plant(sessions, tok, space, rng)
    t = time.perf_counter()
    texts = [T.decode(tok, s) for s in sessions]
    truth = Truth(sessions, texts)
    log(
        f"{sum(len(s) for s in sessions):,} tokens in {len(sessions)} "
        f"sessions, decoded in {time.perf_counter() - t:.1f} s"
    )
    rows, lat = [], {"default": [], "first": [], "case_sensitive": [], "count": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.archive or Path(tmp) / "casing.duckdb"
        index_s: float | None = None  # reused: not built here
        if not path.exists():
            _, write_s, index_s = build_archive(path, tok_hash, sessions)
            log(f"written in {write_s:.1f} s, index built in {index_s:.1f} s")
        with kvdb.open(path, read_only=True) as db:
            ids = {s.session_id: i for i, s in enumerate(sorted(db.sessions(), key=lambda s: s.name))}
            for group, phrases in SET.items():
                for phrase in phrases:
                    want = truth_of(phrase, texts, truth, tok)
                    exact = {
                        (ids[h.session_id], h.position + h.match_tokens - 1)
                        for h in db.search(phrase, k=len(want) + 5, case_sensitive=True, each_occurrence=True)
                        if h.exact
                    }
                    for form, typed in typed_forms(phrase).items():
                        lat["first"].append(1e3 * median_seconds(partial(db.search, typed, k=10), 1))
                        lat["default"].append(1e3 * median_seconds(partial(db.search, typed, k=10), args.reps))
                        lat["case_sensitive"].append(
                            1e3 * median_seconds(partial(db.search, typed, k=10, case_sensitive=True), args.reps)
                        )
                        lat["count"].append(1e3 * median_seconds(partial(db.count, typed), args.reps))
                        hits = db.search(typed, k=len(want) + 5, each_occurrence=True)
                        found = {(ids[h.session_id], h.position + h.match_tokens - 1) for h in hits if h.exact}
                        counted = db.count(typed).count
                        rows.append(
                            {
                                "group": group,
                                "phrase": phrase,
                                "typed": form,
                                "truth": len(want),
                                "found": len(found & want),
                                "extra": len(found - want),
                                "count": counted,
                                "count_exact": counted == len(found),
                                "exact_casing_kept": exact <= found,
                            }
                        )
    by_group = {}
    for group in SET:
        mine = [r for r in rows if r["group"] == group]
        by_group[group] = {
            "phrases": len(mine),
            "occurrences": sum(r["truth"] for r in mine),
            "recall": round(sum(r["found"] for r in mine) / max(1, sum(r["truth"] for r in mine)), 4),
            "exact_casing_kept": all(r["exact_casing_kept"] for r in mine),
        }
    looked_for = [r for r in rows if r["group"] != "outside the casings looked for"]
    out = {
        "tokens": n,
        "machine": describe(),
        "recall": round(sum(r["found"] for r in looked_for) / max(1, sum(r["truth"] for r in looked_for)), 4),
        "by_group": by_group,
        "count_exact": all(r["count_exact"] for r in rows),
        "exact_casing_kept": all(r["exact_casing_kept"] for r in looked_for),
        "extra": sum(r["extra"] for r in rows),
        "latency_ms": {
            name: {"p50": round(pct(v, 50), 3), "p95": round(pct(v, 95), 3), "max": round(max(v), 3)}
            for name, v in lat.items()
        },
        "index_build_s": None if index_s is None else round(index_s, 1),
        "misses": [r for r in rows if r["found"] < r["truth"] or not r["exact_casing_kept"]],
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
