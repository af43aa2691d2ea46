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
        assert st.codebook_bytes == st.bytes["codebooks"] == listed.stored_bytes and st.shipped_codebook_bytes == listed.centroid_bytes
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
    con = duckdb.connect(str(tmp_path / "a.duckdb"))  # as if a later kvdb, with another calibration text, had written it
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
    assert report.built and not again.built and report.path == again.path and report.preset == shipped.recipe(identity)["preset"] == "k4v3"
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
def test_verify_and_repair_pass_an_archive_whose_tier_k_references_shipped_codebooks(tmp_path, tiny_model, monkeypatch, built):
    """Issue 30: verify read the reference as centroids ("bad magic") and failed every such archive."""
    a_machine_that_built_them(built, tmp_path / "cache", monkeypatch)
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        db.ingest(text=TEXT, name="s", keep=KV)
        report = db.verify(deep=True)
        assert report.ok, report.problems
        assert report.checked["codebooks"] == 1 and report.checked["kv streams"] == 1
    monkeypatch.setenv("KVDB_CACHE", str(tmp_path / "another-machine"))  # not built here: the reference alone is checked
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
