"""SQL over the archive (``Archive.sql``, ``kvdb sql``): the documented views, the check that a
query only reads, and the read-only connection it runs on.

The views are temporary views of the query's own connection, named after what a user asks about
(``VIEWS``, pinned by tests/services/test_sql.py and documented in docs/sql.md). They read the
archive's tables by their qualified names, so a view may shadow the table it reads (``sessions``,
``conversations``); they never show a stored block (tokens, codes, vectors: blobs). What no SQL
can compute (a turn's text is decoded from the token stream by the tokenizer; a search runs over
the search indexes) comes from functions the caller registers (``Function``), which the views
and table macros call (kvdb.services.querying).

A query runs only if DuckDB's own parser finds one SELECT statement in it, calling none of the
functions that change a database from inside a SELECT (DuckLake's maintenance, a checkpoint),
and then inside a ``READ ONLY`` transaction, rolled back, on a connection of its own (a second
connection to the database the archive holds open, read-only where the archive is: the CLI opens
it so). DuckDB refuses any write in such a transaction, so even a crafted query cannot write.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import duckdb
import duckdb.func

from kvdb.errors import InvalidQuery, QueryRefused
from kvdb.storage.sql import Storage

# view -> its columns, in order: the documented interface (docs/sql.md), pinned by a test
VIEWS: dict[str, tuple[str, ...]] = {
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
# table macro -> its columns: search hits and a session's turns, as relations a query joins
HIT_COLUMNS = (
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
MACROS: dict[str, tuple[str, ...]] = {
    "search": HIT_COLUMNS,
    "search_meaning": HIT_COLUMNS,
    "turns_of": ("turn", "role", "start", "stop", "text"),
}

TURN_TYPE = "STRUCT(turn INTEGER, role VARCHAR, start BIGINT, stop BIGINT, text VARCHAR)[]"
HIT_TYPE = (
    "STRUCT(rank INTEGER, conversation_id VARCHAR, session_id VARCHAR, title VARCHAR, name VARCHAR, position BIGINT, "
    "match_tokens INTEGER, score DOUBLE, exact BOOLEAN, text VARCHAR, context VARCHAR)[]"
)

# A time kvdb.transcripts.stamps wrote (ISO 8601), as the log wrote it without its zone (as the
# conversations table keeps ``said_at``), else NULL.
_STAMP = "try_cast(regexp_replace({0}, '(Z|[+-][0-9][0-9]:?[0-9][0-9])$', '') as timestamp)"


def _text(metadata: str, key: str) -> str:
    """A metadata key's value where it is a non-empty string, else NULL."""
    return f"case when json_type({metadata}, '$.{key}') = 'VARCHAR' then nullif({metadata} ->> '$.{key}', '') end"


def _definitions(db: str) -> dict[str, str]:
    """Each view's SELECT over the archive's tables in catalog ``db`` (quoted)."""
    t = f"{db}.main"
    started = _STAMP.format(_text("s.metadata", "started"))
    ended = _STAMP.format(_text("s.metadata", "ended"))
    cwd = "nullif(s.metadata ->> '$.cwd', '')"
    # Session.project: the working directory its log records, else its file's folder (none for <text>, <messages>)
    folder = (
        "case when s.source like '<%' then null when strpos(s.source, '/') = 0 then '.' "
        "else coalesce(nullif(regexp_replace(s.source, '/+[^/]*$', ''), ''), '/') end"
    )
    order = "(s.created_at, s.session_id)"
    kept = "list_contains(string_split(coalesce(n.keep, 'search'), ','), '{0}')"
    return {
        "conversations": (
            f"""
            with v as (
                select cs.conversation_id,
                       arg_min(s.name, {order}) as first_name,
                       arg_max({_text("s.metadata", "title")}, {order})
                           filter (where {_text("s.metadata", "title")} is not null) as file_title,
                       arg_min(coalesce({started}, s.created_at), {order}) as started_at
                from {t}.conversation_sessions cs join {t}.sessions s using (session_id) group by cs.conversation_id
            )
            select c.conversation_id, coalesce(c.title, v.file_title, v.first_name) as title, c.agent,
                   coalesce(c.cwd, c.folder) as project, c.versions, c.latest_id as latest_session_id, l.n_tokens,
                   v.started_at, c.said_at, c.updated_at
            from {t}.conversations c left join v using (conversation_id)
                 left join {t}.sessions l on l.session_id = c.latest_id"""
        ),
        "sessions": (
            f"""
            select s.session_id, coalesce(cs.conversation_id, s.session_id) as conversation_id, s.name,
                   coalesce({_text("s.metadata", "title")}, s.name) as title, s.source,
                   {_text("s.metadata", "format")} as agent,
                   coalesce({cwd}, {folder}) as project, m.name as model, s.n_tokens,
                   try_cast(s.metadata ->> '$.part.number' as integer) as part, s.created_at,
                   coalesce({started}, s.created_at) as started_at, coalesce({ended}, s.created_at) as said_at
            from {t}.sessions s left join {t}.conversation_sessions cs using (session_id)
                 left join {t}.models m using (model_id)"""
        ),
        "turns": (
            f"""
            select c.conversation_id, c.latest_id as session_id, c.agent, coalesce(c.cwd, c.folder) as project,
                   c.said_at,
                   unnest(kvdb_turns(c.latest_id), recursive := true)
            from {t}.conversations c where c.latest_id is not null"""
        ),
        "agents": """
            select agent, count(*) as conversations, sum(versions)::bigint as sessions, sum(n_tokens)::bigint as tokens,
                   min(started_at) as first_started_at, max(said_at) as last_said_at
            from temp.main.conversations group by agent""",
        "projects": (
            """
            select project, count(*) as conversations, sum(versions)::bigint as sessions,
                   count(distinct agent) as agents,
                   sum(n_tokens)::bigint as tokens, min(started_at) as first_started_at, max(said_at) as last_said_at
            from temp.main.conversations group by project"""
        ),
        "tiers": (
            f"""
            select 'tokens' as tier, count(*) as nodes, coalesce(sum(n.n_tokens), 0)::bigint as tokens,
                   (select coalesce(sum(octet_length(data)), 0) from {t}.token_blocks)::bigint as bytes
            from {t}.nodes n where {kept.format("tokens")}
            union all
            select 'search', count(*), coalesce(sum(n.n_tokens), 0), null from {t}.nodes n where {kept.format("search")}
            union all
            select 'lm', count(*), coalesce(sum(n.n_tokens), 0), coalesce(sum(octet_length(l.payload)), 0)
            from {t}.node_lm l join {t}.nodes n using (node_id)
            union all
            select 'kv', count(*), coalesce(sum(n.n_tokens), 0), coalesce(sum(k.bytes), 0)
            from (select node_id, sum(octet_length(data)) as bytes from {t}.node_kv group by node_id) k
                 join {t}.nodes n using (node_id)
            union all
            select 'semantic', count(*), coalesce(sum(n.n_tokens), 0), coalesce(sum(k.bytes), 0)
            from (select node_id, sum(octet_length(vector)) as bytes from {t}.node_chunks group by node_id) k
                 join {t}.nodes n using (node_id)"""
        ),
    }


MACRO_SQL = {
    "search": "(phrase, k := 1000, partial := false, case_sensitive := false) as table "
    "select unnest(kvdb_search(phrase, k, partial, case_sensitive), recursive := true)",
    "search_meaning": "(query, k := 10) as table select unnest(kvdb_search_meaning(query, k), recursive := true)",
    "turns_of": "(session) as table select unnest(kvdb_turns(session), recursive := true)",
}


@dataclass(frozen=True)
class Function:
    """A scalar function the views and macros call: ``call`` is Python, run once per row (the
    turns of a session, the hits of a search), serialised with the archive's other reads."""

    name: str
    call: Callable
    parameters: tuple[str, ...]
    returns: str


@dataclass(frozen=True)
class Rows:
    columns: list[str]
    types: list[str]
    rows: list[tuple]


def check(query: str) -> None:
    """Refuse anything but one SELECT (or WITH ... SELECT, FROM ..., VALUES), by DuckDB's parser."""
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as exc:
        raise InvalidQuery(f"SQL: {_one_line(exc)}") from exc
    if not statements:
        raise InvalidQuery("SQL: the query is empty; give one SELECT, e.g. `select * from conversations limit 5`")
    if len(statements) > 1:
        raise InvalidQuery(f"SQL: give one statement at a time; this query holds {len(statements)}")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise QueryRefused(
            f"SQL: only a read (SELECT, WITH ... SELECT) runs over the archive; this statement is {kind.name} "
            "(change the archive with kvdb's own commands: ingest, delete, rename, gc)"
        )


# Functions that change a database from inside a SELECT: DuckLake's maintenance and a checkpoint.
# Of DuckLake's functions, only those that read are let through.
WRITING_FUNCTIONS = frozenset({"checkpoint", "force_checkpoint"})
READING_DUCKLAKE = frozenset(
    {
        "ducklake_snapshots",
        "ducklake_current_snapshot",
        "ducklake_last_committed_snapshot",
        "ducklake_table_info",
        "ducklake_list_files",
        "ducklake_table_changes",
        "ducklake_table_insertions",
        "ducklake_table_deletions",
        "ducklake_options",
    }
)


def refuse_writing_functions(conn: duckdb.DuckDBPyConnection, query: str) -> None:
    """Refuse a query that calls a function that writes, found in DuckDB's parse tree of it."""
    (tree,) = conn.execute("select json_serialize_sql(?)", [query]).fetchone()  # type: ignore[misc]
    called = set(_function_names(json.loads(tree)))
    writing = sorted(
        n
        for n in called
        if n.lower() in WRITING_FUNCTIONS or (n.lower().startswith("ducklake_") and n.lower() not in READING_DUCKLAKE)
    )
    if writing:
        raise QueryRefused(
            f"SQL: {writing[0]}() changes the database; a query over the archive only reads (`kvdb gc` does the upkeep)"
        )


def _function_names(node) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "function_name" and isinstance(value, str):
                yield value
            else:
                yield from _function_names(value)
    elif isinstance(node, list):
        for value in node:
            yield from _function_names(value)


_ONE_QUERY = threading.Lock()  # the functions are the database's (every connection sees them): one query at a time


def run(storage: Storage, query: str, functions: Sequence[Function], lock: threading.Lock) -> Rows:
    """``query`` (``check``-ed) over the views, with ``functions`` registered meanwhile; ``lock``
    is taken around each call of a function (the archive's reads go one at a time)."""
    check(query)
    with _ONE_QUERY, _read_only_connection(storage) as (conn, db):
        refuse_writing_functions(conn, query)
        called: list[BaseException] = []
        (threads,) = conn.execute("select current_setting('threads')").fetchone()  # type: ignore[misc]
        try:
            # One thread while the query runs: a function reads the archive by the archive's own
            # connection from inside the query, and DuckDB's other workers, idle meanwhile, took the
            # cores from those reads (turns decoded 3x slower on 2 cores). The database's setting: restored after.
            conn.execute("set threads = 1")
            for f in functions:
                conn.create_function(
                    f.name,
                    _guarded(f.call, lock, called),
                    [duckdb.sqltype(p) for p in f.parameters],
                    duckdb.sqltype(f.returns),
                    type=duckdb.func.PythonUDFType.NATIVE,
                    null_handling=duckdb.func.FunctionNullHandling.SPECIAL,
                    side_effects=False,
                )
            for name, select in _definitions(db).items():
                conn.execute(f"create or replace temp view {name} as {select}")
            for name, body in MACRO_SQL.items():
                conn.execute(f"create or replace temp macro {name}{body}")
            conn.execute("begin transaction read only")
            try:
                result = conn.execute(query)
                columns = [d[0] for d in result.description or ()]
                types = [str(d[1]) for d in result.description or ()]
                if any(ZONED in t for t in types):  # Python's zoned times need pytz, which kvdb does not require
                    result = conn.execute(_without_zones(query, columns, types))
                    types = [str(d[1]) for d in result.description or ()]
                rows = result.fetchall()
            except duckdb.Error as exc:
                raise _explained(exc, called, storage) from exc
            finally:
                with contextlib.suppress(duckdb.Error):
                    conn.execute("rollback")
        finally:
            for f in functions:
                with contextlib.suppress(duckdb.Error):
                    conn.remove_function(f.name)
            with contextlib.suppress(duckdb.Error):
                conn.execute(f"set threads = {int(threads)}")
    return Rows(columns, types, rows)


ZONED = "WITH TIME ZONE"


def _without_zones(query: str, columns: list[str], types: list[str]) -> str:
    """``query`` with its times with a zone in UTC without it (nested in a list or struct: as text)."""
    picked = []
    for i, (name, kind) in enumerate(zip(columns, types, strict=True), 1):
        value = (
            f"timezone('UTC', #{i})"
            if kind == f"TIMESTAMP {ZONED}"
            else f"cast(#{i} as varchar)"
            if ZONED in kind
            else f"#{i}"
        )
        picked.append(f'{value} as "{_quoted(name)}"')
    body = query.rstrip().rstrip(";").rstrip()  # one statement (``check``): a semicolon can only end it
    return f"select {', '.join(picked)} from (\n{body}\n) as q"


def _guarded(call: Callable, lock: threading.Lock, called: list[BaseException]) -> Callable:
    """``call`` one at a time (DuckDB may call from several threads), its error kept to raise as is."""

    @functools.wraps(call)  # DuckDB reads the parameters from the signature, which wraps passes on
    def guarded(*args):
        if any(a is None for a in args):
            return None
        try:
            with lock:
                return call(*args)
        except BaseException as exc:
            called.append(exc)
            raise

    return guarded


def _explained(exc: duckdb.Error, called: list[BaseException], storage: Storage) -> BaseException:
    """A function's own error (a search refused, a session not found) as it was raised; the
    engine's (a lake unreachable) as it explains it; else DuckDB's, on one line."""
    if called:
        return called[0]
    explained = storage.engine.explain(exc)
    if explained is not None:
        return explained
    if isinstance(exc, duckdb.TransactionException) and "read-only" in str(exc):
        return QueryRefused(f"SQL: the query tried to write ({_one_line(exc)}); a query over the archive only reads")
    return InvalidQuery(f"SQL: {_one_line(exc)}")


def _one_line(exc: BaseException) -> str:
    """DuckDB's message on one line: its first, and its suggestion (``Did you mean ...``, ``Candidate bindings:
    ...``)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    hint = next((line for line in lines[1:] if line.startswith(("Did you mean", "Candidate bindings"))), None)
    return lines[0] + (f" {hint}" if hint else "")


@contextlib.contextmanager
def _read_only_connection(storage: Storage) -> Iterator[tuple[duckdb.DuckDBPyConnection, str]]:
    """A connection of the query's own, and the quoted catalog holding the archive's tables."""
    from kvdb.storage.duckdb_file import SEALED_CATALOG, DuckDBFile
    from kvdb.storage.ducklake import ALIAS, DuckLake

    engine = storage.engine
    with storage.explained():
        # a cursor: the lake as attached (READ_ONLY where the archive is), no second attach
        if isinstance(engine, DuckLake):
            conn = engine.connection().cursor()
            db = ALIAS
        # a cursor too: DuckDB attaches a file once per process
        elif isinstance(engine, DuckDBFile) and engine.seal is not None:
            conn = engine.connection().cursor()
            db = SEALED_CATALOG
        else:
            assert isinstance(engine, DuckDBFile)
            engine.connection()  # the archive's connection first: the file's lock, waited for as any read waits
            # the same database, by a connection of its own that outlives a release of the archive's
            conn = duckdb.connect(str(engine.path), read_only=engine.read_only)
            (db,) = conn.execute("select current_database()").fetchone()  # type: ignore[misc]
    try:
        conn.execute(f'use "{_quoted(db)}"')
        yield conn, f'"{_quoted(db)}"'
    finally:
        conn.close()


def _quoted(name: str) -> str:
    return str(name).replace('"', '""')
