"""The benchmarks' own tests. The benchmarks import each other by bare name (``import
kv_support``), so their folder is on the path for these tests; kvdb's tests (``tests/``)
import no benchmark (``tests/house/test_layers.py`` checks it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support import make_tiny_model

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: a benchmark's name never hides a package's


@pytest.fixture(scope="session")
def tiny_loaded(tmp_path_factory):
    """A tiny randomly initialised Llama, loaded once."""
    from kvdb.model import loading

    return loading.load(str(make_tiny_model(tmp_path_factory.mktemp("tiny-model"))))
