"""Migration 0009 groups the sessions older archives hold into conversations: the archive kvdb
0.1.0 wrote (tests/fixtures/archive_v0_1_0: six sessions, none a state of another) and one
`kvdb serve` wrote at schema 0008 (tests/fixtures/archive_v0_9_serve: a chat of three turns, a
fork of it continued from its first reply, and another chat). Each is copied first: opening
migrates, and the committed files must stay as they were written."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import kvdb

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODEL = FIXTURES / "archive_v0_1_0" / "model"


def opened(tmp_path: Path, name: str, read_only: bool) -> tuple[kvdb.Archive, dict]:
    copy = tmp_path / name
    shutil.copytree(FIXTURES / name, copy, ignore=shutil.ignore_patterns("__pycache__", "*.py", "model"))
    expected = json.loads((copy / "expected.json").read_text(encoding="utf-8"))
    return kvdb.open(copy / "archive.duckdb", model=str(MODEL), read_only=read_only), expected


@pytest.mark.parametrize("read_only", [False, True])
def test_sessions_of_0_1_0_are_each_a_conversation_of_their_own(tmp_path, read_only):
    archive, expected = opened(tmp_path, "archive_v0_1_0", read_only)
    with archive:
        conversations = archive.conversations()
        assert sorted(c.conversation_id for c in conversations) == sorted(s["session_id"] for s in expected["sessions"])
        assert all(
            c.versions == 1 and c.latest.session_id == c.conversation_id and c.title == c.latest.name
            for c in conversations
        )
        assert all(archive.session(s["name"]).session_id == s["session_id"] for s in expected["sessions"])


@pytest.mark.parametrize("read_only", [False, True])
def test_a_servers_chat_its_turns_and_its_fork_become_one_conversation(tmp_path, read_only):
    archive, expected = opened(tmp_path, "archive_v0_9_serve", read_only)
    turns, other = expected["sessions"][:3], expected["sessions"][4]
    fork = expected["sessions"][3]
    assert fork["name"] == turns[0]["name"] + f"@{expected['fork_at']}" and fork["source"] == "<text>"
    with archive:
        listed = {c.title: c for c in archive.conversations()}
        assert sorted(listed) == sorted([turns[0]["name"], other["name"]])  # five sessions, two conversations
        chat = archive.conversation(turns[0]["name"])
        assert [v.session.session_id for v in chat.versions] == [
            s["session_id"] for s in (*turns, fork)
        ]  # oldest first
        assert (
            chat.conversation.conversation_id == turns[0]["session_id"]
            and chat.conversation.latest.session_id == fork["session_id"]
        )
        assert [(v.branch_of, v.forked_at, v.leaf) for v in chat.versions] == [
            (None, None, False),
            (None, None, False),
            (None, None, True),
            (
                turns[1]["session_id"],
                expected["fork_at"],
                True,
            ),  # after the first reply the chat went on another way: first in v2
        ]
        assert (chat.conversation.versions, chat.conversation.branches) == (4, 2) and listed[
            other["name"]
        ].versions == 1
        for s in expected["sessions"]:  # nothing else changed
            ids = np.asarray(archive.tokens(s["session_id"]), dtype="<i4")
            assert hashlib.sha256(ids.tobytes()).hexdigest() == s["tokens_sha256"]
        assert (
            archive.session(turns[0]["name"]).session_id == turns[2]["session_id"]
        )  # its name: the latest version of that name
        assert archive.session(f"{turns[0]['name']}@v1").session_id == turns[0]["session_id"]
        hits = archive.search("lighthouse keeper", k=10)
        assert len({h.conversation_id for h in hits}) == len(hits) and hits[0].title == turns[0]["name"]
