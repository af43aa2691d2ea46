"""`kvdb ingest --workers N` on a file archive: the workers take turns with the file's lock and
archive what one process would; a worker's typed error reaches the user as one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvdb

pytestmark = pytest.mark.slow  # worker processes

ROOT = Path(__file__).resolve().parents[2]


def _kvdb(*args, env):
    return subprocess.run(
        [sys.executable, "-c", "from kvdb.cli.main import main; main()", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )


def test_two_workers_on_a_file_archive_what_one_process_does(tmp_path, tiny_model):
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(6):
        (folder / f"n{i}.md").write_text(
            "# Shared notes header\n\n" + " ".join(f"note{(i * 5 + j) % 30}" for j in range(50))
        )
    (folder / "broken.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{not json\n')
    env = dict(os.environ, KVDB_MODEL=tiny_model)
    many = _kvdb("--db", str(tmp_path / "many.duckdb"), "ingest", "--workers", "2", str(folder), "--json", env=env)
    one = _kvdb("--db", str(tmp_path / "one.duckdb"), "ingest", str(folder), "--json", env=env)
    assert many.returncode == one.returncode == 1  # the broken file fails alone, in both
    by_source = lambda out: sorted(  # noqa: E731
        (r["source"], r["status"], r.get("session_id")) for r in map(json.loads, out.stdout.splitlines())
    )
    assert by_source(many) == by_source(one)
    with (
        kvdb.open(tmp_path / "many.duckdb", model=tiny_model) as a,
        kvdb.open(tmp_path / "one.duckdb", model=tiny_model) as b,
    ):
        assert a.stats().to_dict()["stored_tokens"] == b.stats().to_dict()["stored_tokens"]
        assert a.verify(deep=True).ok


def test_a_workers_error_is_one_line_with_its_exit_code(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text("some text")
    (folder / "b.txt").write_text("more text")
    out = _kvdb(
        "--db",
        str(tmp_path / "a.duckdb"),
        "ingest",
        "--workers",
        "2",
        "--model",
        str(tmp_path / "no-such-model"),
        str(folder),
        env=dict(os.environ),
    )
    assert out.returncode == 4 and out.stderr.count("\n") == 1 and "no-such-model" in out.stderr


def test_workers_take_files_only(tmp_path):
    """Workers are a facade option of ``Archive.ingest`` (the CLI's --workers calls it): they share files out,
    so a text is refused."""
    import pytest

    import kvdb
    from kvdb.errors import InvalidArgument

    with kvdb.open(tmp_path / "a.duckdb") as archive, pytest.raises(InvalidArgument, match="workers= ingests files"):
        archive.ingest(text="one session", workers=2)
