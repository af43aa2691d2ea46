"""An archive on DuckLake (catalog in the tests' own PostgreSQL, data as Parquet files) does
what a file does, through the Python API and the CLI: the same sessions, tokens, searches and
exact restores side by side; a refused schema; a catalog that is down. (kill -9 mid-ingest:
tests/system/test_crash.py, on both backends.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

import kvdb
from kvdb.errors import ArchiveError, NewerArchiveError

ROOT = Path(__file__).resolve().parents[2]
TEXTS = {
    "harbour": "The keeper watched the harbour lights. Ships passed the harbour lights at dusk, and the harbour lights answered.",
    "harbour-2": "The keeper watched the harbour lights. Then the fog came in and nobody saw them again.",
    "garden": "In the garden the basil grew tall. The harbour lights were far away from the garden.",
}


def _fill(archive) -> None:
    for name, text in TEXTS.items():
        archive.ingest(text=text, name=name, keep="tokens,search,lm")


def test_a_lake_archive_matches_a_file_archive(tmp_path, lake, tiny_model):
    where, data_path = lake
    with kvdb.open(tmp_path / "file.duckdb", model=tiny_model) as file, kvdb.open(where, model=tiny_model, data_path=data_path) as lake_archive:
        _fill(file)
        _fill(lake_archive)
        assert [(s.session_id, s.name, s.n_tokens) for s in lake_archive.sessions()] == [(s.session_id, s.name, s.n_tokens) for s in file.sessions()]
        for s in file.sessions():
            assert np.array_equal(lake_archive.tokens(s.session_id), file.tokens(s.session_id))
            assert lake_archive.text(s.session_id) == TEXTS[s.name]
        for phrase in ("harbour lights", "the garden", "fog"):
            assert [h.to_dict() for h in lake_archive.search(phrase, k=20)] == [h.to_dict() for h in file.search(phrase, k=20)]
        shared = lake_archive.stats().to_dict()
        assert shared["sessions"] == 3 and shared["stored_tokens"] < shared["tokens"]  # the shared opening is stored once
        restored, again = lake_archive.restore("harbour", at=20, mode="exact"), file.restore("harbour", at=20, mode="exact")
        assert restored.position == again.position == 20 and np.array_equal(restored.tokens, again.tokens)
        from kvdb import capture

        assert all(np.array_equal(a, b) for a, b in zip(capture.cache_arrays(restored.cache), capture.cache_arrays(again.cache)))
        assert lake_archive.verify(deep=True).ok
    assert any(Path(data_path).rglob("*.parquet"))  # the rows are Parquet files under the data path


def test_a_lake_opens_again_without_its_data_path_and_read_only(lake, tiny_model):
    where, data_path = lake
    with pytest.raises(ArchiveError, match="no archive at"):
        kvdb.open(where, model=tiny_model, read_only=True)
    with kvdb.open(where, model=tiny_model, data_path=data_path) as archive:
        archive.ingest(text=TEXTS["garden"], name="garden")
    with kvdb.open(where, model=tiny_model, read_only=True) as reader:  # the catalog remembers the data path
        assert [s.name for s in reader.sessions()] == ["garden"]
        with pytest.raises(ArchiveError, match="read-only"):
            reader.delete("garden")


def test_a_new_lake_needs_a_data_path_and_a_foreign_or_newer_one_is_refused(postgres, tiny_model, tmp_path):
    where = f"ducklake:postgres:{postgres.new_database()}"
    with pytest.raises(ArchiveError, match="--data-path"):
        kvdb.open(where, model=tiny_model)
    with kvdb.open(where, model=tiny_model, data_path=tmp_path / "d") as archive:
        archive.sessions()
    from kvdb.storage.ducklake import DuckLake

    store = DuckLake(where)
    with store.engine.begin() as conn:
        conn.execute(sa.text("update alembic_version set version_num = '9999'"))
    store.close()
    with pytest.raises(NewerArchiveError, match="9999"):
        kvdb.open(where, model=tiny_model)


def test_a_catalog_that_is_down_is_a_clear_error_and_nothing_is_half_written(postgres, lake, tiny_model):
    where, data_path = lake
    with kvdb.open(where, model=tiny_model, data_path=data_path) as archive:
        archive.ingest(text=TEXTS["garden"], name="garden")
    postgres.pause()
    try:
        with pytest.raises(ArchiveError, match="cannot reach the catalog"):
            kvdb.open(where, model=tiny_model)
    finally:
        postgres.start_again()
    with kvdb.open(where, model=tiny_model) as archive:
        assert [s.name for s in archive.sessions()] == ["garden"] and archive.verify(deep=True).ok


def _kvdb(*args, env=None, check=True):
    return subprocess.run([sys.executable, "-c", "from kvdb_cli.main import main; main()", *args], capture_output=True, text=True, env=env, check=check, cwd=ROOT)


def test_the_cli_on_a_lake(lake, tiny_model, tmp_path):
    where, data_path = lake
    env = dict(os.environ, KVDB_DB=where, KVDB_DATA_PATH=str(data_path), KVDB_MODEL=tiny_model)
    folder = tmp_path / "in"
    folder.mkdir()
    for name, text in TEXTS.items():
        (folder / f"{name}.txt").write_text(text)
    ingested = [json.loads(line) for line in _kvdb("ingest", str(folder), "--json", env=env).stdout.splitlines()]
    assert sorted(r["status"] for r in ingested) == ["ingested"] * 3
    hits = [json.loads(line) for line in _kvdb("search", "harbour lights", "--json", env=env).stdout.splitlines()]
    assert hits and all(h["match"].endswith("harbour lights") for h in hits[:3])
    assert _kvdb("show", "garden", env=env).stdout == TEXTS["garden"]
    stats = json.loads(_kvdb("stats", "--json", env=env).stdout)
    assert stats["sessions"] == 3 and "password" not in json.dumps(stats)
    refused = _kvdb("--db", where.replace("host=", "port=1 host="), "sessions", env=env, check=False)
    assert refused.returncode == 5 and refused.stderr.count("\n") == 1 and "cannot reach the catalog" in refused.stderr

