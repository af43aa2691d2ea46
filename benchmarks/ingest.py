"""Model load times (first, converting the GGUF; later, from the converted copy) and ingest
throughput next to the model's raw prefill throughput on the same text.

    .venv/bin/python benchmarks/ingest.py [--tokens 4096] [--runs 3]

Appends a table to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from corpus import real_text  # noqa: E402
from report import publish  # noqa: E402

import kvdb  # noqa: E402
from kvdb.model import loading as lm_ops  # noqa: E402
from kvdb.model import tokenizer as tok  # noqa: E402

LOAD = "import time; t = time.perf_counter(); from kvdb.model import loading; loading.load(); print(time.perf_counter() - t)"


def timed_load(cache: str) -> tuple[float, float]:
    """(seconds inside load(), wall seconds of the whole process) in a fresh interpreter."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", LOAD], env=dict(os.environ, KVDB_CACHE=cache), capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1]), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of real text to ingest")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as cache:
        first = timed_load(cache)
        later = [timed_load(cache) for _ in range(args.runs)]

    lm = lm_ops.load()
    ids = np.asarray(tok.encode(lm.tokenizer, real_text(args.tokens * 6)), dtype=np.int64)[: args.tokens]
    docs = [tok.decode(lm.tokenizer, part) for part in np.array_split(ids, 4)]
    n_tokens = sum(len(tok.encode(lm.tokenizer, d)) for d in docs)

    prefill_one_pass, prefill_chunked, ingest = [], [], []
    for run in range(args.runs):
        with torch.no_grad():
            start = time.perf_counter()
            for d in docs:
                lm.model(torch.as_tensor(tok.encode(lm.tokenizer, d))[None])
            prefill_one_pass.append(n_tokens / (time.perf_counter() - start))
        start = time.perf_counter()
        for d in docs:
            lm_ops.prefill(lm.model, np.asarray(tok.encode(lm.tokenizer, d)))
        prefill_chunked.append(n_tokens / (time.perf_counter() - start))
        with tempfile.TemporaryDirectory() as tmp, kvdb.open(Path(tmp) / "bench.duckdb", model=lm) as db:  # the load is measured above
            start = time.perf_counter()
            for i, d in enumerate(docs):
                db.ingest(text=d, name=f"doc{i}-{run}")
            ingest.append(n_tokens / (time.perf_counter() - start))

    med = statistics.median
    rows = [
        ("first model load (converts the GGUF), in load()", f"{first[0]:.1f} s", f"process wall {first[1]:.1f} s"),
        ("later model load, in load()", f"{med(x[0] for x in later):.1f} s", f"process wall {med(x[1] for x in later):.1f} s"),
        ("raw prefill, one forward pass per document", f"{med(prefill_one_pass):.0f} tok/s", ""),
        ("raw prefill, 512-token chunks with cache", f"{med(prefill_chunked):.0f} tok/s", ""),
        ("kvdb ingest (render, score, hash, store)", f"{med(ingest):.0f} tok/s", f"{med(ingest) / med(prefill_one_pass):.2f}x raw prefill"),
    ]
    table = [
        f"\n## Ingest throughput and model load ({time.strftime('%Y-%m-%d')})\n",
        f"`{' '.join(['.venv/bin/python', 'benchmarks/ingest.py', *sys.argv[1:]])}` — {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"SmolLM2-135M-Instruct, {n_tokens} tokens of real text in 4 documents, median of {args.runs} runs.\n",
        "| measure | value | note |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
    ]
    publish(table)


if __name__ == "__main__":
    main()
