"""Running a plan inside one SQL transaction: read what it touches, ask :mod:`kvdb.storage.edits`
for the row edits, execute them in order."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import sqlalchemy as sa

from kvdb.errors import ArchiveError, StaleWrite
from kvdb.storage import edits, schema, sql_rows
from kvdb.storage.base import (
    AddTiers,
    CollectGarbage,
    DeleteSession,
    DropTiers,
    ImportRows,
    NodeTiers,
    Plan,
    PutCodebooks,
    PutModel,
    ReplaceIndexState,
    SessionWrite,
    utc_now,
)


def apply(conn, plan: Plan) -> dict | None:
    handler = _HANDLERS[type(plan)]
    return handler(conn, plan)


def run(conn, changes: list[edits.Edit]) -> None:
    for change in changes:
        if isinstance(change, edits.Recount):
            if change.node_ids:
                nodes = schema.nodes
                conn.execute(nodes.update().where(nodes.c.node_id.in_(change.node_ids)).values(refcount=nodes.c.refcount + change.delta))
            continue
        table = schema.metadata.tables[change.table]
        if isinstance(change, edits.Insert):
            if change.rows:
                conn.execute(table.insert(), change.rows)
        elif isinstance(change, edits.Delete):
            conn.execute(table.delete().where(table.c[change.column].in_(change.values)))
        else:
            conn.execute(table.update().where(table.c[change.column] == change.key).values(**change.values))


def _held(conn, node_id: str) -> edits.Held:
    node = sql_rows.node(conn, node_id)
    tokens = logprobs = None
    if "tokens" in node.keep:
        tokens = sql_rows.node_tokens(conn, node_id)
        logprobs = np.frombuffer(sql_rows.logprobs_blob(conn, node_id), "<f4")
    return edits.Held(node, tokens, logprobs, sql_rows.kv_streams(conn, node_id), sql_rows.search_run(conn, node_id))


def _tokens_back(conn, node_id: str, tokens: np.ndarray, logprobs: np.ndarray) -> None:
    run(conn, edits.add_tiers(sql_rows.node(conn, node_id), sql_rows.stream(conn, node_id), NodeTiers(tokens=(tokens, logprobs))))


def _session_write(conn, w: SessionWrite) -> None:
    """Split a node, add a node, add the session and count it on its path."""
    if w.split is not None:
        run(conn, edits.split(_held(conn, w.split.node_id), w.split, w.alphabet))
    if w.node is not None:
        run(conn, edits.new_node(w.node, w.session.model_id, w.alphabet))
    for node_id, (tokens, logprobs) in w.tokens_back.items():
        _tokens_back(conn, node_id, tokens, logprobs)
    if conn.execute(sa.select(schema.sessions.c.session_id).where(schema.sessions.c.session_id == w.session.session_id)).first() is not None:
        # a key would refuse it in a file; a lake has none: another writer archived it meanwhile
        raise StaleWrite(f"session {w.session.session_id[:12]} was archived while this write was planned; plan again")
    conn.execute(schema.sessions.insert().values(**_session_values(w.session)))
    run(conn, [edits.Recount([n.node_id for n in sql_rows.path_rows(conn, w.session.session_id)], +1)])
    if w.index is not None:
        _index_state(conn, w.index)


def _index_state(conn, state) -> None:
    nodes = schema.nodes
    lengths = dict(conn.execute(sa.select(nodes.c.node_id, nodes.c.n_tokens).where(nodes.c.node_id.in_(list(state.ranges)))).all()) if state.ranges else {}
    run(conn, edits.index_state(state, lengths))


def _replace_index_state(conn, plan: ReplaceIndexState) -> None:
    run(conn, [edits.Delete("search_ranges", "index_key", [plan.state.index_key])])
    _index_state(conn, plan.state)


def _delete_session(conn, plan: DeleteSession) -> None:
    """Nodes no session uses drop out of search at once (their refcount is 0) and off the disk
    at gc; re-ingesting revives them."""
    run(conn, [edits.Recount([n.node_id for n in sql_rows.path_rows(conn, plan.session_id)], -1), edits.Delete("sessions", "session_id", [plan.session_id])])


def _collect_garbage(conn, plan: CollectGarbage) -> dict:
    nodes, blocks = schema.nodes, schema.token_blocks
    dead = [r[0] for r in conn.execute(sa.select(nodes.c.node_id).where(nodes.c.refcount <= 0))]
    tokens = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(nodes.c.n_tokens), 0)).where(nodes.c.refcount <= 0)).scalar_one()
    freed = (
        conn.execute(sa.select(sa.func.coalesce(sa.func.sum(sa.func.octet_length(blocks.c.data)), 0)).where(blocks.c.node_id.in_(dead))).scalar_one()
        if dead
        else 0
    )
    run(conn, edits.collect(dead))
    return {"nodes": len(dead), "tokens": int(tokens), "token_bytes": int(freed)}


def _drop_tiers(conn, plan: DropTiers) -> None:
    nodes = schema.nodes
    for row in conn.execute(sa.select(nodes).where(nodes.c.node_id.in_(list(plan.drops)))).all():
        node = sql_rows.node_row(row)
        run(conn, edits.drop_tiers(node, plan.drops[node.node_id]))
    for node_id, (tokens, logprobs) in plan.tokens_back.items():
        _tokens_back(conn, node_id, tokens, logprobs)
    for node_id, payload in plan.recoded.items():
        run(conn, [edits.Delete("node_lm", "node_id", [node_id]), edits.Insert("node_lm", [{"node_id": node_id, "payload": payload}])])


def _add_tiers(conn, plan: AddTiers) -> None:
    searched = set(plan.index.ranges) if plan.index is not None else set()
    for node_id in dict.fromkeys([*plan.nodes, *searched]):
        tiers = plan.nodes.get(node_id, NodeTiers())
        stream = sql_rows.stream(conn, node_id) if tiers.tokens is not None else None
        run(conn, edits.add_tiers(sql_rows.node(conn, node_id), stream, tiers, node_id in searched))
    if plan.index is not None:
        _index_state(conn, plan.index)


def _put_model(conn, plan: PutModel) -> None:
    row, models = plan.row, schema.models
    if conn.execute(sa.select(models.c.model_id).where(models.c.model_id == row.model_id)).first() is None:
        values = dict(model_id=row.model_id, name=row.name, weights_hash=row.weights_hash, tokenizer_hash=row.tokenizer_hash)
        conn.execute(models.insert().values(**values, config=json.dumps(row.config, sort_keys=True), created_at=utc_now()))


def _put_codebooks(conn, plan: PutCodebooks) -> None:
    books = schema.codebooks
    if conn.execute(sa.select(books.c.codebook_id).where(books.c.codebook_id == plan.codebook_id)).first() is None:
        conn.execute(books.insert().values(codebook_id=plan.codebook_id, model_id=plan.model_id, preset=plan.preset, created_at=utc_now(), data=plan.data))


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


IMPORT_BATCH_ROWS = 256


def _import_rows(conn, plan: ImportRows) -> dict:
    """Rows copied per table, into an archive that must hold none yet."""
    if any(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one() for t in schema.metadata.sorted_tables):
        raise ArchiveError("the destination archive is not empty; copy into a new file or an empty lake")
    counts = {}
    for name in [t.name for t in schema.metadata.sorted_tables if t.name in plan.tables]:
        table, batch, counts[name] = schema.metadata.tables[name], [], 0
        for row in plan.tables[name]:
            batch.append(row)
            if len(batch) == IMPORT_BATCH_ROWS:
                conn.execute(table.insert(), batch)
                counts[name] += len(batch)
                batch = []
        if batch:
            conn.execute(table.insert(), batch)
            counts[name] += len(batch)
    return counts


_HANDLERS: dict[type, Callable[[Any, Any], dict | None]] = {
    SessionWrite: _session_write,
    PutModel: _put_model,
    PutCodebooks: _put_codebooks,
    DeleteSession: _delete_session,
    CollectGarbage: _collect_garbage,
    DropTiers: _drop_tiers,
    AddTiers: _add_tiers,
    ReplaceIndexState: _replace_index_state,
    ImportRows: _import_rows,
}
