"""kvdb.codecs.rangecoder: exact round trips, and streams within a byte or so of the information coded."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import examples

from kvdb.codecs import rangecoder
from kvdb.errors import CorruptData


def _code(symbols: list[tuple[str, int, np.ndarray | int]]) -> tuple[bytes, float]:
    """Encode ("cdf", s, cumulative) and ("uniform", s, total) symbols; (stream, ideal bits)."""
    enc, bits = rangecoder.Encoder(), 0.0
    for kind, s, table in symbols:
        if kind == "uniform":
            enc.encode(s, 1, table)
            bits += math.log2(table)
        else:
            freq = int(table[s + 1] - table[s])
            enc.encode(int(table[s]), freq, int(table[-1]))
            bits += math.log2(int(table[-1]) / freq)
    return enc.finish(), bits


def _decode(stream: bytes, symbols) -> list[int]:
    dec = rangecoder.Decoder(stream)
    return [dec.decode_uniform(table) if kind == "uniform" else dec.decode(table) for kind, _, table in symbols]


@st.composite
def symbol_lists(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = []
    for _ in range(draw(st.integers(0, 300))):
        if draw(st.booleans()) and out:
            total = int(draw(st.sampled_from([2, 3, 259, 49152])))
            out.append(("uniform", int(rng.integers(total)), total))
            continue
        size = int(draw(st.sampled_from([2, 5, 300, 5000])))
        freq = rng.integers(1, 1 << int(draw(st.integers(1, 14))), size=size) ** 2  # skewed, some symbols near 2**-24
        freq = np.maximum(1, (freq * ((1 << 24) - size) // freq.sum()))
        freq[0] += (1 << 24) - freq.sum()
        cumulative = np.concatenate([[0], np.cumsum(freq)])
        p = freq / freq.sum()
        out.append(("cdf", int(rng.choice(size, p=p)), cumulative))
    return out


@given(symbol_lists())
@settings(max_examples=examples(60), deadline=None)
def test_any_symbols_round_trip_within_two_bytes_of_their_information(symbols):
    stream, bits = _code(symbols)
    assert _decode(stream, symbols) == [s for _, s, _ in symbols]
    assert len(stream) <= math.ceil(bits / 8) + 2


def test_an_empty_stream_is_no_bytes_and_a_certain_symbol_costs_almost_nothing():
    assert rangecoder.Encoder().finish() == b""
    certain = np.array([0, (1 << 24) - 1, 1 << 24])  # symbol 0 at probability 1 - 2**-24
    stream, _ = _code([("cdf", 0, certain)] * 10_000)
    assert len(stream) <= 2 and _decode(stream, [("cdf", 0, certain)] * 10_000) == [0] * 10_000


def test_a_value_no_symbol_codes_is_corrupt_data():
    """With a total that does not divide the range, the top of the range codes nothing."""
    with pytest.raises(CorruptData):
        rangecoder.Decoder(b"\xff" * 8).decode_uniform(3)  # (2**64 - 1) // (2**64 // 3) == 3
    with pytest.raises(CorruptData):
        rangecoder.Decoder(b"\xff" * 8).decode(np.array([0, 1, 3]))
    assert rangecoder.Decoder(b"\x80").decode(np.array([0, 1, 2])) == 1  # the upper half: the second symbol
