"""A file archive commits an ingest's files in batches (issue 53): the phrase index takes a batch's
runs in one merge at its commit, and a batch that fails leaves the archive, its index and its
queue as they were before it."""

from __future__ import annotations

import pytest
from support import storage_of

import kvdb
from kvdb.storage import sql_apply
from kvdb.storage.base import SessionWrite

TEXTS = {
    f"log{i}": f"Entry {i}: the harbour master counted {i} ships at night, then {i + 1} at dawn." for i in range(6)
}


def _folder(tmp_path):
    folder = tmp_path / "logs"
    folder.mkdir()
    for name, text in TEXTS.items():
        (folder / f"{name}.txt").write_text(text, encoding="utf-8")
    return folder


def test_a_batch_of_files_is_indexed_in_one_merge_as_one_by_one(tmp_path, tiny_loaded):
    folder = _folder(tmp_path)
    with (
        kvdb.open(tmp_path / "batched.duckdb", model=tiny_loaded) as batched,
        kvdb.open(tmp_path / "single.duckdb", model=tiny_loaded) as single,
    ):
        heard = []
        batched.ingest(folder, keep="tokens,search", heard=heard.append)
        for name, text in TEXTS.items():
            single.ingest(text=text, name=name, keep="tokens,search")
        assert sorted(r.name for results in heard for r in results) == sorted(
            TEXTS
        )  # each file said once, after its commit
        for phrase in ("harbour master", "3 ships at night", "at dawn"):
            assert sorted((h.name, h.position) for h in batched.search(phrase, k=10)) == sorted(
                (h.name, h.position) for h in single.search(phrase, k=10)
            )
        assert batched.verify(deep=True).ok
    with kvdb.open(
        tmp_path / "batched.duckdb", model=tiny_loaded, read_only=True
    ) as reopened:  # the sidecar saved at the commit
        assert {h.name for h in reopened.search("harbour master", k=10)} == set(TEXTS)


def test_a_failed_batch_leaves_the_archive_as_it_was(tmp_path, tiny_loaded, monkeypatch):
    folder = _folder(tmp_path)
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded) as db:
        db.ingest(text="Before the batch: the harbour was quiet.", name="before", keep="tokens,search")
        write, calls = sql_apply._session_write, []

        def fail_on_the_fourth(conn, plan):
            calls.append(plan)
            if len(calls) == 4:
                raise OSError("disk full")
            return write(conn, plan)

        monkeypatch.setitem(sql_apply._HANDLERS, SessionWrite, fail_on_the_fourth)
        with pytest.raises(OSError, match="disk full"):
            db.ingest(folder, keep="tokens,search")
        monkeypatch.undo()
        assert [s.name for s in db.sessions()] == ["before"] and db.pending().logprobs.sessions == 1
        assert {h.name for h in db.search("harbour", k=10)} == {"before"} and db.verify(deep=True).ok
        assert storage_of(db).engine.batching is False
        assert {r.status for r in db.ingest(folder, keep="tokens,search")} == {"ingested"}
        assert {h.name for h in db.search("harbour master", k=10)} == set(TEXTS) and db.verify(deep=True).ok


def test_a_long_batch_merges_its_runs_once_and_after_another_writers(tmp_path, tiny_model, tiny_loaded, monkeypatch):
    """Each session commits (a hold of 0 s) yet the index takes the batch's runs in one merge at
    its end; a writer that numbered slots between two of its commits has its runs follow them."""
    import subprocess
    import sys

    from kvdb.index import walk
    from kvdb.storage import base

    folder = _folder(tmp_path)
    path = tmp_path / "a.duckdb"
    monkeypatch.setattr(base, "HOLD_SECONDS", 0.0)
    merges = []
    extend = walk.WalkIndex.extend
    monkeypatch.setattr(
        walk.WalkIndex, "extend", lambda self, *a, **kw: (merges.append(len(a[0])), extend(self, *a, **kw))[1]
    )
    other = (
        f"import kvdb; kvdb.open({str(path)!r}, model={tiny_model!r})"
        ".ingest(text='Meanwhile the lighthouse keeper logged a storm.', name='other', keep='tokens,search')"
    )
    with kvdb.open(path, model=tiny_loaded) as db:
        db.ingest(text="Before: the harbour master slept.", name="before", keep="tokens,search")
        merges.clear()
        engine = storage_of(db).engine
        release, calls = engine.release, []
        monkeypatch.setattr(engine, "wanted", lambda: True)  # another process waits: each hold's end lets go

        def release_then_another_writer():
            release()
            calls.append(1)
            if len(calls) == 3:  # between two of the batch's commits
                subprocess.run([sys.executable, "-c", other], check=True)

        monkeypatch.setattr(engine, "release", release_then_another_writer)
        db.ingest(folder, keep="tokens,search")
        assert (
            len(calls) >= len(TEXTS) and len(merges) == 2
        )  # the runs before the other writer's, then the rest at the end
        assert {h.name for h in db.search("harbour master", k=10)} == {*TEXTS, "before"}
        assert {h.name for h in db.search("lighthouse keeper", k=10)} == {"other"}
        assert db.verify(deep=True).ok


def test_runs_that_do_not_fill_the_tail_join_it_once_at_the_batchs_end(tmp_path, tiny_loaded, monkeypatch):
    """Each merge sorts the whole tail again: a batch's runs wait for its end unless they fill the
    tail, however many commits it makes (decision 0072)."""
    from kvdb.index import indexes, walk
    from kvdb.storage import base

    monkeypatch.setattr(base, "HOLD_SECONDS", 0.0)  # a commit after each session
    monkeypatch.setattr(indexes, "DEFERRED_MIN", 1)
    merges = []
    extend = walk.WalkIndex.extend
    monkeypatch.setattr(
        walk.WalkIndex, "extend", lambda self, *a, **kw: (merges.append(len(a[0])), extend(self, *a, **kw))[1]
    )
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded) as db:
        db.ingest(_folder(tmp_path), keep="tokens,search")
        assert merges == [len(TEXTS)]
        assert {h.name for h in db.search("harbour master", k=10)} == set(TEXTS)


def test_a_long_batch_merges_its_tail_into_the_base_once_at_its_end(tmp_path, tiny_loaded, monkeypatch):
    """Merges inside a batch fill the tail and seal it; only the batch's end merges the tail into
    the newest base (a backfill sorted the base again at each eighth)."""
    from kvdb.index import indexes, walk
    from kvdb.storage import base

    monkeypatch.setattr(base, "HOLD_SECONDS", 0.0)  # a commit after each session
    monkeypatch.setattr(indexes, "DEFERRED_MIN", 1)  # a merge at a commit once the runs fill the tail
    monkeypatch.setattr(walk, "SEGMENT_SLOTS", 250)  # a tail of about four of these sessions
    monkeypatch.setattr(walk, "TAIL_MIN", 1)
    merges, settles = [], []
    extend, settle = walk.WalkIndex.extend, walk.WalkIndex.settle
    monkeypatch.setattr(
        walk.WalkIndex, "extend", lambda self, *a, **kw: (merges.append(len(a[0])), extend(self, *a, **kw))[1]
    )
    monkeypatch.setattr(walk.WalkIndex, "settle", lambda self: (settles.append(len(merges)), settle(self))[1])
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded) as db:
        db.ingest(text="Before: the harbour master slept.", name="before", keep="tokens,search")
        merges.clear(), settles.clear()
        db.ingest(_folder(tmp_path), keep="tokens,search")
        assert len(merges) >= 2 and settles == [len(merges)]  # merges inside the batch, and one settle, with the last
        assert {h.name for h in db.search("harbour master", k=10)} == {*TEXTS, "before"}
        assert db.verify(deep=True).ok
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded) as db:  # the saved copy is the base alone
        assert {h.name for h in db.search("counted 3 ships", k=10)} == {"log3"}
