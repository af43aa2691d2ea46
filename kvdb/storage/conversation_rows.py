"""Which conversation a session belongs to, decided inside the transaction that writes it, so
two writers of one lake cannot both start a conversation that is one.

A session joins, in this order:
1. the conversation of the longest archived session from the same source that is a prefix of it
   (a log that grew, a chat turn after turn): that session's leaf lies on its trie path;
2. the conversation its writer names (a server's chat names the one it continues, forks or starts);
3. from a file (a source that is no ``<text>`` or ``<messages>``), the conversation of the
   latest session of the same file and name (a log rewritten: the versions fork);
4. else a conversation of its own, named by its id.

Migration 0009 grouped the sessions of older archives by the same rules (frozen in
``kvdb/migrations/_frozen_0009_conversations.py``).

The same writes keep each conversation's row current with what listing filters, orders and pages
by in SQL (``SUMMARY``): a session that becomes the latest version updates it from its own row,
and any other change (a delete, a version older than the latest) sums the conversation's versions
up again. Migration 0012 filled the rows of older archives. A listing reads a page of them and
sums up only that page's versions (``LISTED``).
"""

from __future__ import annotations

from kvdb.storage.base import ConversationRow, SessionRow, agent_of, cwd_of, folder_of, said_at_of, stamp
from kvdb.storage.edits import Delete, Edit, Insert, Update
from kvdb.storage.literals import ANY
from kvdb.storage.sql_rows import SESSION, session_row

# columns of the conversations table
SUMMARY = ("versions", "updated_at", "latest_id", "said_at", "agent", "cwd", "folder")

# The versions of a page of conversations, as a listing sums them up (``listed``): the conversations
# table's rows that ``{where}`` admits (a filter on its own columns), ordered and cut (``{paged}``),
# then those conversations' versions alone, oldest first, with what a listing needs of their
# metadata read out in SQL (only the latest version's is parsed), and how many it admits in all.
LISTED = """
with page as (
    select conversation_id, title, agent, coalesce(cwd, folder) as project, updated_at, count(*) over () as total
    from conversations{where} order by updated_at desc, conversation_id desc{paged}
)
select s.session_id, s.name, s.source, s.model_id, s.created_at, s.n_tokens, s.metadata, p.conversation_id,
       p.title, p.agent, p.project, coalesce(n.refcount > 1, false),
       json_extract_string(s.metadata, '$.part.number'), json_extract_string(s.metadata, '$.part.follows'),
       case when json_type(s.metadata, '$.title') = 'VARCHAR' then nullif(s.metadata ->> '$.title', '') end,
       case when json_type(s.metadata, '$.started') = 'VARCHAR' then s.metadata ->> '$.started' end, p.total
from page p join conversation_sessions using (conversation_id) join sessions s using (session_id)
left join nodes n on n.node_id = s.session_id
order by p.updated_at desc, p.conversation_id desc, s.created_at, s.session_id
"""

# The whole versions (of the pairs given: whole, first part, the part's end) that a first part is a
# prefix of: its leaf lies on their path, found by walking up from their leaf no further than the part's end.
CONTINUED = """
with recursive walk as (
    select p.whole, p.first_part, p.part_end, n.node_id, n.start, n.parent_id
    from (select unnest(?) as whole, unnest(?) as first_part, unnest(?) as part_end) p
         join nodes n on n.node_id = p.whole
    union all
    select w.whole, w.first_part, w.part_end, n.node_id, n.start, n.parent_id
    from walk w join nodes n on n.node_id = w.parent_id where w.start >= w.part_end
)
select distinct whole from walk where node_id = first_part
"""


def listed(
    conn, where: str, params: list, paged: str = "", bounds: list | None = None
) -> tuple[list[ConversationRow], int | None]:
    """A page of conversations (``LISTED``), each summed up by the rules of
    ``kvdb.services.conversations``: a version is an end of its conversation (``branches``) unless
    a session runs through its leaf, a later part goes on from it (``follows``), or a first part of
    the conversation is a prefix of it (a whole version archived before its log passed the model's
    context, which goes on in the parts). Only a part another session runs through can be one.
    With them, how many conversations ``where`` admits in all (None: the page is empty)."""
    grouped: dict[str, list[tuple]] = {}
    for r in conn.execute(LISTED.format(where=where, paged=paged), [*params, *(bounds or [])]).fetchall():
        grouped.setdefault(r[7], []).append(r)
    pairs = [
        (whole[0], part[0], part[5])
        for rows in grouped.values()
        for part in rows
        if part[12] == "1" and part[11]
        for whole in rows
        if whole[12] is None and whole[5] > part[5]
    ]
    continued = (
        {r[0] for r in conn.execute(CONTINUED, [list(column) for column in zip(*pairs, strict=True)]).fetchall()}
        if pairs
        else set()
    )
    out = []
    for rows in grouped.values():
        first, latest = rows[0], rows[-1]
        went_on = {r[13] for r in rows if r[13]} | continued
        title = first[8] or next((r[14] for r in reversed(rows) if r[14]), first[1])
        branches = sum(not r[11] and r[0] not in went_on for r in rows)
        out.append(
            ConversationRow(
                session_row(latest), title, stamp(first[15], first[4]), len(rows), branches, first[9], first[10]
            )
        )
    return out, (int(next(iter(grouped.values()))[0][16]) if grouped else None)


def joined(conn, session: SessionRow, path: list[str], named: str | None) -> list[Edit]:
    """The rows that put a new ``session`` (already inserted, ``path``: its trie path's node ids)
    in its conversation."""
    grown, same_file = _earlier(conn, session, path)
    conversation = grown or named or same_file or session.session_id
    edits: list[Edit] = [
        Insert("conversation_sessions", [{"session_id": session.session_id, "conversation_id": conversation}])
    ]
    row = conn.execute(
        "select versions, updated_at, latest_id, cwd from conversations where conversation_id = ?", [conversation]
    ).fetchone()
    if row is None:  # a conversation's row comes with its first session (migration 0012 made those of older archives)
        return edits + [
            Insert("conversations", [{"conversation_id": conversation, "title": None, **summary([session])}])
        ]
    count, updated_at, latest_id, cwd = row
    # a new latest version, as a log grows
    if count is not None and (session.created_at, session.session_id) > (updated_at, latest_id):
        latest = _latest(session) | ({"cwd": cwd_of(session.metadata)} if cwd is None else {})
        return edits + [Update("conversations", "conversation_id", conversation, {"versions": count + 1, **latest})]
    return edits + [
        Update("conversations", "conversation_id", conversation, summary(_with(conn, conversation, session)))
    ]


def left(conn, session_ids: list[str]) -> list[Edit]:
    """The rows to delete with these sessions: their membership, and each conversation they empty."""
    query = f"select distinct conversation_id from conversation_sessions where session_id {ANY}"
    touched = [r[0] for r in conn.execute(query, [session_ids]).fetchall()]
    remaining = (
        "select distinct conversation_id from conversation_sessions "
        f"where conversation_id {ANY} and session_id not {ANY}"
    )
    kept = {r[0] for r in conn.execute(remaining, [touched, session_ids]).fetchall()} if touched else set()
    emptied = [c for c in touched if c not in kept]
    edits: list[Edit] = [Delete("conversation_sessions", "session_id", session_ids)]
    gone = set(session_ids)
    for conversation, versions in versions_of(conn, sorted(kept)).items():
        edits.append(
            Update(
                "conversations",
                "conversation_id",
                conversation,
                summary([r for r in versions if r.session_id not in gone]),
            )
        )
    return edits + ([Delete("conversations", "conversation_id", emptied)] if emptied else [])


def summary(versions: list[SessionRow]) -> dict:
    """A conversation's ``SUMMARY`` columns, of its versions oldest first (``Conversation``'s rules:
    its agent and folder are its first version's, its project the first cwd a version records)."""
    first = versions[0]
    cwd = next((found for r in versions if (found := cwd_of(r.metadata)) is not None), None)
    return {
        "versions": len(versions),
        **_latest(versions[-1]),
        "agent": agent_of(first.metadata),
        "cwd": cwd,
        "folder": folder_of(first.source),
    }


def versions_of(conn, conversation_ids: list[str]) -> dict[str, list[SessionRow]]:
    """These conversations' sessions, each one's oldest first, through the index on membership."""
    if not conversation_ids:
        return {}
    query = (
        f"select {SESSION} from conversation_sessions c join sessions s using (session_id) "
        f"where c.conversation_id {ANY} order by s.created_at, s.session_id"
    )
    out: dict[str, list[SessionRow]] = {}
    for r in conn.execute(query, [list(conversation_ids)]).fetchall():
        out.setdefault(r[7], []).append(session_row(r))
    return out


def _latest(session: SessionRow) -> dict:
    said_at = said_at_of(session.created_at, session.metadata).replace(tzinfo=None)  # the day its log says, not UTC's
    return {"updated_at": session.created_at, "latest_id": session.session_id, "said_at": said_at}


def _with(conn, conversation: str, session: SessionRow) -> list[SessionRow]:
    """The conversation's versions with ``session`` among them, oldest first."""
    others = [r for r in versions_of(conn, [conversation]).get(conversation, []) if r.session_id != session.session_id]
    return sorted([*others, session], key=lambda r: (r.created_at, r.session_id))


def _earlier(conn, session: SessionRow, path: list[str]) -> tuple[str | None, str | None]:
    """(the conversation of the longest session from the same source on ``path``, that of the
    latest session of the same file and name): rules 1 and 3. The candidates are read from the
    sessions table alone, by its key and by ``ix_sessions_name``, and only the chosen ones'
    conversations looked up by key: joining the membership table in made each session's write
    scan it whole (decision 0061), and so did a filter on the source beside them, which DuckDB
    serves from no index (decision 0066)."""
    file = not session.source.startswith("<")  # a text or messages given in a call is no file
    columns = "session_id, source, n_tokens, created_at"
    on_path = conn.execute(f"select {columns} from sessions where session_id {ANY}", [path]).fetchall() if path else []
    named = conn.execute(f"select {columns} from sessions where name = ?", [session.name]).fetchall() if file else []
    grown = max(_from_source(on_path, session), key=lambda r: r[2], default=None)
    same_file = max(_from_source(named, session), key=lambda r: (r[3], r[0]), default=None)
    return (None if grown is None else _conversation_of(conn, grown[0])), (
        None if same_file is None else _conversation_of(conn, same_file[0])
    )


def _from_source(rows: list[tuple], session: SessionRow) -> list[tuple]:
    """The other sessions of ``rows`` archived from ``session``'s source."""
    return [r for r in rows if r[1] == session.source and r[0] != session.session_id]


def _conversation_of(conn, session_id: str) -> str:
    row = conn.execute(
        "select conversation_id from conversation_sessions where session_id = ?", [session_id]
    ).fetchone()
    return session_id if row is None else row[0]  # a session no migration or write grouped is a conversation of its own
