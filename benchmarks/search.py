"""Phrase search: recall/precision against exact ground truth, query latency and index size of
``Archive.search`` at 1e5 to 1e8 archived tokens, next to DuckDB ``contains()`` / ``LIKE``
scans over the decoded text, a numpy suffix array and infini-gram's engine over the same tokens.

    .venv/bin/python benchmarks/search.py [--quick] [--scales 1e5,1e6,1e7,1e8] [--no-results] [--json]

infini-gram is measured when its wheel is installed (``.venv/bin/pip install --no-deps
--require-hashes -r benchmarks/requirements-search.txt``). The opening of the index and the
memory of a searching process are measured in a fresh process (``probe``). The whole run takes
about 40 minutes and 12 GiB at its peak (1e8: the store written, the index built, the numpy
suffix array and infini-gram's built on the same stream).

The model is never loaded (only its tokenizer): sessions are written straight through the
store with zero log-probabilities, and the index is built by ``Archive.rebuild_index()``.

Ground truth is token-subsequence search over the archived token streams, within a session:
an occurrence of a phrase is a (session, end position) where one of the two tokenizations
kvdb searches ends ("as typed", and with a leading space; ``kvdb.services.searching.phrase_variants``),
in the phrase's own casing: recall and precision are of ``search(case_sensitive=True)``. The
latency table times both the default search (any casing, issue 54) and that one.
Text-substring occurrences over the decoded session text are counted separately; the ones
with no token occurrence at the same place are "missed by tokenization boundaries".

Data: real text (``corpus.real_text``, ~1.4M tokens) for 1e5 and 1e6; from 1e7 on the real
stream plus synthetic sessions made of the real stream's sentences in shuffled order.

Writes its section of benchmarks/RESULTS.md (in place of the last run's) and writes benchmarks/search_latency.png when
matplotlib is installed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import duckdb
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from corpus import real_text
from report import median_seconds, publish

import kvdb
from kvdb.index import trie
from kvdb.index.phrase import unsuffixed
from kvdb.model import tokenizer as T
from kvdb.services.searching import phrase_variants
from kvdb.storage import open_storage
from kvdb.storage.base import ModelRow, NewNode, PutModel, SessionRow, SessionWrite

ALPHABET = 49152  # what ingest stores for SmolLM2 (max(config.vocab_size, len(tokenizer)))
SESSION_MIN, SESSION_MAX = 2_000, 10_000
PLANTED_LENGTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 18, 20)
NATURAL_LENGTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20)
PLANT_COPIES = 3
RECALL_MAX = 200  # phrases with more occurrences than this are timed (k=10) but not recall-checked
FREQUENT_MIN = 10
RARE_MAX = 3


def log(message: str) -> None:
    """Progress goes to stderr: with --json, stdout holds the JSON objects alone."""
    print(message, file=sys.stderr, flush=True)


# data ---------------------------------------------------------------------------------------


@dataclass
class Corpus:
    sessions: list[np.ndarray]  # int64 token ids, one array per session (all scales: prefixes)
    planted: list[tuple[str, np.ndarray]]  # (phrase as typed, tokens inserted)
    plant_sites: list[tuple[int, int]]  # (session index, start) of every planted copy
    real_tokens: int


def vocab_tables(tok) -> tuple[np.ndarray, np.ndarray]:
    """Per token id: starts with a space (a word start), ends a sentence or line."""
    # T.load() gives a LightTokenizer (no transformers methods): ask its `tokenizers` backend
    backend = tok.backend if isinstance(tok, T.LightTokenizer) else tok.backend_tokenizer
    pieces = [backend.id_to_token(i) for i in range(ALPHABET)]
    space = np.array([p is not None and p.startswith("\u0120") for p in pieces])  # byte-level BPE: 'Ġ' is a space
    stop = np.array([p is not None and p.endswith((".", "!", "?", "\u010a")) for p in pieces])  # 'Ċ' is a newline
    return space, stop


def split_sessions(ids: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    out, i = [], 0
    while i < len(ids):
        n = int(rng.integers(SESSION_MIN, SESSION_MAX + 1))
        out.append(ids[i : i + n])
        i += n
    return out


def make_corpus(tok, total: int, rng: np.random.Generator, n_planted_per_length: int) -> Corpus:
    t = time.perf_counter()
    real = np.asarray(T.encode(tok, real_text(min(total * 5, 6_000_000))), dtype=np.int64)
    space, stop = vocab_tables(tok)
    log(f"  real text: {len(real):,} tokens ({time.perf_counter() - t:.1f} s)")
    real = real[:total]
    sessions = split_sessions(real, rng)
    if total > len(real):  # synthetic: the real sentences in shuffled order
        cut = np.flatnonzero(stop[real]) + 1
        segments = np.split(real, cut)
        synthetic, need = [], total - len(real)
        while need > 0:
            for j in rng.permutation(len(segments)):
                synthetic.append(segments[j])
                need -= len(segments[j])
                if need <= 0:
                    break
        sessions += split_sessions(np.concatenate(synthetic)[: total - len(real)], rng)

    # planted phrases: random words (from the real text) making exactly L tokens with a leading space
    words = sorted({w for w in real_text(200_000).split() if w.isalpha() and 3 <= len(w) <= 12})
    planted = []
    for length in PLANTED_LENGTHS:
        for _ in range(n_planted_per_length):
            for _attempt in range(500):
                chosen, ids = [], []
                while len(ids) < length:
                    chosen.append(words[int(rng.integers(len(words)))])
                    ids = T.encode(tok, " " + " ".join(chosen))
                if len(ids) == length:
                    planted.append((" ".join(chosen), np.asarray(ids, dtype=np.int64)))
                    break
    # insert PLANT_COPIES copies of each at word starts of sessions lying wholly in the first 80% of
    # the smallest scale, so every scale holds them
    lengths = np.cumsum([len(s) for s in sessions])
    eligible = int(np.searchsorted(lengths, 80_000))
    sites = []
    for _phrase, ids in planted:
        for s in rng.choice(max(eligible, 1), size=min(PLANT_COPIES, max(eligible, 1)), replace=False):
            stream = sessions[s]
            starts = np.flatnonzero(space[stream[100:-100]]) + 100
            at = int(rng.choice(starts))
            sessions[s] = np.concatenate([stream[:at], ids, stream[at:]])
            sites.append((int(s), at))
    return Corpus(sessions, planted, sites, min(total, len(real)))


def scale_sessions(corpus: Corpus, n_tokens: int) -> list[np.ndarray]:
    """The first sessions holding exactly ``n_tokens`` (the last one cut short)."""
    out, total = [], 0
    for s in corpus.sessions:
        if total >= n_tokens:
            break
        take = s[: n_tokens - total]
        out.append(take)
        total += len(take)
    return out


# ground truth ---------------------------------------------------------------------------------


class Truth:
    """Exact token-subsequence and text-substring search over one scale's sessions."""

    def __init__(self, sessions: list[np.ndarray], texts: list[str]):
        sep = np.full(1, -1, dtype=np.int64)
        self.flat = np.concatenate([x for s in sessions for x in (s, sep)]).astype(np.int32)
        self.starts = np.concatenate([[0], np.cumsum([len(s) + 1 for s in sessions])[:-1]]).astype(np.int64)
        self.text = "\x00".join(texts)

    def token_occurrences(self, variants: list[np.ndarray]) -> set[tuple[int, int]]:
        """{(session index, end position)} where some variant ends."""
        found = set()
        for v in variants:
            cand = np.flatnonzero(self.flat[: len(self.flat) - len(v) + 1] == v[0])
            for j in range(1, len(v)):
                cand = cand[self.flat[cand + j] == v[j]]
            ends = cand + len(v) - 1
            sess = np.searchsorted(self.starts, ends, side="right") - 1
            found.update(zip(sess.tolist(), (ends - self.starts[sess]).tolist()))
        return found

    def text_occurrences(self, phrase: str) -> int:
        """Overlapping occurrences of the phrase in the decoded text (sessions never joined)."""
        count, i = 0, self.text.find(phrase)
        while i >= 0:
            count += 1
            i = self.text.find(phrase, i + 1)
        return count


# baselines ------------------------------------------------------------------------------------


def suffix_array(s: np.ndarray) -> np.ndarray:
    """Prefix doubling: sort suffixes by (rank[i], rank[i+h]) packed into one int64, h = 1, 2, 4, ..."""
    n = len(s)
    rank = s.astype(np.int64) + 2  # separators (-1) become 1, tokens >= 2; 0 is "past the end"
    h = 1
    while True:
        second = np.zeros(n, dtype=np.int64)
        second[: n - h] = rank[h:]
        key = (rank << 32) | second
        sa = np.argsort(key)
        ordered = key[sa]
        new = np.empty(n, dtype=np.int64)
        new[sa] = np.cumsum(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
        rank = new
        del key, ordered, second
        if rank.max() == n or h >= n:
            return sa.astype(np.int32)
        h *= 2


class SuffixIndex:
    def __init__(self, truth: Truth):
        self.flat = truth.flat
        self.starts = truth.starts
        t = time.perf_counter()
        self.sa = suffix_array(self.flat)
        self.build_s = time.perf_counter() - t
        # stored: the suffix array (int32) and the tokens (uint16 suffices for a 49,152 vocabulary)
        self.bytes = self.sa.nbytes + len(self.flat) * 2

    def _less(self, pos: int, phrase: np.ndarray, or_equal: bool) -> bool:
        """Is the suffix at ``pos``, cut to len(phrase), < phrase (<= when or_equal)?"""
        seg = self.flat[pos : pos + len(phrase)]
        diff = np.flatnonzero(seg != phrase[: len(seg)])
        if len(diff):
            return bool(seg[diff[0]] < phrase[diff[0]])
        return len(seg) < len(phrase) or or_equal

    def _bound(self, phrase: np.ndarray, or_equal: bool) -> int:
        lo, hi = 0, len(self.sa)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._less(int(self.sa[mid]), phrase, or_equal):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def search(self, variants: list[np.ndarray], k: int | None = None) -> set[tuple[int, int]]:
        found = set()
        for v in variants:
            lo, hi = self._bound(v, False), self._bound(v, True)
            ends = np.sort(self.sa[lo:hi].astype(np.int64))[:k] + len(v) - 1
            sess = np.searchsorted(self.starts, ends, side="right") - 1
            found.update(zip(sess.tolist(), (ends - self.starts[sess]).tolist()))
        return found


class InfiniGram:
    """infini-gram's engine (PyPI ``infini-gram``, Apache-2.0; benchmarks/requirements-search.txt)
    over the same token stream: its own files (``tokenized.0``: each session after a 0xFFFF
    separator, ``offset.0``: where each starts) built by its indexer, then ``find`` per variant."""

    def __init__(self, truth: Truth, folder: Path):
        from infini_gram.engine import InfiniGramEngine

        folder.mkdir(parents=True, exist_ok=True)
        sessions = np.split(truth.flat, np.flatnonzero(truth.flat < 0) + 1)
        offsets, at = [], 0
        with open(folder / "tokenized.0", "wb") as f:
            for s in sessions:
                s = s[s >= 0]
                if not len(s):
                    continue
                offsets.append(at)
                data = b"\xff\xff" + s.astype("<u2").tobytes()
                f.write(data)
                at += len(data)
        np.array(offsets, "<u8").tofile(folder / "offset.0")
        self.tokens = at // 2 - len(offsets)
        t = time.perf_counter()
        cmd = [
            sys.executable,
            "-m",
            "infini_gram.indexing",
            "--data_dir",
            str(folder),
            "--save_dir",
            str(folder),
            "--temp_dir",
            str(folder / "tmp"),
            "--token_dtype",
            "u16",
            "--cpus",
            str(os.cpu_count()),
            "--mem",
            "8",
            "--ulimit",
            "4096",
        ]
        subprocess.run(cmd, check=True, capture_output=True)
        self.build_s = time.perf_counter() - t
        self.bytes = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        t = time.perf_counter()
        self.engine = InfiniGramEngine(index_dir=str(folder), eos_token_id=0, token_dtype="u16")
        self.open_ms = 1e3 * (time.perf_counter() - t)

    def count(self, variants: list[np.ndarray]) -> int:
        """Occurrences of any variant: one that ends with another (" 2001" is [" ", "2", ...])
        is counted within the shorter one's."""
        return sum(self.engine.find(input_ids=[int(x) for x in variants[v]])["cnt"] for v in unsuffixed(variants))


def infini_gram(truth: Truth, folder: Path) -> InfiniGram | None:
    """The peer, or None (and why, once) when its wheel is not installed."""
    if importlib.util.find_spec("infini_gram") is None:
        log(
            "  infini-gram not installed: .venv/bin/pip install --no-deps "
            "--require-hashes -r benchmarks/requirements-search.txt"
        )
        return None
    return InfiniGram(truth, folder)


def duck_table(texts: list[str]) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(":memory:")
    con.execute("CREATE TABLE docs (id INTEGER, text VARCHAR)")
    con.executemany("INSERT INTO docs VALUES (?, ?)", list(enumerate(texts)))
    return con


def like_pattern(phrase: str) -> str:
    return "%" + phrase.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


# kvdb archive ---------------------------------------------------------------------------------


def build_archive(path: Path, tok_hash: str, sessions: list[np.ndarray]) -> tuple[list[str], float, float]:
    """Write sessions through the storage (no model), then rebuild the index. -> (ids, write s, index s)."""
    model_id = hashlib.sha256(f"bench-weights:{tok_hash}".encode()).hexdigest()[:32]
    base = dt.datetime(2024, 1, 1)
    ids = []
    t = time.perf_counter()
    storage = open_storage(path)
    storage.apply(PutModel(ModelRow(model_id, "bench", "bench-weights", tok_hash, {"vocab_size": ALPHABET})))
    keep = frozenset({"tokens", "search"})
    for i, s in enumerate(sessions):  # each session a root node of its own: synthetic sessions share no prefix
        sid = trie.path_id(model_id, s)
        row = SessionRow(sid, f"s{i:05d}", "bench", model_id, base + dt.timedelta(seconds=i), len(s), {"kind": "text"})
        storage.apply(
            SessionWrite(row, ALPHABET, node=NewNode(sid, None, 0, s, np.zeros(len(s), dtype=np.float32), keep))
        )
        ids.append(sid)
    storage.close()
    write_s = time.perf_counter() - t
    with kvdb.open(path) as db:
        info = db.rebuild_index()
    return ids, write_s, info.seconds


def memory_mb() -> dict[str, float]:
    """This process's resident memory, and how much of it is mapped files (shared through the
    page cache) rather than its own."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "RssAnon", "RssFile")}


def probe(path: Path, phrases: list[str]) -> dict:
    """Run in a fresh process (``--probe``): open the index, then 100 searches, and say what the
    opening cost and what the process holds after them."""
    from kvdb.index.walk import WalkIndex

    # the first base, KEY.keys; past 2^24 slots the others are KEY.1.keys, ... (decision 0068)
    [sidecar] = (p for p in path.with_name(path.name + ".index").glob("*.keys") if p.name.count(".") == 1)
    before = memory_mb()
    t = time.perf_counter()
    WalkIndex.load(sidecar)
    open_ms = 1e3 * (time.perf_counter() - t)
    with kvdb.open(path, read_only=True) as db:
        t = time.perf_counter()
        db.search(phrases[0], k=10)
        first_ms = 1e3 * (time.perf_counter() - t)
        for i in range(100):
            db.search(phrases[i % len(phrases)], k=10)
        after = memory_mb()
    return {
        "open_ms": open_ms,
        "first_query_ms": first_ms,
        "rss_mb_before_open": before["VmRSS"],
        "rss_mb_after_100_queries": after["VmRSS"],
        "rss_anon_mb": after["RssAnon"],
        "rss_file_mb": after["RssFile"],
    }


def probe_in_fresh_process(path: Path, phrases: list[str]) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(phrases, f)
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--probe", str(path), "--phrases", f.name],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        os.unlink(f.name)
    return json.loads(out.stdout)


# phrases --------------------------------------------------------------------------------------


@dataclass
class Query:
    phrase: str
    kind: str  # planted | natural-rare | natural-frequent | natural-very-frequent
    variants: list[np.ndarray]
    truth: set = field(default_factory=set)
    text_count: int = 0


def natural_phrases(tok, truth: Truth, space: np.ndarray, rng: np.random.Generator, per_class: int) -> list[Query]:
    """Whole-word n-grams sampled from the data, kept by how often they occur."""
    flat = truth.flat
    word_start = np.flatnonzero((flat >= 0) & space[np.clip(flat, 0, None)])
    out, seen = [], set()
    for n in NATURAL_LENGTHS:
        want = {"natural-rare": per_class, "natural-frequent": per_class, "natural-very-frequent": 1 if n <= 3 else 0}
        for _ in range(600):
            if not any(want.values()):
                break
            start = int(rng.choice(word_start))  # sampling positions weights n-grams by frequency
            ids = flat[start : start + n + 1]
            if len(ids) < n + 1 or (ids < 0).any() or not space[ids[n]]:
                continue  # crosses a session end, or ends inside a word
            text = T.decode(tok, ids[:n])
            phrase = text.strip()
            if not phrase or phrase in seen or "\x00" in phrase or text != " " + phrase:
                continue
            variants = phrase_variants(tok, phrase)
            occ = truth.token_occurrences(variants)
            count = len(occ)
            kind = (
                "natural-rare"
                if count <= RARE_MAX
                else "natural-very-frequent"
                if count > RECALL_MAX
                else "natural-frequent"
                if count >= FREQUENT_MIN
                else None
            )
            if kind is None or not want[kind]:
                continue
            want[kind] -= 1
            seen.add(phrase)
            out.append(Query(phrase, kind, variants, occ, truth.text_occurrences(phrase)))
    return out


# measurement ----------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_scale(n_tokens: int, corpus: Corpus, tok, tok_hash: str, space: np.ndarray, args, rng, tmp: Path) -> dict:
    log(f"\n== {n_tokens:,} archived tokens")
    sessions = scale_sessions(corpus, n_tokens)
    t = time.perf_counter()
    texts = [T.decode(tok, s) for s in sessions]
    truth = Truth(sessions, texts)
    log(f"  {len(sessions)} sessions, decoded in {time.perf_counter() - t:.1f} s")

    path = tmp / f"search-{n_tokens}.duckdb"
    session_ids, write_s, index_s = build_archive(path, tok_hash, sessions)
    index_files = [f for f in path.with_name(path.name + ".index").iterdir() if f.suffix in (".keys", ".tail")]
    index_bytes = sum(f.stat().st_size for f in index_files)
    log(f"  store write {write_s:.1f} s, rebuild_index {index_s:.1f} s, index {index_bytes / n_tokens:.4f} B/token")

    queries = [Query(p, "planted", phrase_variants(tok, p)) for p, _ in corpus.planted]
    for q in queries:
        q.truth = truth.token_occurrences(q.variants)
        q.text_count = truth.text_occurrences(q.phrase)
    queries += natural_phrases(tok, truth, space, rng, args.per_class)
    log(
        f"  {len(queries)} phrases: "
        + ", ".join(f"{k} {sum(q.kind == k for q in queries)}" for k in dict.fromkeys(q.kind for q in queries))
    )

    t = time.perf_counter()
    sa = SuffixIndex(truth)
    log(f"  suffix array built in {sa.build_s:.1f} s ({time.perf_counter() - t:.1f} s)")
    ig = infini_gram(truth, tmp / f"infini-gram-{n_tokens}")
    if ig is not None:
        log(f"  infini-gram built in {ig.build_s:.1f} s, {ig.bytes / n_tokens:.2f} B/token")
    con = duck_table(texts)
    con.execute("SELECT count(*) FROM docs WHERE contains(text, 'warm-up')").fetchall()

    probed = probe_in_fresh_process(path, [q.phrase for q in queries])
    log(
        f"  fresh process: index opened in {probed['open_ms']:.1f} ms, first query {probed['first_query_ms']:.0f} "
        f"ms, {probed['rss_mb_after_100_queries']:.0f} MB resident after 100 queries"
    )
    db = kvdb.open(path)
    first_ms = probed["first_query_ms"]

    # recall / precision (k = ground-truth count + 5)
    sid_index = {sid: i for i, sid in enumerate(session_ids)}
    recall_rows = []
    for q in queries:
        if len(q.truth) > RECALL_MAX:
            continue
        hits = db.search(q.phrase, k=len(q.truth) + 5, case_sensitive=True, each_occurrence=True)
        exact = {(sid_index[h.session_id], h.position + h.match_tokens - 1) for h in hits if h.exact}
        sa_found = sa.search(q.variants)
        assert sa_found == q.truth, f"suffix array disagrees with ground truth on {q.phrase!r}"
        if ig is not None:
            assert ig.count(q.variants) == len(q.truth), f"infini-gram disagrees with ground truth on {q.phrase!r}"
        assert db.count(q.phrase, case_sensitive=True).count == len(q.truth), (
            f"Archive.count disagrees with ground truth on {q.phrase!r}"
        )
        recall_rows.append((q, len(exact & q.truth), len(exact)))

    # latency, k=10: each phrase's first search in every casing timed alone (the pages of the casings and partial hits
    # the recall check above did not touch are read then), then the median of the repeats, at every scale
    reps = reps_of(args)
    lat: dict[str, list[float]] = {
        "kvdb": [],
        "kvdb_first": [],
        "kvdb_case": [],
        "count": [],
        "contains": [],
        "like": [],
        "sa": [],
        "infini_gram": [],
    }
    lat_by_kind: dict[str, list[float]] = {}
    for q in queries:
        lat["kvdb_first"].append(1e3 * median_seconds(partial(db.search, q.phrase, k=10), 1))
        ms = 1e3 * median_seconds(partial(db.search, q.phrase, k=10), reps)
        lat["kvdb"].append(ms)
        lat_by_kind.setdefault(q.kind, []).append(ms)
        lat["kvdb_case"].append(1e3 * median_seconds(partial(db.search, q.phrase, k=10, case_sensitive=True), reps))
        lat["count"].append(1e3 * median_seconds(partial(db.count, q.phrase), reps))
        lat["contains"].append(
            1e3
            * median_seconds(
                lambda phrase=q.phrase: con.execute("SELECT id FROM docs WHERE contains(text, ?)", [phrase]).fetchall(),
                reps,
            )
        )
        pattern = like_pattern(q.phrase)
        lat["like"].append(
            1e3
            * median_seconds(
                lambda pattern=pattern: con.execute(
                    "SELECT id FROM docs WHERE text LIKE ? ESCAPE '\\'", [pattern]
                ).fetchall(),
                reps,
            )
        )
        # tokenizing timed, as kvdb's is
        lat["sa"].append(
            1e3
            * median_seconds(lambda phrase=q.phrase, index=sa: index.search(phrase_variants(tok, phrase), k=10), reps)
        )
        if ig is not None:
            lat["infini_gram"].append(
                1e3
                * median_seconds(lambda phrase=q.phrase, engine=ig: engine.count(phrase_variants(tok, phrase)), reps)
            )
    db.close()
    con.close()
    out = {
        "tokens": n_tokens,
        "sessions": len(sessions),
        "write_s": write_s,
        "index_s": index_s,
        "index_bpt": index_bytes / n_tokens,
        "first_ms": first_ms,
        "lat": lat,
        "lat_by_kind": lat_by_kind,
        "recall_rows": recall_rows,
        "sa_build_s": sa.build_s,
        "sa_bpt": sa.bytes / n_tokens,
        "probe": probed,
        "ig": None if ig is None else {"build_s": ig.build_s, "bpt": ig.bytes / n_tokens, "open_ms": ig.open_ms},
        "queries": queries,
        "real": min(n_tokens, corpus.real_tokens),
    }
    for name in [n for n in lat if lat[n]]:
        log(f"  {name:9s} p50 {pct(lat[name], 50):8.2f} ms  p95 {pct(lat[name], 95):8.2f} ms")
    del sa, truth, texts, ig
    gc.collect()
    for f in index_files:
        f.unlink()
    path.unlink()
    shutil.rmtree(tmp / f"infini-gram-{n_tokens}", ignore_errors=True)
    return out


def as_json(r: dict) -> dict:
    """One scale as ``--json`` prints it: kvdb's default search, then its peers on the same stream."""

    def spread(values: list[float]) -> dict:
        return (
            {
                "p50_ms": round(pct(values, 50), 3),
                "p95_ms": round(pct(values, 95), 3),
                "p99_ms": round(pct(values, 99), 3),
            }
            if values
            else {}
        )

    occurrences = sum(len(q.truth) for q, _, _ in r["recall_rows"])
    found = sum(c for _, c, _ in r["recall_rows"])
    peers = {
        "numpy_suffix_array": spread(r["lat"]["sa"])
        | {"build_s": round(r["sa_build_s"], 2), "bytes_per_token": round(r["sa_bpt"], 3)},
        "infini_gram": spread(r["lat"]["infini_gram"])
        | {
            "build_s": round(r["ig"]["build_s"], 2),
            "bytes_per_token": round(r["ig"]["bpt"], 3),
            "open_ms": round(r["ig"]["open_ms"], 1),
        }
        if r["ig"]
        else {
            "error": "not installed: .venv/bin/pip install --no-deps "
            "--require-hashes -r benchmarks/requirements-search.txt"
        },
        "duckdb_contains": spread(r["lat"]["contains"]),
        "duckdb_like": spread(r["lat"]["like"]),
    }
    return {
        "tokens": r["tokens"],
        **spread(r["lat"]["kvdb"]),
        "recall": round(found / occurrences, 6) if occurrences else None,
        "index_bytes_per_token": round(r["index_bpt"], 4),
        "open_ms": round(r["probe"]["open_ms"], 2),
        "build_s": round(r["index_s"], 2),
        "rss_mb_after_100_queries": round(r["probe"]["rss_mb_after_100_queries"], 1),
        "rss_file_mb": round(r["probe"]["rss_file_mb"], 1),
        "first_query_ms": round(r["probe"]["first_query_ms"], 1),
        "each_phrase_first_call": spread(r["lat"]["kvdb_first"]),
        "case_sensitive": spread(r["lat"]["kvdb_case"]),
        "count": spread(r["lat"]["count"]),
        "peers": peers,
    }


def reps_of(args) -> int:
    return args.reps or (1 if args.quick else 3)


# report ---------------------------------------------------------------------------------------


def kvdb_source() -> str:
    """Where the measured kvdb came from: its folder, and the git commit when it lies in a work tree."""
    folder = Path(kvdb.__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", "."], capture_output=True, text=True, check=True
        ).stdout.strip()
        return f"{folder.name}/ at {rev}{' with uncommitted changes' if dirty else ''}"
    except (OSError, subprocess.CalledProcessError):
        return str(folder)


def report(results: list[dict], args, elapsed: float, planted: int) -> str:
    f = lambda x: f"{x:.2f}" if x < 100 else f"{x:.0f}"  # noqa: E731
    lines = [
        f"`{shlex.join(['.venv/bin/python', 'benchmarks/search.py', *sys.argv[1:]])}` — {platform.machine()}, "
        f"{os.cpu_count()} cores (shared with other work; load average {os.getloadavg()[0]:.1f} at the end), "
        f"duckdb {duckdb.__version__} "
        f"(default threads), SmolLM2 tokenizer (49,152 ids); model not loaded. kvdb imported from `{kvdb_source()}`. "
        f"Total {elapsed / 60:.1f} min.\n",
        "Data: real text from installed package docs up to 1e6 tokens; from 1e7 on, the real stream plus synthetic "
        f"sessions of its sentences shuffled. Sessions of {SESSION_MIN:,}–{SESSION_MAX:,} tokens. {planted} planted "
        f"phrases (1–20 tokens, random words, {PLANT_COPIES} copies each at word starts), plus whole-word n-grams of "
        f"{', '.join(map(str, NATURAL_LENGTHS))} tokens sampled from each scale: rare (≤ {RARE_MAX} occurrences), "
        f"frequent ({FREQUENT_MIN}–{RECALL_MAX}) and very frequent (> {RECALL_MAX}, timed only).\n",
        "Ground truth: token-subsequence search over the archived token streams, within a session. An occurrence is a "
        "(session, end position) where either tokenization kvdb searches ends: the phrase as typed, or after a space. "
        "Recall/precision count `Archive.search(phrase, k=occurrences+5, case_sensitive=True, each_occurrence=True)` "
        "hits (the ground truth is in the phrase's casing) with `exact=True`. Text occurrences = overlapping substring "
        'matches in the decoded session text; "missed by tokenization" = text occurrences minus token occurrences (a '
        "substring whose tokens are neither variant).\n",
        "### Recall and precision\n",
        "| tokens | kind | phrase tokens | phrases checked | token occurrences | "
        "found | recall | precision | text occurrences | missed by tokenization |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for kind in ("planted", "natural-rare", "natural-frequent"):
            rows = [x for x in r["recall_rows"] if x[0].kind == kind]
            if not rows:
                continue
            occ = sum(len(q.truth) for q, _, _ in rows)
            found = sum(c for _, c, _ in rows)
            returned = sum(n for _, _, n in rows)
            text = sum(q.text_count for q, _, _ in rows)
            lines.append(
                f"| {r['tokens']:.0e} | {kind} | "
                f"{min(max(map(len, q.variants)) for q, _, _ in rows)}–"
                f"{max(max(map(len, q.variants)) for q, _, _ in rows)} "
                f"| {len(rows)} | {occ:,} | {found:,} | {found / occ:.4f} | "
                f"{found / returned if returned else float('nan'):.4f} | {text:,} | {text - occ:,} |"
            )
    lines += [
        "",
        f"### Latency (k=10, ms per query, median of {reps_of(args)} "
        "repeats per phrase; p50/p95 over all phrases) and size\n",
        "kvdb = `Archive.search(phrase, k=10)`, index loaded, tokenizer loaded: the phrase in any casing (each word's "
        "casings joined word by word, pruned by the index: `kvdb/index/casing.py`, decision 0057), each as typed and "
        "after a space; case-sensitive = "
        "`case_sensitive=True`, its own casing alone. DuckDB = `SELECT id FROM docs WHERE contains(text, ?)` / `... "
        "text LIKE '%…%'` over one row of decoded text per session, in memory. Suffix array = numpy prefix doubling "
        "over the concatenated token streams; query = tokenize both variants + two binary searches each + map to "
        "sessions; bytes = int32 suffix array + uint16 tokens. infini-gram = its engine (`infini-gram` 2.6.0) over the "
        "same sessions, built by its own indexer; query = tokenize both variants + `find` each (a count and the "
        "suffix-array ranges, no context), bytes = its files. Open = `WalkIndex.load` in a fresh process; resident = "
        "that process's RSS after opening the archive and 100 searches (of it, mapped index and library files shared "
        "through the page cache). Count = `Archive.count(phrase)`, every casing, exact (checked against the ground "
        "truth, case-sensitive, on every recall phrase). First call = each phrase's first `Archive.search(phrase, "
        "k=10)`, timed once before its repeats, after the recall check's case-sensitive searches of it: it "
        "reads the pages of the other casings and of the partial hits for the first time.\n",
        "| tokens | sessions | phrases | kvdb p50 | kvdb p95 | kvdb first call p50 | first call p95 | kvdb "
        "case-sensitive p50 | case-sensitive p95 | kvdb first query (loads index) | contains p50 | contains p95 | LIKE "
        "p50 | LIKE p95 | suffix array p50 | SA p95 | kvdb index build s | kvdb index B/token | SA build s | SA "
        "B/token | infini-gram p50 | infini-gram p95 | infini-gram build s | infini-gram B/token | kvdb open ms | "
        "resident MB (mapped) | kvdb count p50 | count p95 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        "---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        L = r["lat"]
        lines.append(
            f"| {r['tokens']:.0e} | {r['sessions']} | {len(L['kvdb'])} | {f(pct(L['kvdb'], 50))} | "
            f"{f(pct(L['kvdb'], 95))} | {f(pct(L['kvdb_first'], 50))} | {f(pct(L['kvdb_first'], 95))} | "
            f"{f(pct(L['kvdb_case'], 50))} | {f(pct(L['kvdb_case'], 95))} | {f(r['first_ms'])} | "
            f"{f(pct(L['contains'], 50))} | {f(pct(L['contains'], 95))} | {f(pct(L['like'], 50))} | "
            f"{f(pct(L['like'], 95))} | {f(pct(L['sa'], 50))} | {f(pct(L['sa'], 95))} | {r['index_s']:.2f} | "
            f"{r['index_bpt']:.4f} | {r['sa_build_s']:.2f} | {r['sa_bpt']:.2f} "
            + (
                f"| {f(pct(L['infini_gram'], 50))} | {f(pct(L['infini_gram'], 95))} "
                f"| {r['ig']['build_s']:.2f} | {r['ig']['bpt']:.2f} "
                if r["ig"]
                else "| – | – | – | – "
            )
            + f"| {r['probe']['open_ms']:.1f} | {r['probe']['rss_mb_after_100_queries']:.0f} "
            f"({r['probe']['rss_file_mb']:.0f}) | {f(pct(L['count'], 50))} | {f(pct(L['count'], 95))} |"
        )
    kinds = list(dict.fromkeys(k for r in results for k in r["lat_by_kind"]))
    lines += [
        "",
        "kvdb p50 / p95 (ms) by phrase kind:\n",
        "| tokens | " + " | ".join(kinds) + " |",
        "|---:|" + "---:|" * len(kinds),
    ]
    for r in results:
        cells = [
            f"{f(pct(r['lat_by_kind'][k], 50))} / {f(pct(r['lat_by_kind'][k], 95))}" if k in r["lat_by_kind"] else "–"
            for k in kinds
        ]
        lines.append(f"| {r['tokens']:.0e} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def targets(results: list[dict]) -> str:
    at = {r["tokens"]: r for r in results}
    recall = [c / len(q.truth) for r in results for q, c, _ in r["recall_rows"] if q.truth]
    lines = ["", "Targets:\n"]
    lines.append(
        f"- recall 1.0 on exact occurrences: {'met' if recall and min(recall) == 1.0 else 'NOT met'} "
        f"(lowest per-phrase recall {min(recall):.4f})"
    )
    if 10**6 in at:
        p50 = pct(at[10**6]["lat"]["kvdb"], 50)
        lines.append(f"- p50 ≤ 10 ms at 1e6 tokens: {'met' if p50 <= 10 else 'NOT met'} ({p50:.2f} ms)")
    faster = [
        (r["tokens"], pct(r["lat"]["kvdb"], 50), pct(r["lat"]["contains"], 50), pct(r["lat"]["like"], 50))
        for r in results
        if r["tokens"] >= 10**6
    ]
    if faster:
        ok = all(k < min(c, lk) for _, k, c, lk in faster)
        lines.append(
            f"- faster than the DuckDB scan from 1e6 tokens on (p50): {'met' if ok else 'NOT met'} ("
            + "; ".join(f"{t:.0e}: kvdb {k:.1f} vs contains {c:.1f} / LIKE {lk:.1f} ms" for t, k, c, lk in faster)
            + ")"
        )
    bpt = max(r["index_bpt"] for r in results)
    lines.append(
        f"- index ≤ 7 bytes/token (issue 36): {'met' if bpt <= 7 else 'NOT met'} ({bpt:.4f} B/token at most: "
        "4-byte slot and 2-byte token per position, a sampled key per 64)"
    )
    if 10**8 in at:
        r = at[10**8]
        p50, p95 = pct(r["lat"]["kvdb"], 50), pct(r["lat"]["kvdb"], 95)
        first50, first95 = pct(r["lat"]["kvdb_first"], 50), pct(r["lat"]["kvdb_first"], 95)
        lines.append(
            f"- at 1e8 tokens, p50 ≤ 3 ms and p95 ≤ 10 ms: {'met' if p50 <= 3 and p95 <= 10 else 'NOT met'} "
            f"({p50:.2f} / {p95:.2f} ms; each phrase's first call {first50:.2f} / {first95:.2f} ms, "
            f"{'met' if first50 <= 3 and first95 <= 10 else 'NOT met'})"
        )
        lines.append(
            "- opening the index at 1e8 ≤ 100 ms: "
            f"{'met' if r['probe']['open_ms'] <= 100 else 'NOT met'} ({r['probe']['open_ms']:.1f} ms)"
        )
        lines.append(
            "- building 1e8 tokens ≤ 10 minutes: "
            rf"{'met' if r['index_s'] <= 600 else 'NOT met'} ({r['index_s']:.0f} s)"
        )
        if r["ig"] is not None:
            ratio = r["index_s"] / r["ig"]["build_s"]
            lines.append(
                "- building 1e8 tokens within 2x of infini-gram's build (issue 53): "
                f"{'met' if ratio <= 2 else 'NOT met'} ({r['index_s']:.0f} s against {r['ig']['build_s']:.0f} s, "
                f"{ratio:.1f}x)"
            )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    xs = [r["tokens"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = (
        ("kvdb", "kvdb Archive.search (k=10)"),
        ("kvdb_case", "kvdb, case-sensitive"),
        ("contains", "DuckDB contains()"),
        ("like", "DuckDB LIKE"),
        ("sa", "suffix array (numpy)"),
        ("infini_gram", "infini-gram find"),
    )
    for key, label in series:
        if not all(r["lat"][key] for r in results):
            continue
        p50 = [pct(r["lat"][key], 50) for r in results]
        p95 = [pct(r["lat"][key], 95) for r in results]
        line = ax.plot(xs, p50, marker="o", label=f"{label}, p50")[0]
        ax.plot(xs, p95, marker="x", linestyle="--", color=line.get_color(), alpha=0.6, label=f"{label}, p95")
    ax.axhline(10, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("archived tokens")
    ax.set_ylabel("query latency (ms)")
    ax.set_title("Phrase search latency")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1e5 tokens only, few phrases: a smoke run")
    parser.add_argument("--scales", default=None, help="comma-separated token counts (default 1e5,1e6,1e7,1e8)")
    parser.add_argument(
        "--reps", type=int, default=None, help="timed repeats per phrase and method (default 3; 1 with --quick)"
    )
    parser.add_argument("--no-results", action="store_true", help="print only; do not append to RESULTS.md or plot")
    parser.add_argument(
        "--json", action="store_true", help="also print one JSON object per scale on stdout (progress goes to stderr)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe", type=Path, help=argparse.SUPPRESS)  # internal: measure opening in a fresh process
    parser.add_argument("--phrases", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe, json.loads(args.phrases.read_text()))))
        return
    scales = [int(float(x)) for x in (args.scales or ("1e5" if args.quick else "1e5,1e6,1e7,1e8")).split(",")]
    args.per_class = 1 if args.quick else 2
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()

    t = time.perf_counter()
    tok = T.load()
    tok_hash = T.fingerprint(tok)
    log(f"tokenizer loaded in {time.perf_counter() - t:.1f} s")
    corpus = make_corpus(tok, max(scales), rng, 1 if args.quick else 2)
    if args.quick:
        corpus.planted = corpus.planted[::3]
    space, _ = vocab_tables(tok)
    log(
        f"corpus: {sum(len(s) for s in corpus.sessions):,} tokens in "
        f"{len(corpus.sessions)} sessions, {len(corpus.planted)} planted phrases"
    )

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in scales:
            results.append(run_scale(n, corpus, tok, tok_hash, space, args, rng, Path(tmp)))
            if args.json:
                print(json.dumps(as_json(results[-1])), flush=True)
    elapsed = time.perf_counter() - start
    text = report(results, args, elapsed, len(corpus.planted)) + targets(results)
    if not args.no_results:
        png = Path(__file__).with_name("search_latency.png")
        if len(results) > 1 and plot(results, png):
            text += f"\nPlot: `benchmarks/{png.name}` (p50 and p95 latency against archived tokens).\n"
        publish("Phrase search", text, data=[as_json(r) for r in results])
    elif not args.json:
        print(text)


if __name__ == "__main__":
    main()
