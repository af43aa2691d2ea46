"""Statements with their parameters written into the SQL text as literals.

DuckDB's Python client runs a statement with parameters as a prepare, then a bind and an
execute, and a list parameter (``in (select unnest(?))``) is converted and unnested besides. An
ingest runs a score of short statements a session, so binding was a large share of a backfill's
time in the database (decision 0065 has the measurements). Values whose literal is exact and
cheap to write (integers, booleans, NULL, naive timestamps, ASCII text without NUL, short lists
of those) are written in; any other value (bytes, floats, other text) stays a parameter, as does
a long list, whose ``in`` list would cost more to parse than to bind.
"""

from __future__ import annotations

import datetime as dt
import functools
from typing import Any, cast

import duckdb

ANY = "in (select unnest(?))"  # a column's value among a list parameter's
LIST_LITERAL = 64  # the most values a list parameter is written in with
UNNEST = ANY[: ANY.index("?")]


def literal_connection(conn: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """``conn`` writing its statements' parameters in; to its callers, a connection like any."""
    return cast(duckdb.DuckDBPyConnection, LiteralConnection(conn))


class LiteralConnection:
    """A DuckDB connection whose ``execute`` writes parameters in (``bound``); everything else
    is the connection's own."""

    def __init__(self, conn: duckdb.DuckDBPyConnection):
        self._conn = conn

    def execute(self, query: str, parameters: Any = None):
        if parameters:
            query, parameters = bound(query, list(parameters))
        return self._conn.execute(query, parameters) if parameters else self._conn.execute(query)

    def __getattr__(self, name: str):
        return getattr(self._conn, name)


def bound(query: str, parameters: list) -> tuple[str, list]:
    """``query`` with each value of ``parameters`` that has an exact literal written in at its
    ``?``, and the parameters left. A list bound to ``in (select unnest(?))`` becomes an ``in
    (...)`` list."""
    pieces = _pieces(query)
    if len(pieces) != len(parameters) + 1:  # not ours to judge: DuckDB says what is wrong
        return query, parameters
    out, left = [pieces[0]], []
    for value, piece in zip(parameters, pieces[1:]):
        if isinstance(value, (list, tuple)) and out[-1].endswith(UNNEST) and piece.startswith("))"):
            items = _list_items(value)
            if items is not None:
                out[-1] = out[-1][: -len(UNNEST)] + f"in ({items}"
                out.append(piece[1:])
                continue
        written = _literal(value)
        if written is None:
            left.append(value)
            written = "?"
        out.append(written + piece)
    return "".join(out), left


@functools.lru_cache(maxsize=512)
def _pieces(query: str) -> tuple[str, ...]:
    """The text between the query's placeholders: its ``?`` outside quotes."""
    pieces, start, quote = [], 0, ""
    for at, char in enumerate(query):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "?":
            pieces.append(query[start:at])
            start = at + 1
    pieces.append(query[start:])
    return tuple(pieces)


def _literal(value) -> str | None:
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'" if value.isascii() and "\x00" not in value else None
    if isinstance(value, dt.datetime) and value.tzinfo is None:
        return f"TIMESTAMP '{value.isoformat(sep=' ')}'"
    if isinstance(value, (list, tuple)):
        items = _list_items(value)
        return None if items is None else f"[{items}]"
    return None


def _list_items(values) -> str | None:
    if not values or len(values) > LIST_LITERAL:
        return None
    items = [_literal(v) for v in values]
    written = [i for i in items if i is not None and i != "NULL"]
    return ", ".join(written) if len(written) == len(items) else None
