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
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from report import describe, publish
from retrieval import retrieval_set

ASKED = 40  # SemanticTier asks CANDIDATES * k = 4 * 10 chunks


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()

    import faiss

    from kvdb.index import vectors as vector_ops
    from kvdb.model.embedder import Embedder

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
    rows = []
    for size in args.sizes:
        filler = documents[rng.integers(0, len(documents), size - len(documents))]
        noise = rng.standard_normal(filler.shape).astype(np.float32)
        noise *= np.linalg.norm(filler, axis=1, keepdims=True) / np.linalg.norm(noise, axis=1, keepdims=True)
        filler = filler + noise
        vectors = np.concatenate([documents, filler / np.linalg.norm(filler, axis=1, keepdims=True)]).astype(np.float32)
        del filler, noise
        start = time.perf_counter()
        index = vector_ops.build(vectors)
        build_s = time.perf_counter() - start
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
            f"{statistics.median(with_embed):.1f} | {percentile(with_embed, 95):.1f} | {hit10:.3f} | {hit10_exact:.3f} |"
        )
        print(rows[-1], flush=True)
        del vectors, index, exact
    lines = [
        "## Semantic tier: index latency at 1e4-1e6 chunks (`benchmarks/semantic_latency.py`)",
        "",
        describe("faiss-cpu", "torch", "transformers"),
        "The 300 target documents of benchmarks/retrieval.py embedded by all-MiniLM-L6-v2, filled with synthetic unit vectors "
        "near them to each size; the 300 real queries embedded. Search alone asks for 40 nearest (as `search --semantic -k 10`); "
        f"Embedding one query took {statistics.median(embed_ms):.1f} ms (p50). "
        "hit@10: the target among the first 10 real documents returned, by this index and by an exact scan of the same vectors.",
        "",
        "| chunks | index | build s | search p50 ms | search p95 ms | + embedding p50 ms | + embedding p95 ms | hit@10 | hit@10, exact scan |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    publish(lines, append=not args.no_results)


if __name__ == "__main__":
    main()
