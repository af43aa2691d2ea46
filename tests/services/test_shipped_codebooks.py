"""Shipped codebooks (kvdb.services.shipped_codebooks): built once per machine from the packaged calibration text,
referenced by archives (never stored in them), rebuilt alike on a machine that lacks them."""

import hashlib
import json
import shutil
import zlib
from dataclasses import replace

import duckdb
import numpy as np
import pytest
import torch
from support import KV, storage_of

import kvdb
from kvdb.errors import CorruptData, InvalidArgument
from kvdb.model import capture
from kvdb.services import shipped_codebooks as shipped

TEXT = "A session archived with tier K on a fresh archive, with no codebooks trained at all. " * 3


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model):
    """(a machine's cache that built this kvdb's shipped codebooks of the tiny model, the reports
    of that first build and of a second one, the model's identity): a build takes seconds, and
    the tests that only need them built start from a copy of that cache."""
    cache = tmp_path_factory.mktemp("built-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVDB_CACHE", str(cache))
        with kvdb.open(tmp_path_factory.mktemp("build") / "a.duckdb", model=tiny_model) as db:
            reports = db.build_shipped_codebooks(), db.build_shipped_codebooks()
            identity = db.loaded_model.identity
    return cache, reports, identity


def a_machine_that_built_them(built, folder, monkeypatch) -> None:
    shutil.copytree(built[0], folder)
    monkeypatch.setenv("KVDB_CACHE", str(folder))


def test_reference_round_trips_and_refuses_damage_and_newer_versions():
    ref = shipped.Reference({"version": 1, "preset": "k4v3", "weights_hash": "ab" * 32}, "cd" * 32, 20_643_840)
    blob = ref.to_bytes()
    assert shipped.is_reference(blob) and shipped.Reference.from_bytes(blob) == ref and len(blob) < 512
    damaged = bytearray(blob)
    damaged[20] ^= 1
    with pytest.raises(CorruptData, match="CRC"):
        shipped.Reference.from_bytes(bytes(damaged))
    newer = bytearray(blob)
    newer[8] = 2  # the u32 version after the magic
    with pytest.raises(CorruptData, match="newer than this kvdb reads"):
        shipped.Reference.from_bytes(bytes(newer))
    with pytest.raises(CorruptData, match="bad magic"):
        shipped.Reference.from_bytes(b"KVDBRVQ\x00" + blob[8:])
    no_recipe = shipped._PREFIX.pack(shipped.MAGIC, 1, 2) + b"{}"
    with pytest.raises(CorruptData, match="holds no recipe"):
        shipped.Reference.from_bytes(no_recipe + shipped._CRC.pack(zlib.crc32(no_recipe)))


@pytest.mark.slow
def test_a_fresh_archive_codes_tier_k_with_a_reference_not_the_centroids(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("KVDB_CACHE", str(tmp_path / "machine-a"))
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        [r] = db.ingest(text=TEXT, name="s", keep=KV)
        [listed] = db.codebooks()
        built = shipped.cache_path(shipped.recipe_key(shipped.recipe(db.loaded_model.identity)))
        assert listed.source == "shipped" and listed.on_this_machine and built.is_file()
        assert listed.centroid_bytes == built.stat().st_size and listed.stored_bytes < 512
        st = db.stats()
        assert (
            st.codebook_bytes == st.bytes["codebooks"] == listed.stored_bytes
            and st.shipped_codebook_bytes == listed.centroid_bytes
        )
        restored = db.restore("s", mode="archive")
        assert restored.mode == "archive" and restored.cache.get_seq_length() == r.n_tokens
        keys_a = torch.cat([layer.keys for layer in restored.cache.layers])
        books_a = built.read_bytes()
    # another machine (an empty cache) builds the same recipe, alike, and decodes the same values
    monkeypatch.setenv("KVDB_CACHE", str(tmp_path / "machine-b"))
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        [listed] = db.codebooks()
        assert not listed.on_this_machine
        restored = db.restore("s", mode="archive")
        assert shipped.cache_path(built.stem).read_bytes() == books_a
        torch.testing.assert_close(torch.cat([layer.keys for layer in restored.cache.layers]), keys_a)
        reference = shipped.Reference.from_bytes(storage_of(db).codebook_data(listed.codebook_id))
        assert reference.content_sha256 == hashlib.sha256(books_a).hexdigest()
    # a damaged build in the cache is derived data: built again, not an error
    rebuilt = shipped.cache_path(built.stem)
    rebuilt.write_bytes(books_a[: len(books_a) // 2])
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        restored = db.restore("s", mode="archive")
        torch.testing.assert_close(torch.cat([layer.keys for layer in restored.cache.layers]), keys_a)
    assert rebuilt.read_bytes() == books_a


def test_trained_codebooks_take_over_for_later_sessions(kv_archive):
    """kv_archive trained k2v1: the shipped ones are never built or referenced."""
    kv_archive.ingest(text=TEXT, name="s", keep=KV)
    assert [c.source for c in kv_archive.codebooks()] == ["trained"]
    assert kv_archive.stats().shipped_codebook_bytes == 0


@pytest.mark.slow
def test_a_recipe_this_kvdb_cannot_build_is_refused_with_what_to_do(tmp_path, tiny_model, monkeypatch, built):
    a_machine_that_built_them(built, tmp_path / "machine-a", monkeypatch)
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        db.ingest(text=TEXT, name="s", keep=KV)
        [listed] = db.codebooks()
        reference = shipped.Reference.from_bytes(storage_of(db).codebook_data(listed.codebook_id))
    foreign = replace(reference, recipe=dict(reference.recipe, calibration_sha256="0" * 64))
    con = duckdb.connect(
        str(tmp_path / "a.duckdb")
    )  # as if a later kvdb, with another calibration text, had written it
    con.execute("update codebooks set data = ? where codebook_id = ?", [foreign.to_bytes(), listed.codebook_id])
    con.close()
    monkeypatch.setenv("KVDB_CACHE", str(tmp_path / "machine-b"))
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        with pytest.raises(InvalidArgument, match="shipped codebooks this kvdb cannot build.*--mode exact"):
            db.restore("s", mode="archive")
        assert db.restore("s", mode="exact").mode == "exact"


@pytest.mark.slow
def test_the_build_uses_the_packaged_calibration_text(built, monkeypatch):
    cache, (report, again), identity = built
    monkeypatch.setenv("KVDB_CACHE", str(cache))
    assert (
        report.built
        and not again.built
        and report.path == again.path
        and report.preset == shipped.recipe(identity)["preset"] == "k6v4"
    )  # the unmeasured balanced
    books = shipped.cached(shipped.Reference(json.loads(json.dumps(shipped.recipe(identity))), "", 0))
    assert books.meta["tokens"] == shipped.POSITIONS and books.pre_rope
    assert np.isfinite(books.books["k"][0][0]).all() and shipped.CALIBRATION.stat().st_size > 30_000


def test_a_reference_is_built_by_its_own_recipe_when_it_is_not_this_kvdbs(tiny_model, tmp_path, monkeypatch):
    """An archive of an older kvdb may name another preset or size: built as recorded, beside."""
    monkeypatch.setenv("KVDB_CACHE", str(tmp_path / "cache"))
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        loaded = db.loaded_model
    older = dict(shipped.recipe(loaded.identity), preset="k2v1", positions=1000)
    assert shipped.buildable(older, loaded.identity) and not shipped.buildable(dict(older, version=99), loaded.identity)
    reference, books, built = shipped.build(loaded, wanted=older)
    assert built and books.preset == "k2v1" and books.meta["tokens"] == 1000 and reference.recipe == older
    assert not shipped.is_built(loaded.identity)  # this kvdb's own recipe is another file


@pytest.mark.slow
def test_verify_and_repair_pass_an_archive_whose_tier_k_references_shipped_codebooks(
    tmp_path, tiny_model, monkeypatch, built
):
    """Issue 30: verify read the reference as centroids ("bad magic") and failed every such archive."""
    a_machine_that_built_them(built, tmp_path / "cache", monkeypatch)
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        db.ingest(text=TEXT, name="s", keep=KV)
        report = db.verify(deep=True)
        assert report.ok, report.problems
        assert report.checked["codebooks"] == 1 and report.checked["kv streams"] == 1
    monkeypatch.setenv(
        "KVDB_CACHE", str(tmp_path / "another-machine")
    )  # not built here: the reference alone is checked
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        report = db.verify()
        assert report.ok, report.problems
    con = duckdb.connect(str(tmp_path / "a.duckdb"))
    [(blob,)] = con.execute("select data from codebooks").fetchall()
    con.execute("update codebooks set data = ?", [bytes(blob[:-1]) + bytes([blob[-1] ^ 1])])
    con.close()
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        report = db.verify()
        assert not report.ok and any("CRC" in p for p in report.problems)


def measured_table(monkeypatch, weights_hash: str, figures: dict[str, float]) -> None:
    """kvdb/data/kv_fidelity.json as if ``benchmarks/kv.py`` had measured each spec's shipped
    codebooks at the worst perplexity ratio given (at 8,000 tokens; better at 1,024), so the tests
    hold whatever the real figures are."""
    from kvdb.codecs import fidelity

    table = {
        weights_hash: {
            spec: {
                "shipped": {
                    "lengths": {
                        "1024": {"ppl_ratio": 1.0, "kl": None, "top1": 0.99},
                        "8000": {"ppl_ratio": worst, "kl": 0.01, "top1": 0.9},
                    },
                    "measured_by": "a test",
                }
            }
            for spec, worst in figures.items()
        }
    }
    monkeypatch.setattr(fidelity, "table", lambda: table)


@pytest.mark.slow
def test_two_presets_in_one_archive_each_restore_with_their_own_codebooks_and_auto_weighs_them(
    tmp_path, tiny_model, monkeypatch, built
):
    """Sessions ingested with different presets keep their own shipped codebooks; auto takes
    tier K only for a preset measured within max_loss, and says why either way."""
    from kvdb.codecs import presets

    a_machine_that_built_them(built, tmp_path / "cache", monkeypatch)
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        weights = db.loaded_model.identity.weights_hash
        compact, balanced = presets.resolve("compact", weights), presets.resolve("balanced", weights)
        [a] = db.ingest(text=TEXT, name="a", keep=KV, kv_preset="compact")
        [b] = db.ingest(
            text="Another session altogether, of the default preset. " * 3, name="b", keep=KV
        )  # balanced, the default
        db.ingest(
            text=TEXT + " And a different ending.", name="c", keep=KV
        )  # a's node, coded compact, then one of its own
        listed = db.codebooks()
        assert sorted(c.preset for c in listed) == sorted([compact, balanced]) and {c.source for c in listed} == {
            "shipped"
        }
        for name, spec, n in (("a", compact, a.n_tokens), ("b", balanced, b.n_tokens)):
            restored = db.restore(name, mode="archive")
            assert restored.mode == "archive" and restored.cache.get_seq_length() == n
            assert restored.fidelity.spec == spec and restored.fidelity.lengths == {}  # nothing measured the tiny model
            assert "fidelity not measured" in restored.reason
        st = db.stats()
        assert (
            set(st.kv_bytes_by_preset) == {"compact", "balanced"}
            and sum(st.kv_bytes_by_preset.values()) == st.bytes["kv"]
        )

        unmeasured = db.restore("a")
        assert unmeasured.mode == "exact" and unmeasured.fidelity is None
        assert (
            unmeasured.reason
            == f"tier K preset compact ({compact}) has no measured fidelity for this model: prefilled exactly"
        )

        measured_table(monkeypatch, weights, {compact: 1.04, balanced: 1.2})
        within = db.restore("a")
        assert within.mode == "archive" and within.reason.startswith(
            f"tier K preset compact ({compact}) is measured at ppl x1.04 at worst (8,000 tokens)"
        )
        assert within.fidelity.to_dict() == {
            "preset": "compact",
            "spec": compact,
            "source": "shipped",
            "lengths": {
                "1024": {"ppl_ratio": 1.0, "kl": None, "top1": 0.99},
                "8000": {"ppl_ratio": 1.04, "kl": 0.01, "top1": 0.9},
            },
            "measured_by": "a test",
        }
        above = db.restore("b")
        assert above.mode == "exact" and above.fidelity is None
        assert (
            f"({balanced}) is measured at ppl x1.20 at 8,000 tokens, above max-loss 1.05: prefilled exactly"
            in above.reason
        )
        assert db.restore("b", max_loss=1.25).mode == "archive"
        mixed = db.restore("c", max_loss=1.1)  # a path of both presets answers for the less faithful
        assert mixed.mode == "exact" and f"balanced ({balanced})" in mixed.reason
        assert db.restore("a", max_loss=1.0).mode == "exact"
        with pytest.raises(InvalidArgument, match="at least 1.0"):
            db.restore("a", max_loss=0.99)
        # resuming a prompt (the server's path) follows the same rule
        ids = db.tokens("a")
        assert db.resume(ids, mode="auto").mode == "archive"
        assert db.resume(ids, mode="auto", max_loss=1.01) is None  # nothing in the prefix cache either
        assert db.resume(ids, mode="archive", max_loss=1.01).mode == "archive"


@pytest.mark.slow
def test_stale_figures_count_as_unmeasured(tmp_path, tiny_model, monkeypatch, built):
    """Figures measured with another key sharpening than a restore applies describe another restore."""
    from kvdb.codecs import fidelity, presets

    a_machine_that_built_them(built, tmp_path / "cache", monkeypatch)
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        weights = db.loaded_model.identity.weights_hash
        db.ingest(text=TEXT, name="s", keep=KV)
        measured_table(monkeypatch, weights, {presets.resolve("balanced", weights): 1.01})
        assert db.restore("s").mode == "archive"
        monkeypatch.setitem(
            fidelity.table()[weights][presets.resolve("balanced", weights)]["shipped"], "key_sharpening", 1.05
        )
        assert db.restore("s").mode == "exact"


def test_a_transform_preset_is_built_coded_and_restored_like_any_other(tmp_path, tiny_model, monkeypatch):
    """A ``t<bits>`` preset's shipped codebooks (transform coded, with the Fisher information of
    the calibration text) code a session that restores from tier K, finer than a coarser preset's."""
    monkeypatch.setenv("KVDB_CACHE", str(tmp_path / "cache"))
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        db.ingest(text=TEXT, name="fine", keep=KV, kv_preset="t4")
        db.ingest(text="Not the same session: " + TEXT, name="coarse", keep=KV, kv_preset="t1")
        assert sorted(c.preset for c in db.codebooks()) == ["t1", "t4"]
        gaps = {}
        for name in ("fine", "coarse"):
            exact_k, exact_v = capture.cache_arrays(db.restore(name, mode="exact").cache)
            restored = db.restore(name, mode="archive", window="stored")
            assert restored.mode == "archive" and restored.fidelity.spec == ("t4" if name == "fine" else "t1")
            got_k, got_v = capture.cache_arrays(restored.cache)
            gaps[name] = float(np.abs(got_k - exact_k).mean() + np.abs(got_v - exact_v).mean())
        assert (
            0 < gaps["fine"] < 0.75 * gaps["coarse"]
        )  # the tiny model's Fisher information leaves many dimensions without bits at both
        assert set(db.stats().kv_bytes_by_preset) == {"t1", "t4"}
        assert db.verify().ok


def test_an_entropy_coded_preset_is_cut_by_coding_both_halves_again(tmp_path, tiny_model, monkeypatch):
    """An ``e<bits>`` preset stores a node's codes as one entropy-coded payload. A session that
    leaves another's node part-way cuts it: both halves are coded again, and together they hold
    the integers the node held; both sessions restore from them (with the stored window, the
    preset's default) and verify."""
    from kvdb.codecs import code_layout

    monkeypatch.setenv("KVDB_CACHE", str(tmp_path / "cache"))
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        db.ingest(text=TEXT, name="a", keep=KV, kv_preset="e4")
        storage, tier_k = storage_of(db), db._tier_k

        def codes(name):
            parts = []
            for node in storage.node_path(db.session(name).session_id):
                codebook_id, streams = storage.node_kv(node.node_id)
                parts.append(
                    code_layout.codes_from_streams(
                        tier_k.codebooks(node.model_id, codebook_id)[1], streams, node.n_tokens
                    )
                )
            return [np.concatenate(kind, axis=-1) for kind in zip(*parts)], len(parts)

        before, nodes = codes("a")
        assert nodes == 1
        db.ingest(
            text=TEXT[:120] + "and then it goes somewhere else entirely, at some length.",
            name="b",
            keep=KV,
            kv_preset="e4",
        )
        after, nodes = codes("a")
        assert nodes == 2
        for a, b in zip(after, before):
            np.testing.assert_array_equal(a, b)
        db.ingest(text="Not the same session: " + TEXT, name="coarse", keep=KV, kv_preset="e1")
        gaps = {}
        for name in ("a", "b", "coarse"):
            exact_k, exact_v = capture.cache_arrays(db.restore(name, mode="exact").cache)
            restored = db.restore(name, mode="archive")  # an entropy-coded preset's window is stored unless told
            assert restored.mode == "archive" and restored.fidelity.spec == ("e1" if name == "coarse" else "e4")
            assert restored.window == restored.to_dict()["window"] == "stored"
            got_k, got_v = capture.cache_arrays(restored.cache)
            gaps[name] = float(np.abs(got_k - exact_k).mean() + np.abs(got_v - exact_v).mean())
        assert 0 < max(gaps["a"], gaps["b"]) < 0.75 * gaps["coarse"]
        assert set(db.stats().kv_bytes_by_preset) == {"e1", "e4"}
        assert db.verify().ok
