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
``migrations/_frozen_0009_conversations.py``).

The same writes keep each conversation's row current with what listing filters, orders and pages
by in SQL (``SUMMARY``): a session that becomes the latest version updates it from its own row,
and any other change (a delete, a version older than the latest) sums the conversation's versions
up again. Migration 0012 filled the rows of older archives.
"""

from __future__ import annotations

from kvdb.storage.base import SessionRow, agent_of, cwd_of, folder_of, said_at_of
from kvdb.storage.edits import Delete, Edit, Insert, Update
from kvdb.storage.sql_rows import ANY, CONVERSATION, SESSION, session_row

SUMMARY = ("versions", "updated_at", "latest_id", "said_at", "agent", "cwd", "folder")  # columns of the conversations table


def joined(conn, session: SessionRow, path: list[str], named: str | None) -> list[Edit]:
    """The rows that put a new ``session`` (already inserted, ``path``: its trie path's node ids)
    in its conversation."""
    conversation = _grown_from(conn, session, path) or named or _same_file(conn, session) or session.session_id
    edits: list[Edit] = [Insert("conversation_sessions", [{"session_id": session.session_id, "conversation_id": conversation}])]
    row = conn.execute("select versions, updated_at, latest_id, cwd from conversations where conversation_id = ?", [conversation]).fetchone()
    if row is None:
        return edits + [Insert("conversations", [{"conversation_id": conversation, "title": None, **summary(_with(conn, conversation, session))}])]
    count, updated_at, latest_id, cwd = row
    if count is not None and (session.created_at, session.session_id) > (updated_at, latest_id):  # a new latest version, as a log grows
        latest = _latest(session) | ({"cwd": cwd_of(session.metadata)} if cwd is None else {})
        return edits + [Update("conversations", "conversation_id", conversation, {"versions": count + 1, **latest})]
    return edits + [Update("conversations", "conversation_id", conversation, summary(_with(conn, conversation, session)))]


def left(conn, session_ids: list[str]) -> list[Edit]:
    """The rows to delete with these sessions: their membership, and each conversation they empty."""
    query = f"select distinct conversation_id from conversation_sessions where session_id {ANY}"
    touched = [r[0] for r in conn.execute(query, [session_ids]).fetchall()]
    remaining = f"select distinct conversation_id from conversation_sessions where conversation_id {ANY} and session_id not {ANY}"
    kept = {r[0] for r in conn.execute(remaining, [touched, session_ids]).fetchall()} if touched else set()
    emptied = [c for c in touched if c not in kept]
    edits: list[Edit] = [Delete("conversation_sessions", "session_id", session_ids)]
    gone = set(session_ids)
    for conversation, versions in versions_of(conn, sorted(kept)).items():
        edits.append(Update("conversations", "conversation_id", conversation, summary([r for r in versions if r.session_id not in gone])))
    return edits + ([Delete("conversations", "conversation_id", emptied)] if emptied else [])


def summary(versions: list[SessionRow]) -> dict:
    """A conversation's ``SUMMARY`` columns, of its versions oldest first (``Conversation``'s rules:
    its agent and folder are its first version's, its project the first cwd a version records)."""
    first = versions[0]
    cwd = next((found for r in versions if (found := cwd_of(r.metadata)) is not None), None)
    return {"versions": len(versions), **_latest(versions[-1]), "agent": agent_of(first.metadata), "cwd": cwd, "folder": folder_of(first.source)}


def versions_of(conn, conversation_ids: list[str]) -> dict[str, list[SessionRow]]:
    """These conversations' sessions, each one's oldest first, through the index on membership."""
    if not conversation_ids:
        return {}
    query = (
        f"select {SESSION} from conversation_sessions c join sessions s using (session_id) where c.conversation_id {ANY} order by s.created_at, s.session_id"
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


def _grown_from(conn, session: SessionRow, path: list[str]) -> str | None:
    query = (
        f"select {CONVERSATION} from sessions left join conversation_sessions using (session_id) "
        f"where session_id {ANY} and session_id <> ? and source = ? order by n_tokens desc limit 1"
    )
    row = conn.execute(query, [path, session.session_id, session.source]).fetchone()
    return row[0] if row else None


def _same_file(conn, session: SessionRow) -> str | None:
    if session.source.startswith("<"):
        return None
    query = (
        f"select {CONVERSATION} from sessions left join conversation_sessions using (session_id) "
        "where source = ? and name = ? and session_id <> ? order by created_at desc, session_id desc limit 1"
    )
    row = conn.execute(query, [session.source, session.name, session.session_id]).fetchone()
    return row[0] if row else None
