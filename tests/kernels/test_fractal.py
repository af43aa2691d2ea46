"""Properties of the iterated-map codec that the archive and search rely on."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import examples, stream

from kvdb.codecs import fractal
from kvdb.errors import CorruptData, InvalidArgument

FAST = settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALPHABETS = st.one_of(
    st.integers(fractal.MIN_ALPHABET, fractal.MAX_ALPHABET),
    st.sampled_from([2, 3, 4, 8, 32, 128, 255, 256, 257, 1024, 49152, 50257, fractal.MAX_ALPHABET]),
)
BLOCK_SIZES = st.sampled_from([8, 40, 64, 120, 1024, fractal.DEFAULT_BLOCK])


@FAST
@given(alphabet=ALPHABETS, length=st.integers(0, 5000), block_size=BLOCK_SIZES, seed=st.integers(0, 2**32))
def test_round_trip_and_random_ranges(alphabet, length, block_size, seed):
    symbols = stream(seed, alphabet, length)
    blobs = fractal.encode_blocks(symbols, alphabet, block_size)
    assert len(blobs) == -(-length // block_size)
    assert np.array_equal(fractal.decode_blocks(blobs, alphabet), symbols)
    rng = np.random.default_rng(seed)
    for _ in range(5):
        start, end = np.sort(rng.integers(0, length + 1, 2))
        needed = fractal.blocks_for_range(start, end, block_size)
        window = fractal.decode_range([blobs[b] for b in needed], alphabet, block_size, start, end)
        assert window.dtype == np.int64
        assert np.array_equal(window, symbols[start:end])


@pytest.mark.parametrize(
    "alphabet", [2, 3, 4, 8, 32, 128, 256, 1024, 49152, fractal.MAX_ALPHABET]
)  # 4-128: a transform preset's one bit string
def test_large_stream_round_trip(alphabet):
    symbols = stream(7, alphabet, 100_000)
    blobs = fractal.encode_blocks(symbols, alphabet)
    assert np.array_equal(fractal.decode_blocks(blobs, alphabet), symbols)
    ideal = np.log2(alphabet) / 8
    assert sum(map(len, blobs)) / symbols.size <= ideal * 1.05 + 0.01


def test_token_vocabulary_is_near_its_entropy():
    """49,152 = 3 * 2**14: 14 bits plus a trit packed 40 to a word, 15.6 bits per token."""
    assert fractal.layout(49152).bits_per_symbol == pytest.approx(15.6)


@FAST
@given(alphabet=ALPHABETS, position=st.integers(0, 3000), block_size=BLOCK_SIZES, seed=st.integers(0, 2**32))
def test_single_positions_at_span_and_block_boundaries(alphabet, position, block_size, seed):
    symbols = stream(seed, alphabet, 3001)
    blobs = fractal.encode_blocks(symbols, alphabet, block_size)
    span = fractal.layout(alphabet).span or 1
    for at in {position, position - position % span, position - position % block_size, position - 1}:
        if 0 <= at < symbols.size:
            block = at // block_size
            assert fractal.decode_block(blobs[block], alphabet, at % block_size, at % block_size + 1)[0] == symbols[at]


@FAST
@given(
    alphabet=ALPHABETS,
    pieces=st.lists(st.integers(0, 300), min_size=1, max_size=8),
    block_size=BLOCK_SIZES,
    seed=st.integers(0, 2**32),
)
def test_appends_equal_one_encoding(alphabet, pieces, block_size, seed):
    symbols = stream(seed, alphabet, sum(pieces))
    blobs: list[bytes] = []
    done = 0
    for size in pieces:
        replacement = fractal.append_blocks(
            blobs[-1] if blobs else None, alphabet, symbols[done : done + size], block_size
        )
        if blobs and fractal.block_count(blobs[-1], alphabet) < block_size:
            blobs.pop()
        blobs += replacement
        done += size
    assert blobs == fractal.encode_blocks(symbols, alphabet, block_size)


@FAST
@given(alphabet=ALPHABETS, head=st.integers(1, 200), tail=st.integers(0, 200), seed=st.integers(0, 2**32))
def test_append_to_block_rewalks_only_the_open_span(alphabet, head, tail, seed):
    symbols = stream(seed, alphabet, head + tail)
    (before,) = fractal.encode_blocks(symbols[:head], alphabet, 512)
    after = fractal.append_to_block(before, alphabet, symbols[head:])
    assert np.array_equal(fractal.decode_block(after, alphabet), symbols)
    lay = fractal.layout(alphabet)
    closed_words = 8 * (head // lay.span) if lay.span else 0
    assert after[8 : 8 + closed_words] == before[8 : 8 + closed_words]


@FAST
@given(alphabet=ALPHABETS, length=st.integers(1, 2000), seed=st.integers(0, 2**32), data=st.data())
def test_any_flipped_bit_is_detected(alphabet, length, seed, data):
    (blob,) = fractal.encode_blocks(stream(seed, alphabet, length), alphabet, 2048)
    bit = data.draw(st.integers(0, 8 * len(blob) - 1))
    damaged = bytearray(blob)
    damaged[bit // 8] ^= 1 << bit % 8
    with pytest.raises(CorruptData):
        fractal.decode_block(bytes(damaged), alphabet, 0, 1)


def test_truncated_or_foreign_blobs_are_detected():
    (blob,) = fractal.encode_blocks(np.arange(100), 256)
    for bad in (blob[:-1], blob[:5], b"", blob + b"\0"):
        with pytest.raises(CorruptData):
            fractal.decode_block(bad, 256)
    with pytest.raises(InvalidArgument):
        fractal.decode_block(blob, 1024)


@pytest.mark.parametrize(
    "symbols, alphabet",
    [([0, 256], 256), ([-1], 256), ([0], 1), ([0], fractal.MAX_ALPHABET + 1), ([0.5], 256), ([[1, 2]], 256)],
)
def test_bad_symbols_or_alphabets_are_rejected(symbols, alphabet):
    with pytest.raises(InvalidArgument):
        fractal.encode_blocks(np.asarray(symbols), alphabet)


def test_bad_ranges_and_block_sizes_are_rejected():
    blobs = fractal.encode_blocks(np.arange(100), 256, 64)
    with pytest.raises(InvalidArgument):
        fractal.decode_block(blobs[0], 256, 10, 65)
    with pytest.raises(InvalidArgument):
        fractal.decode_range(blobs, 256, 64, 50, 101)
    with pytest.raises(InvalidArgument):
        fractal.encode_blocks(np.arange(10), 256, 12)


# Search keys -------------------------------------------------------------------------------


@FAST
@given(
    alphabet=st.sampled_from([2, 3, 5, 259, 49152, fractal.MAX_ALPHABET]), seed=st.integers(0, 2**32), data=st.data()
)
def test_key_range_holds_exactly_the_occurrences(alphabet, seed, data):
    rng = np.random.default_rng(seed)
    symbols = rng.integers(0, min(alphabet, 4), 600)  # a small working set, so phrases recur
    keys = fractal.walk_keys(symbols, alphabet)
    depth = fractal.key_depth(alphabet)
    length = data.draw(st.integers(1, depth))
    end = data.draw(st.integers(length - 1, len(symbols) - 1))
    phrase = symbols[end - length + 1 : end + 1]
    lo, hi = fractal.key_range(phrase, alphabet)
    found = np.flatnonzero((keys >= np.uint64(lo)) & ((keys < np.uint64(hi)) if hi < 1 << 64 else True))
    window = np.lib.stride_tricks.sliding_window_view(symbols, length)
    truth = np.flatnonzero((window == phrase).all(axis=1)) + length - 1
    np.testing.assert_array_equal(found, truth)


def test_keys_decay_law_and_separation():
    alphabet = 49152
    base, depth = alphabet + 1, fractal.key_depth(alphabet)
    assert depth == 4 and base**depth <= 2**64 < base ** (depth + 1)
    rng = np.random.default_rng(7)
    tail = rng.integers(0, alphabet, 6)
    for shared in range(1, depth + 1):
        a = np.concatenate([rng.integers(0, alphabet, 5), tail[-shared:]])
        b = np.concatenate([rng.integers(0, alphabet, 5), tail[-shared:]])
        ka, kb = (int(fractal.walk_keys(x, alphabet)[-1]) for x in (a, b))
        assert abs(ka - kb) < base ** (depth - shared)  # last s symbols equal => within r**s (r = 1/base), scaled
    x, y = np.array([5, 9]), np.array([5, 10])  # last symbol differs => disjoint intervals
    lo_x, hi_x = fractal.key_range(x[-1:], alphabet)
    assert not lo_x <= int(fractal.walk_keys(y, alphabet)[-1]) < hi_x


def test_keys_walk_on_from_context_and_mark_the_start():
    symbols = np.random.default_rng(3).integers(0, 300, 1000)
    whole = fractal.walk_keys(symbols, 300)
    np.testing.assert_array_equal(fractal.walk_keys(symbols[400:], 300, context=symbols[:400]), whole[400:])
    lo, hi = fractal.key_range(symbols[:2], 300)  # the first position has no predecessor: no 2-symbol match there
    assert not lo <= int(whole[0]) < hi
    with pytest.raises(InvalidArgument):
        fractal.key_range(symbols[: fractal.key_depth(300) + 1], 300)
