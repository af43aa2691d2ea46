"""Conversations: an export ingested again as it grew, or rewritten, is one conversation listed
once as its latest version; its versions are NAME@vN; search hits land on each conversation
once; rename and delete act on the whole of it (library and CLI)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from support import write_jsonl

from kvdb.cli import reading
from kvdb.cli.main import main
from kvdb.errors import SessionNotFound

TALK = [
    {"role": "user", "content": "Where does the keeper keep the harbour ledger?"},
    {"role": "assistant", "content": "In the lamp room, beside the harbour lights."},
]
MORE = [
    {"role": "user", "content": "Who reads the harbour ledger?"},
    {"role": "assistant", "content": "The harbour master, each morning."},
]


def test_an_export_that_grows_or_is_rewritten_is_one_conversation(archive, tmp_path):
    log = tmp_path / "t" / "talk.jsonl"
    first = archive.ingest(write_jsonl(log, TALK))[0]
    grown = archive.ingest(write_jsonl(log, TALK + MORE))[0]
    rewritten = archive.ingest(write_jsonl(log, [TALK[0], {"role": "assistant", "content": "Nobody knows."}]))[0]
    other = archive.ingest(write_jsonl(tmp_path / "u" / "talk.jsonl", MORE))[0]  # another file of the same name
    [talk, elsewhere] = sorted(archive.conversations(), key=lambda c: c.versions, reverse=True)
    assert (talk.versions, talk.branches, talk.latest.session_id, talk.title) == (3, 2, rewritten.session_id, "talk")
    assert elsewhere.latest.session_id == other.session_id and elsewhere.conversation_id != talk.conversation_id
    history = archive.conversation(first.session_id).versions  # any version names its conversation
    assert [v.session.session_id for v in history] == [first.session_id, grown.session_id, rewritten.session_id]
    assert [(v.branch_of, v.leaf) for v in history[:2]] == [(None, False), (None, True)]
    assert (
        history[2].branch_of == first.session_id and 0 < history[2].forked_at < first.n_tokens
    )  # forks inside the first reply
    assert archive.session(f"{talk.conversation_id}@v2").session_id == grown.session_id
    with pytest.raises(SessionNotFound, match="it has 3"):
        archive.session(f"{talk.conversation_id}@v4")
    assert (
        archive.session("talk#1").session_id == rewritten.session_id
    )  # its name (the first of two files so named): its latest version
    assert (
        archive.session(talk.conversation_id).session_id == first.session_id
    )  # named by its first session, whose id it is


def test_search_gives_each_conversation_once_in_its_latest_version(archive):
    archive.ingest(messages=TALK, name="ledger")
    archive.ingest(messages=TALK + MORE, name="ledger")  # grew: "harbour" now four times in it
    archive.ingest(text="The harbour ledger was lost at sea.", name="lost")
    hits = archive.search("harbour", k=10)
    assert sorted(h.title for h in hits) == ["ledger", "lost"]
    latest = archive.conversations()
    assert {h.session_id for h in hits} == {c.latest.session_id for c in latest}
    every = archive.search("harbour", k=10, each_occurrence=True)
    assert len([h for h in every if h.title == "ledger" and h.exact]) == 4
    archive.upkeep(only="semantic")  # ingest queues the embedding
    meaning = archive.search_meaning("harbour ledger", k=10)
    assert len({h.conversation_id for h in meaning}) == len(meaning) == 2


def test_rename_and_delete_act_on_the_whole_conversation(archive):
    archive.ingest(messages=TALK, name="ledger")
    archive.ingest(messages=TALK + MORE, name="ledger")
    renamed = archive.rename("ledger", "The harbour ledger")
    assert (
        renamed.title == "The harbour ledger"
        and archive.session("The harbour ledger").session_id == renamed.latest.session_id
    )
    assert archive.search("harbour", k=1)[0].title == "The harbour ledger"
    assert archive.rename(renamed.conversation_id, "").title == "ledger"  # no title: its first version's name
    gone = archive.delete_conversation("ledger")
    assert gone.sessions == 2 and archive.sessions() == [] and archive.conversations() == []
    assert archive.gc().nodes == 2


def test_cli_lists_conversations_their_history_renames_and_deletes(tmp_path, tiny_model, monkeypatch):
    runner = CliRunner()

    def run(*args, exit_code=0):
        result = runner.invoke(
            main, ["--db", str(tmp_path / "c.duckdb"), *args], env={"KVDB_MODEL": tiny_model}, catch_exceptions=False
        )
        assert result.exit_code == exit_code, result.output
        return result.stdout

    log = tmp_path / "talk.jsonl"
    run("ingest", str(write_jsonl(log, TALK)))
    run("ingest", str(write_jsonl(log, TALK + MORE)))
    [listed] = [json.loads(line) for line in run("sessions", "--json").splitlines()]
    assert listed["versions"] == 2 and listed["agent"] == "messages" and listed["project"] == str(tmp_path)
    assert "[2 versions]" in run("sessions") and len(run("sessions", "--versions").splitlines()) == 2
    assert run("sessions", "--agent", "claude-code") == "" and run("sessions", "--since", "2999-01-01") == ""
    for name in ("second", "third"):
        (tmp_path / f"{name}.txt").write_text(f"the {name} talk")
        run("ingest", str(tmp_path / f"{name}.txt"))
    paged = runner.invoke(
        main, ["--db", str(tmp_path / "c.duckdb"), "sessions", "--limit", "2"], env={"KVDB_MODEL": tiny_model}
    )
    assert [line.split()[-2] for line in paged.stdout.splitlines()] == [
        "second",
        "third",
    ]  # the two latest, oldest first
    assert paged.stderr == "... 1 earlier conversations (--offset 2, or --all)\n"
    monkeypatch.setattr(reading, "PAGE", 2)  # a page unless told: the same two, and --all lists the third
    assert run("sessions") == paged.stdout and len(run("sessions", "--all", "--json").splitlines()) == 3
    run("sessions", "--all", "--limit", "2", exit_code=2)
    assert [
        json.loads(line)["title"] for line in run("sessions", "--limit", "1", "--offset", "1", "--json").splitlines()
    ] == ["second"]
    refused = runner.invoke(
        main,
        ["--db", str(tmp_path / "c.duckdb"), "sessions", "--versions", "--limit", "1"],
        env={"KVDB_MODEL": tiny_model},
    )
    assert run("sessions", "--offset", "3") == "" and refused.exit_code == 2 and "--limit" in refused.stderr
    run("sessions", "--limit", "0", exit_code=2)
    run("delete", "second"), run("delete", "third")
    hits = [json.loads(line) for line in run("search", "harbour", "--project", str(tmp_path), "--json").splitlines()]
    assert [h["title"] for h in hits] == ["talk"] and run(
        "search", "harbour", "--project", str(tmp_path / "nowhere"), exit_code=1
    ) == ""
    history = json.loads(run("history", "talk", "--json"))["history"]
    assert [v["version"] for v in history] == [1, 2] and history[1]["latest"]
    assert "renamed" in run("rename", "talk", "Ledger talk")
    deleted = json.loads(run("delete", "Ledger talk", "--conversation", "--json"))
    assert deleted["sessions"] == 2 and deleted["deleted"]["title"] == "Ledger talk" and run("sessions") == ""


def test_a_servers_continuation_restored_without_a_prompt_replies_as_the_assistant(archive, monkeypatch):
    """A continuation `kvdb serve` archives is a text session whose turns the template framed: a
    restore with no prompt gets the assistant's header, as a chat does, not a turn of the model's choosing."""
    from kvdb.model import chat as chat_template
    from kvdb.services import restore_modes

    loaded = archive.loaded_model
    [chat] = archive.ingest(messages=TALK)
    more = chat_template.turns_suffix(loaded.tokenizer, MORE, add_generation_prompt=False)
    [continued] = archive.ingest(
        text=archive.text(chat.session_id) + more, name="continued"
    )  # what the server archives
    assert continued.status == "ingested" and archive.session("continued").metadata.get("kind") != "chat"
    asked = []
    original = restore_modes.continuation_ids
    monkeypatch.setattr(restore_modes, "continuation_ids", lambda *args: asked.append(args[2]) or original(*args))
    for session in (chat, continued):
        restored = archive.restore(session.session_id)
        archive.generate(restored, None, max_new_tokens=1)
    assert asked == [True, True]  # both taken as chats
    ids = archive.tokens(continued.session_id)
    header = original(loaded, None, True, ids)
    assert chat_template.ends_turn(loaded.tokenizer, ids) and loaded.tokenizer.decode(header).strip().endswith(
        "assistant"
    )
    assert original(loaded, None, True, ids[:-3]).size == 0  # mid-turn: the text goes on


def test_search_keeps_to_an_agent_a_project_and_days(archive, tmp_path):
    archive.ingest(write_jsonl(tmp_path / "repo" / "talk.jsonl", TALK))  # project: tmp_path/repo
    archive.ingest(write_jsonl(tmp_path / "elsewhere" / "log.jsonl", MORE))
    archive.ingest(text="A harbour ledger, in plain text.", name="notes")  # no project
    assert {h.title for h in archive.search("harbour")} == {"talk", "log", "notes"}
    assert {h.title for h in archive.search("harbour", project=str(tmp_path / "repo"))} == {"talk"}
    assert {h.title for h in archive.search("harbour", project=str(tmp_path))} == {
        "talk",
        "log",
    }  # folders inside it too
    assert {h.title for h in archive.search("harbour", agent="text")} == {"notes"}
    today = archive.conversations()[0].latest.created_at.date()
    assert archive.search("harbour", until=today.replace(year=today.year - 1)) == []
    archive.upkeep(only="semantic")  # ingest queues the embedding
    assert {h.title for h in archive.search_meaning("harbour ledger", project=str(tmp_path / "elsewhere"))} == {"log"}


def test_listing_pages_in_the_archive_and_says_how_many_the_filters_admit(archive, tmp_path):
    archive.ingest(write_jsonl(tmp_path / "repo" / "talk.jsonl", TALK))
    archive.ingest(write_jsonl(tmp_path / "repo" / "log.jsonl", MORE))
    archive.ingest(text="A harbour ledger, in plain text.", name="notes")
    every = archive.conversations()
    assert archive.conversations(limit=2) == every[:2] and archive.conversations(limit=2, offset=2) == every[2:]
    first = archive.conversation_page(limit=1).to_dict()
    assert first == {"conversations": [every[0].to_dict()], "total": 3, "next_offset": 1}
    assert archive.conversation_page(project=str(tmp_path / "repo"), limit=5, offset=1).to_dict() == {
        "conversations": [c.to_dict() for c in every if c.project == str(tmp_path / "repo")][1:],
        "total": 2,
    }
    assert archive.conversation_page(agent="text", offset=4).to_dict() == {
        "conversations": [],
        "total": 1,
    }  # past the end: the count still said
