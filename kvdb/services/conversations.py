"""Conversations: the sessions that are states of one conversation, listed as one.

Sessions stay the storage unit (a server's chat stores a session a turn, a log ingested again
a session a growth step; the trie stores what they share once). This service groups them back:
a conversation is shown as its latest version, its versions are numbered oldest first, and a
version that does not extend the one it shares most with is a fork of it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable

from kvdb.errors import InvalidArgument
from kvdb.index.phrase import Hit
from kvdb.records import Conversation, ConversationHistory, DeletedConversation, Session, Version
from kvdb.services.reading import Reader
from kvdb.storage import Storage
from kvdb.storage.base import DeleteConversation, RenameConversation, SessionRow

TITLE_CHARS = 200


class Conversations:
    def __init__(self, storage: Storage, reader: Reader):
        self._storage = storage
        self._reader = reader

    def listed(self, agent: str | None = None, project: str | None = None, since: dt.date | None = None, until: dt.date | None = None) -> list[Conversation]:
        """Every conversation as its latest state, the most recently updated first; ``since`` and
        ``until`` bound the day of its latest version (both included)."""
        grouped: dict[str, list[SessionRow]] = {}
        for row in self._storage.list_sessions():  # oldest first
            grouped.setdefault(row.conversation_id, []).append(row)
        titles, extended = self._storage.conversation_titles(), self._storage.extended_sessions()
        out = []
        for conversation_id, rows in grouped.items():
            latest = Session.from_row(rows[-1])
            day = latest.created_at.date()
            if (agent and latest.agent != agent) or (project and latest.project != project) or (since and day < since) or (until and day > until):
                continue
            branches = sum(r.session_id not in extended for r in rows)
            out.append(Conversation(conversation_id, titles.get(conversation_id, latest.name), latest, rows[0].created_at, len(rows), max(branches, 1)))
        return sorted(out, key=lambda c: (c.latest.created_at, c.conversation_id), reverse=True)

    def history(self, ref: str) -> ConversationHistory:
        """A conversation (named by any of its versions, its id or its title) and its versions."""
        rows = self._rows(ref)
        paths = [{n.node_id: n.end for n in self._storage.node_path(r.session_id)} for r in rows]

        def shared(a: int, b: int) -> int:
            return max((end for node, end in paths[a].items() if node in paths[b]), default=0)

        versions = []
        for i, row in enumerate(rows):
            leaf = not any(shared(i, j) == row.n_tokens for j in range(len(rows)) if j != i)
            nearest = max(range(i), key=lambda j: (shared(i, j), j), default=None)
            forks = nearest is not None and shared(i, nearest) < rows[nearest].n_tokens
            branch_of, forked_at = (rows[nearest].session_id, shared(i, nearest)) if forks and nearest is not None else (None, None)
            versions.append(Version(Session.from_row(row), i + 1, i == len(rows) - 1, leaf, branch_of, forked_at))
        titles = self._storage.conversation_titles()
        conversation = Conversation(
            rows[0].conversation_id,
            titles.get(rows[0].conversation_id, rows[-1].name),
            versions[-1].session,
            rows[0].created_at,
            len(rows),
            sum(v.leaf for v in versions),
        )
        return ConversationHistory(conversation, versions)

    def rename(self, ref: str, title: str | None) -> Conversation:
        """``title`` None or empty: named by its latest version again."""
        if title is not None and len(title) > TITLE_CHARS:
            raise InvalidArgument(f"a title has at most {TITLE_CHARS} characters; this one has {len(title)}")
        rows = self._rows(ref)
        self._storage.apply(RenameConversation(rows[0].conversation_id, (title or "").strip() or None))
        return self.history(rows[0].conversation_id).conversation

    def delete(self, ref: str) -> DeletedConversation:
        """Every version of the conversation; the nodes no other session uses wait for ``gc``."""
        history = self.history(ref)
        self._storage.apply(DeleteConversation(history.conversation.conversation_id))
        return DeletedConversation(history.conversation, len(history.versions))

    def _rows(self, ref: str) -> list[SessionRow]:
        return self._storage.conversation_sessions(self._reader.resolve(ref).conversation_id)


def labelled(hits: list[Hit], conversations: dict[str, str], titles: dict[str, str]) -> list[Hit]:
    """The hits, each with its conversation (``conversations``: session id -> conversation) and
    that conversation's title (an untitled one is called by the name of the hit's version)."""
    out = []
    for hit in hits:
        conversation = conversations.get(hit.session_id, hit.session_id)
        out.append(dataclasses.replace(hit, conversation_id=conversation, title=titles.get(conversation, hit.name)))
    return out


def one_per_conversation(hits: list[Hit], k: int) -> list[Hit]:
    """The best hit of each conversation (``hits``: labelled, best first), up to ``k``."""
    seen: set[str] = set()
    out = []
    for hit in hits:
        if hit.conversation_id not in seen:
            seen.add(hit.conversation_id)
            out.append(hit)
        if len(out) == k:
            break
    return out


def widening(search: Callable[[int], list[Hit]], dedupe: Callable[[list[Hit], int], list[Hit]], k: int) -> list[Hit]:
    """``k`` conversations' best hits: a search for ``k`` hits, and one for four times as many when
    several of the first fall in one conversation."""
    hits = search(k)
    best = dedupe(hits, k)
    if len(best) < k and len(hits) >= k:
        best = dedupe(search(4 * k), k)
    return best
