"""Semantic search: the archived positions whose keys, in one layer of the model, point where the
phrase's last key points.

Tier K already holds every archived position's keys (quantized). Pre-RoPE keys carry content
without position; layer 0 depends on the token alone (near-lexical), deeper layers on context.
A position's vector is its de-quantized pre-RoPE key in the chosen layer, all KV heads
concatenated and L2-normalised; the query is the same vector of the phrase's last token, run
through the model. Nearest by cosine, exactly (FAISS inner product over a flat index).
"""

from __future__ import annotations

import numpy as np

from kvdb.codecs import code_layout, quant
from kvdb.model import capture


def position_vectors(books: quant.Codebooks, streams: dict[int, np.ndarray], n: int, layer: int) -> np.ndarray:
    """[n, heads * dim] unit vectors of a node's positions, from its stored code streams."""
    keys = quant.decode_layer(books, "k", code_layout.codes_from_streams(books, streams, n)[0], layer)
    return _unit(keys.transpose(1, 0, 2).reshape(n, -1))


def query_vector(model, ids: np.ndarray, layer: int) -> np.ndarray:
    """The phrase's last pre-RoPE key in ``layer`` (heads concatenated), as a unit vector."""
    keys, _ = capture.capture(model, ids, pre_rope=True)
    return _unit(keys[layer, :, -1].reshape(1, -1))[0]


def nearest(vectors: np.ndarray, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cosines) of the ``k`` vectors nearest the query, best first."""
    import faiss

    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    scores, rows = index.search(np.ascontiguousarray(query[None], dtype=np.float32), min(k, len(vectors)))
    keep = rows[0] >= 0
    return rows[0][keep], scores[0][keep]


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
