"""The README's Python block runs as written, from a folder holding the repository's examples/,
with no deprecated call (FutureWarning) along the way."""

import re
import warnings

import pytest
from support import REPO

pytestmark = pytest.mark.slow  # the README's Python block, end to end


def python_block() -> str:
    readme = (REPO / "docs" / "python.md").read_text(encoding="utf-8")
    section = readme[readme.index("# Python API") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_python_api_block_runs_as_written(tmp_path, monkeypatch, tiny_model):
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "transcripts").symlink_to(REPO / "examples" / "transcripts")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(
        "KVDB_MODEL", tiny_model
    )  # the block's model=None reads it; the embedded model would take minutes to train on
    monkeypatch.setenv(
        "KVDB_EMBEDDER", tiny_model
    )  # the tiny model embeds too (mean pooling): the mechanics, in seconds
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        exec(compile(python_block(), "docs/python.md", "exec"), {"__name__": "readme"})  # the README's own code
    assert (tmp_path / "my.duckdb").exists()
