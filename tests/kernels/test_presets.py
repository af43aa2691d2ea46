"""Tier K presets: the grammar, per-head depths, bytes per token, and the measured default."""

import pytest

from kvdb.codecs import presets as P
from kvdb.codecs import transform
from kvdb.errors import InvalidArgument


def test_allocation_presets():
    a = P.allocation("k4v2", 3, 1)
    assert a["k"] == [(256,) * 4] * 3 and a["v"] == [(256, 256)] * 3
    a = P.allocation("k2x1024v1+k5@0,2+v3x16@1", 3, 1)
    assert a["k"] == [(256,) * 5, (1024, 1024), (256,) * 5]
    assert a["v"] == [(256,), (16, 16, 16), (256,)]
    assert P.code_bytes_per_token("k4v2", 30, 3) == 540.0
    assert P.code_bytes_per_token("k2x1024v1", 30, 3) == pytest.approx(30 * 3 * (2 * 1.25 + 1))
    for bad in ("k4", "q4v2", "k4v2+k5@99", "k2x70000v1", "k4v2+k5@1.x", "k4v2+k5@3.0"):
        with pytest.raises(InvalidArgument):
            P.allocation(bad, 3, 1)


def test_per_head_presets():
    """``@layer.head`` deepens one head; its layer holds the deepest head's stages and the others
    take a prefix of them, so a layer's heads must share codebook sizes."""
    a = P.allocation("k2v1+k5@1.1+k3@0", 3, heads=2)
    assert a["k"] == [(256,) * 3, (256,) * 5, (256,) * 2] and a["v"] == [(256,)] * 3
    d = P.depths("k2v1+k5@1.1+k3@0+k4@0.0", 3, 2)
    assert d["k"].tolist() == [[4, 3], [2, 5], [2, 2]] and d["v"].tolist() == [[1, 1]] * 3
    assert P.code_bytes_per_token("k2v1+k5@1.1", 3, 2) == 3 * 2 * 3 + 3
    with pytest.raises(InvalidArgument, match="outside"):
        P.depths("k2v1+k5@1.2", 3, 2)
    with pytest.raises(InvalidArgument, match="share"):
        P.allocation("k2v1+k3x16@1.1", 3, 2)


# SmolLM2's compact preset of decision 0028 (0044 replaced it), whose archives still decode
MEASURED_RVQ = "k3v3+k16@18.2+k12@7.2,20.2,23.0+k2@0-5+v2@0-1"


def test_the_measured_compact_preset_is_the_embedded_models_alone():
    """A preset measured on one model's weights goes to that model only."""
    [(weights, named)] = P.MEASURED_PRESETS.items()
    assert P.resolve("compact", weights) == named["compact"] != P.resolve("compact", "0" * 64) == P.DEFAULT_PRESET


def test_a_spec_deepens_the_heads_it_names():
    """Decision 0028's layers and heads: each named one gets its stages, the rest the base's."""
    preset = MEASURED_RVQ
    alloc = P.allocation(preset, 30, 3)
    assert [len(s) for s in alloc["k"]] == [2] * 6 + [3, 12] + [3] * 10 + [16, 3, 12, 3, 3, 12] + [3] * 6
    assert [len(s) for s in alloc["v"]] == [2] * 2 + [3] * 28
    depth = P.depths(preset, 30, 3)["k"]
    assert depth[18].tolist() == [3, 3, 16] and depth[7].tolist() == [3, 3, 12] and depth[23].tolist() == [12, 3, 3]


@pytest.mark.parametrize("weights", [*P.MEASURED_PRESETS, "0" * 64])
def test_every_model_has_each_name_and_a_name_is_found_by_its_spec(weights):
    named = P.named(weights)
    assert set(named) == set(P.NAMES) and P.DEFAULT_NAME == "balanced"
    for name in P.NAMES:
        spec = P.resolve(name, weights)
        assert P.name_of(spec, weights) == name and P.resolve(spec, weights) == spec  # a spec passes through
        if not transform.is_transform_preset(
            spec
        ):  # a transform preset has no stages: its grammar is checked by resolve
            P.allocation(spec, 30, 3)  # every named residual-VQ spec parses
    assert P.name_of("k2v1", weights) is None


def test_an_unknown_preset_is_refused_with_the_names():
    with pytest.raises(InvalidArgument, match="faithful, balanced, compact"):
        P.resolve("tiny", "0" * 64)
    with pytest.raises(InvalidArgument, match="unknown preset"):
        P.resolve("k2v1+bad", "0" * 64)


def test_key_sharpening_is_the_embedded_models_alone():
    [(weights, factor)] = P.MEASURED_KEY_SHARPENING.items()
    assert weights in P.MEASURED_PRESETS and P.key_sharpening(weights) == factor > 1.0
    assert P.key_sharpening("0" * 64) == 1.0


@pytest.mark.parametrize(
    ("spec", "window"),
    [
        ("e3", "stored"),
        ("e0.9jp384", "stored"),
        ("e0.5p64", "stored"),
        ("e0.28jp384", "recompute"),
        ("t4", "recompute"),
        ("k4v3", "recompute"),
        (MEASURED_RVQ, "recompute"),
    ],
)
def test_a_restore_stores_its_window_only_for_an_entropy_coded_preset_of_half_a_bit_or_more(spec, window):
    assert P.restore_window(spec) == window
