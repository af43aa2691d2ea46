"""Tier K's transform coder (kvdb.codecs.transform): bits spent where the Fisher information says
the model loses most, codes laid out and decoded straight from the streams, and its bytes."""

from __future__ import annotations

import numpy as np
import pytest

from kvdb.codecs import code_layout as CL
from kvdb.codecs import presets as P
from kvdb.codecs import transform as TC
from kvdb.errors import CorruptData, InvalidArgument


def _vectors(layers=2, heads=2, n=700, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    mixing = np.random.default_rng(99).standard_normal(
        (layers, heads, dim, dim)
    )  # correlated dimensions, the same for every seed
    scale = np.linspace(2.0, 0.2, dim)
    return (np.einsum("lhnd,lhde->lhne", rng.standard_normal((layers, heads, n, dim)) * scale, mixing) + 1.5).astype(
        np.float32
    )


def _fisher(layers=2, heads=2, dim=8):
    return {"k": np.ones((layers, heads, dim)), "v": np.ones((layers, heads, dim))}


@pytest.fixture(scope="module")
def trained():
    return TC.train({"k": _vectors(seed=1), "v": _vectors(seed=2)}, _fisher(), "t3", iterations=10)


def test_bits_average_the_presets_budget_and_error_falls_with_them():
    held = _vectors(n=300, seed=3), _vectors(n=300, seed=4)
    errors = []
    for bits in (1, 2, 4):
        cb = TC.train({"k": _vectors(seed=1), "v": _vectors(seed=2)}, _fisher(), f"t{bits}", iterations=10)
        assert bits - 0.2 <= cb.bits_per_element() <= bits
        k, v = cb.decode(cb.encode(*held))
        errors.append(float(((k - held[0]) ** 2).mean() + ((v - held[1]) ** 2).mean()))
    assert errors[0] > 2 * errors[1] > 4 * errors[2]


def test_the_fisher_information_moves_bits_to_where_the_loss_is():
    fisher = _fisher()
    fisher["k"][0, 0] *= 1e4  # layer 0, head 0's keys: a small error there costs the model much more
    cb = TC.train({"k": _vectors(seed=1), "v": _vectors(seed=2)}, fisher, "t2", iterations=10)
    assert cb.bits["k"][0, 0].sum() > cb.bits["k"][1, 1].sum() + 8


def test_streams_round_trip_and_decode_as_the_arrays_do(trained):
    k, v = _vectors(n=50, seed=5), _vectors(n=50, seed=6)
    codes = CL.encode(trained, k, v)
    streams = CL.code_streams(trained, codes)
    assert CL.stream_columns(trained) == {size: len(s) // 50 for size, s in streams.items()}
    assert all(s.max() < size for size, s in streams.items())
    back = CL.codes_from_streams(trained, streams, 50)
    for a, b in zip(back, codes):
        np.testing.assert_array_equal(a, b)
    keys, values = trained.decode(codes)
    for layer, (lk, lv) in enumerate(CL.decode_streams(trained, streams, 50, used=30)):
        np.testing.assert_allclose(lk, keys[layer, :, :30], atol=1e-5)
        np.testing.assert_allclose(lv, values[layer, :, :30], atol=1e-5)
    later = CL.code_streams(trained, codes, start=20)  # a session's later positions: a suffix of each stream
    assert all(np.array_equal(later[size], s[20 * len(s) // 50 :]) for size, s in streams.items())


def test_bytes_round_trip_and_refuse_damage(trained):
    blob = trained.to_bytes()
    back = CL.read_codebooks(blob)
    assert isinstance(back, TC.TransformCodebooks) and back.to_bytes() == blob
    k, v = _vectors(n=20, seed=7), _vectors(n=20, seed=8)
    for a, b in zip(back.encode(k, v), trained.encode(k, v)):
        np.testing.assert_array_equal(a, b)
    assert len(blob) > trained.nbytes
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 1
    with pytest.raises(CorruptData, match="CRC"):
        CL.read_codebooks(bytes(damaged))
    with pytest.raises(CorruptData):
        CL.read_codebooks(blob[:100])
    newer = bytearray(blob)
    newer[8] = TC.VERSION + 1
    with pytest.raises(CorruptData, match="newer"):
        TC.TransformCodebooks.from_bytes(bytes(newer))


def test_transform_presets_parse_and_need_the_fisher_information():
    assert P.resolve("t3", "any") == "t3" and P.resolve("t1.5", "any") == "t1.5"
    for bad in ("t0", "t9", "t", "t-1"):
        with pytest.raises(InvalidArgument):
            P.resolve(bad, "any")
    with pytest.raises(InvalidArgument, match="Fisher"):
        CL.train({"k": _vectors(), "v": _vectors()}, "t2")
