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
from kvdb.index.trie import TrieView
from kvdb.records import Conversation, ConversationHistory, ConversationPage, DeletedConversation, Session, Version
from kvdb.services.forgetting import Forgetting
from kvdb.services.reading import Reader
from kvdb.storage import Storage
from kvdb.storage.base import ConversationFilter, ConversationRow, DeleteConversation, RenameConversation, SessionRow

TITLE_CHARS = 200


class Conversations:
    def __init__(self, storage: Storage, reader: Reader):
        self._storage = storage
        self._reader = reader

    def listed(
        self,
        agent: str | None = None,
        project: str | None = None,
        since: dt.date | None = None,
        until: dt.date | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[Conversation]:
        """Every conversation as its latest state, the most recently updated first; ``agent`` is
        its format, ``project`` its folder or a folder it is inside, and ``since`` and ``until``
        bound the day its latest version was said (``Session.said_at``; both included). ``limit``
        and ``offset`` page it."""
        return self.page(agent, project, since, until, limit, offset).conversations

    def page(
        self,
        agent: str | None = None,
        project: str | None = None,
        since: dt.date | None = None,
        until: dt.date | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> ConversationPage:
        """``listed``'s page and how many the filters admit in all. The filters, the order, the
        page and each conversation's summary (its branches too) are the storage's, read for the
        page's conversations alone: never every session of the archive, nor a path per version."""
        found = self._storage.conversations_page(ConversationFilter(agent, project, since, until), limit, offset)
        return ConversationPage([_conversation(row) for row in found.conversations], found.total, max(offset, 0))

    def scope(
        self, agent: str | None, project: str | None, since: dt.date | None, until: dt.date | None
    ) -> set[str] | None:
        """The conversations these filters admit (as ``listed``), for a search to keep to; None: no filter."""
        admits = ConversationFilter(agent, project, since, until)
        return None if admits.admits_all else set(self._storage.conversation_ids(admits))

    def history(self, ref: str) -> ConversationHistory:
        """A conversation (named by any of its versions, its id or its title) and its versions."""
        rows = self._rows(ref)
        shared = self._sharing(rows)
        versions, followed, continued = [], _find_followed(rows), _continued(rows, shared)
        for i, row in enumerate(rows):
            leaf = (
                row.session_id not in followed
                and i not in continued
                and not any(shared(i, j) == row.n_tokens for j in range(len(rows)) if j != i)
            )
            earlier = [j for j in range(i) if _same_part(rows[j], row)]
            most = max((shared(i, j) for j in earlier), default=0)
            # a fork: an earlier version holds those tokens and went on another way; it forks from the first such.
            # A log's first part that an earlier whole version holds goes on in the parts after it: no fork
            went_on = [
                j
                for j in earlier
                if shared(i, j) == most and rows[j].n_tokens > most and not (j in continued and most == row.n_tokens)
            ]
            branch_of, forked_at = (rows[went_on[0]].session_id, most) if went_on else (None, None)
            versions.append(Version(Session.from_row(row), i + 1, i == len(rows) - 1, leaf, branch_of, forked_at))
        summary = self._storage.conversation_row(rows[0].conversation_id)
        assert summary is not None  # its sessions were just read
        return ConversationHistory(
            dataclasses.replace(_conversation(summary), branches=sum(v.leaf for v in versions)), versions
        )

    def _sharing(self, rows: list[SessionRow]) -> Callable[[int, int], int]:
        """shared(a, b): how many first tokens the versions ``rows[a]`` and ``rows[b]`` share (as the trie
        stores them)."""
        paths = [{n.node_id: n.end for n in self._storage.node_path(r.session_id)} for r in rows]
        return lambda a, b: max((end for node, end in paths[a].items() if node in paths[b]), default=0)

    def rename(self, ref: str, title: str | None) -> Conversation:
        """``title`` None or empty: called by its file's title (or its first version's name) again."""
        if title is not None and len(title) > TITLE_CHARS:
            raise InvalidArgument(f"a title has at most {TITLE_CHARS} characters; this one has {len(title)}")
        rows = self._rows(ref)
        self._storage.apply(RenameConversation(rows[0].conversation_id, (title or "").strip() or None))
        return self.history(rows[0].conversation_id).conversation

    def delete(self, ref: str) -> DeletedConversation:
        """Every version of the conversation; the nodes no other session uses wait for ``gc``."""
        history = self.history(ref)
        rows = self._storage.conversation_sessions(history.conversation.conversation_id)
        self._storage.apply(DeleteConversation(history.conversation.conversation_id))
        Forgetting(self._storage).deleted(rows)  # what gc then erases, and watch's tombstone
        return DeletedConversation(history.conversation, len(history.versions))

    def _rows(self, ref: str) -> list[SessionRow]:
        return self._storage.conversation_sessions(self._reader.resolve(ref).conversation_id)


def _part(row: SessionRow) -> dict:
    """Where a session is a part of one longer than the model's context: see ``kvdb.services.write_plan.plan_parts``."""
    return row.metadata.get("part") or {}


def _same_part(earlier: SessionRow, row: SessionRow) -> bool:
    """Whether ``row`` may fork from ``earlier``: a later part of a long log (one that follows
    another) goes on from the part before it, and forks only from a version of its own part."""
    return not _part(row).get("follows") or _part(earlier).get("number") == _part(row)["number"]


def _continued(rows: list[SessionRow], shared: Callable[[int, int], int]) -> set[int]:
    """The whole versions that a log's first part is a prefix of: the log passed the model's
    context, and the parts after that one go on from them (no end of the conversation)."""
    firsts = [k for k, r in enumerate(rows) if _part(r).get("number") == 1]
    return {
        j
        for j, r in enumerate(rows)
        if not _part(r) and any(k != j and shared(k, j) == rows[k].n_tokens for k in firsts)
    }


def _find_followed(rows: list[SessionRow]) -> set[str]:
    """The sessions a later part goes on from: no end of the conversation, though no session extends them."""
    return {_part(r)["follows"] for r in rows if _part(r).get("follows")}


def _conversation(row: ConversationRow) -> Conversation:
    """A conversation as storage sums it up (``ConversationRow``): named by its title, else the
    title the latest version that records one took from its file (``Session.title``: a log grows
    its summary after its first prompt; a fork ``kvdb serve`` archives records none), else its
    first version's name; about the first folder a version records (``Session.project``), begun
    when its first version's file says."""
    latest = Session.from_row(row.latest)
    return Conversation(
        latest.conversation_id, row.title, latest, row.started_at, row.versions, row.branches, row.agent, row.project
    )


def labelled(hits: list[Hit], view: TrieView, storage: Storage, known: dict[str, str]) -> list[Hit]:
    """The hits, each with its conversation and that conversation's title as a listing gives it
    (``_conversation``), read for the conversations not ``known`` yet (conversation -> title, kept
    by the caller for as long as the archive's version: searches in one process mostly land in
    the conversations they landed in before, and a read takes milliseconds)."""
    conversations = [view.conversations.get(hit.session_id, hit.session_id) for hit in hits]
    missing = sorted({c for c in conversations if c not in known})
    if missing:
        known.update(dict.fromkeys(missing, ""))  # one no row names is not read again
        known.update((row.latest.conversation_id, row.title) for row in storage.conversation_rows(missing))
    return [
        dataclasses.replace(hit, conversation_id=conversation, title=known[conversation] or hit.name)
        for hit, conversation in zip(hits, conversations)
    ]


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


def widen_search(
    search: Callable[[int], list[Hit]], dedupe: Callable[[list[Hit], int], list[Hit]], k: int
) -> list[Hit]:
    """``k`` conversations' best hits: a search for ``k`` hits, and one for four times as many when
    several of the first fall in one conversation."""
    hits = search(k)
    best = dedupe(hits, k)
    if len(best) < k and len(hits) >= k:
        best = dedupe(search(4 * k), k)
    return best


def scoped_owners(
    view: TrieView, reader: Reader, session: str | None, within: set[str] | None
) -> dict[str, str] | None:
    """node_id -> the session a scoped search reports its hits in: ``session``'s path, or the
    paths of the conversations ``within``; None when the search is not scoped."""
    if session is not None:
        wanted = reader.resolve(session).session_id
        return {n.node_id: wanted for n in view.path(wanted)}
    return view.owners_within(within) if within is not None else None
