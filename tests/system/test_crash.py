"""SIGKILL during ingest, at random moments: the archive opens, verifies, and holds every
session that was reported ingested; on a file and on a lake."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

import kvdb

pytestmark = pytest.mark.slow  # processes killed mid-write

WRITER = """
import sys, kvdb
db = kvdb.open(sys.argv[1], model=sys.argv[2], data_path=sys.argv[3])
for i in range(10_000):
    [r] = db.ingest(text=f"Session {i}: the harbour lights were lit at dusk, ship {i * 7} came home.", name=f"s{i}")
    print(r.session_id, flush=True)
"""


@pytest.fixture(params=["duckdb-file", "ducklake"])
def where(request, tmp_path):
    """(the archive's location, a data path for a lake)."""
    if request.param == "duckdb-file":
        return str(tmp_path / "crash.duckdb"), str(tmp_path / "unused")
    location, data_path = request.getfixturevalue("lake")
    return location, str(data_path)


def test_kill_during_ingest_loses_nothing_reported(where, tiny_model):
    path, data_path = where
    rng = random.Random(int(os.environ.get("KVDB_CRASH_SEED", 1234)))  # soak it: run with other seeds and more kills
    reported: set[str] = set()
    kills = int(
        os.environ.get("KVDB_CRASH_KILLS", 4 if os.environ.get("KVDB_TESTS") == "thorough" else 2)
    )  # each a writer started (5 s)
    for attempt in range(kills):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, path, tiny_model, data_path], stdout=subprocess.PIPE, text=True
        )
        started = time.monotonic()
        first = proc.stdout.readline()  # wait until it is really writing
        assert first, "the writer died before its first ingest"
        reported.add(first.strip())
        time.sleep(rng.uniform(0.0, 1.5))
        os.kill(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
        reported.update(line.strip() for line in rest.splitlines() if line.strip())
        assert time.monotonic() - started < 120
        with kvdb.open(path, model=tiny_model) as db:
            report = db.verify(deep=True)
            assert report.ok, (attempt, report.problems)
            stored = {s.session_id for s in db.sessions()}
            assert reported <= stored, f"attempt {attempt}: reported but lost: {reported - stored}"
            for sid in list(reported)[:5]:
                assert db.text(sid).startswith("Session ")
