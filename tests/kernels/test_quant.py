"""KV tier: residual VQ codebooks (kvdb.codecs.quant) and capture/restore of K/V (kvdb.model.capture)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support import clustered_vectors, trained_codebooks

import kvdb
from kvdb.codecs import code_layout as CL
from kvdb.codecs import presets as P
from kvdb.codecs import quant as Q
from kvdb.errors import CorruptData, InvalidArgument
from kvdb.model import capture as C
from kvdb.model import loading as M
from kvdb.model import tokenizer as tok

CALIBRATION_FILE = Path(kvdb.__file__).parent / "data" / "calibration.txt"  # real text: ~9k tokens


def _restored(model, ids, keys, values, **restore):
    """``capture.restore_layers`` of whole ``[layers, kv_heads, seq, head_dim]`` arrays (taken over)."""
    return C.restore_layers(model, ids, zip(keys, values), **restore)


@pytest.fixture(scope="module")
def trained():
    return trained_codebooks()


def test_codebook_bytes_round_trip(trained):
    cb, _, _ = trained
    cb.meta = {"model_id": "abc", "calib_tokens": 600}
    blob = cb.to_bytes()
    back = Q.Codebooks.from_bytes(blob)
    assert back.to_bytes() == blob
    assert (back.layers, back.heads, back.dim, back.pre_rope, back.preset, back.meta) == (
        cb.layers,
        cb.heads,
        cb.dim,
        cb.pre_rope,
        cb.preset,
        cb.meta,
    )
    for kind in Q.KINDS:
        assert back.stages(kind) == cb.stages(kind)
        for a, b in zip(back.books[kind], cb.books[kind]):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)  # centroids are fp16-exact, so nothing is lost
    assert blob.startswith(Q.MAGIC) and len(blob) > cb.nbytes
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 1
    with pytest.raises(CorruptData):
        Q.Codebooks.from_bytes(bytes(damaged))
    with pytest.raises(CorruptData):
        Q.Codebooks.from_bytes(b"not a codebook at all")


def test_encode_decode_shapes_and_error_drops_with_stages(trained):
    cb, _, _ = trained
    k, v = clustered_vectors(n=300, seed=3), clustered_vectors(n=300, seed=4)  # held out
    kc, vc = Q.encode(cb, k, v)
    assert kc.dtype == np.uint16 and kc.shape == (2, 2, 3, 300) and vc.shape == (2, 2, 2, 300)
    assert kc.max() < 16
    errors = []
    for stages in (1, 2, 3):  # the codes' first stages alone decode with the codebooks' first stages
        kq, vq = Q.decode(cb, (kc[:, :, :stages], vc[:, :, :1]))
        assert kq.shape == k.shape and vq.shape == v.shape and kq.dtype == np.float32
        errors.append(float(((kq - k) ** 2).mean()))
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.5 * float(((k - k.mean(2, keepdims=True)) ** 2).mean())
    with pytest.raises(InvalidArgument):
        Q.encode(cb, k[:, :, :, :4], v)


def test_stored_code_bytes_match_fractal(trained):
    cb, _, _ = trained
    kc, vc = Q.encode(cb, clustered_vectors(n=100, seed=5), clustered_vectors(n=100, seed=6))
    streams = CL.code_streams(cb, (kc, vc))
    assert list(streams) == [16]
    assert len(streams[16]) == 100 * 2 * 2 * (3 + 2)
    # token-major: position 0's symbols first, kind > layer > stage > head
    first = np.concatenate(
        [
            kc[0, :, :, 0].T.reshape(-1),
            kc[1, :, :, 0].T.reshape(-1),
            vc[0, :, :, 0].T.reshape(-1),
            vc[1, :, :, 0].T.reshape(-1),
        ]
    )
    assert np.array_equal(streams[16][:20], first)


def test_per_layer_training():
    k, v = clustered_vectors(n=200, seed=7), clustered_vectors(n=200, seed=8)
    cb = Q.train({"k": k, "v": v}, "k1x8v1x8+k2x8@1", niter=4)
    assert cb.stages("k") == [(8,), (8, 8)]
    kc, vc = Q.encode(cb, k, v)
    assert kc.shape == (2, 2, 2, 200)
    assert not kc[0, :, 1].any()  # layer 0 has no second stage: zero rows, never stored
    assert len(CL.code_streams(cb, (kc, vc))[8]) == 200 * 2 * (1 + 2 + 1 + 1)
    assert Q.Codebooks.from_bytes(cb.to_bytes()).stages("k") == [(8,), (8, 8)]


def test_heads_with_fewer_stages_than_their_layer():
    """A per-head preset: each head is coded with its own stages only, stores only those (codes,
    streams and centroids: codebook format version 2) and decodes to the sum of its centroids;
    a preset whose heads all take their layers' stages is still written as version 1."""
    k, v = clustered_vectors(layers=3, n=300, seed=11), clustered_vectors(layers=3, n=300, seed=12)
    cb = Q.train({"k": k, "v": v}, "k1x16v1x8+k3x16@1.1+v2x8@2.0", niter=4)
    assert cb.stages("k") == [(16,), (16,) * 3, (16,)] and cb.depth("k").tolist() == [[1, 1], [1, 3], [1, 1]]
    assert not cb.books["k"][1][1][0].any() and cb.books["k"][1][1][1].any()  # head 0 has no stage 1
    uniform = Q.train({"k": k, "v": v}, "k1x16v1x8+k3x16@1+v2x8@2", niter=4)
    assert cb.nbytes == uniform.nbytes - 2 * 16 * 8 * 2 - 8 * 8 * 2  # 2 key stages and 1 value stage of one head fewer
    blob = cb.to_bytes()
    assert blob[8:12] == (2).to_bytes(4, "little") and uniform.to_bytes()[8:12] == (1).to_bytes(4, "little")
    back = Q.Codebooks.from_bytes(blob)
    assert back.to_bytes() == blob and back.nbytes == cb.nbytes
    for kind in Q.KINDS:
        np.testing.assert_array_equal(back.depth(kind), cb.depth(kind))
        for a, b in zip(back.books[kind], cb.books[kind]):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
    kc, vc = Q.encode(cb, k, v)
    assert kc.shape == (3, 2, 3, 300) and not kc[1, 0, 1:].any() and not kc[0, :, 1:].any()
    keys, values = Q.decode(cb, (kc, vc))
    for head in range(2):
        want = sum(cb.books["k"][1][s][head][kc[1, head, s]] for s in range(cb.depth("k")[1, head]))
        np.testing.assert_allclose(keys[1, head], want, rtol=1e-6, atol=1e-6)
    streams = CL.code_streams(cb, (kc, vc), start=4)
    assert len(streams[16]) == 296 * (2 + 2 + 2 + 2) and len(streams[8]) == 296 * (2 + 2 + 3)
    assert CL.stream_columns(cb) == {16: 8, 8: 7}
    for a, b in zip((kc, vc), CL.codes_from_streams(cb, streams, 296)):
        np.testing.assert_array_equal(a[..., 4:], b)
    for layer, (got_k, got_v) in enumerate(CL.decode_streams(cb, CL.code_streams(cb, (kc, vc)), 300, 200)):
        np.testing.assert_array_equal(got_k, keys[layer, :, :200])
        np.testing.assert_array_equal(got_v, values[layer, :, :200])


def test_decode_streams_gives_decode_layer_by_layer():
    """The restore path decodes the stored streams a layer at a time: the same vectors as
    decoding the codes, for a prefix of the positions, with stage counts and codebook sizes
    (so streams) differing by layer, and a kind with no stages in a layer."""
    k, v = clustered_vectors(n=300, seed=9), clustered_vectors(n=300, seed=10)
    cb = Q.train({"k": k, "v": v}, "k2x16v1x8+k3x32@1+v2x16@0", niter=4)
    codes = Q.encode(cb, k, v)
    streams = CL.code_streams(cb, codes)
    assert sorted(streams) == [8, 16, 32]
    want_k, want_v = Q.decode(cb, codes)
    for used in (300, 123, 0):
        layers = list(CL.decode_streams(cb, streams, 300, used))
        assert len(layers) == cb.layers
        for layer, (got_k, got_v) in enumerate(layers):
            assert got_k.shape == got_v.shape == (cb.heads, used, cb.dim) and got_k.dtype == np.float32
            np.testing.assert_array_equal(got_k, want_k[layer, :, :used])
            np.testing.assert_array_equal(got_v, want_v[layer, :, :used])


# -- capture / restore on the tiny model ---------------------------------------------------


@pytest.fixture
def tiny(tiny_loaded):
    """The session's loaded tiny model (and the integer passes lmcode builds of it once)."""
    return tiny_loaded


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=n)


def test_capture_matches_prefill_cache_and_chunks(tiny):
    ids = _ids(70)
    k, v = C.capture(tiny.model, ids, chunk=32)
    assert k.shape == (2, 2, 70, 16) and k.dtype == np.float32
    cache = M.prefill(tiny.model, ids)
    np.testing.assert_allclose(k, np.stack([layer.keys[0].numpy() for layer in cache.layers]), atol=1e-5)
    np.testing.assert_allclose(v, np.stack([layer.values[0].numpy() for layer in cache.layers]), atol=1e-5)
    starts = [s for s, _, _ in C.capture_chunks(tiny.model, ids, chunk=32)]
    assert starts == [0, 32, 64]


def test_pre_rope_inverse_is_exact(tiny):
    ids = _ids(50, seed=1)
    post, _ = C.capture(tiny.model, ids)
    pre, _ = C.capture(tiny.model, ids, pre_rope=True)
    assert not np.allclose(pre[:, :, 1:], post[:, :, 1:], atol=1e-3)  # RoPE did rotate them
    np.testing.assert_allclose(pre[:, :, 0], post[:, :, 0], atol=1e-6)  # position 0: identity
    np.testing.assert_allclose(C.apply_rope(tiny.model, pre), post, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(pre, axis=-1), np.linalg.norm(post, axis=-1), rtol=1e-5)
    # the inverse at an offset: the last 20 keys
    np.testing.assert_allclose(
        C.apply_rope(tiny.model, post[:, :, 30:], start=30, inverse=True), pre[:, :, 30:], atol=1e-5
    )


@pytest.mark.parametrize("pre_rope", [False, True])
def test_build_cache_reproduces_exact_logits(tiny, pre_rope):
    ids = _ids(90, seed=2)
    prefix, cont = ids[:80], ids[80:]
    lp_exact, am_exact = C.teacher_forced(tiny.model, M.prefill(tiny.model, prefix), cont)
    k, v = C.capture(tiny.model, prefix, chunk=32, pre_rope=pre_rope)
    exact = M.prefill(tiny.model, prefix[: C.SINKS])
    for window in ("none", "quantized", "recompute", "stored"):
        cache = _restored(
            tiny.model, prefix, k.copy(), v.copy(), pre_rope=pre_rope, window=window, exact_sinks=C.cache_arrays(exact)
        )
        assert cache.get_seq_length() == 80
        lp, am = C.teacher_forced(tiny.model, cache, cont)
        np.testing.assert_allclose(lp, lp_exact, atol=1e-4)
        assert np.array_equal(am, am_exact)
    cache = C.build_cache(tiny.model, k, v, pre_rope=pre_rope)
    np.testing.assert_allclose(C.teacher_forced(tiny.model, cache, cont)[0], lp_exact, atol=1e-4)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 20, 36, 37])
def test_one_pass_over_sinks_and_window_is_exact_at_any_length(tiny, n):
    """Sessions no longer than the sinks plus the window have no middle: the single masked pass
    must still equal a prefill."""
    ids = _ids(n + 8, seed=5)
    k, v = C.capture(tiny.model, ids[:n], pre_rope=True)
    lp_exact, _ = C.teacher_forced(tiny.model, M.prefill(tiny.model, ids[:n]), ids[n:])
    cache = _restored(tiny.model, ids[:n], k, v, pre_rope=True)
    assert cache.get_seq_length() == n
    np.testing.assert_allclose(C.teacher_forced(tiny.model, cache, ids[n:])[0], lp_exact, atol=1e-4)


def test_restored_cache_generates(tiny):
    ids = _ids(40, seed=3)
    k, v = C.capture(tiny.model, ids[:-1], pre_rope=True)
    cache = _restored(tiny.model, ids[:-1], k, v, pre_rope=True)
    out = M.generate(tiny.model, tiny.tokenizer, cache, ids, 5)
    expect = M.generate(tiny.model, tiny.tokenizer, M.prefill(tiny.model, ids[:-1]), ids, 5)
    assert out == expect


def test_quantized_restore_end_to_end_tiny(tiny):
    ids = _ids(300, seed=4)
    k, v = C.capture(tiny.model, ids, pre_rope=True)
    cb = Q.train({"k": k, "v": v}, "k2x32v2x32", niter=6)
    cb2 = Q.Codebooks.from_bytes(cb.to_bytes())
    kq, vq = Q.decode(cb2, Q.encode(cb2, k, v))
    cache = _restored(tiny.model, ids, kq, vq, pre_rope=True)
    assert cache.get_seq_length() == 300
    # the recomputed window is exact at the sinks
    exact = M.prefill(tiny.model, ids)
    np.testing.assert_allclose(
        cache.layers[0].keys[0, :, :4].numpy(), exact.layers[0].keys[0, :, :4].numpy(), atol=1e-5
    )


def test_the_stored_window_runs_no_forward_pass_and_takes_the_sinks_given(tiny, monkeypatch):
    ids = _ids(120, seed=6)
    k, v = C.capture(tiny.model, ids, pre_rope=True)
    cb = Q.train({"k": k, "v": v}, "k2x32v2x32", niter=6)
    kq, vq = Q.decode(cb, Q.encode(cb, k, v))
    exact = M.prefill(tiny.model, ids)
    sinks = C.cache_arrays(M.prefill(tiny.model, ids[: C.SINKS]))

    def no_forward(*args, **kwargs):
        raise AssertionError("the stored window ran the model")

    monkeypatch.setattr(tiny.model, "forward", no_forward)
    cache = _restored(
        tiny.model, ids, kq.copy(), vq.copy(), pre_rope=True, window="stored", exact_sinks=sinks
    )  # taken over
    monkeypatch.undo()
    got_k, got_v = C.cache_arrays(cache)
    want_k, want_v = C.cache_arrays(exact)
    np.testing.assert_allclose(got_k[:, :, : C.SINKS], want_k[:, :, : C.SINKS], atol=1e-5)  # exact where stored exact
    np.testing.assert_allclose(got_v[:, :, : C.SINKS], want_v[:, :, : C.SINKS], atol=1e-5)
    np.testing.assert_allclose(
        got_k[:, :, C.SINKS :], C.apply_rope(tiny.model, kq)[:, :, C.SINKS :], atol=1e-5
    )  # the codes elsewhere
    error = np.abs(got_v[:, :, C.SINKS :] - want_v[:, :, C.SINKS :]).mean() / np.abs(want_v).mean()
    assert 0 < error < 1  # bounded, not exact
    assert cache.get_seq_length() == len(ids) and M.generate(
        tiny.model, tiny.tokenizer, cache, np.concatenate([ids, ids[:1]]), 3
    )


def test_decode_is_the_sum_of_each_stage_centroid_over_the_metric_scales(tiny):
    """The one-gather decode against the equation, per layer, head and stage, with a stage a
    layer lacks and codes holding fewer stages than the codebooks."""
    ids = _ids(200, seed=7)
    k, v = C.capture(tiny.model, ids, pre_rope=True)
    layers = k.shape[0]
    weights = {
        "k": np.random.default_rng(0).uniform(0.5, 2.0, k.shape[:2] + k.shape[3:]),
        "v": np.ones(v.shape[:2] + v.shape[3:]),
    }
    cb = Q.train({"k": k, "v": v}, f"k3x16v2x16+k1x16@{layers - 1}", niter=4, weights=weights)
    codes = Q.encode(cb, k, v)
    for kc, vc in ((codes[0], codes[1]), (codes[0][:, :, :2], codes[1][:, :, :1])):
        got_k, got_v = Q.decode(cb, (kc, vc))
        for kind, c, got in (("k", kc, got_k), ("v", vc, got_v)):
            want = np.zeros(got.shape, np.float32)
            for layer in range(layers):
                for stage, book in enumerate(cb.books[kind][layer][: c.shape[2]]):
                    for head in range(cb.heads):
                        want[layer, head] += book[head][c[layer, head, stage]]
            np.testing.assert_allclose(got, want / cb.weights[kind][:, :, None, :], rtol=1e-5, atol=1e-6)


# -- embedded model ------------------------------------------------------------------------


@pytest.mark.model
def test_embedded_fidelity_smoke(embedded):
    """Calibrate a small quantizer on one text, restore another through codes; the model still agrees."""
    ids = np.asarray(tok.encode(embedded.tokenizer, CALIBRATION_FILE.read_text()), dtype=np.int64)
    model = embedded.model
    k, v = C.capture(model, ids[:512], pre_rope=True)
    cb = Q.train({"k": k[:, :, C.SINKS :], "v": v[:, :, C.SINKS :]}, "k2x64v1x64", niter=6)
    prefix, cont = ids[2000:2256], ids[2256:2289]
    kp, vp = C.capture(model, prefix, pre_rope=True)
    lp_exact, am_exact = C.teacher_forced(model, M.prefill(model, prefix), cont)
    kq, vq = Q.decode(cb, Q.encode(cb, kp, vp))
    cache = _restored(model, prefix, kq, vq, pre_rope=True)
    lp, am = C.teacher_forced(model, cache, cont)
    ratio = float(np.exp(lp_exact.mean() - lp.mean()))
    assert ratio < 3.0, ratio  # coarse codebooks: damage is bounded, not zero
    assert (am == am_exact).mean() > 0.4
    # unquantized arrays through the same path are exact
    exact_cache = _restored(model, prefix, kp, vp, pre_rope=True)
    np.testing.assert_allclose(C.teacher_forced(model, exact_cache, cont)[0], lp_exact, atol=2e-3)


def test_beam_encoding_never_worse_and_weights_round_trip(trained):
    cb, _, _ = trained
    k, v = clustered_vectors(n=200, seed=9), clustered_vectors(n=200, seed=10)
    greedy = Q.decode(cb, Q.encode(cb, k, v))[0]
    beam = Q.decode(cb, Q.encode(cb, k, v, beam=4))[0]
    err = lambda a: float(((a - k) ** 2).sum(-1).mean())  # noqa: E731
    assert err(beam) <= err(greedy) + 1e-6
    w = np.abs(np.random.default_rng(0).standard_normal((2, 2, 8))) + 0.1
    cw = Q.train({"k": k, "v": v}, "k2x16v1x16", niter=4, weights={"k": w})
    assert set(cw.weights) == {"k"}
    np.testing.assert_allclose(np.sqrt((cw.weights["k"] ** 2).mean(-1)), 1.0, rtol=1e-5)
    back = Q.Codebooks.from_bytes(cw.to_bytes())
    np.testing.assert_array_equal(back.weights["k"], cw.weights["k"])
    kq, _ = Q.decode(back, Q.encode(back, k, v))
    assert err(kq) < float(((k - k.mean(2, keepdims=True)) ** 2).sum(-1).mean())


def test_sharpened_codebooks_decode_keys_further_from_each_heads_centre():
    """Decoding with ``sharpened(f)`` gives ``c + f * (key - c)``, c the mean of the head's
    first-stage centroids, for every head whatever its depth; values do not move; f = 1 is the
    codebooks themselves; and the sharpened set can neither encode nor be stored."""
    k, v = (
        clustered_vectors(layers=3, heads=2, n=400, dim=4, seed=5),
        clustered_vectors(layers=3, heads=2, n=400, dim=4, seed=6),
    )
    cb = Q.train({"k": k, "v": v}, "k3x16v1x16+k1x16@2.1", niter=4)
    codes = Q.encode(cb, k, v)
    keys, values = Q.decode(cb, codes)
    centre = np.stack([layer[0].mean(1) for layer in cb.books["k"]])[:, :, None, :]
    sharp = cb.sharpened(1.25)
    sk, sv = Q.decode(sharp, codes)
    np.testing.assert_allclose(sk, centre + 1.25 * (keys - centre), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(sv, values)
    assert cb.sharpened(1.0) is cb and "sharpened" not in cb.meta
    with pytest.raises(InvalidArgument, match="sharpened"):
        Q.encode(sharp, k, v)
    with pytest.raises(InvalidArgument, match="sharpened"):
        sharp.to_bytes()


def test_a_preset_of_uneven_depths_round_trips_through_its_streams():
    """Layers and heads of different depths in one set: codes -> token-major streams -> codes, and
    decode equals the sum of the centroids each head has."""
    preset = "k3v3+k16@18.2+k12@7.2,20.2,23.0+k2@0-5+v2@0-1"  # SmolLM2's compact of decision 0028
    k, v = (
        clustered_vectors(layers=30, heads=3, n=300, dim=4, seed=3),
        clustered_vectors(layers=30, heads=3, n=300, dim=4, seed=4),
    )
    cb = Q.train({"k": k, "v": v}, preset, niter=2)
    codes = Q.encode(cb, k, v)
    assert [len(s) for s in cb.stages("k")] == [len(s) for s in P.allocation(preset, 30, 3)["k"]]
    codes_per_position = int(cb.depth("k").sum() + cb.depth("v").sum())
    streams = CL.code_streams(cb, codes, start=4)
    assert len(streams[256]) == 296 * codes_per_position
    back = CL.codes_from_streams(cb, streams, 296)
    for kind, (a, b) in enumerate(zip(codes, back)):
        np.testing.assert_array_equal(a[..., 4:], b, err_msg=Q.KINDS[kind])
    keys, _ = Q.decode(cb, codes)
    for layer, head in ((0, 0), (7, 2), (7, 0), (18, 2), (8, 1)):
        want = sum(cb.books["k"][layer][s][head][codes[0][layer, head, s]] for s in range(cb.depth("k")[layer, head]))
        np.testing.assert_allclose(keys[layer, head], want, rtol=1e-6, atol=1e-6)
