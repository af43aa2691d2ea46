"""Running a plan inside one SQL transaction: read what it touches, ask :mod:`kvdb.storage.edits`
for the row edits, execute them in order. ``conn`` is a DuckDB connection in a transaction;
the SQL is written out as in :mod:`kvdb.storage.sql_rows`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from kvdb.errors import ArchiveError, StaleWrite
from kvdb.storage import conversation_rows, edits, sql_rows
from kvdb.storage.base import (
    AddTiers,
    CollectGarbage,
    DeleteConversation,
    DeleteSession,
    Dequeue,
    DropTiers,
    ImportRows,
    NodeTiers,
    Plan,
    PutCodebooks,
    PutLogprobs,
    PutModel,
    PutWatchedFiles,
    Queue,
    RenameConversation,
    ReplaceIndexState,
    SessionWrite,
    utc_now,
)
from kvdb.storage.literals import ANY


def apply(conn, plan: Plan) -> dict | None:
    handler = _HANDLERS[type(plan)]
    return handler(conn, plan)


# Rows a single INSERT carries. DuckDB's executemany runs one statement a row, and DuckLake
# writes each statement's rows to a Parquet file of their own: copying 1e6 tokens made 250
# files a table, 3.60 B/token of Parquet and 1.65 B/token of catalog (benchmarks/lake.py).
INSERT_ROWS = 256


def run(conn, changes: list[edits.Edit]) -> None:
    for change in changes:
        if isinstance(change, edits.Recount):
            if change.node_ids:
                conn.execute(
                    f"update nodes set refcount = refcount + ? where node_id {ANY}",
                    [change.delta, list(change.node_ids)],
                )
        elif isinstance(change, edits.Insert):
            if change.rows:
                columns = list(change.rows[0])
                one = f"({', '.join('?' * len(columns))})"
                # one statement a batch: a lake writes a data file per statement
                for at in range(0, len(change.rows), INSERT_ROWS):
                    batch = change.rows[at : at + INSERT_ROWS]
                    conn.execute(
                        f"insert into {change.table} ({', '.join(columns)}) values {', '.join([one] * len(batch))}",
                        [_value(row[c]) for row in batch for c in columns],
                    )
        elif isinstance(change, edits.Delete):
            conn.execute(
                f"delete from {change.table} where {change.column} {ANY}", [[_value(v) for v in change.values]]
            )
        else:
            columns = list(change.values)
            assignments = ", ".join(f"{c} = ?" for c in columns)
            conn.execute(
                f"update {change.table} set {assignments} where {change.column} = ?",
                [*(_value(change.values[c]) for c in columns), _value(change.key)],
            )


def _value(value):
    """NumPy scalars as Python's: DuckDB binds no NumPy scalar."""
    return value.item() if isinstance(value, np.generic) else value


def _held(conn, node_id: str) -> edits.Held:
    node = sql_rows.node(conn, node_id)
    tokens = logprobs = None
    if "tokens" in node.keep:
        tokens = sql_rows.node_tokens(conn, node_id)
        blob = sql_rows.logprobs_blob(conn, node_id)
        logprobs = None if blob is None else np.frombuffer(blob, "<f4")
    return edits.Held(
        node,
        tokens,
        logprobs,
        sql_rows.kv_streams(conn, node_id),
        sql_rows.search_run(conn, node_id),
        sql_rows.chunk_rows(conn, node_id),
    )


def _tokens_back(conn, node_id: str, tokens: np.ndarray, logprobs: np.ndarray) -> None:
    run(
        conn,
        edits.add_tiers(
            sql_rows.node(conn, node_id), sql_rows.stream(conn, node_id), NodeTiers(tokens=(tokens, logprobs))
        ),
    )


def _session_write(conn, w: SessionWrite) -> None:
    """Split a node, add a node, add the session and count it on its path."""
    if w.split is not None:
        run(conn, edits.split(_held(conn, w.split.node_id), w.split, w.alphabet))
    if w.node is not None:
        run(conn, edits.new_node(w.node, w.session.model_id, w.alphabet))
    for node_id, (tokens, logprobs) in w.tokens_back.items():
        _tokens_back(conn, node_id, tokens, logprobs)
    if conn.execute("select 1 from sessions where session_id = ?", [w.session.session_id]).fetchone() is not None:
        # a key would refuse it in a file; a lake has none: another writer archived it meanwhile
        raise StaleWrite(f"session {w.session.session_id[:12]} was archived while this write was planned; plan again")
    run(conn, [edits.Insert("sessions", [_session_values(w.session)])])
    path = list(w.path) or [n.node_id for n in sql_rows.path_rows(conn, w.session.session_id)]
    run(
        conn,
        [edits.Recount(path, +1)]
        + conversation_rows.joined(conn, w.session, path, w.conversation)
        + _owed(conn, w, path),
    )
    if w.index is not None:
        _index_state(conn, w.index, {w.node.node_id: len(w.node.tokens)} if w.node is not None else {})


def _owed(conn, w: SessionWrite, path: list[str]) -> list[edits.Edit]:
    """The work left for `kvdb upkeep`: what the writer queued, and the model's pass where a node
    on the session's path holds tokens it has not scored (a new node without log-probabilities
    does: no need to look, and a statement is a millisecond of a backfill's session)."""
    fresh = w.node is not None and w.node.logprobs is None and "tokens" in w.node.keep
    unscored = (
        fresh
        or conn.execute(
            f"select count(*) from nodes n where n.node_id {ANY} and {sql_rows.UNSCORED}", [path]
        ).fetchone()[0]
    )
    return edits.queued(
        [(w.session.session_id, kind) for kind in [*w.queued, *([edits.LOGPROBS_WORK] if unscored else [])]], utc_now()
    )


def _queue(conn, plan: Queue) -> None:
    query = f"select session_id from pending_work where work = ? and session_id {ANY}"
    queued = (
        {r[0] for r in conn.execute(query, [plan.work, plan.session_ids]).fetchall()} if plan.session_ids else set()
    )
    run(conn, edits.queued([(s, plan.work) for s in dict.fromkeys(plan.session_ids) if s not in queued], utc_now()))


def _dequeue(conn, session_ids: list[str], work: str) -> None:
    """One session's row by its key (the queue's index: upkeep dequeues a session at a time);
    many (a forget's marks) in one statement."""
    if len(session_ids) == 1:
        conn.execute("delete from pending_work where session_id = ? and work = ?", [session_ids[0], work])
    elif session_ids:
        conn.execute(f"delete from pending_work where work = ? and session_id {ANY}", [work, session_ids])


def _index_state(conn, state, known: dict[str, int] | None = None) -> None:
    """An index's state and the slot runs it adds. ``known``: lengths of nodes of ``state.ranges``
    the caller has (the others are read). The state's row is updated in place (one statement
    where a delete and an insert were two, in every session of a backfill); only an index
    recorded nowhere yet gets one inserted."""
    lengths = dict(known or {})
    unknown = [node_id for node_id in state.ranges if node_id not in lengths]
    if unknown:
        lengths |= {
            r[0]: int(r[1])
            for r in conn.execute(f"select node_id, n_tokens from nodes where node_id {ANY}", [unknown]).fetchall()
        }
    values = [state.alphabet, state.depth, state.ntotal, state.generation]
    updated = conn.execute(
        "update search_indexes set alphabet = ?, depth = ?, ntotal = ?, generation = ? where index_key = ?",
        [*values, state.index_key],
    )
    if not updated.fetchone()[0]:
        row = dict(zip(("index_key", "alphabet", "depth", "ntotal", "generation"), [state.index_key, *values]))
        run(conn, [edits.Insert("search_indexes", [row])])
    run(conn, edits.slot_runs(state, lengths))


def _replace_index_state(conn, plan: ReplaceIndexState) -> None:
    run(conn, [edits.Delete("search_ranges", "index_key", [plan.state.index_key])])
    _index_state(conn, plan.state)


def _delete_session(conn, plan: DeleteSession) -> None:
    """Nodes no session uses drop out of search at once (their refcount is 0) and off the disk
    at gc; re-ingesting revives them."""
    _delete_sessions(conn, [plan.session_id])


def _delete_sessions(conn, session_ids: list[str]) -> None:
    recounts = [edits.Recount([n.node_id for n in sql_rows.path_rows(conn, s)], -1) for s in session_ids]
    gone: list[edits.Edit] = [edits.Delete(table, "session_id", session_ids) for table in ("sessions", "pending_work")]
    run(conn, recounts + conversation_rows.left(conn, session_ids) + gone)


def _delete_conversation(conn, plan: DeleteConversation) -> None:
    query = "select session_id from conversation_sessions where conversation_id = ?"
    _delete_sessions(conn, [r[0] for r in conn.execute(query, [plan.conversation_id]).fetchall()])
    run(conn, [edits.Delete("conversations", "conversation_id", [plan.conversation_id])])


def _put_watched_files(conn, plan: PutWatchedFiles) -> None:
    rows = [dataclasses.asdict(r) for r in plan.rows]
    run(conn, [edits.Delete("watched_files", "path", [r["path"] for r in rows]), edits.Insert("watched_files", rows)])


def _rename_conversation(conn, plan: RenameConversation) -> None:
    run(conn, [edits.Update("conversations", "conversation_id", plan.conversation_id, {"title": plan.title})])


def _collect_garbage(conn, plan: CollectGarbage) -> dict:
    dead = [r[0] for r in conn.execute("select node_id from nodes where refcount <= 0").fetchall()]
    (tokens,) = conn.execute("select coalesce(sum(n_tokens), 0) from nodes where refcount <= 0").fetchone()
    freed = (
        conn.execute(
            f"select coalesce(sum(octet_length(data)), 0) from token_blocks where node_id {ANY}", [dead]
        ).fetchone()[0]
        if dead
        else 0
    )
    run(conn, edits.collect(dead))
    return {"nodes": len(dead), "tokens": int(tokens), "token_bytes": int(freed)}


def _drop_tiers(conn, plan: DropTiers) -> None:
    for row in conn.execute(f"select {sql_rows.NODE} from nodes where node_id {ANY}", [list(plan.drops)]).fetchall():
        node = sql_rows.node_row(row)
        run(conn, edits.drop_tiers(node, plan.drops[node.node_id]))
    for node_id, (tokens, logprobs) in plan.tokens_back.items():
        _tokens_back(conn, node_id, tokens, logprobs)
    for node_id, payload in plan.recoded.items():
        run(
            conn,
            [
                edits.Delete("node_lm", "node_id", [node_id]),
                edits.Insert("node_lm", [{"node_id": node_id, "payload": payload}]),
            ],
        )


def _add_tiers(conn, plan: AddTiers) -> None:
    searched = set(plan.index.ranges) if plan.index is not None else set()
    for node_id in dict.fromkeys([*plan.nodes, *searched]):
        tiers = plan.nodes.get(node_id, NodeTiers())
        stream = sql_rows.stream(conn, node_id) if tiers.tokens is not None else None
        run(conn, edits.add_tiers(sql_rows.node(conn, node_id), stream, tiers, node_id in searched))
    if plan.index is not None:
        _index_state(conn, plan.index)
    if plan.done is not None:
        _dequeue(conn, [plan.done[0]], plan.done[1])


def _put_logprobs(conn, plan: PutLogprobs) -> None:
    have = (
        {
            r[0]
            for r in conn.execute(
                f"select node_id from node_logprobs where node_id {ANY}", [list(plan.logprobs)]
            ).fetchall()
        }
        if plan.logprobs
        else set()
    )
    run(
        conn,
        [e for node_id, lp in plan.logprobs.items() if node_id not in have for e in edits.logprob_rows(node_id, lp)],
    )
    _dequeue(conn, [plan.session_id], edits.LOGPROBS_WORK)


def _put_model(conn, plan: PutModel) -> None:
    row = plan.row
    if conn.execute("select 1 from models where model_id = ?", [row.model_id]).fetchone() is None:
        values = dict(
            model_id=row.model_id, name=row.name, weights_hash=row.weights_hash, tokenizer_hash=row.tokenizer_hash
        )
        run(
            conn,
            [
                edits.Insert(
                    "models", [{**values, "config": json.dumps(row.config, sort_keys=True), "created_at": utc_now()}]
                )
            ],
        )


def _put_codebooks(conn, plan: PutCodebooks) -> None:
    if conn.execute("select 1 from codebooks where codebook_id = ?", [plan.codebook_id]).fetchone() is None:
        row = {
            "codebook_id": plan.codebook_id,
            "model_id": plan.model_id,
            "preset": plan.preset,
            "created_at": utc_now(),
            "data": plan.data,
        }
        run(conn, [edits.Insert("codebooks", [row])])


def _session_values(row) -> dict:
    return {
        "session_id": row.session_id,
        "name": row.name,
        "source": row.source,
        "model_id": row.model_id,
        "created_at": row.created_at,
        "n_tokens": row.n_tokens,
        "metadata": json.dumps(row.metadata, sort_keys=True),
    }


def _import_rows(conn, plan: ImportRows) -> dict:
    """Rows copied per table, into an archive that must hold none yet."""
    if any(conn.execute(f"select count(*) from {name}").fetchone()[0] for name in edits.TABLES):
        raise ArchiveError("the destination archive is not empty; copy into a new file or an empty lake")
    counts = {}
    for name in [name for name in edits.TABLES if name in plan.tables]:
        batch, counts[name] = [], 0
        for row in plan.tables[name]:
            batch.append(row)
            if len(batch) == INSERT_ROWS:
                run(conn, [edits.Insert(name, batch)])
                counts[name] += len(batch)
                batch = []
        if batch:
            run(conn, [edits.Insert(name, batch)])
            counts[name] += len(batch)
    return counts


_HANDLERS: dict[type, Callable[[Any, Any], dict | None]] = {
    SessionWrite: _session_write,
    PutModel: _put_model,
    PutCodebooks: _put_codebooks,
    DeleteSession: _delete_session,
    DeleteConversation: _delete_conversation,
    RenameConversation: _rename_conversation,
    PutWatchedFiles: _put_watched_files,
    CollectGarbage: _collect_garbage,
    DropTiers: _drop_tiers,
    AddTiers: _add_tiers,
    PutLogprobs: _put_logprobs,
    Queue: _queue,
    Dequeue: lambda conn, plan: _dequeue(conn, plan.session_ids, plan.work),
    ReplaceIndexState: _replace_index_state,
    ImportRows: _import_rows,
}
