"""Model load times (first, converting the GGUF; later, from the converted copy) and ingest
throughput next to the model's raw prefill throughput on the same text; and what coding tier K
adds to an ingest, per named preset, once the preset's shipped codebooks are built.

    .venv/bin/python benchmarks/ingest.py [--tokens 4096] [--runs 3] [--kv-tokens 8150]

Writes two tables to benchmarks/RESULTS.md (``--kv-tokens 0`` skips the second).
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
from corpus import real_text
from report import publish

import kvdb
from kvdb.model import loading as lm_ops
from kvdb.model import tokenizer as tok

LOAD = (
    "import time; t = time.perf_counter(); from kvdb.model import "
    "loading; loading.load(); print(time.perf_counter() - t)"
)


def timed_load(cache: str) -> tuple[float, float]:
    """(seconds inside load(), wall seconds of the whole process) in a fresh interpreter."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", LOAD], env=dict(os.environ, KVDB_CACHE=cache), capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1]), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of real text to ingest")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--kv-tokens", type=int, default=8150, help="tokens of the one text ingested with and without tier K (0: skip)"
    )
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
        # the load is measured above
        with tempfile.TemporaryDirectory() as tmp, kvdb.open(Path(tmp) / "bench.duckdb", model=lm) as db:
            start = time.perf_counter()
            for i, d in enumerate(docs):
                db.ingest(text=d, name=f"doc{i}-{run}")
            ingest.append(n_tokens / (time.perf_counter() - start))

    med = statistics.median
    rows = [
        ("first model load (converts the GGUF), in load()", f"{first[0]:.1f} s", f"process wall {first[1]:.1f} s"),
        (
            "later model load, in load()",
            f"{med(x[0] for x in later):.1f} s",
            f"process wall {med(x[1] for x in later):.1f} s",
        ),
        ("raw prefill, one forward pass per document", f"{med(prefill_one_pass):.0f} tok/s", ""),
        ("raw prefill, 512-token chunks with cache", f"{med(prefill_chunked):.0f} tok/s", ""),
        (
            "kvdb ingest (render, score, hash, store)",
            f"{med(ingest):.0f} tok/s",
            f"{med(ingest) / med(prefill_one_pass):.2f}x raw prefill",
        ),
    ]
    table = [
        f"`{' '.join(['.venv/bin/python', 'benchmarks/ingest.py', *sys.argv[1:]])}` ({time.strftime('%Y-%m-%d')}) — "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"SmolLM2-135M-Instruct, {n_tokens} tokens of real text in 4 documents, median of {args.runs} runs.\n",
        "| measure | value | note |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
    ]
    publish("Ingest throughput and model load", table)
    if args.kv_tokens:
        publish("Tier K at ingest", kv_overhead(lm, args.kv_tokens, args.runs))


def kv_overhead(lm, n: int, runs: int) -> list[str]:
    """Seconds to ingest one text of ``n`` tokens into a fresh archive with ``--keep tokens,search``
    and with ``tokens,search,kv`` at each named preset, the codebooks built beforehand (issue 33's
    target: tier K adds at most 25%). The variants take turns within each run, so drift in the
    machine's load falls on all of them."""
    from kvdb.codecs import presets

    text = tok.decode(lm.tokenizer, np.asarray(tok.encode(lm.tokenizer, real_text(n * 6)), dtype=np.int64)[:n])
    variants = [("tokens,search", None)] + [("tokens,search,kv", name) for name in presets.NAMES]
    with tempfile.TemporaryDirectory() as tmp, kvdb.open(Path(tmp) / "build.duckdb", model=lm) as db:
        for name in presets.NAMES:
            db.build_shipped_codebooks(preset=name)  # once per machine: not what an ingest pays
    seconds: dict[tuple[str, str | None], list[float]] = {v: [] for v in variants}
    for run in range(runs):
        for keep, preset in variants if run % 2 == 0 else variants[::-1]:
            with tempfile.TemporaryDirectory() as tmp, kvdb.open(Path(tmp) / "kv.duckdb", model=lm) as db:
                start = time.perf_counter()
                db.ingest(text=text, name="long", keep=keep, **({"kv_preset": preset} if preset else {}))
                seconds[(keep, preset)].append(time.perf_counter() - start)
    base = statistics.median(seconds[variants[0]])
    specs = presets.named(lm.identity.weights_hash)
    lines = [
        f"`.venv/bin/python benchmarks/ingest.py` ({time.strftime('%Y-%m-%d')}) — {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; SmolLM2-135M-Instruct; "
        f"one text of {n:,} tokens ingested into a fresh archive, shipped codebooks built beforehand; median of {runs} "
        "runs, the variants taking turns. Target (issue 33): tier K adds ≤ 25%.\n",
        "| --keep | preset | spec | seconds | overhead |",
        "|---|---|---|---:|---:|",
    ]
    for keep, preset in variants:
        t = statistics.median(seconds[(keep, preset)])
        lines.append(
            f"| `{keep}` | {preset or ''} | {specs[preset] if preset else ''} | {t:.1f} | "
            f"{'' if preset is None else f'{100 * (t / base - 1):+.1f}%'} |"
        )
    return lines


if __name__ == "__main__":
    main()
