"""The rankers benchmarks/hybrid.py (at tag studies-2026-12-06) measured against the semantic
tier's fusion: reciprocal-rank fusion by hand, and the LM's query likelihood against an
unbatched forward pass."""

import numpy as np
import pytest
import rankers
from rankers import rrf


def test_rrf_sums_reciprocal_ranks():
    ids, scores = rrf([np.array([3, 1, 2]), np.array([1, 4])], k=60)
    assert ids.tolist() == [1, 3, 4, 2]
    np.testing.assert_allclose(scores, [1 / 62 + 1 / 61, 1 / 61, 1 / 62, 1 / 63])
    ids, scores = rrf([np.array([3, 1]), np.array([1, 4])], k=1, weights=[4, 1])
    assert ids.tolist() == [3, 1, 4]
    np.testing.assert_allclose(scores, [4 / 2, 4 / 3 + 1 / 2, 1 / 3])
    assert rrf([np.array([5, 6]), np.array([6, 5])])[0].tolist() == [5, 6]  # a tie goes to the lower id
    assert len(rrf([np.array([], np.int64)])[0]) == 0


def test_query_logprob_equals_unbatched_forward(tiny_loaded):
    from kvdb.model.loading import score

    model = tiny_loaded.model
    rng = np.random.default_rng(1)
    contexts = [rng.integers(0, 256, size=n) for n in (1, 7, 30, 12, 30)]
    query = rng.integers(0, 256, size=5)
    got = rankers.query_logprob(model, contexts, query, tokens_per_batch=64)  # several batches, padded
    for context, value in zip(contexts, got):
        logprobs, _ = score(model, np.concatenate((context, query)))
        assert value == pytest.approx(float(logprobs[len(context) :].mean()), abs=1e-5)
    clipped = rankers.query_logprob(model, contexts, query, max_context=4)
    assert clipped[2] == pytest.approx(rankers.query_logprob(model, [contexts[2][-4:]], query)[0], abs=1e-5)
    with pytest.raises(ValueError):
        rankers.query_logprob(model, [np.array([], np.int64)], query)
