"""Sealed files (kvdb/sealing.py): what is written beside an encrypted archive reads back byte for
byte, at every length around a chunk's; a file cut short or changed anywhere is CorruptData; a
wrong or missing key is ArchiveKeyError; and only the files beside the registered archive are sealed."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvdb import sealing
from kvdb.errors import ArchiveKeyError, CorruptData
from kvdb.index import sidecar

C = sealing.CHUNK


@pytest.fixture
def archive(tmp_path):
    path = tmp_path / "a.duckdb"
    sealing.register(path, sealing.open_seal(path, b"the key", create=True))
    yield path
    sealing.register(path, None)


@pytest.mark.parametrize("n", [0, 1, C - 1, C, C + 1, 2 * C, 3 * C + 5])
def test_a_sealed_file_reads_back_and_any_damage_is_corrupt(archive, n):
    data = os.urandom(n)
    path = archive.with_name(archive.name + ".index") / "x"
    path.parent.mkdir()
    with sealing.writing(path, sync=True) as f:
        f.write(data[:7])
        f.write(data[7:])
    raw = path.read_bytes()
    assert raw.startswith(sealing.MAGIC) and (n < 16 or data[:16] not in raw)
    with sealing.reading(path) as f:
        assert f.read() == data
        f.seek(max(0, n - 3))
        assert f.read(2) == data[max(0, n - 3) : max(0, n - 3) + 2]
        assert bytes(sealing.contents(f)) == data
    damaged = [raw[:-1] + bytes([raw[-1] ^ 1])] + ([raw[: len(sealing.MAGIC) + 8 + C + 16]] if n > C else [])
    for bad in damaged:  # a flipped bit; a file cut at a chunk boundary
        path.write_bytes(bad)
        with pytest.raises(CorruptData), sealing.reading(path) as f:
            f.read()


def test_a_sidecar_beside_an_encrypted_archive_is_sealed_and_reads_back(archive):
    path = archive.with_name(archive.name + ".index") / "s.keys"
    arrays = {
        "ids": np.arange(1000, dtype="<u2"),
        "empty": np.zeros(0, "<i8"),
        "words": np.array([b"quillwort"], "|S16"),
    }
    sidecar.write(path, b"KVDBTEST", {"kind": "test"}, arrays)
    assert b"quillwort" not in path.read_bytes() and np.arange(8, dtype="<u2").tobytes() not in path.read_bytes()
    read = sidecar.read(path, b"KVDBTEST")
    assert read.header["kind"] == "test" and all(np.array_equal(read.arrays[k], v) for k, v in arrays.items())
    assert sidecar.header(path, (b"KVDBTEST",))[1]["kind"] == "test"
    plain = archive.with_name("b.duckdb.index") / "s.keys"  # another archive's: not sealed
    sidecar.write(plain, b"KVDBTEST", {"kind": "test"}, arrays)
    assert b"quillwort" in plain.read_bytes()
    path.write_bytes(plain.read_bytes())  # a plain file where a sealed one belongs: derived data to build again
    with pytest.raises(CorruptData):
        sidecar.read(path, b"KVDBTEST")


def test_a_wrong_or_missing_key_and_a_key_for_a_plain_archive(tmp_path, archive):
    with pytest.raises(ArchiveKeyError, match="wrong key"):
        sealing.open_seal(archive, b"another key", create=False)
    with pytest.raises(ArchiveKeyError, match="is encrypted"):
        sealing.open_seal(archive, None, create=False)
    plain = tmp_path / "plain.duckdb"
    plain.write_bytes(b"")
    with pytest.raises(ArchiveKeyError, match="not encrypted"):
        sealing.open_seal(plain, b"the key", create=False)
    assert sealing.open_seal(plain, None, create=False) is None
    assert (
        sealing.open_seal(archive, b"the key", create=True).database_key
        == sealing.open_seal(archive, b"the key", create=False).database_key
    )  # type: ignore[union-attr]
