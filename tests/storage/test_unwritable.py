"""An archive this process cannot write: one clear line at open, before any model loads, and
`kvdb serve` does not start; commands that only read still read it."""

import contextlib
import os
import subprocess

import pytest
from click.testing import CliRunner
from support import write_jsonl

import kvdb
from kvdb.cli.main import main
from kvdb.errors import ArchiveReadOnly


@contextlib.contextmanager
def unwritable(path):
    """``path`` made unwritable for this process. Root writes through mode bits, so as root the
    path is made immutable instead (chattr +i: refused to root as EPERM, the error a newcomer
    met); where the filesystem or the container refuses that, there is no honest way to test."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(
            f"running as root, and chattr +i is refused here ({made.stderr.strip()}): "
            "nothing makes a path unwritable to root"
        )
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.fixture
def archived(tmp_path, tiny_model):
    folder = tmp_path / "shared"
    folder.mkdir()
    path = folder / "a.duckdb"
    with kvdb.open(path, model=tiny_model) as archive:
        archive.ingest(write_jsonl(tmp_path / "chat.jsonl", [{"role": "user", "content": "the harbour master"}]))
    return path


@pytest.mark.parametrize("what", ["folder", "file"])
def test_an_unwritable_archive_is_refused_at_open_and_still_read(archived, what, tiny_model):
    with unwritable(archived.parent if what == "folder" else archived):
        with pytest.raises(ArchiveReadOnly, match="still work") as raised:
            kvdb.open(archived)
        assert raised.value.exit_code == 5 and "\n" not in str(raised.value)
        with kvdb.open(archived, model=tiny_model, read_only=True) as archive:
            [session] = archive.sessions()
            assert "the harbour master" in archive.text(session.session_id)


def test_ingest_and_serve_refuse_it_in_one_line_before_the_model_loads(archived, tmp_path, monkeypatch):
    import kvdb.serving
    from kvdb.services.models import ModelProvider

    def loaded(*_, **__):
        raise AssertionError("the model was loaded before the archive was refused")

    monkeypatch.setattr(ModelProvider, "get", loaded)
    monkeypatch.setattr(kvdb.serving, "Engine", loaded)
    more = write_jsonl(tmp_path / "more.jsonl", [{"role": "user", "content": "something new"}])
    with unwritable(archived.parent):
        for args in (["ingest", str(more)], ["serve", "--port", "1"]):
            result = CliRunner().invoke(main, ["--db", str(archived), *args])
            assert result.exit_code == 5, result.output
            assert result.stderr.count("\n") == 1 and result.stderr.startswith(
                f"kvdb: error: archive {archived} is in a folder this process cannot write to"
            )
