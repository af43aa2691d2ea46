"""The sidecar format (kvdb/index/sidecar.py) against safetensors on the two sidecars' arrays:
a phrase-index segment of 1e7 positions and a chunk index of 1e5 chunks (384-dim fp16 vectors,
BM25 postings), in their real dtypes. Times to write and to open (median of 5, warm page cache),
the bytes allocated by an open (tracemalloc: a mapping allocates nothing, a copy its size), and
the file's bytes. safetensors has no byte-string dtype, so node ids go in as uint8 rows; its
write is followed by the fsync and rename that make the sidecar's atomic.

    .venv/bin/python benchmarks/sidecar_safetensors.py

Decision 0059 records the result.
"""

from __future__ import annotations

import os
import sys
import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from kvdb.index import chunk_index, sidecar

sys.path.insert(0, str(Path(__file__).parent))
from report import median_seconds

MAGIC = b"KVDBBNCH"
RUNS = 5  # timed calls per measure, the median kept


def segment_arrays(positions: int = 10_000_000) -> tuple[dict[str, np.ndarray], None]:
    rng = np.random.default_rng(0)
    runs = positions // 500
    return {
        "samples": np.sort(rng.integers(0, 2**63, -(-positions // 64), dtype=np.uint64)),
        "run_first": np.sort(rng.choice(positions, runs, replace=False)).astype("<u8"),
        "run_link": rng.integers(0, positions, runs, dtype=np.uint64),
        "order": rng.permutation(positions).astype("<u4"),
        "run_length": np.full(runs, 500, "<u4"),
        "run_held": rng.integers(0, 255, runs).astype("<u4"),
        "tokens": rng.integers(0, 49152, positions).astype("<u2"),
        "run_context": rng.integers(0, 49152, runs * 20).astype("<u2"),
    }, None  # every array checked (when asked)


def chunk_arrays(
    chunks: int = 100_000, dim: int = 384, words: int = 60
) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    rng = np.random.default_rng(1)
    postings = chunks * words
    arrays = {
        "node_ids": np.array([f"{i:032x}".encode() for i in range(chunks // 4)]),
        "row_node": np.repeat(np.arange(chunks // 4), 4).astype(np.int64),
        "spans": np.stack([np.arange(chunks), np.arange(chunks) + 128], 1).astype(np.int64),
        "live": np.ones(chunks, bool),
        "vectors": rng.standard_normal((chunks, dim)).astype(np.float16),
        "bm25.words": rng.integers(97, 123, 400_000).astype(np.uint8),
        "bm25.df": rng.integers(1, 100, 50_000).astype(np.int64),
        "bm25.lengths": np.full(chunks, words, np.int64),
        "bm25.gone": np.zeros(chunks, bool),
        "bm25.segment_sizes": np.array([[50_000, postings]], np.int64),
        "bm25.terms": np.arange(50_000, dtype=np.int64),
        "bm25.starts": np.linspace(0, postings, 50_001).astype(np.int64),
        "bm25.docs": rng.integers(0, chunks, postings).astype(np.int64),
        "bm25.tf": rng.integers(1, 4, postings).astype(np.float64),
    }
    return arrays, chunk_index.CHECKED  # the arrays whose CRC the chunk index checks at each open


def atomic_save_file(arrays: dict[str, np.ndarray], path: Path) -> None:
    """safetensors' write made as durable and atomic as the sidecar's: fsync, then rename."""
    tmp = path.with_suffix(".tmp")
    save_file(arrays, str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def allocated(run: Callable[[], object]) -> int:
    tracemalloc.start()
    kept = run()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del kept
    return peak


def measure(name: str, arrays: dict[str, np.ndarray], checked: tuple[str, ...] | None, folder: Path) -> list[str]:
    ours, theirs = folder / "sidecar.kvdb", folder / "sidecar.safetensors"
    plain = {k: (v.view(np.uint8).reshape(len(v), -1) if v.dtype.kind == "S" else v) for k, v in arrays.items()}
    rows = []
    write_ours = median_seconds(lambda: sidecar.write(ours, MAGIC, {"kind": name}, arrays, checked), RUNS)
    write_theirs = median_seconds(lambda: atomic_save_file(plain, theirs), RUNS)
    for label, path, write, open_ in (
        (
            "kvdb sidecar (CRC of the checked arrays)",
            ours,
            write_ours,
            lambda: sidecar.read(ours, MAGIC, checked=checked),
        ),
        (
            "kvdb sidecar (CRC not compared)",
            ours,
            write_ours,
            lambda: sidecar.read(ours, MAGIC, checked=checked, check_up_to=0),
        ),
        ("safetensors load_file", theirs, write_theirs, lambda: load_file(str(theirs))),
    ):
        seconds = median_seconds(open_, RUNS)
        rows.append(
            f"| {name} | {label} | {write * 1e3:.0f} | {seconds * 1e3:.1f} | "
            f"{allocated(open_) / 2**20:.1f} | {path.stat().st_size / 2**20:.2f} |"
        )
    return rows


def main() -> None:
    print("| sidecar | format | write ms | open ms | MiB allocated by an open | file MiB |")
    print("|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arrays, checked) in (
            ("segment, 1e7 positions", segment_arrays()),
            ("chunk index, 1e5 chunks", chunk_arrays()),
        ):
            print("\n".join(measure(name, arrays, checked, Path(tmp))))


if __name__ == "__main__":
    main()
