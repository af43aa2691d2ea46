"""kvdb.codecs.fidelity's ``record`` (what ``make fidelity`` writes with) writes what its
``measured`` reads: a rerun replaces its own entry and keeps the others."""

import json

import pytest

from kvdb.codecs import fidelity
from kvdb.errors import InvalidArgument

MODEL = "ab" * 32  # a model nobody measured: no key sharpening


def test_a_recorded_entry_is_what_the_library_reads_and_a_rerun_replaces_only_it(tmp_path, monkeypatch):
    path = tmp_path / "kv_fidelity.json"
    monkeypatch.setattr(fidelity, "FILE", path)
    fidelity.table.cache_clear()
    try:
        fidelity.record(MODEL, "k4v3", "shipped", {1024: {"ppl_ratio": 1.031, "kl": None, "top1": 0.9}}, 1.0, "a run")
        fidelity.record(
            MODEL,
            "k6v4",
            "shipped",
            {8000: {"ppl_ratio": 1.2, "kl": 0.1, "top1": 0.8}, 1024: {"ppl_ratio": 1.01, "kl": 0.01, "top1": 0.97}},
            1.0,
            "a run",
        )
        assert fidelity.measured(MODEL, "k4v3", "shipped") == {
            "key_sharpening": 1.0,
            "lengths": {"1024": {"ppl_ratio": 1.031, "kl": None, "top1": 0.9}},
            "measured_by": "a run",
        }
        assert fidelity.worst_ppl(fidelity.measured(MODEL, "k6v4", "shipped")["lengths"]) == (8000, 1.2)
        fidelity.record(MODEL, "k4v3", "shipped", {4096: {"ppl_ratio": 1.02, "kl": 0.02, "top1": 0.95}}, 1.0, "a rerun")
        table = json.loads(path.read_text())
        assert (
            set(table[MODEL]["k4v3"]["shipped"]["lengths"]) == {"4096"}
            and table[MODEL]["k4v3"]["shipped"]["measured_by"] == "a rerun"
        )
        assert set(table[MODEL]["k6v4"]["shipped"]["lengths"]) == {"1024", "8000"}
        assert (
            fidelity.measured(MODEL, "k4v3", "trained") is None and fidelity.measured(MODEL, "k2v1", "shipped") is None
        )
        fidelity.record(
            MODEL, "k2v1", "shipped", {1024: {"ppl_ratio": 1.5, "kl": None, "top1": 0.7}}, 1.05, "sharpened"
        )  # not what a restore applies here
        assert fidelity.measured(MODEL, "k2v1", "shipped") is None
        with pytest.raises(InvalidArgument, match="figures"):
            fidelity.record(MODEL, "k4v3", "shipped", {1024: {"ppl_ratio": 1.0}}, 1.0, "a run")
        with pytest.raises(InvalidArgument, match="source"):
            fidelity.record(MODEL, "k4v3", "measured", {}, 1.0, "a run")
    finally:
        fidelity.table.cache_clear()


def test_the_shipped_table_holds_only_whole_measured_entries():
    """Every entry names its run and its key sharpening, and every length all three figures."""
    for by_spec in fidelity.table().values():
        for by_source in by_spec.values():
            for source, entry in by_source.items():
                assert (
                    source in fidelity.SOURCES
                    and entry["measured_by"].startswith("benchmarks/")
                    and entry["key_sharpening"] >= 1.0
                )
                assert entry["lengths"] and all(set(f) == set(fidelity.FIGURES) for f in entry["lengths"].values())
