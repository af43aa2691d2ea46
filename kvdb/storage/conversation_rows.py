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
"""

from __future__ import annotations

from kvdb.storage.base import SessionRow
from kvdb.storage.edits import Delete, Edit, Insert
from kvdb.storage.sql_rows import ANY, CONVERSATION


def joined(conn, session: SessionRow, path: list[str], named: str | None) -> list[Edit]:
    """The rows that put a new ``session`` (already inserted, ``path``: its trie path's node ids)
    in its conversation."""
    conversation = _grown_from(conn, session, path) or named or _same_file(conn, session) or session.session_id
    edits: list[Edit] = [Insert("conversation_sessions", [{"session_id": session.session_id, "conversation_id": conversation}])]
    if conn.execute("select 1 from conversations where conversation_id = ?", [conversation]).fetchone() is None:
        edits.append(Insert("conversations", [{"conversation_id": conversation, "title": None}]))
    return edits


def left(conn, session_ids: list[str]) -> list[Edit]:
    """The rows to delete with these sessions: their membership, and each conversation they empty."""
    query = f"select distinct conversation_id from conversation_sessions where session_id {ANY}"
    touched = [r[0] for r in conn.execute(query, [session_ids]).fetchall()]
    remaining = f"select distinct conversation_id from conversation_sessions where conversation_id {ANY} and session_id not {ANY}"
    kept = {r[0] for r in conn.execute(remaining, [touched, session_ids]).fetchall()} if touched else set()
    emptied = [c for c in touched if c not in kept]
    edits: list[Edit] = [Delete("conversation_sessions", "session_id", session_ids)]
    return edits + ([Delete("conversations", "conversation_id", emptied)] if emptied else [])


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
