"""SQL over the archive (``Archive.sql``, issue 54 item 6): the documented views and their columns,
pinned here and checked against docs/sql.md; search hits as relations joined by conversation;
turns decoded only where a query's filters reach; bad SQL in one line; a write refused by the
check and, past it, by the read-only transaction; on a DuckDB file and on a DuckLake."""

from __future__ import annotations

import re

import pytest
from support import REPO, write_jsonl

import kvdb
from kvdb.errors import InvalidQuery, QueryRefused, TierMissing
from kvdb.services.reading import Reader
from kvdb.storage import views

# The documented interface: a change here is a change of docs/sql.md and of every query written against it.
PINNED_VIEWS = {
    "conversations": (
        "conversation_id",
        "title",
        "agent",
        "project",
        "versions",
        "latest_session_id",
        "n_tokens",
        "started_at",
        "said_at",
        "updated_at",
    ),
    "sessions": (
        "session_id",
        "conversation_id",
        "name",
        "title",
        "source",
        "agent",
        "project",
        "model",
        "n_tokens",
        "part",
        "created_at",
        "started_at",
        "said_at",
    ),
    "turns": ("conversation_id", "session_id", "agent", "project", "said_at", "turn", "role", "start", "stop", "text"),
    "agents": ("agent", "conversations", "sessions", "tokens", "first_started_at", "last_said_at"),
    "projects": ("project", "conversations", "sessions", "agents", "tokens", "first_started_at", "last_said_at"),
    "tiers": ("tier", "nodes", "tokens", "bytes"),
}
HITS = (
    "rank",
    "conversation_id",
    "session_id",
    "title",
    "name",
    "position",
    "match_tokens",
    "score",
    "exact",
    "text",
    "context",
)
PINNED_MACROS = {"search": HITS, "search_meaning": HITS, "turns_of": ("turn", "role", "start", "stop", "text")}

TALK = [
    {"role": "user", "content": "Where does the keeper keep the harbour ledger?"},
    {"role": "assistant", "content": "In the lamp room, beside the harbour lights."},
]
MORE = [
    {"role": "user", "content": "Who reads the harbour ledger?"},
    {"role": "assistant", "content": "The harbour master, each morning."},
]


def fill(archive, tmp_path) -> None:
    archive.ingest(write_jsonl(tmp_path / "repo" / "talk.jsonl", TALK))
    archive.ingest(write_jsonl(tmp_path / "repo" / "talk.jsonl", TALK + MORE))  # grew: two versions of one conversation
    archive.ingest(write_jsonl(tmp_path / "elsewhere" / "log.jsonl", MORE))
    archive.ingest(text="A harbour ledger, in plain text.", name="notes")  # no project


def documented(section: str) -> list[str]:
    """The columns docs/sql.md's table under ``### `section` `` lists, in order."""
    text = (REPO / "docs" / "sql.md").read_text(encoding="utf-8")
    found = re.search(rf"^### `{section}`$(.*?)(?=^#)", text + "\n#", re.S | re.M)
    assert found, f"docs/sql.md has no section for {section}"
    return re.findall(r"^\| `(\w+)` \|", found.group(1), re.M)


def test_the_views_and_their_columns_are_pinned_and_documented():
    assert views.VIEWS == PINNED_VIEWS and views.MACROS == PINNED_MACROS
    for name, columns in PINNED_VIEWS.items():
        assert documented(name) == list(columns), name
    assert documented("turns_of") == list(PINNED_MACROS["turns_of"])
    text = (REPO / "docs" / "sql.md").read_text(encoding="utf-8")
    hits = re.search(r"^## Search relations$(.*?)^### ", text, re.S | re.M)
    assert hits and re.findall(r"^\| `(\w+)` \|", hits.group(1), re.M) == list(HITS)


@pytest.fixture(params=["duckdb-file", "ducklake"])
def filled(request, tmp_path, tiny_loaded):
    """An archive of three conversations (one of two versions) on each backend."""
    if request.param == "duckdb-file":
        location, data_path = tmp_path / "a.duckdb", None
    else:
        location, data_path = request.getfixturevalue("lake")
    with kvdb.open(location, model=tiny_loaded, data_path=data_path) as archive:
        fill(archive, tmp_path)
        yield archive


def test_every_view_and_search_as_a_relation_on_both_backends(filled, tmp_path):
    for name, columns in PINNED_VIEWS.items():
        assert tuple(filled.sql(f"select * from {name} limit 0").columns) == columns, name
    per_project = filled.sql(
        "select c.project, date_trunc('month', c.said_at) as month, count(*) as hits "
        "from search('harbour ledger') h join conversations c using (conversation_id) group by all order by all"
    )
    month = filled.conversations()[0].latest.said_at.replace(
        day=1, hour=0, minute=0, second=0, microsecond=0, tzinfo=None
    )
    assert per_project.rows == [
        (str(tmp_path / "elsewhere"), month, 1),
        (str(tmp_path / "repo"), month, 1),
        (None, month, 1),
    ]
    said = filled.sql(
        "select t.text from turns t join conversations c using (conversation_id) "
        "where c.title = 'talk' and t.role = 'user' order by t.turn"
    )
    assert said.rows == [(TALK[0]["content"],), (MORE[0]["content"],)]
    with pytest.raises(QueryRefused):
        filled.sql("select * from ducklake_expire_snapshots('lake', older_than => now())")
    assert filled.session_count() == 4


def test_the_views_say_what_the_library_says(archive, tmp_path):
    fill(archive, tmp_path)
    listed = {c.conversation_id: c for c in archive.conversations()}
    rows = archive.sql("select * from conversations").to_dict()["rows"]
    assert {r[0]: (r[1], r[2], r[3], r[4], r[5], r[6]) for r in rows} == {
        c.conversation_id: (c.title, c.agent, c.project, c.versions, c.latest.session_id, c.latest.n_tokens)
        for c in listed.values()
    }
    sessions = {s.session_id: s for s in archive.sessions()}
    for row in archive.sql(
        "select session_id, conversation_id, title, agent, project, n_tokens, said_at, started_at from sessions"
    ).rows:
        s = sessions[row[0]]
        assert row[1:] == (
            s.conversation_id,
            s.title,
            s.agent,
            s.project,
            s.n_tokens,
            s.said_at.replace(tzinfo=None),
            s.started_at.replace(tzinfo=None),
        )
    for conversation in listed.values():
        turns = archive.sql(
            "select role, start, stop, text from turns "
            f"where conversation_id = '{conversation.conversation_id}' order by turn"
        ).rows
        assert turns == [(t.role, t.start, t.end, t.text) for t in archive.turns(conversation.latest.session_id)]
    first = min(sessions.values(), key=lambda s: s.created_at)  # the first version of talk: its turns by turns_of
    assert (
        len(archive.sql(f"select * from turns_of('{first.session_id}')").rows)
        == len(archive.turns(first.session_id))
        == 2
    )
    agents = archive.sql("select agent, conversations, sessions from agents order by agent").rows
    assert agents == [("messages", 2, 3), ("text", 1, 1)]
    projects = dict(archive.sql("select project, conversations from projects").rows)
    assert projects == {str(tmp_path / "repo"): 1, str(tmp_path / "elsewhere"): 1, None: 1}
    stats = archive.stats()
    tiers = {r[0]: r[1:] for r in archive.sql("select * from tiers").rows}
    assert (
        tiers["tokens"] == (stats.nodes, stats.stored_tokens, stats.bytes["tokens"] - 12 * stats.nodes)
        and tiers["search"][2] is None
    )
    assert tiers["lm"] == tiers["kv"] == (0, 0, 0)


def test_turns_are_decoded_only_for_the_conversations_a_query_keeps(archive, tmp_path, monkeypatch):
    fill(archive, tmp_path)
    decoded = []
    original = Reader.turns
    monkeypatch.setattr(Reader, "turns", lambda self, ref, *a: decoded.append(ref) or original(self, ref, *a))
    talk = next(c for c in archive.conversations() if c.title == "talk")
    found = archive.sql(f"select count(*) from turns where project = '{tmp_path / 'repo'}'").rows
    assert found == [(4,)] and decoded == [talk.latest.session_id]
    decoded.clear()
    assert archive.sql("select count(*) from conversations").rows == [(3,)] and decoded == []  # no turn read
    assert (
        archive.sql("select count(*) from turns").rows == [(7,)] and len(decoded) == 3
    )  # all of them: the costly query


def test_search_options_and_meaning_hits(archive, tmp_path):
    fill(archive, tmp_path)
    exact = archive.sql("select title from search('harbour master') order by title").rows
    assert exact == [("log",), ("talk",)]
    assert archive.sql("select count(*) from search('old harbour ledger')").rows == [(0,)]  # whole matches only
    partial = archive.sql("select title, exact from search('old harbour ledger', partial := true) order by title").rows
    assert partial == [("log", False), ("notes", False), ("talk", False)]
    assert archive.sql("select count(*) from search('Harbour Master', case_sensitive := true)").rows == [(0,)]
    assert archive.sql("select rank, title from search('harbour', k := 1)").rows == [
        (1, archive.search("harbour", k=1)[0].title)
    ]
    with pytest.raises(TierMissing):  # raised as itself from inside the query: nothing embedded yet
        archive.sql("select * from search_meaning('harbour ledger')")
    archive.upkeep(only="semantic")
    meaning = archive.sql(
        "select h.rank, c.title from search_meaning('harbour ledger', k := 2) h "
        "join conversations c using (conversation_id) order by rank"
    )
    assert [r[1] for r in meaning.rows] == [h.title for h in archive.search_meaning("harbour ledger", k=2)]


@pytest.mark.parametrize(
    ("query", "error", "says"),
    [
        ("selec * from conversations", InvalidQuery, 'SQL: Parser Error: syntax error at or near "selec"'),
        ("select * from convrsations", InvalidQuery, 'Did you mean "conversations"'),
        ("select nope from sessions", InvalidQuery, "Binder Error"),
        ("", InvalidQuery, "the query is empty"),
        ("select 1; select 2", InvalidQuery, "one statement at a time"),
        ("insert into sessions select * from sessions", QueryRefused, "this statement is INSERT"),
        ("delete from conversations", QueryRefused, "this statement is DELETE"),
        ("create table t as select 1", QueryRefused, "this statement is CREATE"),
        ("copy sessions to 'out.csv'", QueryRefused, "this statement is COPY"),
        ("attach 'other.duckdb'", QueryRefused, "this statement is ATTACH"),
        ("select * from checkpoint()", QueryRefused, "checkpoint() changes the database"),
    ],
)
def test_bad_sql_is_one_line_and_a_write_is_refused(archive, tmp_path, query, error, says):
    archive.ingest(text="A harbour ledger.", name="notes")
    with pytest.raises(error) as raised:
        archive.sql(query)
    assert says in str(raised.value) and "\n" not in str(raised.value)
    assert archive.session_count() == 1 and archive.sql("select count(*) from sessions").rows == [(1,)]


def test_a_write_past_the_checks_is_refused_by_the_read_only_transaction(archive, monkeypatch):
    archive.ingest(text="A harbour ledger.", name="notes")
    monkeypatch.setattr(views, "check", lambda query: None)
    with pytest.raises(QueryRefused, match="tried to write"):
        archive.sql("insert into a.main.sessions select * from a.main.sessions")  # the file a.duckdb: catalog a
    assert archive.session_count() == 1


def test_results_are_plain_values(archive):
    found = archive.sql(
        "select 1.5 as d, interval 2 minute as i, '\\x01'::blob as b, "
        "[1, 2] as l, {'a': date '2024-01-02'} as s, now() as t"
    )
    row = found.to_dict()["rows"][0]
    assert row[:5] == [1.5, 120.0, "01", [1, 2], {"a": "2024-01-02"}] and isinstance(row[5], str)
    assert found.types[5] == "TIMESTAMP"  # a zoned time, in UTC without its zone
