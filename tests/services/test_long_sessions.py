"""A session longer than the model's context: archived as parts, each a session of one
conversation that goes on from the part before (decision 0049)."""

import numpy as np
from support import write_jsonl

from kvdb.model import chat
from kvdb.services import ingesting
from kvdb.services.write_plan import part_bounds, plan_session

CONTEXT = 4096  # the tiny model's
BUDGET = CONTEXT - CONTEXT // 4


def turns(n: int, start: int = 0) -> list[dict]:
    """Messages of about 250 tokens each (the tiny model's tokenizer), every one of them different."""
    return [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": f"turn {i}: " + " ".join(f"word{i}x{j}" for j in range(20)),
        }
        for i in range(start, start + n)
    ]


def test_parts_are_cut_between_turns_and_inside_a_turn_that_would_leave_one_half_empty():
    opens = np.array([0, 100, 250, 400, 1300, 1350])
    assert part_bounds(np.zeros(1400), opens, 500) == [(0, 400), (400, 900), (900, 1400)]
    assert part_bounds(np.zeros(1401), opens, 500) == [(0, 400), (400, 900), (900, 1350), (1350, 1401)]
    assert part_bounds(np.zeros(500), opens, 500) == [(0, 500)]
    assert part_bounds(np.zeros(1200), np.array([0, 30, 1100]), 500) == [
        (0, 500),
        (500, 1000),
        (1000, 1200),
    ]  # no part less than half full


def test_a_long_log_is_archived_as_parts_of_one_conversation(archive, tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", turns(40))
    results = archive.ingest(path)
    assert [r.status for r in results] == ["ingested"] * len(results) and len(results) == 3
    assert [r.part for r in results] == list(range(1, len(results) + 1))
    assert all(r.n_tokens <= BUDGET for r in results)
    whole = chat.render(archive.loaded_model.tokenizer, turns(40))
    parts = [archive.session(r.session_id) for r in results]
    assert "".join(archive.text(p.session_id) for p in parts) == whole  # nothing dropped, nothing added
    assert [p.part["number"] for p in parts] == list(range(1, len(parts) + 1))
    assert [p.part["follows"] for p in parts] == [None] + [p.session_id for p in parts[:-1]]
    assert [p.part["starts"] for p in parts] == list(np.cumsum([0] + [p.n_tokens for p in parts[:-1]]))
    [conversation] = archive.conversations()
    assert conversation.versions == len(parts) and conversation.branches == 1 and conversation.latest == parts[-1]
    history = archive.conversation("long").versions
    assert [v.branch_of for v in history] == [None] * len(parts) and [v.leaf for v in history] == [False] * (
        len(parts) - 1
    ) + [True]
    [holder] = [p.session_id for p in parts if "word31x7 " in archive.text(p.session_id)]
    hit = archive.search("word31x7 word31x8")[0]
    assert (hit.session_id, hit.conversation_id, hit.match) == (
        holder,
        conversation.conversation_id,
        "word31x7 word31x8",
    )


def test_a_long_log_that_grows_keeps_its_parts_and_grows_the_last(archive, tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", turns(30))
    before = archive.ingest(path)
    write_jsonl(path, turns(31))
    after = archive.ingest(path)
    assert before[-1].n_tokens < BUDGET - 300  # room for one more turn in the last part
    assert [r.status for r in after] == ["unchanged"] * (len(before) - 1) + ["ingested"]
    assert [r.session_id for r in after[:-1]] == [r.session_id for r in before[:-1]]
    grown = archive.session(after[-1].session_id)
    assert (
        after[-1].new_tokens == grown.n_tokens - before[-1].n_tokens
        and grown.part == archive.session(before[-1].session_id).part
    )
    [conversation] = archive.conversations()
    assert conversation.latest == grown and conversation.branches == 1
    history = archive.conversation("long").versions
    assert all(v.branch_of is None for v in history)


def test_a_grown_log_s_unchanged_parts_are_checked_in_one_read_and_stay_queued(archive, tmp_path, monkeypatch):
    """A watched log is read again whole at each turn: its parts but the last are found archived
    together, not planned one at a time, and what they still wait for stays queued once."""
    path = write_jsonl(tmp_path / "long.jsonl", turns(50))
    before = archive.ingest(path)
    planned = []
    monkeypatch.setattr(
        ingesting,
        "plan_session",
        lambda storage, model_id, ids, *rest: planned.append(len(ids)) or plan_session(storage, model_id, ids, *rest),
    )
    write_jsonl(path, turns(51))
    after = archive.ingest(path)
    assert len(before) > 3 and [r.status for r in after] == ["unchanged"] * (len(before) - 1) + ["ingested"]
    assert [r.part for r in after] == [r.part for r in before] and planned == [
        after[-1].n_tokens
    ]  # the last part alone
    assert archive.pending().semantic.sessions == len(before) + 1 == len(archive.sessions())  # none queued twice
    assert [r.status for r in archive.ingest(path)] == ["unchanged"] * len(after)


def test_a_long_text_and_a_turn_longer_than_a_part_are_cut_inside_and_kept_whole(archive):
    text = " ".join(f"line{i}" for i in range(2500))  # one text session, no turns: cut every part's budget
    results = archive.ingest(text=text, name="notes")
    assert (
        len(results) > 1
        and all(r.n_tokens <= BUDGET for r in results[:-1])
        and sum(r.n_tokens for r in results) > CONTEXT
    )
    assert "".join(archive.text(r.session_id) for r in results) == text
    reply = [{"role": "assistant", "content": " ".join(f"token{i}" for i in range(1500))}]
    chat_results = archive.ingest(messages=[{"role": "user", "content": "write a long list"}, *reply], name="list")
    assert [r.n_tokens for r in chat_results[:-1]] == [BUDGET] * (
        len(chat_results) - 1
    )  # the user's turn is no part of its own
    whole = chat.render(archive.loaded_model.tokenizer, [{"role": "user", "content": "write a long list"}, *reply])
    assert "".join(archive.text(r.session_id) for r in chat_results) == whole
    assert {archive.session(r.session_id).conversation_id for r in chat_results} == {
        archive.conversation("list").conversation.conversation_id
    }


def test_a_part_restores_and_continues_on_its_own(archive, tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", turns(30))
    last = archive.ingest(path)[-1]
    restored = archive.session("long").restore()
    assert restored.session_id == last.session_id and restored.position == last.n_tokens == len(restored.tokens)
    assert isinstance(archive.continue_session("long", "and then?", max_new_tokens=4), str)


def test_a_log_that_passes_the_context_goes_on_in_parts_without_a_fork_or_a_second_end(archive, tmp_path):
    path = write_jsonl(tmp_path / "log.jsonl", turns(18))
    [whole] = archive.ingest(path)
    assert whole.part is None and BUDGET < whole.n_tokens <= CONTEXT  # within the context: whole, as before
    write_jsonl(path, turns(24))
    parts = archive.ingest(path)
    assert [r.part for r in parts] == [1, 2]
    [conversation] = archive.conversations()
    assert conversation.branches == 1 and conversation.latest.session_id == parts[-1].session_id
    history = archive.conversation("log").versions
    assert [(v.session.part or {}).get("number") for v in history] == [None, 1, 2]
    assert [v.branch_of for v in history] == [None, None, None] and [v.leaf for v in history] == [False, False, True]


def test_a_part_another_file_shares_does_not_draw_that_file_into_its_conversation(archive, tmp_path):
    a = archive.ingest(write_jsonl(tmp_path / "a.jsonl", turns(30)))
    b = archive.ingest(
        write_jsonl(tmp_path / "b.jsonl", turns(20) + turns(10, start=100))
    )  # a copy of a's start, then its own
    assert b[0].session_id == a[0].session_id and b[0].status == "unchanged"  # the same tokens: the same session
    conversation_of = {r.source: archive.session(r.session_id).conversation_id for r in (a[-1], b[-1])}
    assert len(set(conversation_of.values())) == 2 and len(archive.conversations()) == 2
