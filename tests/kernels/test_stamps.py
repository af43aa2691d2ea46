"""Agent logs' sessions carry when they were said (their records' times) and the folder the
agent ran in, whenever they are ingested (kvdb.transcripts.stamps)."""

import datetime as dt
import json
from pathlib import Path

import pytest
from support import write

from kvdb.transcripts import read_transcripts
from kvdb.transcripts.files import iter_transcripts
from kvdb.transcripts.formats.base import Log
from kvdb.transcripts.messages import Invalid
from kvdb.transcripts.sessions import Transcript
from kvdb.transcripts.stamps import StampedLog

EXPORTS = Path(__file__).parents[1] / "fixtures" / "exports"


def times_of(path: Path) -> list[dt.datetime]:
    """Every top-level ``timestamp`` of a JSONL file, as naive UTC."""
    out = []
    for text in path.read_text(encoding="utf-8").splitlines():
        stamp = json.loads(text).get("timestamp")
        if isinstance(stamp, str):
            out.append(dt.datetime.fromisoformat(stamp).astimezone(dt.UTC).replace(tzinfo=None))
    return out


def test_a_claude_code_log_says_when_and_where_it_ran():
    path = EXPORTS / "claude-code" / "spotter-tool_heavy.jsonl"
    times = times_of(path)
    assert len(times) > 10
    for session in read_transcripts(path):
        assert session.metadata["cwd"] == "/home/marco/projects/spotter"
        assert (session.metadata["started"], session.metadata["ended"]) == (
            min(times).isoformat(),
            max(times).isoformat(),
        )


def test_a_codex_rollout_gets_its_times_and_keeps_the_cwd_of_its_meta():
    path = EXPORTS / "codex-cli" / "vct-rollout-2025-09-19-codex_vscode-0.39.0.jsonl"
    [session] = read_transcripts(path)
    times = times_of(path)
    assert session.metadata["ended"] == max(times).isoformat() and session.metadata["started"] == min(times).isoformat()
    assert session.metadata["cwd"] == next(
        json.loads(t)["payload"]["cwd"] for t in path.read_text().splitlines() if '"session_meta"' in t
    )


def test_a_gemini_session_takes_its_header_times_too():
    path = EXPORTS / "gemini-cli" / "vct-session-2026-04-23.jsonl"
    [session, *_] = read_transcripts(path)
    header = json.loads(path.read_text().splitlines()[0])
    assert (
        session.metadata["started"]
        <= dt.datetime.fromisoformat(header["startTime"]).astimezone(dt.UTC).replace(tzinfo=None).isoformat()
    )
    assert session.metadata["ended"] >= max(times_of(path)).isoformat()


def test_a_log_without_times_has_none_and_a_skipped_record_leaves_no_time(tmp_path):
    plain = write(tmp_path / "plain.jsonl", '{"role": "user", "content": "hello"}\n')
    assert "started" not in read_transcripts(plain)[0].metadata
    stamped = write(
        tmp_path / "stamped.jsonl",
        '{"role": "user", "content": "hello", "timestamp": "2026-01-02T03:04:05Z"}\n'
        '{"role": "user", "content": 5, "timestamp": "2030-01-01T00:00:00Z"}\n'
        '{"role": "assistant", "content": "hi", "timestamp": "2026-01-02T05:04:05+02:00"}\n',
    )
    skipped: list[dict] = []
    [session] = iter_transcripts(stamped, skipped=skipped)
    assert [s["line"] for s in skipped] == [2]
    assert (session.metadata["started"], session.metadata["ended"]) == ("2026-01-02T03:04:05", "2026-01-02T03:04:05")


class Fixed(Log):
    """A format's log that sets a cwd of its own."""

    def __init__(self):
        self.records = []

    def add(self, record, line: int) -> None:
        if record.get("bad"):
            raise Invalid("refused")
        self.records.append(record)

    def sessions(self):
        return [Transcript("s", "f.jsonl", "text", None, {"format": "fixed", "cwd": "/own"})]


def test_the_format_s_own_metadata_comes_first_and_a_refused_record_counts_for_nothing():
    log = StampedLog(Fixed())
    log.add({"cwd": "/records", "timestamp": "2026-03-01T10:00:00Z"}, 1)
    with pytest.raises(Invalid):
        log.add({"bad": True, "timestamp": "2030-01-01T00:00:00Z", "cwd": "/bad"}, 2)
    log.add({"timestamp": "0001-01-01T00:00:00+01:00"}, 3)  # no time UTC can hold: no time
    [session] = log.sessions()
    assert session.metadata == {
        "format": "fixed",
        "cwd": "/own",
        "started": "2026-03-01T10:00:00",
        "ended": "2026-03-01T10:00:00",
    }


def test_a_gemini_session_file_of_the_older_layout_gets_its_times():
    [session, *_] = read_transcripts(EXPORTS / "gemini-cli" / "vct-legacy-session-2025-10-11.json")
    assert (session.metadata["started"], session.metadata["ended"]) == (
        "2025-10-11T11:58:27.603000",
        "2025-10-11T12:00:30.384000",
    )
