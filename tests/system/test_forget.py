"""Forget (issue 55, item 3): after `kvdb delete` (of a session, of a conversation, of everything
from one source file) and `kvdb gc`, no byte of the deleted text or of its token ids is left in any
file the archive wrote, on either backend; and a tombstone keeps `kvdb watch` from archiving a
forgotten log again, unless asked to.

The scan reads every byte of every file: for a DuckDB file, the database file (its free pages
included), its write-ahead log and every file beside it (the phrase and chunk sidecars, the exact
caches, the serve journal); for a lake, every file under its data path (each Parquet file as
stored, and its rows decoded, since Parquet pages are compressed) and the local folder of its
derived files. It looks for each planted phrase as UTF-8, for a rare word of it, for its token ids
as little-endian uint16, int32 and int64 runs of 8, and for the stored blobs of the nodes only the
deleted sessions held (token blocks, tier L payloads, log-probabilities, chunk vectors), which
DuckDB keeps byte for byte in the pages it frees. A positive control runs the same scan before the
delete: it must find what it later must not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pytest
from support import storage_of

import kvdb
from kvdb.storage import duckdb_file

pytestmark = pytest.mark.slow  # subprocesses, PostgreSQL, and the model's pass over each archive

KVDB = str(Path(sys.executable).with_name("kvdb"))
KEEP = "tokens,search,lm,semantic"
FILLER = "The keeper watched the harbour lights, and the ships answered them at dusk. " * 6
# one phrase per way of deleting: unique words, so their bytes and token ids are unique
PHRASES = {
    "session": "Quokka vellum jackdaw 7731 plumbago wyvern oxbow fjord",
    "conversation": "Marzipan zeugma 4409 kestrel obsidian quince hawthorn",
    "source": "Tamarind gnomon 5813 xebec lapwing cormorant vetch",
}
WORDS = {"session": "plumbago", "conversation": "zeugma", "source": "gnomon"}
NODE_TABLES = (
    "nodes",
    "token_streams",
    "token_blocks",
    "node_lm",
    "node_logprobs",
    "node_kv",
    "node_chunks",
    "search_ranges",
)
BLOBS = {"token_blocks": "data", "node_lm": "payload", "node_logprobs": "logprobs", "node_chunks": "vector"}


def _log(path: Path, turns: list[str]) -> Path:
    roles = ["user", "assistant"]
    path.write_text(
        "".join(json.dumps({"role": roles[i % 2], "content": t}) + "\n" for i, t in enumerate(turns)), encoding="utf-8"
    )
    return path


def _plant(archive, logs: Path) -> dict:
    """Sessions that stay, and one to delete each way; returns what the deletes need."""
    archive.ingest(text=FILLER + "The basil in the garden grew tall.", name="stays", keep=KEEP)
    archive.ingest(
        text=FILLER + f"Secret: {PHRASES['session']}. Nothing more. {PHRASES['session']}", name="victim", keep=KEEP
    )
    grown = _log(logs / "chat.jsonl", ["Where did the fog come from?", f"It said {PHRASES['conversation']} twice."])
    [first] = archive.ingest(grown, keep=KEEP)
    _log(
        grown,
        [
            "Where did the fog come from?",
            f"It said {PHRASES['conversation']} twice.",
            "And then?",
            f"Then {PHRASES['conversation']} again.",
        ],
    )
    [second] = archive.ingest(grown, keep=KEEP)
    assert second.session_id != first.session_id  # a second version of the same conversation
    source = _log(
        logs / "other.jsonl", ["Name the birds.", f"{PHRASES['source']}, and the {PHRASES['source']} once more."]
    )
    archive.ingest(source, keep=KEEP)
    archive.ingest(text=FILLER + "A second keeper came.", name="stays-too", keep=KEEP)
    archive.upkeep()  # the semantic tier and the model's pass: chunk sidecar, tier L, log-probabilities
    for phrase in PHRASES.values():  # the phrase and chunk sidecars hold them now
        assert archive.search(phrase[:24])
        assert archive.search_meaning(phrase)
    return {"conversation": archive.session(second.session_id).conversation_id, "source": source}


def _ids(archive, name_or_id: str, phrase: str) -> np.ndarray:
    """The phrase's token ids as the session holds them."""
    tokens = np.asarray(archive.tokens(name_or_id))
    text = archive.text(name_or_id)
    at = text.index(phrase)
    # byte-level tokenizer: a token per byte (the tests' tiny model)
    start = len(text[:at].encode())
    ids = tokens[start + 1 : start + len(phrase.encode()) - 1]
    assert len(ids) > 12
    return ids


def _only_theirs(conn, session_ids: list[str]) -> set[str]:
    """Nodes on the deleted sessions' paths and on no other session's."""
    from kvdb.storage import sql_rows

    theirs = {n.node_id for s in session_ids for n in sql_rows.path_rows(conn, s)}
    others = [r[0] for r in conn.execute("select session_id from sessions").fetchall() if r[0] not in session_ids]
    return theirs - {n.node_id for s in others for n in sql_rows.path_rows(conn, s)}


def _patterns(
    archive, storage, kinds=("session", "conversation", "source"), ways=None
) -> tuple[dict[str, bytes], set[str], list[str]]:
    """What must be gone: byte patterns by label, the nodes only the deleted sessions held, and their session ids."""
    conn = storage.engine.connection()
    pats: dict[str, bytes] = {}
    sessions = []
    for kind in kinds:
        phrase = PHRASES[kind]
        ids = [s.session_id for s in archive.sessions() if phrase in archive.text(s.session_id)]
        assert ids, kind
        sessions += ids
        pats[f"{kind}: text"] = phrase.encode()
        pats[f"{kind}: word"] = WORDS[kind].encode()
        token_ids = _ids(archive, ids[-1], phrase)
        for dtype in ("<u2", "<i4", "<i8"):
            pats[f"{kind}: ids {dtype}"] = token_ids[:8].astype(dtype).tobytes()
            pats[f"{kind}: ids {dtype} later"] = token_ids[-8:].astype(dtype).tobytes()
    nodes = _only_theirs(conn, sessions)
    assert nodes
    for table, column in BLOBS.items():
        for i, (blob,) in enumerate(
            conn.execute(
                f"select {column} from {table} where node_id in (select unnest(?))", [sorted(nodes)]
            ).fetchall()
        ):
            if blob is not None and len(blob) >= 24 and len(set(bytes(blob))) > 4:
                pats[f"{table} blob {i}"] = bytes(blob)
    return pats, nodes, sessions


def _parquet_rows(path: Path) -> bytes:
    """A Parquet file's rows, decoded: every value's bytes (its pages are compressed as stored)."""
    con = duckdb.connect()
    try:
        rows = con.execute(f"select * from read_parquet('{path}')").fetchall()
    finally:
        con.close()
    out = bytearray()
    for row in rows:
        for value in row:
            if isinstance(value, bytes | bytearray | memoryview):
                out += bytes(value)
            elif value is not None:
                out += str(value).encode()
            out += b"\0"
    return bytes(out)


def _scan(folders: list[Path], pats: dict[str, bytes]) -> dict[str, list[str]]:
    """Label -> the files holding it, over every file under ``folders``."""
    found: dict[str, list[str]] = {}
    files = sorted({p for folder in folders if folder.exists() for p in folder.rglob("*") if p.is_file()})
    assert files
    for path in files:
        contents = [path.read_bytes()]
        if path.suffix == ".parquet":
            contents.append(_parquet_rows(path))
        for label, pattern in pats.items():
            if any(pattern in data for data in contents):
                found.setdefault(label, []).append(path.name)
    return found


def _forget(archive, planted: dict) -> None:
    archive.delete("victim")
    archive.delete_conversation(planted["conversation"])
    gone = archive.delete_source(planted["source"])
    assert gone.sessions == 1


def _rows_left(storage, nodes: set[str], sessions: list[str]) -> dict[str, int]:
    conn = storage.engine.connection()
    left = {
        t: conn.execute(f"select count(*) from {t} where node_id in (select unnest(?))", [sorted(nodes)]).fetchone()[0]
        for t in NODE_TABLES
    }
    for table in ("sessions", "conversation_sessions"):
        left[table] = conn.execute(
            f"select count(*) from {table} where session_id in (select unnest(?))", [sessions]
        ).fetchone()[0]
    return {t: n for t, n in left.items() if n}


def test_delete_and_gc_leave_no_byte_of_a_file_archive(tmp_path, tiny_loaded, tiny_model, monkeypatch):
    # an archive this small is rewritten by any gc (its free space is over a quarter of it); a
    # large one is not, and a forget must not depend on that
    monkeypatch.setattr(duckdb_file, "COMPACT_MIN_BYTES", 1 << 40)
    folder = tmp_path / "archive"
    logs = tmp_path / "logs"
    logs.mkdir()
    with kvdb.open(folder / "a.duckdb", model=tiny_loaded, embedder=tiny_model) as archive:
        planted = _plant(archive, logs)
        storage = storage_of(archive)
        pats, nodes, sessions = _patterns(archive, storage)
        storage.engine.connection().execute("checkpoint")
        before = _scan([folder], pats)
        for kind in PHRASES:  # the control: the scan finds what is there
            assert f"{kind}: word" in before and f"{kind}: ids <u2" in before, (kind, before)
        assert any(label.startswith("token_blocks blob") for label in before)
        _forget(archive, planted)
        report = archive.gc()
        assert report.forgotten == 4 and report.nodes >= len(nodes)
        assert not _rows_left(storage, nodes, sessions)
    assert _scan([folder], pats) == {}  # before anything reads the archive again (a read catches sidecars up)
    with kvdb.open(folder / "a.duckdb", model=tiny_loaded, embedder=tiny_model) as archive:
        assert [s.name for s in archive.sessions()] == ["stays", "stays-too"]
        assert not archive.search(PHRASES["session"][:24]) and archive.search("basil in the garden")
        assert archive.search_meaning("basil in the garden")
        assert archive.verify(deep=True).ok
        again = archive.gc()  # nothing deleted since: no rewrite, no renumbering
        assert again.forgotten == 0 and again.file_bytes_before is None and again.renumbered_indexes == ()


def test_delete_and_gc_leave_no_byte_of_a_lake(tmp_path, lake, tiny_model):
    where, data_path = lake
    logs = tmp_path / "logs"
    logs.mkdir()
    with kvdb.open(where, model=tiny_model, data_path=data_path, embedder=tiny_model) as archive:
        planted = _plant(archive, logs)
        storage = storage_of(archive)
        derived = storage.derived_path("").parent
        pats, nodes, sessions = _patterns(archive, storage)
        before = _scan([Path(data_path), derived], pats)
        for kind in PHRASES:
            assert f"{kind}: word" in before and f"{kind}: ids <u2" in before, (kind, before)
        assert any(label.startswith("token_blocks blob") for label in before)
        _forget(archive, planted)
        report = archive.gc()
        assert report.forgotten == 4
        assert report.data_files_kept  # the replaced files stay for readers: gc says so
        now = archive.gc(now=True)  # the marks stayed: this gc erases again, and deletes the replaced files at once
        assert now.data_files_kept == 0 and now.forgotten == 4
        assert archive.gc().forgotten == 0
        assert not _rows_left(storage, nodes, sessions)
        assert archive.verify(deep=True).ok
        assert _scan([Path(data_path), derived], pats) == {}


def test_a_forgotten_log_is_not_archived_again_by_watch_unless_asked(tmp_path, tiny_loaded, tiny_model):
    env = {**os.environ, "KVDB_MODEL": tiny_model}
    logs = tmp_path / "logs"
    logs.mkdir()
    log = _log(logs / "session.jsonl", ["Which test fails?", f"{PHRASES['source']} fails."])
    kept = _log(logs / "kept.jsonl", ["Hello.", "Hello to you."])
    db = tmp_path / "a.duckdb"
    with kvdb.open(db, model=tiny_loaded) as archive:
        assert sorted(r.status.value for r in archive.watch([logs])) == ["ingested", "ingested"]
        gone = archive.delete_source(log)
        assert gone.sessions == 1
        archive.gc()
        with open(log, "a", encoding="utf-8") as f:  # the agent goes on writing the forgotten log
            f.write(json.dumps({"role": "user", "content": "And now?"}) + "\n")
        with open(kept, "a", encoding="utf-8") as f:
            f.write(json.dumps({"role": "user", "content": "Still here?"}) + "\n")
        [grown] = archive.watch([logs])
        assert grown.source.startswith(str(kept))
        assert not any(PHRASES["source"] in archive.text(s.session_id) for s in archive.sessions())
        assert {f.path: f.status for f in archive.watched()}[str(log.resolve())] == "forgotten"
    # `kvdb delete --source` tombstones a log as well; `watch --readmit-forgotten` archives both again
    out = subprocess.run(
        [KVDB, "--db", str(db), "watch", "--status"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "forgotten" in out
    subprocess.run(
        [KVDB, "--db", str(db), "delete", "--source", str(kept)], env=env, capture_output=True, text=True, check=True
    )
    again = subprocess.run(
        [KVDB, "--db", str(db), "watch", "--once", str(logs)], env=env, capture_output=True, text=True, check=True
    )
    assert "ingested" not in again.stdout + again.stderr
    asked = subprocess.run(
        [KVDB, "--db", str(db), "watch", "--once", "--readmit-forgotten", str(logs)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert (asked.stdout + asked.stderr).count("ingested") == 2
    with kvdb.open(db, model=tiny_loaded) as archive:
        assert any(PHRASES["source"] in archive.text(s.session_id) for s in archive.sessions())
        assert {f.status for f in archive.watched()} == {"ingested"}


def test_delete_source_finds_a_file_by_any_spelling_of_its_path_and_no_other(tmp_path, tiny_loaded, monkeypatch):
    """A source is recorded as its path was given; a delete names the file in any spelling
    (relative, absolute, through a link), found by one query, not by listing every session.
    Another file of the folder, and text given directly, stay."""
    logs = tmp_path / "logs"
    logs.mkdir()
    log = _log(logs / "a.jsonl", ["Which test fails?", "The parser test fails."])
    other = _log(logs / "b.jsonl", ["Which test fails?", "None of them."])
    (tmp_path / "link").symlink_to(logs)
    monkeypatch.chdir(tmp_path)
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded) as archive:
        archive.ingest(["logs/a.jsonl", other])  # relative, as a user in tmp_path types it
        archive.ingest(text="Which test fails? Given directly.", name="typed")
        listed = archive.sessions
        monkeypatch.setattr(
            type(storage_of(archive)), "list_sessions", lambda self: pytest.fail("a delete listed every session")
        )
        gone = archive.delete_source(tmp_path / "link" / "a.jsonl")  # absolute, through the link
        monkeypatch.undo()
        assert gone.sessions == 1
        assert sorted(s.name for s in listed()) == ["b", "typed"]
        assert not any("parser test" in archive.text(s.session_id) for s in listed())
        with pytest.raises(kvdb.errors.InvalidArgument, match="no session was archived from"):
            archive.delete_source(log)  # gone already, in its absolute spelling
