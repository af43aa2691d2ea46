"""The semantic tier's index at 1e4, 1e5 and 1e6 chunks: query latency, build time, and whether
the inverted file past 1e5 still finds what the exact scan finds.

    .venv/bin/python benchmarks/semantic_latency.py [--sizes 10000 100000 1000000] [--no-results]

The index holds the 300 target documents of ``benchmarks/retrieval.py`` (embedded whole by the
tier's embedder, all-MiniLM-L6-v2) and, to fill it to each size, synthetic unit vectors: a
real document's vector plus Gaussian noise of the same norm, normalised (vectors that sit
among the real ones, as a big archive's would, rather than in an empty corner of the sphere).
The queries are the 300 real docstring first lines, embedded as ``search --semantic`` embeds
them. Per size: the index build (``kvdb.index.vectors.build``: flat up to 1e5, then the
inverted file), p50/p95 of the search alone (k = 40, as the tier asks for k = 10 hits) and of
embedding plus search, and hit@10 of the target among the real documents the search returns,
beside the exact scan's over the same index (the recall the inverted file keeps).

Each size's index is built as the semantic tier derives it (``kvdb.index.chunk_index.ChunkIndex``:
the vector index and BM25 over the chunks' texts, here each filler's source document, ten
chunks a node) and saved as the tier's sidecar; a NEW process then opens the sidecar and
answers a first query (the vector search and BM25), and catches up with one more session (20
chunks appended, the sidecar saved again). The build stands for what every new process paid
before the sidecar (less the database read and the texts' decoding, which it also paid).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from report import describe, publish
from retrieval import retrieval_set

ASKED = 40  # SemanticTier asks CANDIDATES * k = 4 * 10 chunks
CHUNKS_PER_NODE = 10
SESSION_CHUNKS = 20  # one more session's chunks, for the catch-up

# Run in a new process: open the sidecar, answer one query, catch up with one session, save.
NEW_PROCESS = """
import json, sys, time
start = time.perf_counter()
import numpy as np
from kvdb.index.chunk_index import ChunkIndex
imported = time.perf_counter()
path, query_file, text, adding = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
query = np.load(query_file)
index = ChunkIndex.load(__import__("pathlib").Path(path))
opened = time.perf_counter()
rows, _ = index.nearest(query, 100)
words = index.words.scores(text)
answered = time.perf_counter()
held = index.counts()
rng = np.random.default_rng(1)
vectors = rng.standard_normal((adding, query.shape[0])).astype(np.float32)
vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
counted = time.perf_counter()
index.append(["f" * 32] * len(vectors), np.zeros((len(vectors), 2), np.int64), vectors, [text] * len(vectors))
appended = time.perf_counter()
index.save(__import__("pathlib").Path(path))
saved = time.perf_counter()
print(json.dumps({"import": imported - start, "open": opened - imported, "first_query": answered - opened, \
"counts": counted - answered,
                  "append": appended - counted, "save": saved - appended, "nodes": len(held), "hits": len(rows)}))
"""


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--no-results", action="store_true")
    parser.add_argument(
        "--scratch", default=None, help="folder for the sidecars (default: the system's temporary folder)"
    )
    args = parser.parse_args()

    import faiss
    import torch

    from kvdb.index import vectors as vector_ops
    from kvdb.index.chunk_index import ChunkIndex
    from kvdb.model.embedder import Embedder

    torch.set_num_threads(1)

    items, _, _ = retrieval_set(300, 0)
    embedder = Embedder()
    documents = embedder.embed([item.document for item in items])
    queries = [item.query for item in items]
    embed_ms, vectors_one_by_one = [], []
    for query in queries:  # one at a time, as a search embeds its query
        start = time.perf_counter()
        vectors_one_by_one.append(embedder.embed([query])[0])
        embed_ms.append(1e3 * (time.perf_counter() - start))
    query_vectors = np.stack(vectors_one_by_one)
    rng = np.random.default_rng(0)
    rows, opened = [], []
    for size in args.sizes:
        source = rng.integers(0, len(documents), size - len(documents))
        filler = documents[source]
        noise = rng.standard_normal(filler.shape).astype(np.float32)
        noise *= np.linalg.norm(filler, axis=1, keepdims=True) / np.linalg.norm(noise, axis=1, keepdims=True)
        filler = filler + noise
        vectors = np.concatenate([documents, filler / np.linalg.norm(filler, axis=1, keepdims=True)]).astype(np.float32)
        texts = [items[i].document for i in range(len(items))] + [items[int(i)].document for i in source]
        del filler, noise
        start = time.perf_counter()
        table = ChunkIndex.build(
            "bench@0",
            [f"{i // CHUNKS_PER_NODE:032x}" for i in range(size)],
            np.zeros((size, 2), np.int64),
            vectors,
            texts,
        )
        build_s = time.perf_counter() - start
        index = table.index
        times, found = [], []
        for q in query_vectors:
            start = time.perf_counter()
            _, hit = vector_ops.nearest(index, q[None], ASKED)
            times.append(1e3 * (time.perf_counter() - start))
            found.append(hit[0])
        exact = faiss.IndexFlatIP(vectors.shape[1])
        exact.add(vectors)
        _, truth = exact.search(query_vectors, ASKED)
        real = [[int(r) for r in hits if 0 <= r < len(items)][:10] for hits in found]
        real_exact = [[int(r) for r in hits if 0 <= r < len(items)][:10] for hits in truth]
        hit10 = statistics.mean(i in got for i, got in enumerate(real))
        hit10_exact = statistics.mean(i in got for i, got in enumerate(real_exact))
        kind = type(index).__name__.replace("Index", "")
        with_embed = [t + e for t, e in zip(times, embed_ms)]
        rows.append(
            f"| {size:,} | {kind} | {build_s:.1f} | {statistics.median(times):.2f} | {percentile(times, 95):.2f} | "
            f"{statistics.median(with_embed):.1f} | "
            f"{percentile(with_embed, 95):.1f} | {hit10:.3f} | {hit10_exact:.3f} |"
        )
        print(rows[-1], flush=True)
        del exact, index
        with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
            sidecar, query_file = Path(scratch) / "chunks.vec", Path(scratch) / "query.npy"
            start = time.perf_counter()
            table.save(sidecar)
            save_s = time.perf_counter() - start
            del table, vectors
            np.save(query_file, query_vectors[0])
            size_mb = sidecar.stat().st_size / 2**20
            child_start = time.perf_counter()
            child = subprocess.run(
                [sys.executable, "-c", NEW_PROCESS, str(sidecar), str(query_file), queries[0], str(SESSION_CHUNKS)],
                capture_output=True,
                text=True,
                check=True,
            )
            wall = time.perf_counter() - child_start
            got = json.loads(child.stdout.strip().splitlines()[-1])
        opened.append(
            f"| {size:,} | {kind} | {build_s:.1f} | {save_s:.1f} | {size_mb:,.0f} | {got['import']:.2f} | "
            f"{got['open']:.2f} | {1e3 * got['first_query']:.0f} | {wall:.1f} | {got['counts']:.2f} | "
            f"{got['append']:.2f} | {got['save']:.1f} |"
        )
        print(opened[-1], flush=True)
    lines = [
        describe("faiss-cpu", "torch", "transformers"),
        f"`.venv/bin/python benchmarks/semantic_latency.py {' '.join(sys.argv[1:])}`.",
        "The 300 target documents of benchmarks/retrieval.py embedded by all-MiniLM-L6-v2, filled with synthetic unit "
        "vectors near them to each size; the 300 real queries embedded. Search alone asks for 40 nearest (as `search "
        f"--semantic -k 10`); Embedding one query took {statistics.median(embed_ms):.1f} ms (p50). hit@10: the target "
        "among the first 10 real documents returned, by this index and by an exact scan of the same vectors.",
        "",
        "| chunks | index | derive s | search p50 ms | search p95 ms | + "
        "embedding p50 ms | + embedding p95 ms | hit@10 | hit@10, exact scan |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "The tier's index kept between processes (its sidecar, `kvdb/index/chunk_index.py`): derive s is the build "
        f"every new process paid before (vector index and BM25 over the chunks' texts, {CHUNKS_PER_NODE} chunks a "
        "node; the database read and the texts' decoding, also paid then, not counted); a NEW process then imports, "
        "opens the sidecar (memory-mapped), answers one query (vector search and BM25), and catches up with one more "
        f"session of {SESSION_CHUNKS} chunks: its rows counted per node, appended, the sidecar saved again. process s: "
        "the new process's whole run, from its start.",
        "",
        "| chunks | index | derive s | save s | sidecar MB | import s | open s | "
        "first query ms | process s | count per node s | append s | save again s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *opened,
    ]
    publish("Semantic tier: index latency at 1e4-1e6 chunks", lines, append=not args.no_results)


if __name__ == "__main__":
    main()
