"""`kvdb watch` over each agent's own log layout (real logs from tests/fixtures/exports), written
in two steps as the agent writes it: the grown log's session joins the conversation of its first
state, stores only what was added, and carries the agent, the folder it ran in and the log's
own last time."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

import kvdb

EXPORTS = Path(__file__).parents[1] / "fixtures" / "exports"
LOGS = {
    "claude-code": ("claude-code/spotter-tool_heavy.jsonl", "/home/marco/projects/spotter"),
    "codex-cli": ("codex-cli/vct-rollout-2025-09-19-codex_vscode-0.39.0.jsonl", None),
    "gemini-cli": ("gemini-cli/agent-sessions-stage0-gemini-jsonl_v040.jsonl", None),
}

WRITTEN = (
    40  # lines of each log written in all: the log as it stood then (the tiny model makes a part of every 3k bytes)
)


@pytest.mark.parametrize("agent", sorted(LOGS))
def test_an_agent_log_written_in_two_steps_is_one_conversation(agent, tmp_path, tiny_loaded):
    fixture, cwd = LOGS[agent]
    lines = (EXPORTS / fixture).read_text(encoding="utf-8").splitlines(keepends=True)[:WRITTEN]
    log = tmp_path / "logs" / Path(fixture).name
    log.parent.mkdir()
    log.write_text("".join(lines[: len(lines) // 2]), encoding="utf-8")
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded) as archive:
        first = archive.watch([log.parent], keep="tokens,search")
        log.write_text("".join(lines), encoding="utf-8")
        grown = archive.watch([log.parent], keep="tokens,search")
        assert first and grown and {r.status for r in first + grown} <= {"ingested", "unchanged"}
        main = [
            archive.session(r.session_id) for r in grown if r.name == first[0].name
        ]  # the log's session (or its parts), grown
        assert {s.conversation_id for s in main} == {archive.session(first[0].session_id).conversation_id}
        assert (
            0 < sum(r.new_tokens for r in grown) < sum(r.n_tokens for r in grown)
        )  # the first state's tokens were not stored again
        after = main[-1]
        conversation = archive.conversation(after.session_id).conversation
        assert conversation.agent == agent and conversation.versions >= 2
        if cwd is not None:
            assert conversation.project == cwd
        stamps = [json.loads(t).get(key) for t in lines for key in ("timestamp", "lastUpdated")]
        last = max(
            dt.datetime.fromisoformat(s).astimezone(dt.UTC).replace(tzinfo=None) for s in stamps if isinstance(s, str)
        )
        assert (
            after.said_at == last
            and archive.conversations(since=last.date(), until=last.date()) == archive.conversations()
        )
