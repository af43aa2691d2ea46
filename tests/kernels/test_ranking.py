"""Ranking kernels: the word splitter, BM25 against hand-computed scores, appending against one
build, and the fusion of scored lists."""

import math

import numpy as np
import pytest

from kvdb.index.ranking import BM25, top_k, weighted, words


def test_words_split_identifiers_and_lower_case():
    assert words("def py_scanstring(HTTPServer, getHTTPResponse2):") == [
        "def",
        "py",
        "scanstring",
        "http",
        "server",
        "get",
        "http",
        "response",
        "2",
    ]
    assert words("os.path.join(a, b) # Split the PATH") == ["os", "path", "join", "a", "b", "split", "the", "path"]
    assert words("x86_64 camelCase ABC Café") == ["x", "86", "64", "camel", "case", "abc", "café"]
    assert words("  -- ") == []


def test_bm25_scores_equal_the_formula_by_hand():
    index = BM25(k1=1.2, b=0.75)
    index.add(["alpha beta", "alpha gamma gamma", "beta"])  # lengths 2, 3, 1: avgdl 2
    idf_alpha = math.log(1 + (3 - 2 + 0.5) / (2 + 0.5))
    idf_gamma = math.log(1 + (3 - 1 + 0.5) / (1 + 0.5))
    norm = lambda length: 1.2 * (1 - 0.75 + 0.75 * length / 2)  # noqa: E731
    expected = [
        idf_alpha * 1 * 2.2 / (1 + norm(2)),
        idf_alpha * 1 * 2.2 / (1 + norm(3)) + idf_gamma * 2 * 2.2 / (2 + norm(3)),
        0.0,
    ]
    np.testing.assert_allclose(index.scores("Gamma alpha delta"), expected)
    ids, scores = top_k(index.scores("gamma alpha"), 5)
    assert ids.tolist() == [1, 0]  # the chunk no word meets is left out
    np.testing.assert_allclose(scores, expected[1::-1])
    assert index.scores("delta").tolist() == [0, 0, 0]


def test_bm25_appended_in_pieces_equals_one_build():
    rng = np.random.default_rng(0)
    vocabulary = [f"w{i}" for i in range(40)] + ["snake_case", "camelCase"]
    texts = [" ".join(rng.choice(vocabulary, size=rng.integers(0, 12))) for _ in range(97)]
    once = BM25()
    once.add(texts)
    pieces = BM25()
    at = 0
    for size in (1, 5, 1, 30, 2, 2, 40, 16):
        assert pieces.add(texts[at : at + size]).tolist() == list(range(at, at + size))
        at += size
    assert at == len(texts) and len(pieces.segments) < 8
    for query in ("w1 w2", "w3 w3 w39", "snake camel case", "nothing"):
        np.testing.assert_allclose(pieces.scores(query), once.scores(query), rtol=1e-12)


def test_top_k_breaks_ties_by_id_and_keeps_the_floor():
    scores = np.array([0.5, 2.0, 0.0, 2.0, 1.0])
    assert top_k(scores, 2)[0].tolist() == [1, 3]
    assert top_k(scores, 10)[0].tolist() == [1, 3, 4, 0]
    assert top_k(scores - 1, 10, floor=-np.inf)[0].tolist() == [1, 3, 4, 0, 2]


def test_weighted_fusion_normalises_each_list_and_floors_missing_ids():
    bm25 = (np.array([7, 2, 5]), np.array([10.0, 6.0, 2.0]))  # min-max: 1, 0.5, 0
    dense = (np.array([2, 9]), np.array([0.9, 0.5]))  # min-max: 1, 0
    ids, scores = weighted([bm25, dense], [0.25, 0.75])
    assert ids.tolist() == [2, 7, 5, 9]
    np.testing.assert_allclose(scores, [0.25 * 0.5 + 0.75, 0.25, 0, 0])
    z_ids, z = weighted([bm25, dense], how="zscore")
    zb = (bm25[1] - bm25[1].mean()) / bm25[1].std()
    np.testing.assert_allclose(z, sorted([zb[0] - 1, zb[1] + 1, zb[2] - 1, zb.min() - 1], reverse=True))
    assert z_ids[0] == 2
    with pytest.raises(ValueError):
        weighted([bm25], how="rank")


def test_bm25_over_groups_of_chunks_equals_a_build_over_their_joined_texts():
    """Whole-session BM25 (decision 0058) from the chunks' postings: each session's chunks one
    document; a removed chunk, and a chunk of no session (-1), count nowhere."""
    rng = np.random.default_rng(1)
    vocabulary = [f"w{i}" for i in range(30)]
    texts = [" ".join(rng.choice(vocabulary, size=rng.integers(1, 10))) for _ in range(60)]
    groups = rng.integers(-1, 9, size=60)
    index = BM25()
    index.add(texts[:25])
    index.add(texts[25:])
    index.remove(np.array([3, 40]))
    kept = [(g, t) for i, (g, t) in enumerate(zip(groups.tolist(), texts)) if g >= 0 and i not in (3, 40)]
    present = sorted({g for g, _ in kept})
    joined = BM25()
    joined.add([" ".join(t for g2, t in kept if g2 == g) for g in present])
    for query in ("w1 w2 w2", "w7", "w29 w3 w11 nowhere"):
        scores, ceiling = index.grouped(query, groups, 10)
        expected = np.zeros(10)
        expected[present] = joined.scores(query)
        np.testing.assert_allclose(scores, expected)
        assert ceiling == pytest.approx(joined.ceiling(query)) and (scores < ceiling).all()


def test_a_score_over_the_ceiling_is_a_share_of_the_query_that_no_list_moves():
    index = BM25()
    index.add(["alpha beta", "alpha gamma gamma", "beta"])
    share = index.scores("alpha gamma") / index.ceiling("alpha gamma")
    assert 0 < share.max() < 1 and share[2] == 0
    unseen = index.scores("alpha gamma zeta") / index.ceiling("alpha gamma zeta")
    assert (unseen[:2] < share[:2]).all()  # a word nothing holds lowers every share: the query is met less
    assert index.ceiling("zeta") > 0 and not index.scores("zeta").any()
    assert BM25().ceiling("alpha") == 0.0
