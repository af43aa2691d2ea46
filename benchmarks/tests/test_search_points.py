"""The float walk points of benchmarks/search_points.py (decision 0003): the decay law, the
separation, exact resolution of the trailing symbols, and radius search."""

import numpy as np
import pytest
import search_points
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import examples, stream

from kvdb.codecs import fractal
from kvdb.errors import InvalidArgument

FAST = settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize(
    "symbols, alphabet",
    [([0, 256], 256), ([-1], 256), ([0], 1), ([0], fractal.MAX_ALPHABET + 1), ([0.5], 256), ([[1, 2]], 256)],
)
def test_bad_symbols_or_alphabets_are_rejected(symbols, alphabet):
    for call in (search_points.walk, search_points.query_point):
        with pytest.raises(InvalidArgument):
            call(np.asarray(symbols), alphabet)


SEARCH_ALPHABETS = st.sampled_from([2, 3, 256, 1024, 49152, fractal.MAX_ALPHABET])
DTYPES = st.sampled_from([np.float64, np.float32, np.float16])


@pytest.mark.parametrize("alphabet", [256, 1024, 49152, fractal.MAX_ALPHABET])
def test_default_float32_points_are_small_and_resolve_enough(alphabet):
    points = search_points.walk(stream(0, alphabet, 100), alphabet)
    assert points.dtype == np.float32 and points.shape[1] <= 8
    assert search_points.capacity(alphabet) >= search_points.MIN_CONTEXT


@FAST
@given(alphabet=SEARCH_ALPHABETS, dtype=DTYPES, dim=st.sampled_from([None, 2, 4, 8]), seed=st.integers(0, 2**32))
def test_points_resolve_exactly_capacity_trailing_symbols(alphabet, dtype, dim, seed):
    depth = search_points.capacity(alphabet, dtype, dim)
    if depth == 0:
        return
    symbols = stream(seed, alphabet, 300)
    points = search_points.walk(symbols, alphabet, dtype, dim)
    windows = np.lib.stride_tricks.sliding_window_view(symbols, depth)
    assert np.array_equal(search_points.resolve(points[depth - 1 :], alphabet, depth, dim), windows)


@FAST
@given(alphabet=SEARCH_ALPHABETS, dtype=DTYPES, seed=st.integers(0, 2**32), data=st.data())
def test_decay_law_and_separation(alphabet, dtype, seed, data):
    """Shared last s symbols: distance <= c r**s. Last symbol differs: distance >= gap."""
    geo = search_points.geometry(alphabet)
    depth = geo.capacity(dtype)
    if depth == 0:
        return
    rng = np.random.default_rng(seed)
    shared = data.draw(st.integers(0, depth))
    suffix = rng.integers(0, alphabet, shared)
    a = np.concatenate([rng.integers(0, alphabet, data.draw(st.integers(0, 12))), suffix])
    b = np.concatenate([rng.integers(0, alphabet, data.draw(st.integers(0, 12))), suffix])
    distance = np.linalg.norm(
        search_points.walk(a, alphabet, dtype)[-1:].astype(np.float64) - search_points.walk(b, alphabet, dtype)[-1:]
    )
    slack = 4 * np.sqrt(geo.dim) * np.finfo(dtype).eps * geo.extent
    if a.size and b.size:
        assert distance <= geo.decay(shared) + slack
    if a.size and b.size and a[-1] != b[-1]:
        assert distance >= geo.gap - slack


@FAST
@given(alphabet=SEARCH_ALPHABETS, seed=st.integers(0, 2**32), data=st.data())
def test_match_radius_separates_matches_from_non_matches(alphabet, seed, data):
    """Radius search is exact for phrases up to capacity symbols (float32, distances as FAISS flat L2)."""
    geo = search_points.geometry(alphabet)
    rng = np.random.default_rng(seed)
    small = min(alphabet, 3)  # a tiny sub-alphabet makes partial matches of every depth common
    symbols = rng.integers(0, small, 3000) * (alphabet // small)
    length = data.draw(st.integers(1, geo.capacity(np.float32)))
    phrase = symbols[data.draw(st.integers(0, symbols.size - length)) :][:length]
    points = search_points.walk(symbols, alphabet)
    query = search_points.query_point(phrase, alphabet)
    near = np.sqrt(((points - query) ** 2).sum(axis=1)) <= geo.match_radius(length)
    ends = np.lib.stride_tricks.sliding_window_view(symbols, length)
    truth = np.zeros(symbols.size, bool)
    truth[length - 1 :] = (ends == phrase).all(axis=1)
    assert np.array_equal(near[length - 1 :], truth[length - 1 :])


def test_equal_windows_give_identical_points_and_truncation_drops_oldest_first():
    alphabet = 49152
    symbols = stream(3, alphabet, 50)
    depth = search_points.capacity(alphabet)
    repeated = np.concatenate([symbols, symbols[-depth:]])
    points = search_points.walk(repeated, alphabet)
    assert np.array_equal(points[49], points[-1])
    assert np.array_equal(search_points.query_point(symbols, alphabet), points[49])
    # float16 keeps the newest symbols, float32 and float64 keep progressively older ones.
    depths = [search_points.capacity(alphabet, t) for t in (np.float16, np.float32, np.float64)]
    assert depths == sorted(depths) and depths[0] < depths[-1]
    for dtype, kept in zip((np.float16, np.float32, np.float64), depths):
        point = search_points.query_point(symbols[-depths[-1] :], alphabet, dtype)
        assert np.array_equal(search_points.resolve(point, alphabet, kept), symbols[-kept:])


def test_short_histories_and_empty_phrase():
    assert search_points.walk([], 256).shape == (0, search_points.geometry(256).dim)
    assert not search_points.query_point([], 256).any()
    assert np.array_equal(search_points.walk([5], 256)[0], search_points.query_point([5], 256))
