"""Does semantic search (nearest keys in one layer) find paraphrases that phrase search cannot?
Measured on a small labelled set (`benchmarks/data/paraphrases.json`) with the embedded model.

    .venv/bin/python benchmarks/semantic.py

Hit@1 / hit@5: the labelled document is the session of the first hit / among the sessions of
the first five hits. Lexical = `Archive.search` (which ranks partial suffix matches after full
ones); semantic = `Archive.search_semantic` at several layers. Appends to RESULTS.md.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from report import describe, publish  # noqa: E402

import kvdb  # noqa: E402

DATA = Path(__file__).with_name("data") / "paraphrases.json"


def hit_rates(hits_by_query: list[tuple[str, list[str]]]) -> tuple[float, float]:
    top1 = sum(bool(names) and names[0] == label for label, names in hits_by_query)
    top5 = sum(label in names[:5] for label, names in hits_by_query)
    return top1 / len(hits_by_query), top5 / len(hits_by_query)


def main() -> None:
    data = json.loads(DATA.read_text())
    with tempfile.TemporaryDirectory() as tmp, kvdb.open(Path(tmp) / "bench.duckdb") as db:
        for name, text in data["documents"].items():
            db.ingest(text=text, name=name)
        trained = db.train_codebooks(preset="k4v2", tokens=4096)
        for name, text in data["documents"].items():  # again, now with tier K (same tokens: completes the nodes)
            db.delete(name)
            db.ingest(text=text, name=name, keep="tokens,search,kv")
        layers = db.loaded_model.model.config.num_hidden_layers
        rows = []
        lexical = [(q["label"], [h.name for h in db.search(q["query"], k=5)]) for q in data["queries"]]
        rows.append(("lexical (phrase search)", *hit_rates(lexical)))
        for layer in sorted({0, layers // 6, layers // 3, layers // 2, 2 * layers // 3, layers - 1}):
            found = [(q["label"], [h.name for h in db.search_semantic(q["query"], k=5, layer=layer)]) for q in data["queries"]]
            rows.append((f"semantic, layer {layer}", *hit_rates(found)))
    chance = 1 / len(data["documents"])
    lines = [
        f"\n## Semantic search on paraphrases ({time.strftime('%Y-%m-%d')})\n",
        f"`.venv/bin/python benchmarks/semantic.py` — {describe(f'torch {torch.__version__}')}; SmolLM2-135M-Instruct; "
        f"{len(data['documents'])} documents, {len(data['queries'])} paraphrase queries (chance hit@1 = {chance:.3f}); "
        f"tier K k4v2 trained on the documents themselves ({trained['tokens']} positions).\n",
        "| method | hit@1 | hit@5 |",
        "|---|---:|---:|",
        *[f"| {m} | {a:.3f} | {b:.3f} |" for m, a, b in rows],
    ]
    publish(lines)


if __name__ == "__main__":
    main()
