"""`make demo` sets up only what the demo runs (the venv, the model wheels): a newcomer running it
as root had Chromium and PostgreSQL apt-installed, 115 packages, which only the tests need."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from support import REPO


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_installs_no_system_package():
    planned = subprocess.run(
        ["make", "-n", "-B", "demo", "MISSING=chromium postgresql"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert planned.returncode == 0, planned.stderr
    assert "pip install" in planned.stdout and "apt-get" not in planned.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_installs_what_the_tests_need():
    planned = subprocess.run(
        ["make", "-n", "-B", "test", "MISSING=chromium postgresql"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert planned.returncode == 0, planned.stderr
    assert "apt-get" in planned.stdout and "chromium postgresql" in planned.stdout
