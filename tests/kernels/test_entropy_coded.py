"""Tier K's entropy-coded transform coder (kvdb.codecs.entropy_coded): one step for every
coefficient, the integers coded against their class's table, and a node's codes as one payload."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvdb.codecs import code_layout as CL
from kvdb.codecs import entropy_coded as EC
from kvdb.codecs import entropy_training as ET
from kvdb.codecs import presets as P
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


def _train(preset="e3", fisher=None):
    return ET.train({"k": _vectors(seed=1), "v": _vectors(seed=2)}, fisher or _fisher(), preset)


@pytest.fixture(scope="module")
def trained():
    return _train()


def _payload_bits(books, k, v) -> float:
    return len(CL.code_streams(books, CL.encode(books, k, v))[EC.PAYLOAD]) * 8 / (k.size + v.size)


def test_the_step_spends_the_presets_bits_and_error_falls_by_about_6_db_a_bit():
    held = _vectors(n=400, seed=3), _vectors(n=400, seed=4)
    errors = []
    for bits in (2, 3, 4):
        cb = _train(f"e{bits}")
        assert cb.bits_per_element() == pytest.approx(bits, abs=0.1)
        assert _payload_bits(cb, *held) == pytest.approx(bits, abs=0.3)  # held-out vectors, headers included
        k, v = cb.decode(cb.encode(*held))
        errors.append(float(((k - held[0]) ** 2).mean() + ((v - held[1]) ** 2).mean()))
    assert errors[0] > 3 * errors[1] > 9 * errors[2]


def test_the_fisher_information_scales_where_the_error_goes():
    fisher = _fisher()
    fisher["k"][0, 0] *= 1e4  # layer 0, head 0's keys: a small error there costs the model much more
    cb = _train("e2", fisher)
    held = _vectors(n=300, seed=3), _vectors(n=300, seed=4)
    k, _ = cb.decode(cb.encode(*held))
    error = ((k - held[0]) ** 2).mean(axis=(2, 3))
    assert error[0, 0] * 100 < error[1, 1]


def test_the_payload_round_trips_and_decodes_as_the_arrays_do(trained):
    k, v = _vectors(n=50, seed=5), _vectors(n=50, seed=6)
    codes = CL.encode(trained, k, v)
    streams = CL.code_streams(trained, codes)
    assert set(streams) == {EC.PAYLOAD} and streams[EC.PAYLOAD].dtype == np.uint8
    back = CL.codes_from_streams(trained, streams, 50)
    for a, b in zip(back, codes):
        np.testing.assert_array_equal(a, b)
    CL.check_streams(trained, streams, 50)
    keys, values = trained.decode(codes)
    for layer, (lk, lv) in enumerate(CL.decode_streams(trained, streams, 50, used=30)):
        np.testing.assert_allclose(lk, keys[layer, :, :30], atol=1e-5)
        np.testing.assert_allclose(lv, values[layer, :, :30], atol=1e-5)
    later = CL.codes_from_streams(
        trained, CL.code_streams(trained, codes, start=20), 30
    )  # a node's later positions, coded again
    for a, b in zip(later, codes):
        np.testing.assert_array_equal(a, b[..., 20:])


def test_values_far_past_the_calibration_escape_and_come_back(trained):
    k, v = _vectors(n=10, seed=7), _vectors(n=10, seed=8)
    k[0, 0, 3] *= (
        50  # one position of one head far outside anything calibrated (int16 saturates only some 30,000 steps out)
    )
    codes = CL.encode(trained, k, v)
    assert np.abs(codes[0]).max() > 127  # past the tables: escaped
    back = CL.codes_from_streams(trained, CL.code_streams(trained, codes), 10)
    np.testing.assert_array_equal(back[0], codes[0])
    keys, _ = trained.decode(codes)
    error = np.abs(keys[0, 0] - k[0, 0]).max(-1)
    assert error[3] < 2 * np.delete(error, 3).max()  # no worse than a step's rounding: nothing was clipped


def test_a_damaged_payload_is_refused_not_decoded(trained):
    k, v = _vectors(n=20, seed=7), _vectors(n=20, seed=8)
    payload = CL.code_streams(trained, CL.encode(trained, k, v))[EC.PAYLOAD]
    with pytest.raises(CorruptData):
        CL.check_streams(trained, {EC.PAYLOAD: payload[:-3]}, 20)
    with pytest.raises(CorruptData):
        CL.check_streams(trained, {EC.PAYLOAD: payload[:6]}, 20)  # cut inside its table of layer lengths
    with pytest.raises(CorruptData):
        CL.check_streams(trained, {EC.PAYLOAD: payload}, 21)
    with pytest.raises(CorruptData):
        CL.check_streams(trained, {256: payload}, 20)


def test_bytes_round_trip_and_refuse_damage(trained):
    blob = trained.to_bytes()
    back = CL.read_codebooks(blob)
    assert isinstance(back, EC.EntropyCodebooks) and back.to_bytes() == blob
    k, v = _vectors(n=20, seed=7), _vectors(n=20, seed=8)
    for a, b in zip(back.encode(k, v), trained.encode(k, v)):
        np.testing.assert_array_equal(a, b)
    assert len(blob) > trained.nbytes
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 1
    with pytest.raises(CorruptData, match="CRC"):
        CL.read_codebooks(bytes(damaged))
    newer = bytearray(blob)
    newer[8] = EC.VERSION + 1
    with pytest.raises(CorruptData, match="newer"):
        EC.EntropyCodebooks.from_bytes(bytes(newer))


def test_entropy_coded_presets_parse_and_need_the_fisher_information():
    assert P.resolve("e3", "any") == "e3" and P.resolve("e1.5", "any") == "e1.5"
    assert (
        P.resolve("e2p32", "any") == "e2p32"
        and P.resolve("e2p64i32", "any") == "e2p64i32"
        and P.resolve("e1.2jp128", "any") == "e1.2jp128"
    )
    for bad in (
        "e0",
        "e9",
        "e",
        "e-1",
        "t3p8",
        "e2p0",
        "e2p",
        "e2p4i5",
        "e2p4i0",
        "e2i4",
        "t3p8i4",
        "t3j",
        "e2jp0",
        "e2jp8i9",
        "e2pj8",
    ):
        with pytest.raises(InvalidArgument):
            P.resolve(bad, "any")
    with pytest.raises(InvalidArgument, match="Fisher"):
        CL.train({"k": _vectors(), "v": _vectors()}, "e2")
    assert isinstance(CL.train({"k": _vectors(), "v": _vectors()}, "e2", _fisher()), EC.EntropyCodebooks)


# -- cross-layer prediction (``e<bits>p<count>``) --------------------------------------------------


def _layered(n, seed, layers=4, heads=2, dim=8):
    """Vectors whose layers are much alike: each is the one before plus a little of its own, as
    neighbouring layers of a model's cache are (more so in their leading coefficients)."""
    rng = np.random.default_rng(seed)
    first = _vectors(layers=1, heads=heads, n=n, dim=dim, seed=seed)[0]
    out = [first]
    for _ in range(1, layers):
        out.append(0.9 * out[-1] + 0.3 * rng.standard_normal(first.shape).astype(np.float32))
    return np.stack(out)


def _train_layered(preset):
    fisher = {kind: np.ones((4, 2, 8)) for kind in EC.KINDS}
    return ET.train({"k": _layered(700, 1), "v": _layered(700, 2)}, fisher, preset)


@pytest.fixture(scope="module", params=["e3p4", "e3p4i2", "e3jp16i8"])
def predicted(request):
    """Each head's first 4 coefficients predicted from the previous layer's first 4, or first 2;
    or, one rotation per layer, the layer's first 16 from the previous layer's first 8."""
    return _train_layered(request.param)


def test_prediction_from_the_previous_layer_halves_the_error_at_the_same_bits(predicted):
    plain = _train_layered("e3")
    inputs = {"e3p4": 16, "e3p4i2": 8, "e3jp16i8": 8}[predicted.preset]
    assert len(predicted.predicted_rows()) == 16 and len(predicted.input_rows()) == inputs
    assert predicted.predictor.shape == (4, 16, inputs) and not predicted.predictor[0].any()
    held = _layered(400, 3), _layered(400, 4)
    errors, bits = [], []
    for books in (plain, predicted):
        k, v = books.decode(books.encode(*held))
        errors.append(float(((k - held[0]) ** 2).mean() + ((v - held[1]) ** 2).mean()))
        bits.append(_payload_bits(books, *held))
    assert bits[1] == pytest.approx(bits[0], abs=0.25)
    assert errors[1] < errors[0] / 2


def test_the_loop_is_closed_so_errors_do_not_add_up_down_the_layers(predicted):
    """The encoder predicts from what the decoder will have: every coefficient of every layer is
    within a step of its value (an open loop would add each layer's error to the next one's)."""
    k, v = _layered(300, 5), _layered(300, 6)
    true, decoded = predicted.coefficients(k, v), predicted.coefficients(*predicted.decode(predicted.encode(k, v)))
    assert float(np.abs(true - decoded)[-1].max()) <= predicted.step * 1.01


def test_a_predicted_payload_decodes_straight_as_the_reference_decodes(predicted):
    k, v = _layered(60, 7), _layered(60, 8)
    codes = CL.encode(predicted, k, v)
    streams = CL.code_streams(predicted, codes)
    keys, values = predicted.decode(codes)
    for layer, (lk, lv) in enumerate(CL.decode_streams(predicted, streams, 60, used=45)):
        np.testing.assert_allclose(lk, keys[layer, :, :45], atol=1e-5)
        np.testing.assert_allclose(lv, values[layer, :, :45], atol=1e-5)
    later = CL.codes_from_streams(
        predicted, CL.code_streams(predicted, codes, start=25), 35
    )  # a cut node's tail: its integers unchanged
    for a, b in zip(later, codes):
        np.testing.assert_array_equal(a, b[..., 25:])


def test_a_predicted_set_is_format_version_2_or_3_with_fewer_inputs_or_4_joint_and_a_plain_one_stays_version_1(
    predicted, trained
):
    blob = predicted.to_bytes()
    version = 4 if predicted.joint else 3 if predicted.prediction_inputs < predicted.predicted else 2
    assert int.from_bytes(blob[8:12], "little") == version and int.from_bytes(trained.to_bytes()[8:12], "little") == 1
    back = CL.read_codebooks(blob)
    assert isinstance(back, EC.EntropyCodebooks) and back.to_bytes() == blob and back.predicted == predicted.predicted
    header = json.loads(blob[16 : 16 + int.from_bytes(blob[12:16], "little")])
    assert back.prediction_inputs == predicted.prediction_inputs and back.joint == predicted.joint
    assert header.get("inputs") == {2: None, 3: 2, 4: 8}[version]
    np.testing.assert_array_equal(back.predictor, predicted.predictor)
    assert (
        predicted.nbytes == _train_layered("e3j" if predicted.joint else "e3").nbytes + predicted.predictor.size * 2
    )  # float16, counted in the ratio a benchmark reports
    with pytest.raises(InvalidArgument, match="predicts 9 coefficients per head, but heads have 8"):
        _train_layered("e3p9")
    with pytest.raises(InvalidArgument, match="predicts 33 coefficients per layer, but layers have 32"):
        _train_layered("e3jp33")


# -- one rotation per layer (``e<bits>j``) -----------------------------------------------------


def _shared(n, seed, layers=2, heads=2, dim=8):
    """Keys and values whose heads hold much the same thing: one latent per position, mixed
    differently into every head and kind, plus a little of each head's own."""
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((layers, n, 4)) * np.array([3.0, 2.0, 1.0, 0.5])
    mixing = np.random.default_rng(77).standard_normal((2, layers, heads, 4, dim))
    own = 0.1 * rng.standard_normal((2, layers, heads, n, dim))
    x = np.einsum("lnc,klhcd->klhnd", latent, mixing) + own
    return x[0].astype(np.float32), x[1].astype(np.float32)


def test_one_rotation_per_layer_codes_heads_that_share_at_a_fraction_of_the_error_at_the_same_bits():
    fisher = {kind: np.ones((2, 2, 8)) for kind in EC.KINDS}
    calibration, held = _shared(1500, 1), _shared(400, 2)
    errors, bits = [], []
    for preset in ("e2", "e2j"):
        books = ET.train(dict(zip(EC.KINDS, calibration)), fisher, preset)
        assert books.joint == (preset == "e2j") and books.basis[EC.JOINT if books.joint else "k"].shape == (
            (2, 32, 32) if books.joint else (2, 2, 8, 8)
        )
        k, v = books.decode(books.encode(*held))
        errors.append(float(((k - held[0]) ** 2).mean() + ((v - held[1]) ** 2).mean()))
        bits.append(_payload_bits(books, *held))
    assert bits[1] == pytest.approx(bits[0], rel=0.1)
    assert errors[1] < errors[0] / 4
