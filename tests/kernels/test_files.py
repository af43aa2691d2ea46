"""A file written whole or not at all."""

from __future__ import annotations

import os

import pytest

from kvdb import files


def test_a_file_is_replaced_whole_and_no_temporary_file_stays(tmp_path):
    path = tmp_path / "deep" / "table.json"
    files.replace_whole(path, b"first")
    files.replace_whole(path, b"second")
    assert path.read_bytes() == b"second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["table.json"]


def test_a_failed_replace_leaves_the_last_whole_version(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    files.replace_whole(path, b"whole")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        files.replace_whole(path, b"half")
    assert path.read_bytes() == b"whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]
