"""Rows read on a connection: the readers of :class:`kvdb.storage.sql.SqlStorage` and the plan
executor (:mod:`kvdb.storage.sql_apply`, inside its transaction) share them."""

from __future__ import annotations

import json

import numpy as np
import sqlalchemy as sa

from kvdb.codecs import fractal
from kvdb.storage.base import NodeRow, SessionRow
from kvdb.storage.edits import Stream, keep_from_text
from kvdb.storage.schema import (
    node_kv,
    node_logprobs,
    nodes,
    search_ranges,
    token_blocks,
    token_streams,
)


def path_rows(conn, node_id: str) -> list[NodeRow]:
    """The nodes from the root down to ``node_id``, by a recursive walk up."""
    path = sa.select(nodes).where(nodes.c.node_id == node_id).cte(recursive=True)
    path = path.union_all(sa.select(nodes).join(path, nodes.c.node_id == path.c.parent_id))
    return [node_row(r) for r in conn.execute(sa.select(path).order_by(path.c.start))]


def node(conn, node_id: str) -> NodeRow:
    return node_row(conn.execute(sa.select(nodes).where(nodes.c.node_id == node_id)).one())


def stream(conn, node_id: str) -> Stream:
    row = conn.execute(sa.select(token_streams).where(token_streams.c.node_id == node_id)).one()
    return Stream(int(row.alphabet), int(row.block_size), int(row.n_tokens))


def node_tokens(conn, node_id: str, start: int = 0, end: int | None = None) -> np.ndarray:
    """Token ids [start, end) of a node, decoded from only the blocks the range touches."""
    coded = stream(conn, node_id)
    end = coded.n_tokens if end is None else end
    needed = fractal.blocks_for_range(start, end, coded.block_size)
    if not needed:
        return np.zeros(0, dtype=np.int64)
    blobs = (
        conn.execute(
            sa.select(token_blocks.c.data)
            .where(token_blocks.c.node_id == node_id, token_blocks.c.block_no.between(needed.start, needed.stop - 1))
            .order_by(token_blocks.c.block_no)
        )
        .scalars()
        .all()
    )
    if len(blobs) != len(needed):  # a node held in tier L only: the services decode those
        raise ValueError(f"node {node_id} holds no token blocks for tokens [{start}, {end})")
    return fractal.decode_range(blobs, coded.alphabet, coded.block_size, start, end)


def logprobs_blob(conn, node_id: str) -> bytes:
    return conn.execute(sa.select(node_logprobs.c.logprobs).where(node_logprobs.c.node_id == node_id)).scalar_one()


def kv_streams(conn, node_id: str) -> tuple[str, dict[int, np.ndarray]] | None:
    rows = conn.execute(
        sa.select(node_kv.c.alphabet, node_kv.c.codebook_id, node_kv.c.data)
        .where(node_kv.c.node_id == node_id)
        .order_by(node_kv.c.alphabet, node_kv.c.block_no)
    ).all()
    if not rows:
        return None
    blobs: dict[int, list[bytes]] = {}
    for size, _, data in rows:
        blobs.setdefault(int(size), []).append(data)
    return rows[0][1], {size: fractal.decode_blocks(b, size) for size, b in blobs.items()}


def search_run(conn, node_id: str) -> tuple[str, int, int] | None:
    row = conn.execute(sa.select(search_ranges).where(search_ranges.c.node_id == node_id)).first()
    return None if row is None else (row.index_key, int(row.first_slot), int(row.n_tokens))


def node_row(r) -> NodeRow:
    return NodeRow(r.node_id, r.parent_id, r.model_id, int(r.start), int(r.n_tokens), int(r.first_token), int(r.refcount), keep_from_text(r.keep))


def session_row(r) -> SessionRow:
    return SessionRow(r.session_id, r.name, r.source, r.model_id, r.created_at, int(r.n_tokens), json.loads(r.metadata))
