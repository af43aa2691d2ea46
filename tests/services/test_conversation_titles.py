"""Through the archive: a conversation is listed, found and shown under its log's title, dated
by its export's own times, not by the day it was ingested (decision 0052)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from support import write_jsonl

EXPORTS = Path(__file__).parents[1] / "fixtures" / "exports"


def test_conversations_take_their_title_and_dates_from_the_file(archive):
    archive.ingest(EXPORTS / "claude-code" / "spotter-short.jsonl", keep="tokens,search")
    archive.ingest(EXPORTS / "chatgpt" / "openwebui-importer-gpt_example.json", keep="tokens,search")
    listed = {c.agent: c for c in archive.conversations()}
    claude, gpt = listed["claude-code"], listed["chatgpt"]

    assert (
        claude.latest.name == "55604662-cf2a-4331-851a-ec234028f8ca"
        and claude.title == "mix phx.server doesnt seem to start"
    )
    assert (claude.created_at, claude.latest.said_at) == (
        dt.datetime(2026, 2, 10, 21, 11, 52, 438000),
        dt.datetime(2026, 2, 10, 21, 16, 12, 381000),
    )

    export = json.loads((EXPORTS / "chatgpt" / "openwebui-importer-gpt_example.json").read_text(encoding="utf-8"))[0]
    said = [
        dt.datetime.fromtimestamp(export[key], dt.UTC).replace(tzinfo=None) for key in ("create_time", "update_time")
    ]
    shown = gpt.to_dict()
    assert (gpt.title, shown["title"]) == (export["title"], export["title"])
    assert (shown["created_at"], shown["updated_at"], shown["said_at"]) == (
        said[0].isoformat(),
        said[1].isoformat(),
        said[1].isoformat(),
    )
    assert gpt.latest.created_at - said[1] > dt.timedelta(days=1)  # archived now, said when the export says

    [hit] = archive.search("phx.server doesnt", k=1)
    assert hit.title == claude.title and hit.name == claude.latest.name  # the name still refers to it
    assert archive.conversation(claude.latest.name).conversation.title == claude.title
    assert archive.search("photosynthesis", until=said[1].date()) and not archive.search(
        "photosynthesis", since=said[1].date() + dt.timedelta(days=1)
    )


def event(uuid: str, parent: str | None, role: str, text: str) -> dict:
    return {
        "type": role,
        "uuid": uuid,
        "parentUuid": parent,
        "sessionId": "7f3e9b2a-5c1d-4e8f-a6b0-3d2c1e0f9a8b",
        "message": {"role": role, "content": text},
    }


def test_a_log_that_grows_a_title_is_listed_and_found_under_it(archive, tmp_path):
    log = tmp_path / "7f3e9b2a-5c1d-4e8f-a6b0-3d2c1e0f9a8b.jsonl"
    turns = [
        event("u1", None, "user", "Why is the harbour ledger late?"),
        event("a1", "u1", "assistant", "The keeper forgot it."),
    ]
    write_jsonl(log, turns)
    archive.ingest(log, keep="tokens,search")
    [first] = archive.conversations()
    assert first.title == "Why is the harbour ledger late?" and first.latest.name == log.stem
    grown = [
        *turns,
        event("u2", "a1", "user", "Remind him."),
        {"type": "ai-title", "aiTitle": "Late harbour ledger", "sessionId": log.stem},
    ]
    archive.ingest(write_jsonl(log, grown), keep="tokens,search")
    [conversation] = archive.conversations()
    assert conversation.versions == 2 and conversation.title == "Late harbour ledger"  # the latest version's
    assert [h.title for h in archive.search("harbour ledger", k=1)] == ["Late harbour ledger"]
    archive.rename(conversation.conversation_id, "Ledger")
    assert (
        archive.rename(conversation.conversation_id, None).title == "Late harbour ledger"
    )  # the user's title gone: the log's again
