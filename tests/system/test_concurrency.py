"""Several processes on one archive: read-only opens share the file, and an ingest lets the
file go while its model works (taking into account what others wrote meanwhile)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import storage_of, write_jsonl

import kvdb
import kvdb.services.write_compute
import kvdb.storage.base
from kvdb.errors import ArchiveError, ArchiveLocked
from kvdb.model import loading as lm_ops
from kvdb.storage import open_storage

pytestmark = pytest.mark.slow  # several processes on one archive

READER = (
    "from kvdb.storage import open_storage; "
    "print(len(open_storage({path!r}, lock_timeout=0, read_only=True).list_sessions()))"
)


def _hold(path, read_only: bool) -> subprocess.Popen:
    code = (
        f"from kvdb.storage import open_storage; s = open_storage({str(path)!r}, read_only={read_only}); "
        "s.list_sessions(); print('ready', flush=True); import time; time.sleep(30)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ready"
    return holder


def test_read_only_opens_share_the_file_and_exclude_a_writer(tmp_path):
    path = tmp_path / "a.duckdb"
    open_storage(path).close()
    holder = _hold(path, read_only=True)
    try:
        reader = open_storage(path, lock_timeout=0.5, read_only=True)
        assert reader.list_sessions() == []
        reader.close()
        with pytest.raises(ArchiveLocked, match="read-only"):
            open_storage(path, lock_timeout=0.5).list_sessions()
    finally:
        holder.kill()
        holder.wait()


def test_read_only_archive_refuses_writes_before_any_work(tmp_path, tiny_model):
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        db.ingest(text="hello there", name="one")
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model, read_only=True) as db:
        assert [s.name for s in db.sessions()] == ["one"]
        assert [h.session_id for h in db.search("hello") if h.exact] == [db.session("one").session_id]
        with pytest.raises(ArchiveError, match="open read-only; open it without read_only=True"):
            db.ingest(text="more", name="two")
        with pytest.raises(ArchiveError, match="read-only"):
            db.delete("one")
        assert db.restore("one").position == db.session("one").n_tokens


def test_read_only_open_of_a_missing_archive_creates_nothing(tmp_path):
    with pytest.raises(ArchiveError, match="no archive at"):
        kvdb.open(tmp_path / "new.duckdb", read_only=True)
    assert list(tmp_path.iterdir()) == []


def test_read_only_search_rebuilds_a_missing_index(tmp_path, tiny_model):
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        db.ingest(text="the quick brown fox", name="fox")
    for f in (tmp_path / "a.duckdb.index").iterdir():
        f.unlink()
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model, read_only=True) as db:
        assert [h.position for h in db.search("brown") if h.exact] == [10]
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        assert db.verify(deep=True).ok


@pytest.mark.parametrize("model_work", ["ingest --keep lm", "upkeep"])
def test_readers_get_in_while_the_model_works(tmp_path, tiny_model, monkeypatch, model_work):
    """The model's pass runs without the file: an ingest that computes a tier at once, and the
    pass an ingest of the default tiers queued for upkeep."""
    monkeypatch.setattr(
        kvdb.services.write_compute, "SHORT_WORK_TOKENS", 0
    )  # these sessions are short; the real threshold is 128 tokens
    path = tmp_path / "a.duckdb"
    seen = []
    score = lm_ops.score

    def score_while_another_process_reads(*args, **kwargs):
        reader = subprocess.run([sys.executable, "-c", READER.format(path=str(path))], capture_output=True, text=True)
        seen.append((reader.returncode, reader.stdout.strip(), reader.stderr.strip()[-300:]))
        return score(*args, **kwargs)

    with kvdb.open(path, model=tiny_model) as db:
        db.ingest(text="first session", name="first", keep="tokens,search")
        monkeypatch.setattr(lm_ops, "score", score_while_another_process_reads)
        if model_work == "upkeep":
            db.upkeep(limit=1)  # the newest (only) session's pass
        else:
            db.ingest(text="second session", name="second", keep="tokens,search,lm")
    assert seen == [(0, "1", "")]


AT_ONCE = "tokens,search,lm"  # a tier only the model makes: the ingest runs it at once (the default tiers queue it)


def test_a_trie_changed_by_another_writer_meanwhile_is_taken_into_account(tmp_path, tiny_model, monkeypatch):
    """While this ingest's model runs, another writer splits the node it was going to extend:
    the ingest redoes its plan against the new trie, and every session stays whole."""
    monkeypatch.setattr(kvdb.services.write_compute, "SHORT_WORK_TOKENS", 0)
    path = tmp_path / "a.duckdb"
    prompt = "System: you are a careful assistant who answers briefly.\n"
    texts = {"base": prompt + "User: hi", "grown": prompt + "User: hi\nAssistant: hello", "other": prompt + "User: bye"}
    score = lm_ops.score
    interleaved, calls = [], []

    def score_while_another_writer_ingests(*args, **kwargs):
        calls.append(True)
        if not interleaved:
            interleaved.append(True)
            with kvdb.open(path, model=tiny_model) as other:
                other.ingest(text=texts["other"], name="other", keep=AT_ONCE)  # splits the node "grown" extends
        return score(*args, **kwargs)

    with kvdb.open(path, model=tiny_model) as db:
        db.ingest(text=texts["base"], name="base", keep=AT_ONCE)
        monkeypatch.setattr(lm_ops, "score", score_while_another_writer_ingests)
        [result] = db.ingest(text=texts["grown"], name="grown", keep=AT_ONCE)
        assert result.status == "ingested" and interleaved
        assert len(calls) == 3  # this ingest, the other writer's, and this one again against the new trie
        assert {s.name: db.text(s.session_id) for s in db.sessions()} == texts
        assert db.verify(deep=True).ok
        # the shared prefix, once, in the latest version of the conversation that holds it ("grown" grew "base")
        assert [h.session_id for h in db.search("careful") if h.exact] == [db.session("grown").session_id]
        assert db.stats().stored_tokens < sum(len(t.encode()) for t in texts.values())


def test_short_work_keeps_the_file_for_up_to_a_second(tmp_path, tiny_model, monkeypatch):
    """Reconnecting costs ~30 ms: within one ingest of the default tiers (no model's work: all of
    it short), the sessions of a fresh hold keep the file; once held long enough, each lets it go
    if another process waits for it, else commits and goes on."""
    sessions = [
        {"name": n, "messages": [{"role": "user", "content": c}]}
        for n, c in (("a", "hi"), ("b", "yo"), ("c", "long " * 40))
    ]
    path = write_jsonl(tmp_path / "three.jsonl", sessions)
    opened = []
    for hold, waiting in ((60.0, True), (0.0, False), (0.0, True)):
        monkeypatch.setattr(kvdb.storage.base, "HOLD_SECONDS", hold)  # the policy lives in storage (before_compute)
        with kvdb.open(tmp_path / f"{hold}-{waiting}.duckdb", model=tiny_model) as db:
            engine = storage_of(db).engine
            monkeypatch.setattr(engine, "wanted", lambda waiting=waiting: waiting)
            before = engine.connections
            assert [r.status for r in db.ingest(path)] == ["ingested"] * 3
            opened.append(engine.connections - before)
    assert (
        opened[0] == opened[1] == 0 and opened[2] >= 3
    )  # held through a, b and c; or let go (and taken again) for each
