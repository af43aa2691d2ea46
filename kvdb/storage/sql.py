"""The one repository of an archive's rows: every read as DuckDB SQL, every change as a plan
run in one transaction (:mod:`kvdb.storage.sql_apply`), on whichever engine holds the tables.

The services above never see an engine, a connection or a file. They read rows through the
methods of :class:`Storage`, describe every change as a plan (:mod:`kvdb.storage.base`) and
hand it to ``apply``, which applies it all or nothing. What differs between a DuckDB file and
a DuckLake (the lock, the version, compaction, where derived files go) is the engine's
(:class:`kvdb.storage.engine.Engine`); the contract suite (tests/storage/test_contract.py)
runs the same checks on both.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import duckdb
import numpy as np

from kvdb.codecs import fractal
from kvdb.errors import ArchiveError
from kvdb.storage import base, conversation_rows, edits, sql_apply
from kvdb.storage.base import (
    CodebookRow,
    ConversationFilter,
    ConversationRows,
    IndexState,
    ModelRow,
    NodeRow,
    Plan,
    SessionRow,
    TrieShape,
    WatchedFileRow,
)
from kvdb.storage.engine import Engine
from kvdb.storage.literals import ANY, LIST_LITERAL
from kvdb.storage.sql_rows import (
    CONVERSATION,
    NODE,
    SESSION,
    SESSIONS,
    UNSCORED,
    kv_streams,
    logprobs_blob,
    node_row,
    node_tokens,
    path_rows,
    session_row,
)

STREAM_ROW_BYTES = 12  # alphabet, block_size and n_tokens of a token_streams row, counted in its tier
SMALL_BLOB = 4096  # codebook blobs listed whole: references to shipped codebooks (trained ones are MBs)
CHUNK_ROW_BYTES = 56  # a chunk's node id (32 hex chars), number, span and embedder reference, beside its vector
# node, parent and model ids (32 hex chars each), four integers and the child key (~80 chars), counted as metadata
NODE_ROW_BYTES = 192
FETCH_ROWS = 256  # rows a streamed read holds at once
# What each tier's stored blobs are: table, owner column, part column, data column, order.
BLOBS = {
    "tokens": ("token_blocks", "node_id", "block_no", "data", "node_id, block_no"),
    "kv": ("node_kv", "node_id", "alphabet", "data", "node_id, alphabet, block_no"),
    "lm": ("node_lm", "node_id", "0", "payload", "node_id"),
    "codebooks": ("codebooks", "codebook_id", "0", "data", "codebook_id"),
}


class Storage:
    """One open archive. Reads return rows; every change is a plan given to :meth:`apply`."""

    def __init__(self, engine: Engine):
        self.engine = engine

    # lifecycle: the engine's -----------------------------------------------------------
    @property
    def read_only(self) -> bool:
        return self.engine.read_only

    @property
    def claims_inputs(self) -> bool:
        return self.engine.claims_inputs

    def close(self) -> None:
        self.engine.close()

    def version(self) -> object:
        return self.engine.version()

    def release(self) -> None:
        self.engine.release()

    def held_for(self) -> float:
        return self.engine.held_for()

    def before_compute(self, short: bool = False) -> None:
        """The one place a service's work decides about the lock: about to compute without the
        file (a forward pass, a model load, a build), hand the lock back, unless the work is
        ``short`` and the hold fresh (see base.hold_seconds). A hold past its time goes on, its
        batch committed, while no other process waits for the file: a let-go costs a checkpoint
        that grows with the archive (decision 0061)."""
        if not short:
            self.release()
        elif self.held_for() >= self.engine.hold_seconds():
            if self.engine.wanted():
                self.release()
            else:
                self.engine.keep()

    @contextlib.contextmanager
    def writable(self):
        """Write access for one repair of derived data, even when opened read-only: the
        read-only connection is closed, opened again for writing, and given back after."""
        if not self.read_only:
            yield
            return
        self.engine.close()
        self.engine.read_only = False
        try:
            yield
        finally:
            self.engine.close()
            self.engine.read_only = True

    def check_writable(self) -> None:
        if self.read_only:
            raise ArchiveError(
                f"archive {self.describe()} is open read-only; open it without read_only=True to change it"
            )

    def claim(self, key: str, owner: str, lease_seconds: float, steal_from: str | None = None) -> str | None:
        self.check_writable()
        with self.explained():
            return self.engine.claim(key, owner, lease_seconds, steal_from)

    def release_claim(self, key: str, owner: str) -> None:
        with self.explained():
            self.engine.release_claim(key, owner)

    def compact_files(self, forget: bool = False, now: bool = False) -> dict:
        self.check_writable()
        with self.explained():
            return self.engine.compact_files(forget, now)

    def derived_path(self, suffix: str) -> Path:
        with self.explained():
            return self.engine.derived_path(suffix)

    def footprint(self) -> int:
        with self.explained():
            return self.engine.footprint()

    def describe(self) -> str:
        return self.engine.describe()

    def data_file_problems(self) -> list[str]:
        with self.explained():
            return self.engine.data_file_problems()

    # writes -----------------------------------------------------------------------------
    def apply(self, plan: Plan, based_on=None) -> dict | None:
        """Apply a plan all or nothing; ``CollectGarbage`` returns what it freed. ``based_on``:
        the ``version()`` the plan was made at; if anything was committed since, the plan is
        refused with ``StaleWrite`` (make it again)."""
        self.check_writable()
        with self.explained():
            return self.engine.write(lambda conn: sql_apply.apply(conn, plan), based_on)

    def batch(self):
        """Plans applied inside share one transaction where the engine allows (``Engine.batch``)."""
        return self.engine.batch()

    @property
    def batching(self) -> bool:
        return self.engine.batching

    def after_commit(self, then, undo=None) -> None:
        self.engine.after_commit(then, undo)

    def after_batch(self, then) -> None:
        self.engine.after_batch(then)

    @contextlib.contextmanager
    def explained(self):
        """DuckDB's errors in the engine's terms where it has them (a lake's catalog unreachable)."""
        try:
            yield
        except duckdb.Error as exc:
            explained = self.engine.explain(exc)
            if explained is None:
                raise
            raise explained from exc

    @contextlib.contextmanager
    def _read(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read transaction: the statements of one read see one snapshot."""
        with self.explained(), self.engine.reading() as conn:
            yield conn

    def _rows(self, query: str, params=()) -> list[tuple]:
        with self._read() as conn:
            return conn.execute(query, list(params)).fetchall()

    def _value(self, query: str, params=()):
        rows = self._rows(query, params)
        return rows[0][0] if rows else None

    # models and codebooks -----------------------------------------------------------------
    def get_model(self, model_id: str) -> ModelRow | None:
        rows = self._rows(
            "select model_id, name, weights_hash, tokenizer_hash, config from models where model_id = ?", [model_id]
        )
        if not rows:
            return None
        model_id, name, weights_hash, tokenizer_hash, config = rows[0]
        return ModelRow(model_id, name, weights_hash, tokenizer_hash, json.loads(config))

    def model_ids_with_tokenizer(self, tokenizer_hash: str) -> list[str]:
        return [r[0] for r in self._rows("select model_id from models where tokenizer_hash = ?", [tokenizer_hash])]

    def tokenizer_hashes(self) -> list[str]:
        return sorted({r[0] for r in self._rows("select tokenizer_hash from models")})

    def codebooks_for(self, model_id: str, preset: str | None = None) -> tuple[str, bytes] | None:
        """The newest codebook set stored for a model (of one preset spec, if named): (codebook_id, serialized
        codebooks)."""
        among, args = ("", [model_id]) if preset is None else (" and preset = ?", [model_id, preset])
        rows = self._rows(
            f"select codebook_id, data from codebooks where model_id = ?{among} order by created_at desc limit 1", args
        )
        return None if not rows else (rows[0][0], rows[0][1])

    def node_codebooks(self, node_ids: list[str]) -> dict[str, str]:
        """The codebook id each of these nodes' tier K was coded with (nodes without tier K left out)."""
        if not node_ids:
            return {}
        return dict(
            self._rows(f"select distinct node_id, codebook_id from node_kv where node_id {ANY}", [list(node_ids)])
        )

    def kv_bytes_by_codebooks(self) -> dict[str, int]:
        """Tier K code bytes stored per codebook id."""
        return {
            r[0]: int(r[1])
            for r in self._rows("select codebook_id, sum(octet_length(data)) from node_kv group by codebook_id")
        }

    def codebook_data(self, codebook_id: str) -> bytes:
        rows = self._rows("select data from codebooks where codebook_id = ?", [codebook_id])
        if not rows:
            raise LookupError(f"codebooks {codebook_id} are not in the archive")
        return rows[0][0]

    def codebook_rows(self) -> list[CodebookRow]:
        """Every codebook set, oldest first."""
        query = (
            "select codebook_id, model_id, preset, created_at, octet_length(data), "
            "case when octet_length(data) <= ? then data end "
            "from codebooks order by created_at, codebook_id"
        )
        return [CodebookRow(*row) for row in self._rows(query, [SMALL_BLOB])]

    # sessions ---------------------------------------------------------------------------
    def has_session(self, session_id: str) -> bool:
        return bool(self._rows("select 1 from sessions where session_id = ?", [session_id]))

    def get_session(self, session_id: str) -> SessionRow | None:
        rows = self._rows(f"select {SESSION} from {SESSIONS} where session_id = ?", [session_id])
        return session_row(rows[0]) if rows else None

    def list_sessions(self) -> list[SessionRow]:
        """Oldest first (ties by id)."""
        return [session_row(r) for r in self._rows(f"select {SESSION} from {SESSIONS} order by created_at, session_id")]

    def sessions_from(self, files: list[str]) -> list[SessionRow]:
        """The sessions archived from any of ``files`` (a session's source is its file, or one of
        its records: ``FILE#L12``), oldest first: one scan in SQL, where listing every session
        made a row object each, 50k of them in a whole history, for every delete."""
        if not files:
            return []
        query = (
            f"select {SESSION} from {SESSIONS} where regexp_replace(source, '{base.RECORD_LINE}', '') {ANY} "
            "order by created_at, session_id"
        )
        return [session_row(r) for r in self._rows(query, [list(files)])]

    def conversation_sessions(self, conversation_id: str) -> list[SessionRow]:
        """The sessions of a conversation, oldest first."""
        query = f"select {SESSION} from {SESSIONS} where {CONVERSATION} = ? order by created_at, session_id"
        return [session_row(r) for r in self._rows(query, [conversation_id])]

    def conversations_page(
        self, admits: ConversationFilter, limit: int | None = None, offset: int = 0
    ) -> ConversationRows:
        """The conversations ``admits`` lets through, the most recently updated first (ties by id,
        the greater first), from ``offset`` on, at most ``limit``: filtered, ordered and paged on
        the conversations table's own columns, and only the page's versions read and summed up
        (``conversation_rows.listed``), with how many it admits in all."""
        where, params = _admitting(admits)
        offset = max(int(offset), 0)
        paged, bounds = ("", []) if limit is None else (" limit ? offset ?", [max(int(limit), 0), offset])
        if limit is None and offset:
            paged, bounds = " offset ?", [offset]
        with self._read() as conn:
            found, total = conversation_rows.listed(conn, where, params, paged, bounds)
            if total is None:  # a page past the end
                total = int(conn.execute(f"select count(*) from conversations{where}", params).fetchone()[0])  # type: ignore[index]
        return ConversationRows(found, total)

    def conversation_rows(self, conversation_ids: list[str]) -> list[base.ConversationRow]:
        """These conversations as ``conversations_page`` lists them (those that exist), read by id:
        a search labels its hits with their conversations' titles so."""
        if not conversation_ids:
            return []
        with self._read() as conn:
            found, _ = conversation_rows.listed(conn, f" where conversation_id {ANY}", [list(conversation_ids)])
        return found

    def conversation_row(self, conversation_id: str) -> base.ConversationRow | None:
        """One conversation as ``conversations_page`` lists it."""
        found = self.conversation_rows([conversation_id])
        return found[0] if found else None

    def conversation_ids(self, admits: ConversationFilter) -> list[str]:
        """Every conversation ``admits`` lets through, by the conversations table's own columns."""
        where, params = _admitting(admits)
        return [r[0] for r in self._rows(f"select conversation_id from conversations{where}", params)]

    def conversation_titles(self) -> dict[str, str]:
        """The conversations given a title (``rename``): id -> title."""
        return dict(self._rows("select conversation_id, title from conversations where title is not null"))

    def extended_sessions(self) -> set[str]:
        """The sessions another session runs through (a longer version of them is archived)."""
        return {
            r[0]
            for r in self._rows("select session_id from sessions join nodes on node_id = session_id where refcount > 1")
        }

    def watched_files(self) -> list[WatchedFileRow]:
        """`kvdb watch`'s checkpoint, by path."""
        rows = self._rows("select path, size, mtime_ns, checked_at, status, detail from watched_files order by path")
        return [WatchedFileRow(r[0], int(r[1]), int(r[2]), r[3], r[4], r[5]) for r in rows]

    def match_sessions(self, ref: str) -> list[SessionRow]:
        """Sessions whose id starts with ``ref`` or whose name equals it."""
        return [
            session_row(r)
            for r in self._rows(
                f"select {SESSION} from {SESSIONS} where name = ? or starts_with(session_id, ?)", [ref, ref.lower()]
            )
        ]

    # the trie ---------------------------------------------------------------------------
    def children(self, parent_id: str | None, model_id: str, first_token: int) -> list[NodeRow]:
        parent = "parent_id is null" if parent_id is None else "parent_id = ?"
        params = [*([] if parent_id is None else [parent_id]), model_id, int(first_token)]
        return [
            node_row(r)
            for r in self._rows(f"select {NODE} from nodes where {parent} and model_id = ? and first_token = ?", params)
        ]

    def children_opening(self, parent_id: str | None, model_id: str, opening: np.ndarray) -> list[NodeRow]:
        """The child whose first ``HEAD_TOKENS`` tokens ``opening`` begins with, and the children
        keyed by their first token alone (shorter ones, and those before migration 0014) that
        open with its first: one lookup of ``ix_nodes_child_key`` (decision 0066)."""
        keys = [base.child_key(parent_id, model_id, opening[:1])]
        if len(opening) >= base.HEAD_TOKENS:
            keys.append(base.child_key(parent_id, model_id, opening))
        return [node_row(r) for r in self._rows(f"select {NODE} from nodes where child_key {ANY}", [keys])]

    def nodes_by_id(self, node_ids: list[str]) -> dict[str, NodeRow]:
        """The nodes of ``node_ids`` that exist, by id, in one statement."""
        if not node_ids:
            return {}
        rows = self._rows(f"select {NODE} from nodes where node_id {ANY}", [list(node_ids)])
        return {row.node_id: row for row in map(node_row, rows)}

    def node_path(self, node_id: str) -> list[NodeRow]:
        """The nodes from the root down to ``node_id`` (a session id names its leaf)."""
        with self._read() as conn:
            return path_rows(conn, node_id)

    def session_paths(self, session_ids: list[str]) -> dict[str, list[NodeRow]]:
        """``node_path`` of each of ``session_ids`` that is an archived session (the others left
        out), by one recursive walk up from all their leaves."""
        if not session_ids:
            return {}
        columns = ", ".join("n." + c for c in NODE.split(", "))
        query = (
            f"with recursive path as (select node_id as leaf, {NODE} from nodes "
            f"where node_id in (select session_id from sessions where session_id {ANY}) "
            f"union all select path.leaf, {columns} from nodes n join path on n.node_id = path.parent_id) "
            f"select leaf, {NODE} from path order by leaf, start"
        )
        out: dict[str, list[NodeRow]] = {}
        for row in self._rows(query, [list(session_ids)]):
            out.setdefault(row[0], []).append(node_row(row[1:]))
        return out

    def nodes_of(self, model_ids: list[str]) -> list[NodeRow]:
        """Every node of these models (unused ones too, until gc), parents before children."""
        return [
            node_row(r)
            for r in self._rows(
                f"select {NODE} from nodes where model_id {ANY} order by start, node_id", [list(model_ids)]
            )
        ]

    def shared_nodes(self) -> list[NodeRow]:
        """Nodes on the paths of two or more sessions, shortest first."""
        return [
            node_row(r) for r in self._rows(f"select {NODE} from nodes where refcount >= 2 order by start, node_id")
        ]

    def node_shapes(self) -> list[tuple[NodeRow, int, int]]:
        """Every node with its token stream's alphabet and block size."""
        columns = ", ".join(f"n.{c}" for c in NODE.split(", "))
        query = f"select {columns}, s.alphabet, s.block_size from nodes n join token_streams s on s.node_id = n.node_id"
        return [(node_row(r), int(r[8]), int(r[9])) for r in self._rows(query)]

    def trie_shape(self) -> TrieShape:
        """The trie's nodes and sessions in columns, read in one snapshot."""
        nodes = (
            "select n.node_id, coalesce(n.parent_id, '') as parent_id, n.start, n.start + n.n_tokens as stop, "
            "n.keep, s.alphabet, s.block_size "
            "from nodes n join token_streams s on s.node_id = n.node_id"
        )
        sessions = (
            f"select session_id, name, {CONVERSATION} as conversation from {SESSIONS} order by created_at, session_id"
        )
        with self._read() as conn:
            n, s = conn.execute(nodes).fetchnumpy(), conn.execute(sessions).fetchnumpy()
        return TrieShape(
            n["node_id"].tolist(),
            n["parent_id"].tolist(),
            n["start"].tolist(),
            n["stop"].tolist(),
            [edits.keep_from_text(k) for k in n["keep"].tolist()],
            n["alphabet"].tolist(),
            n["block_size"].tolist(),
            s["session_id"].tolist(),
            s["name"].tolist(),
            s["conversation"].tolist(),
        )

    # tiers ------------------------------------------------------------------------------
    def node_tokens(self, node_id: str, start: int = 0, end: int | None = None) -> np.ndarray:
        with self._read() as conn:
            return node_tokens(conn, node_id, start, end)

    def path_tokens(self, path: list[NodeRow], start: int = 0, end: int | None = None) -> np.ndarray:
        """Token ids [start, end) along a node path the caller has read already."""
        end = path[-1].end if end is None else end
        with self._read() as conn:
            pieces = [
                node_tokens(conn, n.node_id, max(start, n.start) - n.start, min(end, n.end) - n.start)
                for n in path
                if n.start < end and n.end > start
            ]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    def load_tokens(self, session_id: str, start: int = 0, end: int | None = None) -> np.ndarray:
        return self.path_tokens(self.node_path(session_id), start, end)

    def nodes_tokens(self, node_ids: list[str]) -> dict[str, np.ndarray]:
        """Whole nodes' token ids, read together (an index built or caught up reads many)."""
        if not node_ids:
            return {}
        with self._read() as conn:
            coded = {
                r[0]: r[1:]
                for r in conn.execute(
                    f"select node_id, alphabet, block_size, n_tokens from token_streams where node_id {ANY}", [node_ids]
                ).fetchall()
            }
            blobs: dict[str, list[bytes]] = {node_id: [] for node_id in coded}
            query = f"select node_id, data from token_blocks where node_id {ANY} order by node_id, block_no"
            for node_id, data in conn.execute(query, [node_ids]).fetchall():
                blobs[node_id].append(data)
        out = {}
        for node_id in node_ids:
            row = coded.get(node_id)
            if row is None or len(blobs[node_id]) != len(fractal.blocks_for_range(0, int(row[2]), int(row[1]))):
                raise ValueError(
                    f"node {node_id} holds no token blocks (held in tier L only: the services decode those)"
                )
            out[node_id] = fractal.decode_range(blobs[node_id], int(row[0]), int(row[1]), 0, int(row[2]))
        return out

    def load_blocks(self, wanted: list[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        """Token blocks by (node_id, block_no): each node's blocks read whole, at most
        ``LIST_LITERAL`` nodes a query, and the pairs asked for kept. DuckDB answers an ``in``
        list of node ids alone from the node index; a join to the pairs, or any filter on the
        block number beside it, scanned the whole table (0.25-0.3 s of a fresh search at 1e8 tokens)."""
        wanted_set = set(wanted)
        node_ids = sorted({node_id for node_id, _ in wanted_set})
        out: dict[tuple[str, int], bytes] = {}
        for at in range(0, len(node_ids), LIST_LITERAL):
            query = f"select node_id, block_no, data from token_blocks where node_id {ANY}"
            for node_id, block, data in self._rows(query, [node_ids[at : at + LIST_LITERAL]]):
                if (node_id, block) in wanted_set:
                    out[node_id, int(block)] = data
        return out

    def load_logprobs(self, session_id: str) -> np.ndarray | None:
        """Along the session's path; None while a node on it waits for the model's pass."""
        with self._read() as conn:
            blobs = [logprobs_blob(conn, n.node_id) for n in path_rows(conn, session_id)]
        if any(b is None for b in blobs):
            return None
        return np.frombuffer(b"".join(b for b in blobs if b is not None), dtype="<f4").copy()

    def session_count(self) -> int:
        return int(self._value("select count(*) from sessions"))

    def first_model_id(self) -> str | None:
        """The model of the archive's first session (its shape sizes what stats compare tier K with)."""
        return self._value("select model_id from sessions order by created_at, session_id limit 1")

    def unscored(self, node_ids: list[str]) -> set[str]:
        """Of these nodes, those holding tokens the model has not scored (an ingest without it)."""
        return (
            {
                r[0]
                for r in self._rows(f"select n.node_id from nodes n where n.node_id {ANY} and {UNSCORED}", [node_ids])
            }
            if node_ids
            else set()
        )

    def pending_sessions(self, work: str, limit: int) -> list[SessionRow]:
        """Sessions ``work`` is queued for, the newest first (what is searched and restored next):
        by when their conversation was last said (a backfill archives a year of logs in minutes),
        then by when they were archived."""
        queued = "(select session_id from pending_work where work = ?)"
        said = (
            "(select c.said_at from conversations c "
            "where c.conversation_id = coalesce(conversation_sessions.conversation_id, sessions.session_id))"
        )
        query = (
            f"select {SESSION} from {SESSIONS} where session_id in {queued} "
            f"order by {said} desc nulls last, created_at desc, session_id limit ?"
        )
        return [session_row(r) for r in self._rows(query, [work, limit])]

    def queued(self, work: str) -> list[str]:
        """The session ids ``work`` is queued for, deleted sessions' included (a forget waits for gc)."""
        return [
            r[0] for r in self._rows("select session_id from pending_work where work = ? order by session_id", [work])
        ]

    def pending_counts(self) -> dict[str, tuple[int, int]]:
        """Queued work by kind: (sessions, their tokens)."""
        query = (
            "select p.work, count(*), coalesce(sum(s.n_tokens), 0) "
            "from pending_work p join sessions s on s.session_id = p.session_id group by p.work"
        )
        return {r[0]: (int(r[1]), int(r[2])) for r in self._rows(query)}

    def logprob_lengths(self) -> dict[str, int]:
        return {r[0]: int(r[1]) // 4 for r in self._rows("select node_id, octet_length(logprobs) from node_logprobs")}

    def max_alphabet(self, model_ids: list[str]) -> int:
        query = (
            "select coalesce(max(s.alphabet), 0) from token_streams s join nodes n on n.node_id = s.node_id "
            f"where n.model_id {ANY}"
        )
        return int(self._value(query, [list(model_ids)]))

    def node_lm_payload(self, node_id: str) -> bytes | None:
        return self._value("select payload from node_lm where node_id = ?", [node_id])

    def chunk_embedders(self) -> list[str]:
        """The embedders the semantic tier's chunks were embedded with (none: no session has the tier)."""
        return [r[0] for r in self._rows("select distinct embedder from node_chunks order by embedder")]

    def chunk_counts(self, embedder: str) -> dict[str, int]:
        """Chunks by ``embedder`` per node some session still uses: a copy of the index that
        holds as many for each node is up to date (a node's rows are only added, deleted, or
        moved to a new node by a split)."""
        query = (
            "select c.node_id, count(*) from node_chunks c join nodes n on n.node_id = c.node_id "
            "where c.embedder = ? and n.refcount > 0 group by c.node_id"
        )
        return dict(self._rows(query, [embedder]))

    def chunks_of(self, embedder: str, node_ids: list[str] | None = None) -> tuple[list[str], np.ndarray, np.ndarray]:
        """(node ids, [n, 2] spans on the path, [n, dim] float16 unit vectors) of the semantic
        tier's chunks by ``embedder`` in nodes some session still uses (of ``node_ids`` alone
        when given)."""
        among = "" if node_ids is None else f" and c.node_id {ANY}"
        query = (
            "select c.node_id, c.start, c.stop, c.vector from node_chunks c join nodes n on n.node_id = c.node_id "
            f"where c.embedder = ? and n.refcount > 0{among} order by c.node_id, c.chunk_no"
        )
        rows = self._rows(query, [embedder] if node_ids is None else [embedder, list(node_ids)])
        if not rows:
            return [], np.zeros((0, 2), np.int64), np.zeros((0, 0), np.float16)
        spans = np.array([(r[1], r[2]) for r in rows], dtype=np.int64)
        return [r[0] for r in rows], spans, np.frombuffer(b"".join(r[3] for r in rows), "<f2").reshape(len(rows), -1)

    def node_kv(self, node_id: str) -> tuple[str, dict[int, np.ndarray]] | None:
        """(codebook_id, {codebook size: token-major code symbols}) of a node, or None."""
        with self._read() as conn:
            return kv_streams(conn, node_id)

    # search index bookkeeping ---------------------------------------------------------------
    def index_state(self, index_key: str, from_slot: int = 0) -> IndexState | None:
        """The index's row, with the slot runs that begin at ``from_slot`` or later in ``ranges``
        (a reader catching up reads only the runs it lacks)."""
        with self._read() as conn:
            row = conn.execute(
                "select alphabet, depth, ntotal, generation from search_indexes where index_key = ?", [index_key]
            ).fetchone()
            if row is None:
                return None
            query = "select node_id, first_slot from search_ranges where index_key = ? and first_slot >= ?"
            ranges = {r[0]: int(r[1]) for r in conn.execute(query, [index_key, int(from_slot)]).fetchall()}
        return IndexState(index_key, int(row[0]), int(row[1]), int(row[2]), int(row[3]), ranges)

    def index_generation(self, index_key: str) -> tuple[int, int] | None:
        rows = self._rows("select generation, ntotal from search_indexes where index_key = ?", [index_key])
        return None if not rows else (int(rows[0][0]), int(rows[0][1]))

    def index_keys(self) -> list[str]:
        return [r[0] for r in self._rows("select index_key from search_indexes")]

    def slot_runs(self, index_key: str) -> list[tuple[str, int, int, int]]:
        """(node_id, first_slot, n_tokens, node start) of every live node in an index."""
        query = (
            "select r.node_id, r.first_slot, r.n_tokens, n.start "
            "from search_ranges r join nodes n on n.node_id = r.node_id "
            "where r.index_key = ? and n.refcount > 0"
        )
        return [(r[0], int(r[1]), int(r[2]), int(r[3])) for r in self._rows(query, [index_key])]

    # checks and accounting ------------------------------------------------------------------
    def stored_blobs(self, tier: str, sample: int | None = None) -> Iterator[tuple[str, int, bytes]]:
        """(owner id, part, bytes) of every stored blob of a tier, or an evenly spread sample.
        The part is the block number for "tokens", the alphabet the block was coded for for
        "kv", and 0 for "lm" and "codebooks"."""
        table, owner, part, data, order = BLOBS[tier]
        numbered = (
            f"select {owner} as owner, {part} as part, {data} as data, "
            f"row_number() over (order by {order}) as n from {table}"
        )
        with self._read() as conn:
            every = 1
            if sample is not None:
                (count,) = conn.execute(f"select count(*) from {table}").fetchone()  # type: ignore[misc]
                every = max(1, count // max(sample, 1))
            yield from _streamed(
                conn.execute(f"select owner, part, data from ({numbered}) where (n - 1) % ? = 0 order by n", [every])
            )

    def dangling_references(self) -> list[tuple[str, str, str, str]]:
        """(what refers, its id, what it names, the missing id): sessions and nodes naming an
        unregistered model, KV codes naming codebooks that are gone."""
        checks = (
            ("session", "sessions", "session_id", "model", "model_id", "models", "model_id"),
            ("node", "nodes", "node_id", "model", "model_id", "models", "model_id"),
            ("KV codes of node", "node_kv", "node_id", "codebooks", "codebook_id", "codebooks", "codebook_id"),
        )
        with self._read() as conn:
            return [
                (what, row_id, kind, missing)
                for what, table, key, kind, ref, target, target_key in checks
                for row_id, missing in conn.execute(
                    f"select distinct {key}, {ref} from {table} where {ref} not in (select {target_key} from {target})"
                ).fetchall()
            ]

    def table_rows(self, table: str) -> Iterator[dict]:
        """Every row of one of the schema's tables, in the order of its columns' values: the
        same rows read the same way from any backend."""
        from kvdb.storage import schema  # the columns' order as declared; a copy is no read-only command

        columns = [c.name for c in schema.metadata.tables[table].columns]
        with self._read() as conn:
            for row in _streamed(
                conn.execute(f"select {', '.join(columns)} from {table} order by {', '.join(columns)}")
            ):
                yield dict(zip(columns, row, strict=True))

    def content_hashes(self) -> dict[str, str]:
        """Each table's SHA-256 over its rows in that order: equal on two archives exactly
        when they hold the same rows."""
        out = {}
        for table in edits.TABLES:
            digest = hashlib.sha256()
            for row in self.table_rows(table):
                digest.update(repr(sorted(row.items())).encode())
            out[table] = digest.hexdigest()
        return out

    def byte_counts(self) -> dict[str, int]:
        """Payload bytes stored per tier, and tokens archived: not the engine's page overhead
        (that is ``footprint``)."""

        def total(table: str, column: str) -> str:
            return f"(select coalesce(sum(octet_length({column})), 0) from {table})"

        query = (
            "select (select count(*) from sessions), (select coalesce(sum(n_tokens), 0) from sessions), "
            # strlen: UTF-8 bytes
            "(select coalesce(sum(strlen(metadata) + strlen(name) + strlen(source)), 0) from sessions), "
            "(select count(*) from token_streams), (select coalesce(sum(n_tokens), 0) from token_streams), "
            "(select count(*) from nodes), "
            f"{total('token_blocks', 'data')}, {total('node_logprobs', 'logprobs')}, "
            f"{total('node_lm', 'payload')}, {total('node_kv', 'data')}, "
            f"{total('codebooks', 'data')}, "
            "(select coalesce(sum(n_tokens), 0) from nodes where node_id in (select node_id from node_kv)), "
            f"{total('node_chunks', 'vector')} + {CHUNK_ROW_BYTES} * (select count(*) from node_chunks)"
        )
        sessions, tokens, text, streams, stored, nodes, blocks, logprobs, lm, kv, books, kv_tokens, semantic = (
            int(v) for v in self._rows(query)[0]
        )
        return {
            "sessions": sessions,
            "tokens": tokens,
            "stored_tokens": stored,
            "nodes": nodes,
            "metadata_bytes": text + NODE_ROW_BYTES * nodes,
            "token_bytes": blocks + STREAM_ROW_BYTES * streams,
            "logprob_bytes": logprobs,
            "lm_bytes": lm,
            "kv_bytes": kv,
            "kv_tokens": kv_tokens,
            "codebook_bytes": books,
            "semantic_bytes": semantic,
        }


def _admitting(admits: ConversationFilter) -> tuple[str, list]:
    """The WHERE clause of ``admits`` over the conversations table, and its parameters: a day
    bound is a range of ``said_at`` (the time its log wrote, without a zone, whose date is the day)."""
    terms: list[str] = []
    params: list = []
    if admits.agent is not None:
        terms.append("agent = ?")
        params.append(admits.agent)
    if admits.project is not None:  # its folder or one inside it
        terms.append("starts_with(coalesce(cwd, folder) || '/', ?)")
        params.append(admits.project.rstrip("/") + "/")
    if admits.since is not None:
        terms.append("said_at >= ?")
        params.append(dt.datetime.combine(admits.since, dt.time()))
    if admits.until is not None and admits.until < dt.date.max:
        terms.append("said_at < ?")
        params.append(dt.datetime.combine(admits.until + dt.timedelta(days=1), dt.time()))
    return (" where " + " and ".join(terms) if terms else ""), params


def _streamed(result: duckdb.DuckDBPyConnection) -> Iterator[tuple]:
    while rows := result.fetchmany(FETCH_ROWS):
        yield from rows
