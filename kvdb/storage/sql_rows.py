"""Rows read on a connection: the reads of :class:`kvdb.storage.sql.Storage` and the plan
executor (:mod:`kvdb.storage.sql_apply`, inside its transaction) share them.

The SQL is DuckDB's, written out, with ``?`` parameters: both engines are DuckDB (a file, or
DuckLake attached to an in-memory DuckDB), and SQLAlchemy's import alone cost a read-only
command more than its whole budget (decisions/0031). Columns are always named: an archive
migrated from an older revision need not hold them in the order a new one does.
"""

from __future__ import annotations

import json

import numpy as np

from kvdb.codecs import fractal
from kvdb.codecs.entropy_coded import PAYLOAD
from kvdb.storage.base import NodeRow, SessionRow
from kvdb.storage.edits import Stream, keep_from_text

NODE = "node_id, parent_id, model_id, start, n_tokens, first_token, refcount, keep"
# a session no migration or write grouped is a conversation of its own
CONVERSATION = "coalesce(conversation_id, session_id)"
SESSION = f"session_id, name, source, model_id, created_at, n_tokens, metadata, {CONVERSATION}"
SESSIONS = "sessions left join conversation_sessions using (session_id)"  # where SESSION is selected from
# nodes n that hold tokens the model has not scored (an ingest without it queued the pass)
UNSCORED = "n.keep like '%tokens%' and not exists (select 1 from node_logprobs l where l.node_id = n.node_id)"


def path_rows(conn, node_id: str) -> list[NodeRow]:
    """The nodes from the root down to ``node_id``, by a recursive walk up."""
    query = (
        f"with recursive path as (select {NODE} from nodes where node_id = ? "
        f"union all select {', '.join('n.' + c for c in NODE.split(', '))} "
        "from nodes n join path on n.node_id = path.parent_id) "
        f"select {NODE} from path order by start"
    )
    return [node_row(r) for r in conn.execute(query, [node_id]).fetchall()]


def node(conn, node_id: str) -> NodeRow:
    row = conn.execute(f"select {NODE} from nodes where node_id = ?", [node_id]).fetchone()
    if row is None:
        raise LookupError(f"node {node_id} is not in the archive")
    return node_row(row)


def stream(conn, node_id: str) -> Stream:
    row = conn.execute(
        "select alphabet, block_size, n_tokens from token_streams where node_id = ?", [node_id]
    ).fetchone()
    if row is None:
        raise LookupError(f"node {node_id} has no token stream")
    return Stream(int(row[0]), int(row[1]), int(row[2]))


def node_tokens(conn, node_id: str, start: int = 0, end: int | None = None) -> np.ndarray:
    """Token ids [start, end) of a node, decoded from only the blocks the range touches. One
    statement (a backfill reads nodes' tokens several times a session, decision 0064), whose
    blocks are found by node_id alone, which its index serves (a filter on block_no too scans
    the table); a node holds a part of a session at most, a few blocks."""
    query = (
        "select s.alphabet, s.block_size, s.n_tokens, b.block_no, b.data from token_streams s "
        "left join token_blocks b on b.node_id = ? where s.node_id = ? order by b.block_no"
    )
    rows = conn.execute(query, [node_id, node_id]).fetchall()
    if not rows:
        raise LookupError(f"node {node_id} has no token stream")
    alphabet, block_size, n_tokens = (int(v) for v in rows[0][:3])
    end = n_tokens if end is None else end
    needed = fractal.blocks_for_range(start, end, block_size)
    if not needed:
        return np.zeros(0, dtype=np.int64)
    blobs = [data for *_, block_no, data in rows if block_no is not None and block_no in needed]
    if len(blobs) != len(needed):  # a node held in tier L only: the services decode those
        raise ValueError(f"node {node_id} holds no token blocks for tokens [{start}, {end})")
    return fractal.decode_range(blobs, alphabet, block_size, start, end)


def logprobs_blob(conn, node_id: str) -> bytes | None:
    """None: the model has not scored the node's tokens yet."""
    row = conn.execute("select logprobs from node_logprobs where node_id = ?", [node_id]).fetchone()
    return None if row is None else row[0]


def kv_streams(conn, node_id: str) -> tuple[str, dict[int, np.ndarray]] | None:
    rows = conn.execute(
        "select alphabet, codebook_id, data from node_kv where node_id = ? order by alphabet, block_no", [node_id]
    ).fetchall()
    if not rows:
        return None
    blobs: dict[int, list[bytes]] = {}
    for size, _, data in rows:
        blobs.setdefault(int(size), []).append(data)
    return rows[0][1], {
        size: np.frombuffer(b"".join(b), np.uint8) if size == PAYLOAD else fractal.decode_blocks(b, size)
        for size, b in blobs.items()
    }


CHUNK = "node_id, chunk_no, start, stop, embedder, vector"


def chunk_rows(conn, node_id: str) -> list[dict]:
    """A node's node_chunks rows, as the edits write them."""
    names = CHUNK.split(", ")
    return [
        dict(zip(names, row))
        for row in conn.execute(
            f"select {CHUNK} from node_chunks where node_id = ? order by chunk_no", [node_id]
        ).fetchall()
    ]


def search_run(conn, node_id: str) -> tuple[str, int, int] | None:
    row = conn.execute(
        "select index_key, first_slot, n_tokens from search_ranges where node_id = ?", [node_id]
    ).fetchone()
    return None if row is None else (row[0], int(row[1]), int(row[2]))


def node_row(r) -> NodeRow:
    """A row selected as ``NODE`` names its columns."""
    return NodeRow(r[0], r[1], r[2], int(r[3]), int(r[4]), int(r[5]), int(r[6]), keep_from_text(r[7]))


def session_row(r) -> SessionRow:
    """A row selected as ``SESSION`` names its columns."""
    return SessionRow(r[0], r[1], r[2], r[3], r[4], int(r[5]), json.loads(r[6]), r[7])
