"""The install is quiet: building kvdb's wheel prints no warning the project causes, and the
wheel carries the data files the library reads (calibration text, measured tier K fidelity, the page)
and both compiled parts."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
from support import REPO


@pytest.mark.slow
def test_the_wheel_builds_without_warnings_and_carries_its_data(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]
    [wheel] = tmp_path.glob("kvdb-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "kvdb/data/calibration.txt",
        "kvdb/data/kv_fidelity.json",
        "kvdb/server/static/index.html",
        "kvdb/migrations/script.py.mako",
    } <= names
    assert any(n.startswith("kvdb/model/_integer_kernel") for n in names) and any(
        n.startswith("kvdb/codecs/_rans") for n in names
    )
