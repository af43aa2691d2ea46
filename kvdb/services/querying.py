"""SQL over the archive as a database operation (``Archive.sql``, ``kvdb sql``, docs/sql.md).

The views are storage's (:mod:`kvdb.storage.views`); this service gives them what only the
library computes, as functions a query calls row by row: a turn's text (decoded from the token
stream by the tokenizer), and the hits of a phrase or meaning search, relations a query joins to
the views by ``conversation_id``. Each function runs when, and as often as, the query asks for
it: ``turns`` decodes only the conversations a query's filters leave, ``search('...')`` runs one
search, and nothing loads the language model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import lru_cache

from kvdb.errors import InvalidArgument
from kvdb.index.phrase import Hit
from kvdb.records import QueryResult
from kvdb.services.reading import Reader
from kvdb.storage import Storage, views

SESSION_TURNS_CACHED = 64  # sessions whose turns one query keeps decoded (a query may ask twice)


class Querying:
    def __init__(
        self,
        storage: Storage,
        reader: Reader,
        search: Callable[..., list[Hit]],
        search_meaning: Callable[..., list[Hit]],
    ):
        """``search(phrase, k, case_sensitive=)`` and ``search_meaning(query, k)``: the archive's searches."""
        self._storage = storage
        self._reader = reader
        self._search = search
        self._search_meaning = search_meaning

    def sql(self, query: str) -> QueryResult:
        """Run one read-only SELECT over the views and the search macros (see docs/sql.md)."""
        if not isinstance(query, str):
            raise InvalidArgument("give the query as one string of SQL")

        @lru_cache(maxsize=SESSION_TURNS_CACHED)
        def turns(session_id: str) -> list[dict]:
            found = self._reader.turns(session_id)
            return [
                {"turn": i, "role": t.role, "start": t.start, "stop": t.end, "text": t.text}
                for i, t in enumerate(found, 1)
            ]

        def search(phrase: str, k: int, partial: bool, case_sensitive: bool) -> list[dict]:
            hits = self._search(phrase, _k(k), case_sensitive=case_sensitive)
            return _hits(hits if partial else [h for h in hits if h.exact])

        def search_meaning(query: str, k: int) -> list[dict]:
            return _hits(self._search_meaning(query, _k(k)))

        functions = [
            views.Function("kvdb_turns", turns, ("VARCHAR",), views.TURN_TYPE),
            views.Function("kvdb_search", search, ("VARCHAR", "BIGINT", "BOOLEAN", "BOOLEAN"), views.HIT_TYPE),
            views.Function("kvdb_search_meaning", search_meaning, ("VARCHAR", "BIGINT"), views.HIT_TYPE),
        ]
        found = views.run(self._storage, query, functions, threading.Lock())
        return QueryResult(found.columns, found.types, found.rows)


def _k(k: int) -> int:
    if k < 1:
        raise InvalidArgument(f"a search in SQL takes k >= 1 hits (k := {k})")
    return int(k)


def _hits(hits: list[Hit]) -> list[dict]:
    return [
        {
            "rank": rank,
            "conversation_id": h.conversation_id,
            "session_id": h.session_id,
            "title": h.title,
            "name": h.name,
            "position": h.position,
            "match_tokens": h.match_tokens,
            "score": float(h.score),
            "exact": h.exact,
            "text": h.match,
            "context": h.context,
        }
        for rank, h in enumerate(hits, 1)
    ]
