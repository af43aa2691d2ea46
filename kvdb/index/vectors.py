"""Nearest unit vectors by inner product: the semantic tier's index, arrays in, arrays out.

Exact (a flat scan) up to ``FLAT_UP_TO`` vectors; past that an inverted file of
``lists(n)`` k-means cells, of which ``NPROBE`` nearest the query are scanned. On 2 cores, one
thread per query: a flat scan of 1e6 384-d vectors takes several times the latency target, and the
inverted file at 1e6 with 128 of its 4,000 cells probed is well within it, finding what the exact scan
finds (16 probed is faster, but loses hit@10; benchmarks/RESULTS.md, "Semantic tier: index
latency at 1e4-1e6 chunks", and decisions/0037). A query is one vector, so FAISS's threads would
only wait on each other.
"""

from __future__ import annotations

import math

import numpy as np

FLAT_UP_TO = 100_000
NPROBE = 128  # cells scanned of lists(n): about 3% of the vectors
TRAIN_PER_LIST = 40  # k-means points per cell (FAISS warns below 39)


def lists(n: int) -> int:
    """Cells of the inverted file for n vectors: about 4 sqrt(n), FAISS's rule of thumb."""
    return max(1, int(4 * math.sqrt(n)))


def build(vectors: np.ndarray, seed: int = 0):
    """A FAISS index over the rows of ``vectors`` (unit length), searched by inner product."""
    import faiss

    faiss.omp_set_num_threads(1)
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, dim = vectors.shape
    if n <= FLAT_UP_TO:
        flat = faiss.IndexFlatIP(dim)
        flat.add(vectors)
        return flat
    cells = lists(n)
    # the cells hold float16 codes, as the sidecar holds the vectors: float32 lists doubled its size and
    # its load (0.14 s of a fresh search at 1e5 chunks), and probed the same rows (decision 0074)
    quantizer = faiss.IndexFlatIP(dim)
    fp16 = faiss.ScalarQuantizer.QT_fp16
    index = faiss.IndexIVFScalarQuantizer(quantizer, dim, cells, fp16, faiss.METRIC_INNER_PRODUCT, False)
    sample = np.random.default_rng(seed).choice(n, size=min(n, cells * TRAIN_PER_LIST), replace=False)
    index.train(vectors[np.sort(sample)])
    index.nprobe = NPROBE
    index.add(vectors)
    return index


def add(index, vectors: np.ndarray) -> None:
    """Append rows: an inverted file files them in the cells it was trained with (no retraining)."""
    import faiss

    faiss.omp_set_num_threads(1)
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))


def trained(index) -> bool:
    """Whether ``index`` is an inverted file (trained cells) rather than a flat scan of its rows."""
    return hasattr(index, "nprobe")


def to_bytes(index) -> np.ndarray:
    """An inverted file, serialised by FAISS (its version checks what it reads back)."""
    import faiss

    return faiss.serialize_index(index)


def read(read_bytes) -> object:
    """An inverted file from FAISS's serialised bytes, read through ``read_bytes(n)`` (a file's
    ``read``): no second copy of a GB-sized index on the way in."""
    import faiss

    index = faiss.read_index(faiss.PyCallbackIOReader(read_bytes))  # type: ignore[attr-defined]  # missing from FAISS's stubs
    faiss.extract_index_ivf(index).nprobe = NPROBE
    return index


def nearest(index, queries: np.ndarray, k: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(inner products, rows) of the ``k`` nearest rows to each query, best first; -1 rows pad.
    ``allowed``: a mask of the rows that may be returned (the others are tombstones)."""
    import faiss

    faiss.omp_set_num_threads(1)
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    if allowed is None or allowed.all():
        return index.search(queries, k)
    bits = np.packbits(allowed, bitorder="little")
    selector = faiss.IDSelectorBitmap(len(allowed), faiss.swig_ptr(bits))
    if trained(index):
        ivf = faiss.SearchParametersIVF()
        ivf.nprobe = NPROBE
        ivf.sel = selector
        return index.search(queries, k, params=ivf)
    flat = faiss.SearchParameters()
    flat.sel = selector
    return index.search(queries, k, params=flat)
