"""The store: alembic creates and upgrades the schema; foreign or newer files are refused clearly."""

import duckdb
import pytest
from support import CALIBRATION, undo_child_keys

import kvdb
from kvdb.errors import ArchiveError, NewerArchiveError
from kvdb.storage import edits, open_storage, schema
from kvdb.storage.duckdb_file import DuckDBFile
from kvdb.storage.engine import REVISION
from kvdb.storage.migrate import script_directory

HEAD = script_directory()[0].get_current_head()


def test_the_tables_name_the_head_revision():
    """An archive at schema.REVISION opens without alembic: it must be the newest migration."""
    assert schema.REVISION == HEAD


def test_the_tables_every_read_names_are_the_schemas():
    assert edits.TABLES == tuple(t.name for t in schema.metadata.sorted_tables)


def test_opening_and_reading_an_archive_imports_neither_sqlalchemy_nor_alembic(tmp_path):
    """Their import was most of a read-only command's start (decisions/0031): an archive at
    the head revision opens and reads on DuckDB alone; one behind it still migrates."""
    import subprocess
    import sys

    path = tmp_path / "a.duckdb"
    open_storage(path).close()
    probe = (
        "import sys; from kvdb.storage import open_storage; "
        f"s = open_storage({str(path)!r}, read_only=True); "
        "s.list_sessions(); s.byte_counts(); s.index_keys(); s.close(); "
        "print(sorted(m for m in ('sqlalchemy', 'alembic', 'duckdb_engine') if m in sys.modules))"
    )
    assert (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )


def test_new_archive_is_migrated_to_head(tmp_path):
    store = open_storage(tmp_path / "a.duckdb")
    try:
        assert store.engine.schema_revision() == HEAD
        tables = {
            r[0]
            for r in store.engine.connection().execute("select table_name from information_schema.tables").fetchall()
        }
        assert {
            "models",
            "sessions",
            "nodes",
            "token_streams",
            "token_blocks",
            "node_logprobs",
            "alembic_version",
        } <= tables
        assert set(store.byte_counts().values()) == {0}
    finally:
        store.close()


def test_reopening_keeps_revision(tmp_path):
    DuckDBFile(tmp_path / "a.duckdb").close()
    store = DuckDBFile(tmp_path / "a.duckdb")
    assert store.schema_revision() == HEAD
    store.close()


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "a.duckdb"
    DuckDBFile(path).close()
    con = duckdb.connect(str(path))
    con.execute("update alembic_version set version_num = 'ffff-from-the-future'")
    con.close()
    with pytest.raises(NewerArchiveError, match="newer kvdb"):
        DuckDBFile(path)


def test_foreign_duckdb_file_is_refused(tmp_path):
    path = tmp_path / "other.duckdb"
    con = duckdb.connect(str(path))
    con.execute("create table customers (id integer)")
    con.close()
    with pytest.raises(ArchiveError, match="not a kvdb archive"):
        DuckDBFile(path)


def test_non_database_file_is_refused(tmp_path):
    path = tmp_path / "notes.duckdb"
    path.write_text("just some text, not a database\n" * 100)
    with pytest.raises(ArchiveError, match="notes.duckdb is not a kvdb archive"):
        DuckDBFile(path)


def test_directory_is_refused(tmp_path):
    with pytest.raises(ArchiveError, match="is a directory"):
        DuckDBFile(tmp_path)


def test_second_process_waits_then_fails_naming_the_holder(tmp_path):
    import os
    import subprocess
    import sys
    import time

    from kvdb.errors import ArchiveLocked

    path = tmp_path / "a.duckdb"
    DuckDBFile(path).close()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from kvdb.storage.duckdb_file import DuckDBFile; s = DuckDBFile({str(path)!r}); "
            "print('ready', flush=True); import time; time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        start = time.monotonic()
        with pytest.raises(ArchiveLocked, match=rf"in use by process {holder.pid}.*waited 0.5s"):
            DuckDBFile(path, lock_timeout=0.5)
        assert time.monotonic() - start >= 0.5
    finally:
        holder.kill()
        holder.wait()
    DuckDBFile(path, lock_timeout=5).close()  # once the holder is gone the archive opens again
    assert os.path.exists(path)


@pytest.mark.slow
def test_gc_gives_the_freed_blocks_back_to_the_file_system(tmp_path, tiny_model):
    """Issue 30: DuckDB reuses freed blocks but never shrinks its file; gc rewrites it when much is free."""
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_model) as db:
        for i in range(30):
            db.ingest(text=f"session {i}: " + CALIBRATION[:3000], name=f"s{i}")
        kept = {f"s{i}": db.text(f"s{i}") for i in range(25, 30)}
        for i in range(25):
            db.delete(f"s{i}")
        freed = db.gc()  # frees the nodes, then gives their blocks back
        assert freed.file_bytes == path.stat().st_size < 0.8 * freed.file_bytes_before
        assert {s.name: db.text(s.session_id) for s in db.sessions()} == kept
        assert db.search("session 27")[0].name == "s27" and db.verify(deep=True).ok
        assert db.gc().file_bytes_before is None  # nothing left to give back
    assert not list(tmp_path.glob(".a.duckdb.compacting-*"))
    with kvdb.open(path, model=tiny_model) as db:  # the rewritten file opens as an archive of this schema
        assert len(db.sessions()) == 5 and db.verify().ok


@pytest.mark.slow
def test_a_rewrite_that_fails_is_a_clear_error_and_the_archive_stays_whole(tmp_path, tiny_model, monkeypatch):
    import kvdb.storage.duckdb_file as duckdb_file

    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_model) as db:
        for i in range(30):
            db.ingest(text=f"session {i}: " + CALIBRATION[:3000], name=f"s{i}")
        for i in range(25):
            db.delete(f"s{i}")

        # the copy cannot be made (as on a full disk): DuckDB refuses the staging file
        monkeypatch.setattr(duckdb_file, "quoted", lambda _: str(tmp_path / "no-such-folder" / "copy.duckdb"))
        with pytest.raises(ArchiveError, match="could not rewrite .* smaller .*the archive is whole"):
            db.gc()
        monkeypatch.undo()
        assert [s.name for s in db.sessions()] == [f"s{i}" for i in range(25, 30)] and db.verify(deep=True).ok
    assert not list(tmp_path.glob(".a.duckdb.compacting-*"))


def test_a_hold_lasts_ten_times_the_last_let_go_when_that_is_longer(tmp_path, monkeypatch):
    """Letting the file go checkpoints it, at a cost that grows with the archive: a hold lasts
    long enough that it stays a tenth of the time, and a second at least."""
    import itertools

    import kvdb.storage.duckdb_file as duckdb_file
    from kvdb.storage import base
    from kvdb.storage.base import Queue

    assert base.hold_seconds(0.01) == base.HOLD_SECONDS and base.hold_seconds(0.3) == pytest.approx(3.0)
    storage = open_storage(tmp_path / "a.duckdb")
    storage.apply(Queue(["s1"], "semantic"))
    assert storage.engine.hold_seconds() == base.HOLD_SECONDS
    clock = itertools.count(0.0, 0.25)  # each reading of the clock a quarter second later
    monkeypatch.setattr(duckdb_file.time, "monotonic", lambda: next(clock))
    storage.release()  # read before and after the close: it took 0.25 s
    monkeypatch.undo()
    assert storage.engine.hold_seconds() == pytest.approx(2.5)
    storage.close()


def test_a_hold_past_its_time_commits_and_goes_on_until_another_process_waits(tmp_path, monkeypatch):
    """Letting go checkpoints the file, at a cost that grows with the archive: past its hold a
    batch commits and keeps the file while nobody waits, and lets go once a process asks for it
    (a reader waiting on the lock touches ``.wanted``), which then reads what was committed."""
    import subprocess
    import sys
    import time

    from kvdb.storage import base
    from kvdb.storage.base import Queue

    monkeypatch.setattr(base, "HOLD_SECONDS", 0.05)
    path = tmp_path / "a.duckdb"
    storage = open_storage(path)
    read = (
        f"from kvdb.storage import open_storage; s = open_storage({str(path)!r}, read_only=True, lock_timeout=30); "
        "print(len(s.queued('semantic')))"
    )
    with storage.batch():
        storage.apply(Queue(["s0"], "semantic"))
        connections = storage.engine.connections
        time.sleep(0.06)
        storage.before_compute(short=True)
        assert (
            storage.engine.connections == connections and storage.held_for() < 0.05
        )  # committed, held on, the hold begun anew
        reader = subprocess.Popen(
            [sys.executable, "-c", read], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        written = 1
        while (
            reader.poll() is None and written < 2000
        ):  # short work, one queued session at a time, until the reader got in
            storage.apply(Queue([f"s{written}"], "semantic"))
            written += 1
            time.sleep(0.01)
            storage.before_compute(short=True)
        out, err = reader.communicate(timeout=30)
    assert reader.returncode == 0, err
    assert (
        storage.engine.connections > connections and 1 <= int(out) < written
    )  # let go for it, with what was committed by then
    assert not (tmp_path / "a.duckdb.wanted").exists()  # asked for and given
    storage.close()


def test_an_archive_of_0012_gets_an_index_for_each_read_of_a_nodes_rows(tmp_path):
    """DuckDB scans an index only for a filter on all its columns: the keys that begin with
    node_id served no ``where node_id = ?``, which scanned the table (migration 0013)."""
    path = tmp_path / "a.duckdb"
    DuckDBFile(path).close()
    tables = ("token_blocks", "node_kv", "node_chunks", "search_ranges")
    with duckdb.connect(str(path)) as conn:
        for table in tables:
            conn.execute(f"drop index ix_{table}_node")
        undo_child_keys(conn)
        conn.execute("update alembic_version set version_num = '0012'")
    DuckDBFile(path).close()
    with duckdb.connect(str(path), read_only=True) as conn:
        indexes = dict(
            conn.execute(
                "select table_name, expressions from duckdb_indexes() where index_name like 'ix_%_node'"
            ).fetchall()
        )
        assert indexes == {table: "[node_id]" for table in tables}
        assert conn.execute("select version_num from alembic_version").fetchone() == (REVISION,)
