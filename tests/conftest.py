"""Shared fixtures: a tiny randomly initialised Llama (fast mechanics) and the embedded model (quality)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from support import CALIBRATION, examples, make_tiny_model

import kvdb

# properties without settings of their own: hypothesis' 100 examples scaled like the others, and no
# deadline (a loaded 2-core machine would fail a property on time, not on its claim)
settings.register_profile("kvdb", max_examples=examples(100), deadline=None)
settings.load_profile("kvdb")

# Under xdist each worker gets its share of the cores for torch's threads, and so do the processes
# its tests start (unless told otherwise), as kvdb.services.workers shares them: with the default
# (every core) in each of make test's 2 workers on 2 cores, the threads of one-token steps wait on
# each other: tier L's version-2 decodes took 4 to 6 times as long as with 1 thread a worker.
if _workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // _workers)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="session")
def other_tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("other-tiny-model"), seed=1))


# fixtures whose tests share one worker, so the fixture is made once, not once a worker: the
# embedded model (loaded, on a fresh machine converted) and test_shipped_codebooks' build (seconds)
SHARED_FIXTURES = {"embedded": "embedded", "built": "shipped-codebooks"}


def pytest_collection_modifyitems(config, items):
    """Under make test's ``-n 2 --dist loadgroup``, every test of the loaded embedded model runs on
    one worker: it is loaded (and on a fresh machine converted) once, not once per worker.

    xdist 3.8 sends a group to one worker by the suffix ``@group`` it gives the test's id, which
    it sets as ``item._nodeid``; pytest 9 builds the id from ``item._id``, so the suffix is set
    there (its string form) until xdist does: without it every group was split over the workers."""
    for item in items:
        for fixture, group in SHARED_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(group))
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        groups = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        if groups and "@" not in item.nodeid:
            object.__setattr__(item._id, "_str_cache", f"{item.nodeid}@{'_'.join(groups)}")


@pytest.fixture(autouse=True)
def isolated_env(tmp_path_factory, monkeypatch, tiny_model):
    """Never touch the user's archive; share one model cache across the run. The tiny model embeds
    the default semantic tier (mean pooling over its hidden states): the tier's mechanics at a
    fraction of all-MiniLM-L6-v2's cost; the tests of the real embedder name it."""
    monkeypatch.delenv("KVDB_DB", raising=False)
    monkeypatch.delenv("KVDB_MODEL", raising=False)
    monkeypatch.delenv("KVDB_DATA_PATH", raising=False)
    monkeypatch.setenv("KVDB_EMBEDDER", tiny_model)
    monkeypatch.setenv("KVDB_DB", str(tmp_path_factory.getbasetemp() / "must-not-be-used.duckdb"))


@pytest.fixture(scope="session")
def postgres():
    """The tests' own PostgreSQL, stopped and removed after the run however it ends."""
    from postgres import Cluster, PostgresMissing

    try:
        cluster = Cluster()
    except PostgresMissing as exc:
        pytest.skip(str(exc))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def lake(postgres, tmp_path):
    """A new, empty DuckLake location on the tests' PostgreSQL, and its data path."""
    return f"ducklake:postgres:{postgres.new_database()}", tmp_path / "lake-data"


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model):
    """The tiny model loaded once: an archive opened with a loaded model shares it (0.5 s a test otherwise)."""
    from kvdb.model import loading

    return loading.load(tiny_model)


@pytest.fixture
def archive(tmp_path, tiny_loaded):
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded) as db:
        yield db


@pytest.fixture(scope="session")
def kv_template(tmp_path_factory, tiny_loaded) -> Path:
    """An archive holding the calibration text and codebooks trained on it, built once: training
    costs a second or more a test, and a copy of the closed files is the same archive. They are
    of the preset ingest takes by default (balanced: the tiny model's is the unmeasured one), so
    ``keep=KV`` codes with them."""
    folder = tmp_path_factory.mktemp("kv-template")
    with kvdb.open(folder / "a.duckdb", model=tiny_loaded) as db:
        db.ingest(text=CALIBRATION, name="calibration")
        report = db.train_codebooks(preset="balanced", tokens=2000, niter=4)
    assert report.tokens == len(CALIBRATION.encode()) - 4 and report.bytes > 0
    return folder


@pytest.fixture
def kv_archive(tmp_path, tiny_loaded, kv_template):
    """A fresh copy of ``kv_template`` (the archive file and every file derived beside it), opened."""
    for made in kv_template.iterdir():
        (shutil.copytree if made.is_dir() else shutil.copy2)(made, tmp_path / made.name)
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded) as db:
        yield db


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2 (converted once into the user cache dir, then reused)."""
    from kvdb.model import loading as model

    return model.load()
