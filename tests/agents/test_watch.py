"""`kvdb watch` over a temporary folder that a test writer appends to, cuts and rotates: a grown
log stores only its new turns, a half-written last line waits, a rewritten log forks its
conversation, a restarted watcher reads only what changed since its checkpoint, and the live
watcher (a process of its own) archives each change and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import storage_of

import kvdb
from kvdb.model import loading

KVDB = str(Path(sys.executable).with_name("kvdb"))
TURNS = [
    {"role": "user", "content": "Which test fails in this repository?"},
    {"role": "assistant", "content": "test_leap_year: days_in_year(2024) returns 365."},
    {"role": "user", "content": "Fix it, please."},
    {"role": "assistant", "content": "Done: a year divisible by 400 is a leap year too."},
    {"role": "user", "content": "Run the tests again."},
    {"role": "assistant", "content": "All 41 tests pass."},
]


def line(message: dict) -> str:
    return json.dumps(message) + "\n"


def append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def test_a_log_grows_waits_for_its_last_line_forks_and_is_rotated(tmp_path, tiny_loaded):
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "session.jsonl"
    log.write_text("".join(map(line, TURNS[:2])), encoding="utf-8")
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded) as archive:
        [first] = archive.watch([logs])
        assert first.status == "ingested" and first.new_tokens == first.n_tokens
        assert archive.watch([logs]) == []  # unchanged since the checkpoint: not read again

        append(log, line(TURNS[2]) + line(TURNS[3])[:20])  # a turn, and the next one half-written
        [waiting] = archive.watch([logs])
        assert waiting.status == "waiting" and [f.status for f in archive.watched()] == ["waiting"]
        append(log, line(TURNS[3])[20:])
        [grown] = archive.watch([logs])
        assert (
            grown.status == "ingested" and 0 < grown.new_tokens < grown.n_tokens - first.n_tokens + 8
        )  # only the new turns
        [conversation] = archive.conversations()
        assert conversation.versions == 2 and conversation.latest.session_id == grown.session_id

        log.write_text(
            "".join(map(line, [*TURNS[:2], {"role": "user", "content": "Never mind."}])), encoding="utf-8"
        )  # rewritten
        [forked] = archive.watch([logs])
        history = archive.conversation(conversation.conversation_id)
        assert forked.status == "ingested" and len(history.versions) == 3  # the old versions stay: a fork, not a loss
        assert (history.versions[-1].branch_of, history.versions[-1].forked_at) == (grown.session_id, first.n_tokens)

        log.rename(logs / "session.1.jsonl")  # rotated: the old log under another name, a new one begun
        log.write_text("".join(map(line, TURNS[4:])), encoding="utf-8")
        rotated = archive.watch([logs])
        assert sorted(r.status.value for r in rotated) == ["ingested", "unchanged"]
        assert {f.path for f in archive.watched()} == {str(log), str(logs / "session.1.jsonl")}

    with kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded) as restarted:  # resumes from the checkpoint in the archive
        assert restarted.watch([logs]) == []
        append(log, "{not json\n")  # a malformed line is named and left out; the rest is what was archived
        [bad] = restarted.watch([logs])
        assert bad.status == "unchanged" and [s["line"] for s in bad.skipped] == [3]


def test_a_restarted_watcher_stores_a_long_log_s_new_turn_alone_and_runs_no_model(tmp_path, tiny_model, monkeypatch):
    """A log past the model's context, grown while no watcher ran: the restarted watcher reads it
    again, but finds its parts but the last archived, stores the new turn alone, and loads no
    model; each pass takes the archive once (its checkpoint is written on the ingest's hold)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "long.jsonl"
    log.write_text(
        "".join(
            line(
                {
                    "role": ("user", "assistant")[i % 2],
                    "content": f"turn {i}: " + " ".join(f"word{i}x{j}" for j in range(20)),
                }
            )
            for i in range(50)
        )
    )
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as archive:
        assert archive.loaded_model is not None  # this machine has loaded the model once: its facts are cached
        first = archive.watch([logs])
    monkeypatch.setattr(loading, "load", _refuse_to_load)
    append(log, line(TURNS[4]) + line(TURNS[5]))
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as restarted:
        grown = restarted.watch([logs])
        assert len(first) > 3 and [r.status for r in grown] == ["unchanged"] * (len(first) - 1) + ["ingested"]
        assert 0 < grown[-1].new_tokens < grown[-1].n_tokens - first[-1].n_tokens + 8  # only the new turns
        assert restarted.search("All 41 tests pass")[0].session_id == grown[-1].session_id
        restarted.release()
        opened = storage_of(restarted).engine.connections
        append(log, line(TURNS[2]))
        [*_, again] = restarted.watch([logs])
        assert again.status == "ingested" and storage_of(restarted).engine.connections == opened + 1
        assert [(f.size, f.status) for f in restarted.watched()] == [(log.stat().st_size, "ingested")]


def _refuse_to_load(name=None):
    raise AssertionError(f"the language model was loaded ({name})")


def test_the_watcher_archives_each_change_and_stops_cleanly(tmp_path, tiny_model):
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "agent.jsonl"
    log.write_text(line(TURNS[0]) + line(TURNS[1]), encoding="utf-8")
    db = tmp_path / "w.duckdb"
    env = {**os.environ, "KVDB_MODEL": tiny_model}

    def start():
        err = open(tmp_path / "watch.err", "a", encoding="utf-8")  # the process writes it
        return subprocess.Popen(
            [KVDB, "--db", str(db), "watch", str(logs)], env=env, stdout=subprocess.DEVNULL, stderr=err, text=True
        )

    def said() -> str:
        return (tmp_path / "watch.err").read_text(encoding="utf-8")

    def versions(expected: int) -> int:
        deadline = time.monotonic() + 60
        while True:
            listed = subprocess.run(
                [KVDB, "--db", str(db), "sessions", "--versions", "--json"], env=env, capture_output=True, text=True
            )
            count = len(listed.stdout.splitlines()) if listed.returncode == 0 else 0
            if count >= expected or time.monotonic() > deadline:
                return count
            time.sleep(0.2)

    watcher = start()
    try:
        assert versions(1) == 1, said()
        append(log, line(TURNS[2]) + line(TURNS[3]))
        assert versions(2) == 2, said()
        status = json.loads(
            subprocess.run(
                [KVDB, "--db", str(db), "watch", "--status", "--json"], env=env, capture_output=True, text=True
            ).stdout
        )
        assert (
            status["running"]
            and status["pid"] == watcher.pid
            and [f["path"] for f in status["files"]] == [str(log.resolve())]
        )
    finally:
        watcher.send_signal(signal.SIGTERM)
        watcher.wait(timeout=60)
    assert watcher.returncode == 0 and "stopped" in said(), said()
    assert not Path(str(db) + ".watch.pid").exists()

    append(log, line(TURNS[4]) + line(TURNS[5]))  # written while no watcher ran
    watcher = start()
    try:
        assert versions(3) == 3, said()  # the restarted watcher's first pass finds it
        logged = Path(str(db) + ".watch.log")
        deadline = time.monotonic() + 60
        while (
            logged.read_text(encoding="utf-8").count("ingested") < 3 and time.monotonic() < deadline
        ):  # logged after the pass's checkpoint
            time.sleep(0.1)
        assert logged.read_text(encoding="utf-8").count("ingested") == 3, logged.read_text(encoding="utf-8")
    finally:
        watcher.kill()
        watcher.wait(timeout=60)


@pytest.mark.parametrize("agent", ["claude-code", "codex", "gemini"])
def test_from_names_each_agents_own_folder(tmp_path, tiny_model, agent):
    home = tmp_path / "home"
    moved = ("CLAUDE_CONFIG_DIR", "CODEX_HOME", "GEMINI_CLI_HOME")  # each moves its agent's folder from the home
    env = {**{k: v for k, v in os.environ.items() if k not in moved}, "KVDB_MODEL": tiny_model, "HOME": str(home)}
    missing = subprocess.run(
        [KVDB, "--db", str(tmp_path / "a.duckdb"), "watch", "--from", agent, "--once"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and f"no {agent} logs at {home}" in missing.stderr


def test_an_idle_watcher_does_the_queued_work_beside_it(tmp_path, tiny_model):
    """Ingest queues the models' work; a watcher with nothing to archive for a moment starts
    `kvdb upkeep` in a process of its own, which empties the queue; it is stopped with the watcher."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "session.jsonl").write_text("".join(map(line, TURNS)), encoding="utf-8")
    db, env = tmp_path / "a.duckdb", dict(os.environ, KVDB_MODEL=tiny_model)
    stop = threading.Event()
    with kvdb.open(db, model=tiny_model) as archive:
        watcher = threading.Thread(target=archive.watch, args=([logs],), kwargs={"stop": stop})
        watcher.start()
        try:
            deadline, stats = time.monotonic() + 120, None
            while not (stats and stats["sessions"] and stats["pending"] == kvdb.records.Pending().to_dict()):
                assert time.monotonic() < deadline, f"still queued: {stats}"
                time.sleep(0.5)
                status = subprocess.run(
                    [KVDB, "--db", str(db), "stats", "--json"], env=env, capture_output=True, text=True
                )
                stats = json.loads(status.stdout) if status.returncode == 0 else None
        finally:
            stop.set()
            watcher.join(timeout=60)
        assert not watcher.is_alive()
        [session] = archive.sessions()
        assert (
            archive.search_meaning(TURNS[1]["content"], k=1)[0].session_id == session.session_id
        )  # embedded beside the watcher
        assert archive.stats().bytes["logprobs"] == 4 * session.n_tokens  # and scored
