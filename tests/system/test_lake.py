"""An archive on DuckLake (catalog in the tests' own PostgreSQL, data as Parquet files) does
what a file does, through the Python API and the CLI: the same sessions, tokens, searches and
exact restores side by side; a refused schema; a catalog that is down. (kill -9 mid-ingest:
tests/system/test_crash.py, on both backends.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pytest
from support import undo_child_keys

import kvdb
from kvdb.errors import ArchiveError, NewerArchiveError

pytestmark = pytest.mark.slow  # a PostgreSQL cluster and subprocesses

ROOT = Path(__file__).resolve().parents[2]
TEXTS = {
    "harbour": (
        "The keeper watched the harbour lights. Ships passed the harbour lights at dusk, "
        "and the harbour lights answered."
    ),
    "harbour-2": "The keeper watched the harbour lights. Then the fog came in and nobody saw them again.",
    "garden": "In the garden the basil grew tall. The harbour lights were far away from the garden.",
}

# PostgreSQL is stopped once 3 are in: the rest (about a second each) leave the stop time to land
SESSIONS_WHEN_STOPPED = 15


def _fill(archive) -> None:
    for name, text in TEXTS.items():
        archive.ingest(text=text, name=name, keep="tokens,search,lm,semantic")
    archive.upkeep(only="semantic")  # ingest queues the embedding


def test_a_lake_archive_matches_a_file_archive(tmp_path, lake, tiny_model):
    where, data_path = lake
    with (
        kvdb.open(tmp_path / "file.duckdb", model=tiny_model, embedder=tiny_model) as file,
        kvdb.open(where, model=tiny_model, data_path=data_path, embedder=tiny_model) as lake_archive,
    ):
        _fill(file)
        _fill(lake_archive)
        assert [(s.session_id, s.name, s.n_tokens) for s in lake_archive.sessions()] == [
            (s.session_id, s.name, s.n_tokens) for s in file.sessions()
        ]
        for s in file.sessions():
            assert np.array_equal(lake_archive.tokens(s.session_id), file.tokens(s.session_id))
            assert lake_archive.text(s.session_id) == TEXTS[s.name]
        for phrase in ("harbour lights", "the garden", "fog"):
            assert [h.to_dict() for h in lake_archive.search(phrase, k=20)] == [
                h.to_dict() for h in file.search(phrase, k=20)
            ]
            assert [h.to_dict() for h in lake_archive.search_meaning(phrase)] == [
                h.to_dict() for h in file.search_meaning(phrase)
            ]
        shared = lake_archive.stats().to_dict()
        assert (
            shared["sessions"] == 3 and shared["stored_tokens"] < shared["tokens"]
        )  # the shared opening is stored once
        restored, again = (
            lake_archive.restore("harbour", at=20, mode="exact"),
            file.restore("harbour", at=20, mode="exact"),
        )
        assert restored.position == again.position == 20 and np.array_equal(restored.tokens, again.tokens)
        from kvdb.model import capture

        assert all(
            np.array_equal(a, b)
            for a, b in zip(capture.cache_arrays(restored.cache), capture.cache_arrays(again.cache))
        )
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
    talk = [
        {"role": "user", "content": "Where is the harbour?"},
        {"role": "assistant", "content": "Past the lighthouse."},
    ]
    with kvdb.open(where, model=tiny_model, data_path=tmp_path / "d") as archive:
        archive.ingest(messages=talk, name="chat")  # a chat archived turn after turn, as `kvdb serve` does
        archive.ingest(
            messages=[
                *talk,
                {"role": "user", "content": "And the ships?"},
                {"role": "assistant", "content": "At anchor."},
            ],
            name="chat",
        )
        archive.ingest(text=TEXTS["harbour"], name="harbour")
    from kvdb.storage.ducklake import DuckLake

    store = DuckLake(where)
    for table in (
        "node_chunks",
        "conversations",
        "conversation_sessions",
        "watched_files",
        "pending_work",
    ):  # a lake kvdb wrote before the semantic tier and conversations
        store.connection().execute(f"drop table {table}")
    undo_child_keys(store.connection())
    store.connection().execute("update alembic_version set version_num = '0007'")
    store.close()
    with pytest.raises(ArchiveError, match="revision 0007; open it once with a command that writes"):
        kvdb.open(where, model=tiny_model, read_only=True)
    with kvdb.open(
        where, model=tiny_model, embedder=tiny_model
    ) as archive:  # upgraded: the semantic tier's table added
        archive.ingest(text=TEXTS["garden"], name="garden", keep="tokens,search,semantic")
        listed = {
            c.title: c for c in archive.conversations()
        }  # ...and the sessions grouped, as migration 0009 groups a file's
        assert (
            sorted(listed) == ["chat", "garden", "harbour"]
            and listed["chat"].versions == 2
            and listed["harbour"].versions == 1
        )
    store = DuckLake(where)
    store.connection().execute("update alembic_version set version_num = '9999'")
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
    return subprocess.run(
        [sys.executable, "-c", "from kvdb.cli.main import main; main()", *args],
        capture_output=True,
        text=True,
        env=env,
        check=check,
        cwd=ROOT,
    )


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


def test_claims_keep_a_file_to_one_worker_until_released_or_expired(lake):
    from kvdb.storage import open_storage

    where, data_path = lake
    first, second = open_storage(where, data_path=data_path), open_storage(where)
    try:
        assert first.claim("file-a", "host1:1", 60) is None
        assert second.claim("file-a", "host2:7", 60) == "host1:1"
        assert first.claim("file-a", "host1:1", 60) is None  # renewed by its owner
        first.release_claim("file-a", "host1:1")
        assert second.claim("file-a", "host2:7", 60) is None
        assert first.claim("file-b", "host1:1", 0) is None  # a lease that is over: a dead worker's file is taken again
        assert second.claim("file-b", "host2:7", 60) is None
    finally:
        first.close()
        second.close()


def test_a_file_another_worker_claimed_is_passed_by_and_said_so(lake, tiny_model, tmp_path):
    from kvdb.services.claims import CLAIM_LEASE_SECONDS, _claim_key
    from kvdb.storage import open_storage
    from kvdb.tiers import DEFAULT_KEEP, parse_keep

    where, data_path = lake
    path = tmp_path / "busy.txt"
    path.write_text(TEXTS["garden"])
    other = open_storage(where, data_path=data_path)
    try:
        other.claim(_claim_key(path, parse_keep(DEFAULT_KEEP)), "elsewhere:1", CLAIM_LEASE_SECONDS)
        with kvdb.open(where, model=tiny_model) as archive:
            [result] = archive.ingest(path)
            assert (result.status, result.claimed_by) == ("claimed", "elsewhere:1") and archive.sessions() == []
            other.release_claim(_claim_key(path, parse_keep(DEFAULT_KEEP)), "elsewhere:1")
            assert [r.status for r in archive.ingest(path)] == ["ingested"]
    finally:
        other.close()


def test_two_workers_ingest_conversations_sharing_a_prefix_into_one_trie(lake, tiny_model, tmp_path):
    """Workers commit at once; the shared opening ends up stored once, as in a file ingested by one process."""
    where, data_path = lake
    folder = tmp_path / "in"
    folder.mkdir()
    opening = "The keeper of the harbour lights kept a log of every ship. " * 6
    for i in range(8):
        (folder / f"c{i}.txt").write_text(
            opening + f"Entry {i}: " + " ".join(f"w{(i * 13 + j) % 40}" for j in range(30))
        )
    env = dict(os.environ, KVDB_MODEL=tiny_model)
    out = _kvdb(
        "--db", where, "--data-path", str(data_path), "ingest", "--workers", "2", str(folder), "--json", env=env
    )
    statuses = [json.loads(line)["status"] for line in out.stdout.splitlines()]
    assert statuses == ["ingested"] * 8
    _kvdb("--db", str(tmp_path / "one.duckdb"), "ingest", str(folder), env=env)
    with kvdb.open(where, model=tiny_model) as on_lake, kvdb.open(tmp_path / "one.duckdb", model=tiny_model) as on_file:
        lake_stats, file_stats = on_lake.stats().to_dict(), on_file.stats().to_dict()
        assert (lake_stats["sessions"], lake_stats["tokens"], lake_stats["stored_tokens"]) == (
            file_stats["sessions"],
            file_stats["tokens"],
            file_stats["stored_tokens"],
        )
        assert sorted(s.session_id for s in on_lake.sessions()) == sorted(s.session_id for s in on_file.sessions())
        assert on_lake.verify(deep=True).ok

        def hits(archive):  # ingested in another order: a hit in the shared opening may name another session through it
            return sorted((h.position, h.score, h.match) for h in archive.search("harbour lights", k=100))

        assert hits(on_lake) == hits(on_file) != []
        for h in on_lake.search("harbour lights", k=100):
            assert on_lake.text(h.session_id, h.position, h.position + h.match_tokens) == h.match


def test_copy_a_file_to_a_lake_and_back_verified_by_content_hashes(lake, tiny_model, tmp_path):
    where, data_path = lake
    with kvdb.open(tmp_path / "src.duckdb", model=tiny_model) as source:
        _fill(source)
        expected = [h.to_dict() for h in source.search("harbour lights", k=20)]
    env = dict(os.environ, KVDB_MODEL=tiny_model)
    there = json.loads(
        _kvdb("--data-path", str(data_path), "copy", str(tmp_path / "src.duckdb"), where, "--json", env=env).stdout
    )
    assert there["rows"]["sessions"] == 3 and "password" not in there["target"]
    for table in (
        "sessions",
        "nodes",
        "token_blocks",
        "search_ranges",
    ):  # one INSERT a table, so one data file (was one a row)
        assert len([f for f in data_path.rglob("*.parquet") if table in f.relative_to(data_path).parts]) == 1, table
    back = json.loads(_kvdb("copy", where, str(tmp_path / "back.duckdb"), "--json", env=env).stdout)
    assert back["sha256"] == there["sha256"]
    with kvdb.open(tmp_path / "back.duckdb", model=tiny_model) as copied:
        assert [
            h.to_dict() for h in copied.search("harbour lights", k=20)
        ] == expected  # its index rebuilt from the rows
        assert copied.text("garden") == TEXTS["garden"] and copied.verify(deep=True).ok
    again = _kvdb("copy", str(tmp_path / "src.duckdb"), where, env=env, check=False)
    assert again.returncode == 5 and "not empty" in again.stderr


def test_postgres_stopped_mid_ingest_is_one_clear_error_and_the_rerun_completes(postgres, lake, tiny_model, tmp_path):
    where, data_path = lake
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(SESSIONS_WHEN_STOPPED):
        (folder / f"s{i:02}.txt").write_text(f"Session {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(40)))
    env = dict(os.environ, KVDB_MODEL=tiny_model)
    with kvdb.open(where, model=tiny_model, data_path=data_path):
        pass
    worker = subprocess.Popen(
        [sys.executable, "-c", "from kvdb.cli.main import main; main()", "--db", where, "ingest", str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    from kvdb.storage import open_storage

    watcher = open_storage(where, read_only=True)
    try:
        while len(watcher.list_sessions()) < 3 and worker.poll() is None:
            time.sleep(0.2)
    finally:
        watcher.close()
    postgres.pause()
    try:
        out, err = worker.communicate(timeout=120)
    finally:
        postgres.start_again()
    assert worker.returncode == 5, (out, err)
    assert "lost the catalog" in err and "run the command again" in err and "Traceback" not in err
    again = [
        json.loads(line) for line in _kvdb("--db", where, "ingest", str(folder), "--json", env=env).stdout.splitlines()
    ]
    assert {r["status"] for r in again} <= {"ingested", "unchanged"} and len(again) == SESSIONS_WHEN_STOPPED
    with kvdb.open(where, model=tiny_model) as archive:
        assert len(archive.sessions()) == SESSIONS_WHEN_STOPPED and archive.verify(deep=True).ok


def test_an_aborted_transaction_is_a_lost_catalog_only_while_postgres_is_down(postgres, lake, tiny_model):
    """DuckLake says "transaction is aborted" both for a connection PostgreSQL dropped and for any
    earlier failure in the transaction: only the first is the lost catalog (the rerun's advice)."""
    where, data_path = lake
    with kvdb.open(where, model=tiny_model, data_path=data_path):
        pass
    from kvdb.storage import open_storage

    aborted = duckdb.TransactionException(
        "TransactionContext Error: Failed to get global stats information from DuckLake: "
        "Current transaction is aborted (please ROLLBACK)"
    )
    store = open_storage(where, read_only=True)
    try:
        assert store.engine.explain(aborted) is None  # PostgreSQL answers: some other failure, reported as it was
        postgres.pause()
        try:
            explained = store.engine.explain(aborted)
        finally:
            postgres.start_again()
        assert (
            isinstance(explained, ArchiveError)
            and "lost the catalog" in str(explained)
            and "run the command again" in str(explained)
        )
    finally:
        store.close()


def test_verify_names_a_data_file_deleted_or_damaged(lake, tiny_model):
    where, data_path = lake
    with kvdb.open(where, model=tiny_model, data_path=data_path) as archive:
        _fill(archive)
        assert archive.verify().ok
    from kvdb.storage import open_storage

    store = open_storage(where, read_only=True)
    try:
        conn = store.engine.connection()  # the files of the current snapshot (older ones may be left for time travel)
        blocks, logprobs = (
            [Path(r[0]) for r in conn.execute(f"select data_file from ducklake_list_files('lake', '{t}')").fetchall()]
            for t in ("token_blocks", "node_logprobs")
        )
    finally:
        store.close()
    blocks[0].unlink()
    logprobs[0].write_bytes(logprobs[0].read_bytes()[:-10])
    with kvdb.open(where, model=tiny_model) as archive:
        problems = archive.verify(deep=True).problems
    assert any("token_blocks" in p and str(blocks[0]) in p and "missing" in p for p in problems), problems
    assert any("node_logprobs" in p and str(logprobs[0]) in p for p in problems), problems
    out = _kvdb("--db", where, "verify", env=dict(os.environ, KVDB_MODEL=tiny_model), check=False)
    assert out.returncode == 1 and str(blocks[0]) in out.stdout + out.stderr


def test_machines_searching_one_lake_catch_up_with_each_others_commits_and_never_renumber(
    lake, tiny_model, tmp_path, monkeypatch
):
    """Each machine keeps its own copy of the search index (its cache directory); a commit by
    one is merged into the other's copy from the lake's slot runs, with no rebuild written to
    the catalog, and both answer as one file archive of the same sessions does."""
    from kvdb.index.walk import WalkIndex
    from kvdb.storage import open_storage

    where, data_path = lake
    machines = []
    for name in ("a", "b"):
        monkeypatch.setenv("KVDB_CACHE", str(tmp_path / f"cache-{name}"))
        machines.append(kvdb.open(where, model=tiny_model, data_path=data_path))
    a, b = machines
    with kvdb.open(tmp_path / "file.duckdb", model=tiny_model) as file:
        store = open_storage(where, read_only=True)
        try:
            a.ingest(text=TEXTS["harbour"], name="harbour")
            file.ingest(text=TEXTS["harbour"], name="harbour")
            (key,) = store.index_keys()
            numbering, _ = store.index_generation(key)
            for phrase in ("harbour lights", "fog"):
                assert [h.to_dict() for h in b.search(phrase)] == [h.to_dict() for h in file.search(phrase)]
            for writer, name in ((a, "harbour-2"), (b, "garden")):  # each machine writes once more, the other searches
                writer.ingest(text=TEXTS[name], name=name)
                file.ingest(text=TEXTS[name], name=name)
                for reader in (a, b):
                    for phrase in ("harbour lights", "fog", "the garden", "basil"):
                        assert [h.to_dict() for h in reader.search(phrase, k=20)] == [
                            h.to_dict() for h in file.search(phrase, k=20)
                        ]
            generation, ntotal = store.index_generation(key)
            assert generation == numbering  # nobody numbered the slots anew
            for name, machine in zip("ab", machines):  # each machine's sidecar holds the catalog's whole index
                monkeypatch.setenv("KVDB_CACHE", str(tmp_path / f"cache-{name}"))
                header = WalkIndex.read_header(machine.local_path(".index") / f"{key}.keys")
                assert (header.generation, header.ntotal) == (generation, ntotal)
        finally:
            store.close()
            for m in machines:
                m.close()


def test_gc_merges_the_small_parquet_files_commits_leave(lake, tiny_model):
    where, data_path = lake
    with kvdb.open(where, model=tiny_model, data_path=data_path) as archive:
        _fill(archive)
        hits = [h.to_dict() for h in archive.search("harbour lights", k=20)]
        freed = archive.gc()
        assert freed.data_files_written < freed.data_files_merged  # one commit per session wrote a file per table
        assert freed.data_files_deleted == 0  # the merged ones stay for readers still scanning them, an hour
        assert [h.to_dict() for h in archive.search("harbour lights", k=20)] == hits
        assert archive.verify(deep=True).ok


def test_an_object_store_that_cannot_be_reached_is_one_clear_error_and_nothing_is_written(
    lake, tiny_model, monkeypatch
):
    """A data path on object storage goes through httpfs, with the S3 credentials of the
    environment; a store that answers nobody (here a closed local port) is an ArchiveError
    naming the data path, and the lake is left as it was: empty."""
    where, _ = lake
    for name, value in {
        "AWS_ACCESS_KEY_ID": "kvdb",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ArchiveError, match="cannot reach the data path.*AWS_"):
        kvdb.open(where, model=tiny_model, data_path="s3://kvdb-test/lake")
    with pytest.raises(ArchiveError, match="no archive at"):
        kvdb.open(where, model=tiny_model, read_only=True)


def test_a_conninfo_libpq_refuses_is_one_clear_error(tiny_model):
    with pytest.raises(ArchiveError, match="catalog in PostgreSQL: give --db as ducklake:postgres:"):
        kvdb.open("ducklake:sqlite:somewhere.db", model=tiny_model)
    with pytest.raises(ArchiveError, match="cannot reach the catalog"):
        kvdb.open(
            "ducklake:postgres:host=/nonexistent-socket-folder dbname=x connect_timeout=2",
            model=tiny_model,
            data_path="/tmp/x",
        )


def test_the_tests_postgres_is_stopped_and_removed_when_its_starter_is_killed():
    """pytest killed -9 runs no teardown: the cluster's watchdog stops it and removes its folder."""
    script = (
        f"import sys, time; sys.path.insert(0, {str(ROOT / 'tests')!r}); "
        "from postgres import Cluster; print(Cluster().start().folder, flush=True); time.sleep(120)"
    )
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    folder = Path(starter.stdout.readline().strip())
    server = int((folder / "data" / "postmaster.pid").read_text().split()[0])
    os.kill(server, 0)  # running
    starter.kill()
    starter.wait()
    deadline = time.monotonic() + 30
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not folder.exists()
    assert _gone(server)


def _gone(pid: int) -> bool:
    """No such process, or only its exit status left (a zombie nobody in this container reaps)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
