"""The semantic tier's chunk size and overlap, on the standard-library docstring set of
``benchmarks/retrieval.py``: each target cut into windows of the archive model's tokens as the
tier cuts a turn, ranked as ``search --semantic`` ranks (cosine and BM25 over each retriever's
best 100 chunks, min-max, 0.7 / 0.3; a session at its best chunk), without an archive.

    .venv/bin/python benchmarks/chunk_sizes.py [--no-results]

Rows: windows of 64, 128, 256 and 512 tokens at an overlap of a quarter, and each document
whole (one chunk; the embedder reads its first 256 word pieces), with how many chunks that
makes and the time to embed them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from report import describe, publish
from retrieval import DEPTH, retrieval_set

WINDOWS = ((64, 16), (128, 32), (256, 64), (512, 128), (None, 0))
CANDIDATES, DENSE, WORDS = 100, 0.7, 0.3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()

    from kvdb.index import chunks as chunk_ops
    from kvdb.index import ranking
    from kvdb.index import vectors as vector_ops
    from kvdb.model import tokenizer as tok
    from kvdb.model.embedder import Embedder

    items, _, _ = retrieval_set(300, 0)
    tokenizer = tok.load(None)
    embedder = Embedder()
    ids = [np.asarray(tok.encode(tokenizer, item.document), dtype=np.int64) for item in items]
    queries = embedder.embed([item.query for item in items], kind="query")
    rows = []
    for window, overlap in WINDOWS:
        owner, texts = [], []
        for doc, tokens in enumerate(ids):
            spans = [(0, len(tokens))] if window is None else chunk_ops.spans([(0, len(tokens))], window, overlap).tolist()
            for a, b in spans:
                owner.append(doc)
                texts.append(tok.plain_text(tokenizer, tokens[a:b]))
        owner_of = np.asarray(owner)
        start = time.perf_counter()
        vectors = embedder.embed(texts)
        embed_s = time.perf_counter() - start
        index = vector_ops.build(vectors)
        words = ranking.BM25()
        words.add(texts)
        top1 = top10 = 0
        for target, item in enumerate(items):
            scores, found = vector_ops.nearest(index, queries[target][None], CANDIDATES)
            keep = found[0] >= 0
            fused, _ = ranking.weighted([(found[0][keep], scores[0][keep]), ranking.top_k(words.scores(item.query), CANDIDATES)], [DENSE, WORDS])
            ranked = list(dict.fromkeys(owner_of[fused].tolist()))[:DEPTH]
            top1 += bool(ranked) and ranked[0] == target
            top10 += target in ranked
        label = "whole document" if window is None else f"{window} tokens, overlap {overlap}"
        rows.append(f"| {label} | {len(texts):,} | {embed_s:.1f} | {top1 / len(items):.3f} | {top10 / len(items):.3f} |")
        print(rows[-1], flush=True)
    lines = [
        "## Semantic tier: chunk size (`benchmarks/chunk_sizes.py`)",
        "",
        describe("torch", "transformers", "faiss-cpu"),
        "The 300 targets of benchmarks/retrieval.py (the function's source without its docstring) cut into windows of SmolLM2's "
        "tokens as the tier cuts a turn, embedded by all-MiniLM-L6-v2 and ranked as `search --semantic` ranks them (cosine and "
        "BM25 over each retriever's best 100 chunks, min-max, 0.7 / 0.3; a target at its best chunk). Queries: the docstrings' "
        "first lines.",
        "",
        "| chunks | how many | embedding s | hit@1 | hit@10 |",
        "|---|---:|---:|---:|---:|",
        *rows,
    ]
    publish(lines, append=not args.no_results)


if __name__ == "__main__":
    main()
