"""An encrypted archive (issue 55, item 2): with a key, every file kvdb writes beside the archive
is ciphertext. A planted phrase is ingested (the default tiers and the semantic tier), searched
back, restored, its conversation grown (the prefix cache) and journalled (the serve journal);
then every byte of every file under the archive's folder is scanned for its text, a rare word of
it, and its token ids as little-endian uint16, int32 and int64 runs of 8 (the phrase index holds
ids). The same scan over a plain archive made alike is the control: it must find them (the
text in the journal, a word in the chunk index, the ids in the phrase index; the database
compresses its columns).

A wrong key, a missing one, and a key given to a plain archive are each one line and no read.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pytest

import kvdb
from kvdb.errors import ArchiveKeyError
from kvdb.services.journal import Journal

pytestmark = pytest.mark.slow  # the model's pass over each archive, and subprocesses

KVDB = str(Path(sys.executable).with_name("kvdb"))
KEY = "correct horse battery staple"
KEEP = "tokens,search,lm,semantic"
FILLER = "The keeper watched the harbour lights, and the ships answered them at dusk. " * 6
PHRASE = "Pangolin vermilion 6021 quillwort zephyr bittern"
WORD = b"quillwort"


def _build(db: Path, tiny_loaded, tiny_model, key: str | None) -> None:
    with kvdb.open(db, model=tiny_loaded, embedder=tiny_model, key=key if key is not None else b"") as archive:
        archive.ingest(text=FILLER + "The basil in the garden grew tall.", name="stays", keep=KEEP)
        first = archive.ingest(
            messages=[
                {"role": "user", "content": "What was said?"},
                {"role": "assistant", "content": f"It said {PHRASE}."},
            ],
            name="secret",
            keep=KEEP,
        )
        # the conversation grows: its cache is kept in the prefix cache (an exact cache of its tokens)
        archive.ingest(
            messages=[
                {"role": "user", "content": "What was said?"},
                {"role": "assistant", "content": f"It said {PHRASE}."},
                {"role": "user", "content": "Again?"},
                {"role": "assistant", "content": f"{PHRASE} again."},
            ],
            name="secret",
            keep=KEEP,
        )
        archive.upkeep()  # the semantic tier's chunk sidecar, the model's pass
        assert archive.search(PHRASE[:24])
        assert archive.search_meaning(PHRASE)
        assert PHRASE in archive.text(first[0].session_id)
        assert archive.restore(first[0].session_id).mode == "exact"
        Journal(archive.local_path(".serve")).write(
            {"kind": "text", "content": f"Journalled: {PHRASE}", "name": "pending"}
        )


def _needles(db: Path, tiny_loaded, key: str | None) -> dict[str, bytes]:
    with kvdb.open(db, model=tiny_loaded, read_only=True, key=key if key is not None else b"") as archive:
        session = next(s for s in archive.sessions() if PHRASE in archive.text(s.session_id))
        text = archive.text(session.session_id)
        tokens = np.asarray(archive.tokens(session.session_id))
    start = len(text[: text.index(PHRASE)].encode())  # a token per byte: the tiny model's tokenizer
    ids = tokens[start + 1 : start + len(PHRASE.encode()) - 1]
    needles = {"text": PHRASE.encode(), "word": WORD}
    for dtype in ("<u2", "<i4", "<i8"):
        needles[f"ids {dtype}"] = ids[:8].astype(dtype).tobytes()
        needles[f"ids {dtype} later"] = ids[-8:].astype(dtype).tobytes()
    return needles


def _scan(folder: Path, needles: dict[str, bytes]) -> tuple[dict[str, list[str]], list[str]]:
    """Label -> the files holding it, over every byte of every file under ``folder``; and the files."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    found: dict[str, list[str]] = {}
    for path in files:
        data = path.read_bytes()
        for label, needle in needles.items():
            if needle in data:
                found.setdefault(label, []).append(str(path.relative_to(folder)))
    return found, [str(p.relative_to(folder)) for p in files]


def test_an_encrypted_archive_leaves_no_byte_of_a_phrase_on_disk(tmp_path, tiny_loaded, tiny_model):
    plain, sealed = tmp_path / "plain" / "a.duckdb", tmp_path / "sealed" / "a.duckdb"
    _build(plain, tiny_loaded, tiny_model, None)
    _build(sealed, tiny_loaded, tiny_model, KEY)
    needles = _needles(plain, tiny_loaded, None)
    assert needles == _needles(sealed, tiny_loaded, KEY)
    control, plain_files = _scan(plain.parent, needles)
    # the control: the scan finds the text (the journal), a word (the chunk index) and the ids (the phrase index)
    assert {"text", "word", "ids <u2"} <= set(control), control
    # every kind of file beside the archive was written
    # (.sinks/ is a prefix cache as .prefix/ is, kept by tier K's restores)
    for folder in (".index", ".prefix", ".serve"):
        assert any(name.startswith(f"a.duckdb{folder}/") for name in plain_files), (folder, plain_files)
    found, files = _scan(sealed.parent, needles)
    assert found == {}, found
    assert {name.split("/")[0] for name in files} >= {
        "a.duckdb",
        "a.duckdb.seal",
        "a.duckdb.index",
        "a.duckdb.prefix",
        "a.duckdb.serve",
    }
    with kvdb.open(sealed, model=tiny_loaded, embedder=tiny_model, key=KEY) as archive:  # and it all reads back
        assert archive.search(PHRASE[:24]) and archive.search_meaning(PHRASE)
        assert archive.verify(deep=True).ok
        [entry] = Journal(archive.local_path(".serve")).pending()
        assert PHRASE in Journal.read(entry)["content"]
        archive.delete("stays")
        assert archive.gc().forgotten == 1  # the file rewritten without the deleted rows: encrypted as well
    with pytest.raises(duckdb.Error, match="without a key"):
        duckdb.connect(str(sealed), read_only=True)
    assert _scan(sealed.parent, needles)[0] == {}
    with kvdb.open(sealed, model=tiny_loaded, key=KEY, read_only=True) as archive:
        assert [s.name for s in archive.sessions()] == ["secret", "secret"]
        assert archive.sql("select count(*) from sessions").rows == [(2,)]  # SQL over an encrypted archive's views


def test_a_wrong_or_missing_key_is_one_line_and_reads_nothing(tmp_path, tiny_loaded, monkeypatch):
    monkeypatch.delenv("KVDB_KEY", raising=False)
    sealed, plain = tmp_path / "sealed.duckdb", tmp_path / "plain.duckdb"
    with kvdb.open(sealed, model=tiny_loaded, key=KEY) as archive:
        archive.ingest(text=f"Secret: {PHRASE}", name="secret", keep="tokens,search")
    with kvdb.open(plain, model=tiny_loaded) as archive:
        archive.ingest(text="Nothing secret.", name="open", keep="tokens,search")
    for db, key, says in [
        (sealed, "a wrong key", "wrong key"),
        (sealed, None, "is encrypted"),
        (plain, KEY, "is not encrypted"),
    ]:
        for read_only in (False, True):
            with pytest.raises(ArchiveKeyError, match=says):
                kvdb.open(db, model=tiny_loaded, read_only=read_only, key=key)
    (tmp_path / "sealed.duckdb.seal").rename(tmp_path / "elsewhere.seal")
    with pytest.raises(ArchiveKeyError, match="sealed.duckdb.seal beside it is missing"):
        kvdb.open(sealed, model=tiny_loaded, read_only=True)
    (tmp_path / "elsewhere.seal").rename(tmp_path / "sealed.duckdb.seal")
    # the CLI: one line, exit code 7; the key from $KVDB_KEY or --key-file
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    runs = {
        "missing": [KVDB, "--db", str(sealed), "sessions"],
        "wrong": [KVDB, "--db", str(sealed), "sessions"],
        "plain": [KVDB, "--key-file", str(key_file), "--db", str(plain), "sessions"],
        "file": [KVDB, "--key-file", str(key_file), "--db", str(sealed), "sessions"],
        "env": [KVDB, "--db", str(sealed), "sessions"],
    }
    keys = {"wrong": "not it", "env": KEY}
    out = {
        name: subprocess.run(
            cmd, env=env | ({"KVDB_KEY": keys[name]} if name in keys else {}), capture_output=True, text=True
        )
        for name, cmd in runs.items()
    }
    for name in ("missing", "wrong", "plain"):
        assert out[name].returncode == 7, out[name]
        assert out[name].stdout == "" and len(out[name].stderr.strip().splitlines()) == 1, out[name]
    assert (
        "is encrypted" in out["missing"].stderr
        and "wrong key" in out["wrong"].stderr
        and "not encrypted" in out["plain"].stderr
    )
    for name in ("file", "env"):
        assert out[name].returncode == 0 and "secret" in out[name].stdout, out[name]


def test_copy_encrypt_makes_an_encrypted_copy_of_a_plain_archive(tmp_path, tiny_loaded, tiny_model):
    plain, copy = tmp_path / "plain" / "a.duckdb", tmp_path / "copy" / "a.duckdb"
    with kvdb.open(plain, model=tiny_loaded) as archive:
        archive.ingest(text=FILLER + f"Secret: {PHRASE}", name="secret", keep="tokens,search")
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KVDB_MODEL": tiny_model}
    refused = subprocess.run(
        [KVDB, "copy", "--encrypt", str(plain), str(copy)], env=env, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "needs the key" in refused.stderr
    done = subprocess.run(
        [KVDB, "--key-file", str(key_file), "copy", "--encrypt", str(plain), str(copy)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    with pytest.raises(ArchiveKeyError):
        kvdb.open(copy, model=tiny_loaded, read_only=True, key=b"")
    with kvdb.open(copy, model=tiny_loaded, key=KEY) as archive:
        assert [s.name for s in archive.sessions()] == ["secret"]
        assert archive.search(PHRASE[:24])  # the phrase index, built in the copy, sealed
        assert archive.verify(deep=True).ok
    found, files = _scan(copy.parent, {"text": PHRASE.encode(), "word": WORD})
    assert found == {} and any(name.startswith("a.duckdb.index/") for name in files), (found, files)


def test_a_key_on_a_lake_is_refused_before_anything_is_reached():
    with pytest.raises(ArchiveKeyError, match="DuckLake archive cannot be encrypted"):
        kvdb.open("ducklake:postgres:dbname=nowhere host=/nonexistent", key=KEY)
