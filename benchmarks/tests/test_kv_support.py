"""benchmarks/kv_support.py: codebooks cut down to a shallower preset (stages nest, so one deep
training run stands for every shallower preset) and the stored bytes of a set of codes."""

import kv_support as KS
import numpy as np
import pytest
from support import clustered_vectors, trained_codebooks

from kvdb.codecs import code_layout as CL
from kvdb.codecs import quant as Q
from kvdb.errors import InvalidArgument


@pytest.fixture(scope="module")
def trained():
    return trained_codebooks()


def test_truncated_codebooks_decode_a_prefix_of_the_codes(trained):
    cb, _, _ = trained
    k, v = clustered_vectors(n=300, seed=3), clustered_vectors(n=300, seed=4)  # held out
    kc, vc = Q.encode(cb, k, v)
    errors = []
    for stages in (1, 2, 3):
        kq, _ = Q.decode(KS.truncate(cb, f"k{stages}x16v1x16"), (kc[:, :, :stages], vc[:, :, :1]))
        errors.append(float(((kq - k) ** 2).mean()))
    assert errors[0] > errors[1] > errors[2]
    np.testing.assert_array_equal(
        Q.decode(cb, (kc[:, :, :2], vc))[0], Q.decode(KS.truncate(cb, "k2x16v2x16"), (kc[:, :, :2], vc))[0]
    )


def test_stored_code_bytes_are_the_fractal_blocks(trained):
    cb, _, _ = trained
    kc, vc = Q.encode(cb, clustered_vectors(n=100, seed=5), clustered_vectors(n=100, seed=6))
    # 16-ary symbols cost 4 bits; one block (12 B header + CRC)
    assert KS.stored_code_bytes(cb, (kc, vc)) == 2000 // 2 + 12
    assert KS.stored_code_bytes(cb, (kc, vc), start=4) == 96 * 20 // 2 + 12


def test_per_head_presets_cut_down_as_they_are_trained():
    k, v = clustered_vectors(layers=3, n=300, seed=11), clustered_vectors(layers=3, n=300, seed=12)
    cb = Q.train({"k": k, "v": v}, "k1x16v1x8+k3x16@1.1+v2x8@2.0", niter=4)
    uniform = Q.train({"k": k, "v": v}, "k1x16v1x8+k3x16@1+v2x8@2", niter=4)
    shallow = KS.truncate(cb, "k1x16v1x8+k2x16@1.1")
    assert shallow.depth("k")[1].tolist() == [1, 2] and shallow.depths.keys() == {"k"}
    assert shallow.stages("v")[2] == (8,) and not shallow.books["k"][1][1][0].any()
    # stages nest per head too: cutting the uniform set down is training the per-head preset
    assert KS.truncate(uniform, "k1x16v1x8+k3x16@1.1+v2x8@2.0").to_bytes() == cb.to_bytes()
    assert KS.truncate(cb, "k1x16v1x8").to_bytes()[8:12] == (1).to_bytes(4, "little")
    with pytest.raises(InvalidArgument, match="needs 3 k stages in layer 1 head 0"):
        KS.truncate(cb, "k1x16v1x8+k3x16@1")
    streams = CL.code_streams(cb, Q.encode(cb, k, v), start=4)
    bits = sum(len(symbols) * np.log2(alphabet) for alphabet, symbols in streams.items())
    assert KS.stored_code_bytes(cb, Q.encode(cb, k, v), start=4) > bits / 8  # the codes at their width, and headers
