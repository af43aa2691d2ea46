"""Does the KV-state search (``Archive.search_semantic``, nearest keys at one layer, over tier K)
add anything to the semantic tier's hybrid ranking? Issue 32 keeps it only if it does.

    .venv/bin/python benchmarks/kv_state_fusion.py [--queries N] [--layers 0,15]

On retrieval.py's targets (the first N of its 300, same seed), ingested with
``keep="tokens,search,kv,semantic"`` and its codebooks: per query the semantic tier's session
ranking, the KV-state ranking at each layer, and their reciprocal-rank fusion (k = 60) with the
KV list weighted 1, 0.5 and 0.25 against the tier's 1; hit@1 and hit@10 of each. Prints a
table to paste into RESULTS.md (a one-off: the search it measures is removed if it adds nothing).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from retrieval import DEPTH, K_SEMANTIC, QUERIES, SEED, default_codebooks, distinct, retrieval_set, score

RRF_K = 60


def fused(lists: list[list[str]], weights: list[float]) -> list[str]:
    """Names by weighted reciprocal rank: Σ w / (k + rank)."""
    total: dict[str, float] = {}
    for names, w in zip(lists, weights):
        for rank, name in enumerate(distinct(names)):
            total[name] = total.get(name, 0.0) + w / (RRF_K + rank + 1)
    return sorted(total, key=lambda n: -total[n])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--layers", default="0,15")
    args = parser.parse_args()
    import torch

    import kvdb

    torch.set_num_threads(2)
    items, _, _ = retrieval_set(QUERIES, SEED)
    items = items[: args.queries]
    layers = [int(x) for x in args.layers.split(",")]
    with tempfile.TemporaryDirectory() as tmp, kvdb.open(Path(tmp) / "bench.duckdb") as db:
        codebooks = default_codebooks(db)
        start = time.perf_counter()
        for item in items:
            db.ingest(text=item.document, name=item.name, keep="tokens,search,kv,semantic")
        print(f"ingested {len(items)} in {time.perf_counter() - start:.0f} s (codebooks: {codebooks})", flush=True)
        tier = [[h.name for h in db.search_meaning(item.query, k=DEPTH * 2)] for item in items]
        kv = {layer: [[h.name for h in db.search_semantic(item.query, k=K_SEMANTIC, context=0, layer=layer)] for item in items] for layer in layers}
    rows = [("semantic tier (hybrid)", score([(it.name, r) for it, r in zip(items, tier)]))]
    for layer in layers:
        rows.append((f"KV-state search, layer {layer}", score([(it.name, r) for it, r in zip(items, kv[layer])])))
        for w in (1.0, 0.5, 0.25):
            rankings = [(it.name, fused([t, k], [1.0, w])) for it, t, k in zip(items, tier, kv[layer])]
            rows.append((f"RRF(tier, KV layer {layer} x{w})", score(rankings)))
    print(f"\n{len(items)} queries (benchmarks/kv_state_fusion.py --queries {args.queries} --layers {args.layers})\n")
    print("| method | hit@1 | hit@10 |\n|---|---:|---:|")
    for name, (h1, h10) in rows:
        print(f"| {name} | {h1:.3f} | {h10:.3f} |")


if __name__ == "__main__":
    main()
