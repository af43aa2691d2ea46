"""The model's work that ingest leaves for later (issue 53, decision 0053): an ingest of the
default tiers never loads the language model; the pass it queues is done by `kvdb upkeep`,
newest first, survives kill -9 and completes, and gives what an ingest with the model gave."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kvdb
from kvdb.model import loading
from kvdb.records import Pending, Queued

KVDB = str(Path(sys.executable).with_name("kvdb"))
TURNS = [
    {"role": "user", "content": "Which test fails in this repository?"},
    {"role": "assistant", "content": "test_leap_year: days_in_year(2024) returns 365."},
    {"role": "user", "content": "Fix it, please."},
    {"role": "assistant", "content": "Done: a year divisible by 400 is a leap year too."},
]


def _refuse_to_load(name=None):
    raise AssertionError(f"the language model was loaded ({name})")


def test_an_ingest_of_the_default_tiers_never_loads_the_model(tmp_path, tiny_model, monkeypatch):
    with kvdb.open(tmp_path / "first.duckdb", model=tiny_model) as db:
        assert db.loaded_model is not None  # this machine has loaded the model once: its facts are cached
    monkeypatch.setattr(loading, "load", _refuse_to_load)
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as db:
        results = db.ingest(messages=TURNS, name="chat") + db.ingest(
            text="The harbour lights were lit at dusk.", name="harbour"
        )
        assert [r.status for r in results] == ["ingested", "ingested"]
        assert [h.session_id for h in db.search("leap year")] == [results[0].session_id]
        queued = Queued(2, sum(r.n_tokens for r in results))
        assert db.stats().pending == Pending(logprobs=queued, semantic=queued)
        with pytest.raises(kvdb.errors.TierMissing, match="2 sessions .* wait for it; run `kvdb upkeep`"):
            db.search_meaning("harbour lights")
        with pytest.raises(
            AssertionError, match="language model was loaded"
        ):  # the embedder's pass first, then the language model's
            db.upkeep()
        assert db.pending() == Pending(logprobs=queued)
        assert db.search_meaning("harbour lights")[0].session_id == results[1].session_id


def test_upkeep_gives_what_an_ingest_with_the_model_gave(tmp_path, tiny_loaded):
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded) as db:
        short = db.ingest(messages=TURNS[:2], name="chat")[0]
        long = db.ingest(messages=TURNS, name="chat")[0]
        [shared] = db.prefixes()
        assert shared.bits is None and shared.to_dict()["pending"] is True
        first_use = db.logprobs(long.session_id)  # computed on first use, and not stored: no getter writes
        both = Queued(2, short.n_tokens + long.n_tokens)
        assert db.pending() == Pending(both, both)
        report = db.upkeep()
        assert (report.embedded, report.scored, report.pending) == (both, both, Pending())
        assert report.cached == 1  # the newest scored both paths; the older had nothing left to score
        expected, _ = loading.score(tiny_loaded.model, db.tokens(long.session_id))
        np.testing.assert_allclose(db.logprobs(long.session_id), expected, atol=1e-4)
        np.testing.assert_allclose(first_use, expected, atol=1e-4)
        np.testing.assert_array_equal(db.logprobs(short.session_id), db.logprobs(long.session_id)[: short.n_tokens])
        [shared] = db.prefixes()
        assert shared.bits == pytest.approx(-expected[: shared.tokens].sum() / np.log(2), rel=1e-5)
        assert db.verify(deep=True).ok
        assert db.upkeep().scored == Queued()


def test_a_deleted_session_leaves_the_queue(archive):
    one = archive.ingest(text="A session deleted before the model's pass.", name="gone")[0]
    assert archive.pending() == Pending(Queued(1, one.n_tokens), Queued(1, one.n_tokens))
    archive.delete(one.session_id)
    assert archive.pending() == Pending()


def test_a_split_node_waits_for_its_pass_in_both_halves(archive):
    letters = "abcdefghijklmnopqrstuvwxyz" * 2
    a = archive.ingest(text=letters, name="a")[0]
    b = archive.ingest(text=letters[:40] + "XYZ", name="b")[0]  # cuts a's node, neither half scored
    assert archive.pending().logprobs == Queued(2, a.n_tokens + b.n_tokens)
    archive.upkeep()
    expected, _ = loading.score(archive.loaded_model.model, archive.tokens(a.session_id))
    np.testing.assert_allclose(archive.logprobs(a.session_id), expected, atol=1e-4)
    assert archive.verify(deep=True).ok


def test_the_queue_survives_kill_9_and_completes(tmp_path, tiny_model):
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_model) as db:
        # 16 sessions: the kill lands after the first commit (a poll takes about as long as a
        # session's pass) and the rerun scores the rest, which with 40 took half the test's time
        for n in range(16):
            db.ingest(
                text=f"Session {n}: " + " ".join(f"word{k * n}" for k in range(200)), name=f"s{n}", keep="tokens,search"
            )
        queued = db.pending().logprobs.sessions
    assert queued == 16
    env = dict(os.environ, KVDB_MODEL=tiny_model)
    worker = subprocess.Popen(
        [KVDB, "--db", str(path), "upkeep"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        left = queued
        while left == queued and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            status = subprocess.run(
                [KVDB, "--db", str(path), "upkeep", "--status", "--json"], env=env, capture_output=True, text=True
            )
            if status.returncode == 0:
                left = json.loads(status.stdout)["logprobs"]["sessions"]
        worker.send_signal(signal.SIGKILL)
        assert worker.wait(timeout=30) == -signal.SIGKILL, (
            worker.stderr.read() if worker.stderr else ""
        )  # killed mid-run, not finished
    finally:
        worker.kill()
    assert 0 < left < queued
    done = subprocess.run([KVDB, "--db", str(path), "upkeep", "--json"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["pending"] == Pending().to_dict() and 0 < report["scored"]["sessions"] <= left
    with kvdb.open(path, model=tiny_model) as db:
        assert db.verify(deep=True).ok
        for s in db.sessions()[:3]:
            expected, _ = loading.score(db.loaded_model.model, db.tokens(s.session_id))
            np.testing.assert_allclose(db.logprobs(s.session_id), expected, atol=1e-4)


_EMBED_WORKER = """
import sys, time
import kvdb
from kvdb.services import semantic_tier, upkeep

upkeep.GROUP_CHUNKS = 4  # many groups, each committed: a kill lands between two of them, or in one
embedded = semantic_tier.SemanticTier.embedded
semantic_tier.SemanticTier.embedded = lambda self, cuts: (time.sleep(0.2), embedded(self, cuts))[1]  # a slow embedder
with kvdb.open(sys.argv[1], model=sys.argv[2], embedder=sys.argv[2]) as db:
    db.upkeep(only="semantic", progress=lambda tokens, queued: print(tokens, flush=True))
"""


def _chunk_rows(path: Path, model: str) -> list[tuple]:
    with kvdb.open(path, model=model, embedder=model) as db, db._storage._read() as conn:
        return conn.execute(
            "select node_id, chunk_no, start, stop, vector from node_chunks order by node_id, chunk_no"
        ).fetchall()


def test_the_semantic_queue_survives_kill_9_in_a_group_and_completes(tmp_path, tiny_model):
    """Upkeep embeds a group of sessions in one call and commits each with its row off the queue:
    killed anywhere, no session is lost or embedded twice."""
    paths = [tmp_path / "killed.duckdb", tmp_path / "whole.duckdb"]
    for path in paths:
        with kvdb.open(path, model=tiny_model, embedder=tiny_model) as db:
            for n in range(20):
                db.ingest(
                    text=f"Session {n}: " + " ".join(f"word{k * n}" for k in range(100)),
                    name=f"s{n}",
                    keep="tokens,search,semantic",
                )
            queued = db.pending().semantic.sessions
    assert queued == 20
    with kvdb.open(paths[1], model=tiny_model, embedder=tiny_model) as db:
        assert db.upkeep(only="semantic").embedded.sessions == queued
    worker = subprocess.Popen(
        [sys.executable, "-c", _EMBED_WORKER, str(paths[0]), tiny_model],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        for _ in range(6):  # sessions committed (durable once the next group lets the file go)
            assert worker.stdout.readline(), worker.stderr.read() if worker.stderr else ""
        worker.send_signal(signal.SIGKILL)
        assert worker.wait(timeout=30) == -signal.SIGKILL  # killed mid-run, not finished
    finally:
        worker.kill()
    with kvdb.open(paths[0], model=tiny_model, embedder=tiny_model) as db:
        left = db.pending().semantic.sessions
        assert 0 < left < queued
        assert db.upkeep(only="semantic").embedded.sessions == left
        assert db.pending().semantic.sessions == 0 and db.verify(deep=True).ok
    killed, whole = (_chunk_rows(path, tiny_model) for path in paths)
    assert [row[:4] for row in killed] == [row[:4] for row in whole]  # each chunk once
    for a, b in zip(killed, whole):
        np.testing.assert_allclose(np.frombuffer(a[4], "<f2"), np.frombuffer(b[4], "<f2"), atol=2e-3)
