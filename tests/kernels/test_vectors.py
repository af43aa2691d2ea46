"""The semantic tier's index: exact while flat, and past FLAT_UP_TO an inverted file that finds
what the flat scan finds for vectors near the query."""

import numpy as np

from kvdb.index import vectors as vector_ops


def _unit(x):
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_flat_is_exact_and_the_inverted_file_finds_near_neighbours(monkeypatch):
    rng = np.random.default_rng(0)
    data = _unit(rng.standard_normal((3000, 32)))
    queries = _unit(data[:20] + 0.05 * rng.standard_normal((20, 32)))
    scores, rows = vector_ops.nearest(vector_ops.build(data), queries, 5)
    exact = np.argsort(-(queries @ data.T), axis=1)[:, :5]
    assert np.array_equal(rows, exact) and np.allclose(
        scores, np.take_along_axis(queries @ data.T, exact, axis=1), atol=1e-5
    )
    monkeypatch.setattr(vector_ops, "FLAT_UP_TO", 1000)
    index = vector_ops.build(data)
    assert type(index).__name__ == "IndexIVFScalarQuantizer" and index.nlist == vector_ops.lists(3000)
    scores, found = vector_ops.nearest(index, queries, 5)
    assert np.mean(found[:, 0] == np.arange(20)) >= 0.9  # each query's own source, nearly always
    # its codes are float16, as the sidecar's vectors: a row's score is its float16 vector's
    held = data.astype(np.float16).astype(np.float32)
    assert np.allclose(scores, np.take_along_axis(queries @ held.T, found, axis=1), atol=1e-3)
