"""The archive's tables in one DuckDB file, reached only through SQLAlchemy Core.

Every table access of kvdb goes through this module, so the storage can later move
(DuckLake, several shards) without touching the rest. Statements use bound parameters
only. The schema is created and upgraded by alembic whenever an archive is opened.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.util
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.ddl.impl import DefaultImpl
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from kvdb import fractal
from kvdb.errors import ArchiveError, ArchiveLocked, NewerArchiveError



class DuckDBImpl(DefaultImpl):
    """Alembic has no DuckDB dialect of its own; declaring this registers one (importing is enough)."""

    __dialect__ = "duckdb"
    transactional_ddl = True


metadata = sa.MetaData()

models = sa.Table(
    "models",
    metadata,
    sa.Column("model_id", sa.String, primary_key=True),
    sa.Column("name", sa.String, nullable=False),
    sa.Column("weights_hash", sa.String, nullable=False),
    sa.Column("tokenizer_hash", sa.String, nullable=False),
    sa.Column("config", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime, nullable=False),
)

sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("session_id", sa.String, primary_key=True),
    sa.Column("name", sa.String, nullable=False),
    sa.Column("source", sa.String, nullable=False),
    sa.Column("model_id", sa.String, nullable=False),
    sa.Column("created_at", sa.DateTime, nullable=False),
    sa.Column("n_tokens", sa.Integer, nullable=False),
    sa.Column("metadata", sa.Text, nullable=False),
)

# The prefix trie: a session is the path from a root node to its leaf, and the leaf's id is the
# session's id. Every tier below is stored per node, so a shared prefix is stored once.
nodes = sa.Table(
    "nodes",
    metadata,
    sa.Column("node_id", sa.String, primary_key=True),
    sa.Column("parent_id", sa.String, nullable=True),
    sa.Column("model_id", sa.String, nullable=False),
    sa.Column("start", sa.Integer, nullable=False),  # tokens on the path before this node
    sa.Column("n_tokens", sa.Integer, nullable=False),
    sa.Column("first_token", sa.Integer, nullable=False),  # children are found by (parent_id, first_token)
    sa.Column("refcount", sa.Integer, nullable=False),  # sessions whose path runs through this node
    sa.Column("keep", sa.String),  # optional tiers the node holds, comma-separated: "search", "lm"
)

# Tier L: a node's tokens range-coded against the model's own next-token distribution (kvdb.lmcode),
# given the context of its parent path.
node_lm = sa.Table(
    "node_lm",
    metadata,
    sa.Column("node_id", sa.String, primary_key=True),
    sa.Column("payload", sa.LargeBinary, nullable=False),
)

# A node's token stream: fractal-coded blocks of anchors (kvdb.fractal), one row per block,
# so reading a range fetches only the blocks it touches.
token_streams = sa.Table(
    "token_streams",
    metadata,
    sa.Column("node_id", sa.String, primary_key=True),
    sa.Column("alphabet", sa.Integer, nullable=False),
    sa.Column("block_size", sa.Integer, nullable=False),
    sa.Column("n_tokens", sa.Integer, nullable=False),
)

token_blocks = sa.Table(
    "token_blocks",
    metadata,
    sa.Column("node_id", sa.String, primary_key=True),
    sa.Column("block_no", sa.Integer, primary_key=True),
    sa.Column("data", sa.LargeBinary, nullable=False),
)

# float32 natural-log probability of each token under the model, from the ingest forward pass.
node_logprobs = sa.Table(
    "node_logprobs",
    metadata,
    sa.Column("node_id", sa.String, primary_key=True),
    sa.Column("logprobs", sa.LargeBinary, nullable=False),
)

# Search index bookkeeping (kvdb.index): the sorted walk keys live in a sidecar file bound to the
# database by generation and slot count; these rows map slot runs to nodes.
search_indexes = sa.Table(
    "search_indexes",
    metadata,
    sa.Column("index_key", sa.String, primary_key=True),
    sa.Column("alphabet", sa.Integer, nullable=False),
    sa.Column("depth", sa.Integer, nullable=False),
    sa.Column("ntotal", sa.BigInteger, nullable=False),
    sa.Column("generation", sa.BigInteger, nullable=False),
)

search_ranges = sa.Table(
    "search_ranges",
    metadata,
    sa.Column("node_id", sa.String, primary_key=True),
    sa.Column("index_key", sa.String, nullable=False),
    sa.Column("first_slot", sa.BigInteger, nullable=False),
    sa.Column("n_tokens", sa.Integer, nullable=False),
)

# Tier K: residual-VQ codebooks (kvdb.quant) and each node's code streams, one fractal-coded
# stream per codebook size, token-major so that a node's positions can be sliced.
codebooks = sa.Table(
    "codebooks",
    metadata,
    sa.Column("codebook_id", sa.String, primary_key=True),
    sa.Column("model_id", sa.String, nullable=False),
    sa.Column("preset", sa.String, nullable=False),
    sa.Column("created_at", sa.DateTime, nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
)

node_kv = sa.Table(
    "node_kv",
    metadata,
    sa.Column("node_id", sa.String, primary_key=True),
    sa.Column("alphabet", sa.Integer, primary_key=True),
    sa.Column("block_no", sa.Integer, primary_key=True),
    sa.Column("codebook_id", sa.String, nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
)

STREAM_ROW_BYTES = 12  # alphabet, block_size and n_tokens of a token_streams row, counted in its tier
NODE_ROW_BYTES = 112  # node, parent and model ids (32 hex chars each) and four integers, counted as metadata


@dataclass(frozen=True)
class ModelRow:
    model_id: str
    name: str
    weights_hash: str
    tokenizer_hash: str
    config: dict


@dataclass(frozen=True)
class IndexState:
    """What the database says the sidecar index of one tokenizer must hold."""

    index_key: str
    alphabet: int
    depth: int
    ntotal: int
    generation: int
    ranges: dict[str, int]  # node_id -> first slot, for the nodes this commit adds (or all, on rebuild)


@dataclass(frozen=True)
class NodeRow:
    node_id: str
    parent_id: str | None
    model_id: str
    start: int
    n_tokens: int
    first_token: int
    refcount: int
    keep: frozenset[str] = frozenset()  # optional tiers held: "search", "lm"

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


@dataclass(frozen=True)
class Split:
    """Node ``node_id`` keeps its tokens from ``offset`` on; the new node ``head_id`` takes the rest."""

    node_id: str
    head_id: str
    offset: int
    lm_head: bytes | None = None  # tier L payloads of the two halves, re-coded, when the node has one
    lm_tail: bytes | None = None
    tokens: np.ndarray | None = None  # the node's tokens (decoded from tier L) and log-probabilities (scored
    logprobs: np.ndarray | None = None  # again), when it is held in tier L only


@dataclass(frozen=True)
class NewNode:
    node_id: str
    parent_id: str | None
    start: int
    tokens: np.ndarray
    logprobs: np.ndarray
    keep: frozenset[str] = frozenset({"search"})
    lm: bytes | None = None
    kv: tuple[str, dict[int, np.ndarray]] | None = None  # (codebook_id, {codebook size: token-major codes})


@dataclass(frozen=True)
class SessionWrite:
    """Everything one ingested session changes, applied in one transaction."""

    session: SessionRow
    alphabet: int
    split: Split | None = None
    node: NewNode | None = None
    index: IndexState | None = None
    # Nodes on the session's path held in tier L only get their tokens and log-probabilities back
    # (node id -> both) from the new session's own: a node two sessions share keeps its tokens.
    tokens_back: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


@dataclass(frozen=True)
class SessionRow:
    session_id: str
    name: str
    source: str
    model_id: str
    created_at: dt.datetime
    n_tokens: int
    metadata: dict


def _script_directory() -> ScriptDirectory:
    location = importlib.util.find_spec("kvdb_migrations").submodule_search_locations[0]
    config = Config()
    config.set_main_option("script_location", location)
    return ScriptDirectory.from_config(config), config


class Store:
    """One open archive file. DuckDB admits one writing process, or any number of read-only
    ones, per file; a Store holds that lock while its connection is open, and ``release`` lets
    it go (the next call takes it again) so that long work between queries blocks nobody."""

    def __init__(self, path: str | Path, lock_timeout: float | None = None, read_only: bool = False):
        """Open (creating and migrating as needed). While another process holds the file, wait up
        to ``lock_timeout`` seconds (``$KVDB_LOCK_TIMEOUT``, default 10), then raise ArchiveLocked.
        A read-only store of a missing or older archive creates or upgrades it first."""
        self.path = Path(path)
        if self.path.exists() and self.path.is_dir():
            raise ArchiveError(f"{self.path} is a directory; give the path of an archive file (e.g. {self.path}/archive.duckdb)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.timeout = float(os.environ.get("KVDB_LOCK_TIMEOUT", 10)) if lock_timeout is None else lock_timeout
        self.read_only = read_only
        self._engine: sa.Engine | None = None
        self._released: tuple | None = None  # the file's state when this store last let it go
        self._held_since = 0.0
        self.connections = 0  # connections opened so far: anything cached from an earlier one may be stale
        if read_only and (not self.path.exists() or self.schema_revision() != _script_directory()[0].get_current_head()):
            self.release()
            Store(self.path, self.timeout).close()
        if not read_only:
            self._migrate()

    @property
    def engine(self) -> sa.Engine:
        if self._engine is None:
            self._engine = self._connect()
        return self._engine

    def _connect(self) -> sa.Engine:
        deadline = time.monotonic() + self.timeout
        while True:
            engine = sa.create_engine(
                f"duckdb:///{self.path}", poolclass=sa.pool.SingletonThreadPool, connect_args={"read_only": self.read_only}
            )
            try:
                with engine.connect() as conn:
                    conn.exec_driver_sql("select 1")
                self.connections += 1
                self._held_since = time.monotonic()
                return engine
            except Exception as exc:  # duckdb raises its own IOException family for locks and bad files
                engine.dispose()
                message = _first_line(exc)
                if "lock" not in message.lower():
                    raise ArchiveError(f"cannot open archive {self.path}: {message}") from exc
                if time.monotonic() >= deadline:
                    holder = re.search(r"PID (\d+)", message)
                    who = f"process {holder.group(1)}" if holder else "another process"
                    raise ArchiveLocked(
                        f"archive {self.path} is in use by {who} (DuckDB allows one writing process, or several "
                        f"read-only ones); waited {self.timeout:g}s — retry when it is done, or raise KVDB_LOCK_TIMEOUT"
                    ) from exc
                time.sleep(0.1)

    def release(self) -> None:
        """Close the connection, and with it the file lock, until the next call needs it."""
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
            self._released = self._file_state()

    def held_for(self) -> float:
        """Seconds this store has held the file (0 when it does not)."""
        return time.monotonic() - self._held_since if self._engine is not None else 0.0

    def unchanged_since(self, connection: int) -> bool:
        """Whether no other process can have written since ``connection`` (a value of
        ``connections``) was current: it still is, or it was let go and nobody opened the file
        for writing since (its size and modification time, and its log's, are as it left them)."""
        if self.connections != connection:
            return False
        return self._engine is not None or self._released == self._file_state()

    def _file_state(self) -> tuple:
        def state(path: Path):
            try:
                st = path.stat()
            except FileNotFoundError:
                return None
            return st.st_size, st.st_mtime_ns

        return state(self.path), state(self.path.with_name(self.path.name + ".wal"))

    @contextlib.contextmanager
    def writable(self):
        """Write access for one derived-data repair (a stale search index) even on a read-only
        store: the read-only connection is closed, the write lock taken, and given back after."""
        if not self.read_only:
            yield
            return
        self.release()
        self.read_only = False
        try:
            yield
        finally:
            self.release()
            self.read_only = True

    def check_writable(self) -> None:
        if self.read_only:
            raise ArchiveError(f"archive {self.path} is open read-only; open it without read_only=True to change it")

    def _write(self):
        """A write transaction; refused on a read-only store with a message saying what to do."""
        self.check_writable()
        return self.engine.begin()

    def _migrate(self) -> None:
        script, config = _script_directory()
        head = script.get_current_head()
        with self.engine.begin() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
            if current == head:
                return
            if current is not None and current not in {rev.revision for rev in script.walk_revisions()}:
                raise NewerArchiveError(
                    f"{self.path} was written by a newer kvdb (schema revision {current}); upgrade kvdb to open it"
                )
            if current is None and sa.inspect(conn).get_table_names():
                raise ArchiveError(f"{self.path} is a DuckDB file but not a kvdb archive; choose another --db path")
            config.attributes["connection"] = conn
            command.upgrade(config, "head")

    def close(self) -> None:
        self.release()

    def schema_revision(self) -> str | None:
        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    # models ---------------------------------------------------------------------------
    def put_model(self, row: ModelRow) -> None:
        with self._write() as conn:
            exists = conn.execute(sa.select(models.c.model_id).where(models.c.model_id == row.model_id)).first()
            if exists is None:
                conn.execute(
                    models.insert().values(
                        model_id=row.model_id,
                        name=row.name,
                        weights_hash=row.weights_hash,
                        tokenizer_hash=row.tokenizer_hash,
                        config=json.dumps(row.config, sort_keys=True),
                        created_at=_now(),
                    )
                )

    def get_model(self, model_id: str) -> ModelRow | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(models).where(models.c.model_id == model_id)).first()
        if row is None:
            return None
        return ModelRow(row.model_id, row.name, row.weights_hash, row.tokenizer_hash, json.loads(row.config))

    # writing ------------------------------------------------------------------------
    def write_session(self, w: SessionWrite) -> None:
        """Split a node, add a node, add the session and count it on its path: all or nothing."""
        with self._write() as conn:
            if w.split is not None:
                self._split(conn, w.split, w.alphabet)
            if w.node is not None:
                self._insert_node(conn, w.node, w.session.model_id, w.alphabet)
            for node_id, (tokens, logprobs) in w.tokens_back.items():
                self._put_tokens_back(conn, node_id, tokens, logprobs)
            conn.execute(sessions.insert().values(**_session_values(w.session)))
            path = _path_cte(w.session.session_id)
            conn.execute(nodes.update().where(nodes.c.node_id.in_(sa.select(path.c.node_id))).values(refcount=nodes.c.refcount + 1))
            if w.index is not None:
                self._put_index_state(conn, w.index)

    def _insert_node(self, conn, node: NewNode, model_id: str, alphabet: int) -> None:
        conn.execute(
            nodes.insert().values(
                node_id=node.node_id,
                parent_id=node.parent_id,
                model_id=model_id,
                start=node.start,
                n_tokens=len(node.tokens),
                first_token=int(node.tokens[0]),
                refcount=0,
                keep=_keep_text(node.keep),
            )
        )
        self._put_tiers(conn, node.node_id, node.tokens, node.logprobs, alphabet, held="tokens" in node.keep)
        if node.lm is not None:
            conn.execute(node_lm.insert().values(node_id=node.node_id, payload=node.lm))
        if node.kv is not None:
            self._put_kv(conn, node.node_id, *node.kv)

    @staticmethod
    def _put_kv(conn, node_id: str, codebook_id: str, streams: dict[int, np.ndarray]) -> None:
        rows = [
            {"node_id": node_id, "alphabet": size, "block_no": k, "codebook_id": codebook_id, "data": blob}
            for size, symbols in streams.items()
            for k, blob in enumerate(fractal.encode_blocks(symbols, size))
        ]
        if rows:
            conn.execute(node_kv.insert(), rows)

    @staticmethod
    def _kv_streams(conn, node_id: str) -> tuple[str, dict[int, np.ndarray]] | None:
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

    @classmethod
    def _put_tiers(cls, conn, node_id: str, tokens: np.ndarray, logprobs: np.ndarray, alphabet: int, held: bool = True) -> None:
        """A node's stream row, and its token blocks and log-probabilities unless it is held in
        tier L only (then both are the model's to recompute: decoding, then scoring)."""
        conn.execute(token_streams.insert().values(node_id=node_id, alphabet=alphabet, block_size=fractal.DEFAULT_BLOCK, n_tokens=len(tokens)))
        if held:
            cls._put_token_rows(conn, node_id, tokens, logprobs)

    @classmethod
    def _put_tokens_back(cls, conn, node_id: str, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """A node held in tier L only holds its tokens again."""
        cls._put_token_rows(conn, node_id, tokens, logprobs)
        keep = _node_row(conn.execute(sa.select(nodes).where(nodes.c.node_id == node_id)).one()).keep
        conn.execute(nodes.update().where(nodes.c.node_id == node_id).values(keep=_keep_text(keep | {"tokens"})))

    @staticmethod
    def _put_token_rows(conn, node_id: str, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Token blocks and log-probabilities of a node whose stream row exists (it says the
        alphabet and block size)."""
        stream = conn.execute(sa.select(token_streams).where(token_streams.c.node_id == node_id)).one()
        if not stream.n_tokens == len(tokens) == len(logprobs):
            raise ValueError(f"node {node_id} holds {stream.n_tokens} tokens, not {len(tokens)} (with {len(logprobs)} log-probabilities)")
        blocks = fractal.encode_blocks(tokens, stream.alphabet, stream.block_size)
        conn.execute(token_blocks.insert(), [{"node_id": node_id, "block_no": k, "data": blob} for k, blob in enumerate(blocks)])
        conn.execute(node_logprobs.insert().values(node_id=node_id, logprobs=np.asarray(logprobs, dtype="<f4").tobytes()))

    def _split(self, conn, split: Split, alphabet: int) -> None:
        """The head [0, offset) of a node becomes its own node, parent of the rest."""
        node = _node_row(conn.execute(sa.select(nodes).where(nodes.c.node_id == split.node_id)).one())
        keep = node.keep | {"tokens"}  # both halves hold their tokens: the head is shared from now on
        if "tokens" not in node.keep:
            if split.tokens is None or split.logprobs is None:
                raise ValueError(f"node {node.node_id} is held in tier L only: a split must bring its tokens and log-probabilities")
            tokens, logprobs = np.asarray(split.tokens), np.asarray(split.logprobs, dtype=np.float32)
        else:
            tokens = self._node_tokens(conn, node.node_id)
            logprobs = np.frombuffer(
                conn.execute(sa.select(node_logprobs.c.logprobs).where(node_logprobs.c.node_id == node.node_id)).scalar_one(), "<f4"
            )
        k = split.offset
        for table in (token_blocks, token_streams, node_logprobs):
            conn.execute(table.delete().where(table.c.node_id == node.node_id))
        self._put_tiers(conn, node.node_id, tokens[k:], logprobs[k:], alphabet)
        conn.execute(
            nodes.insert().values(
                node_id=split.head_id,
                parent_id=node.parent_id,
                model_id=node.model_id,
                start=node.start,
                n_tokens=k,
                first_token=node.first_token,
                refcount=node.refcount,
                keep=_keep_text(keep),
            )
        )
        self._put_tiers(conn, split.head_id, tokens[:k], logprobs[:k], alphabet)
        kv = self._kv_streams(conn, node.node_id)
        if kv is not None:  # token-major streams: the first k positions' columns go to the head
            codebook_id, streams = kv
            conn.execute(node_kv.delete().where(node_kv.c.node_id == node.node_id))
            rows = {size: symbols.reshape(node.n_tokens, -1) for size, symbols in streams.items()}
            self._put_kv(conn, split.head_id, codebook_id, {size: r[:k].reshape(-1) for size, r in rows.items()})
            self._put_kv(conn, node.node_id, codebook_id, {size: r[k:].reshape(-1) for size, r in rows.items()})
        conn.execute(node_lm.delete().where(node_lm.c.node_id == node.node_id))
        if "lm" in node.keep:
            if split.lm_head is None or split.lm_tail is None:
                raise ValueError(f"node {node.node_id} keeps tier L: a split must bring both halves re-coded")
            conn.execute(node_lm.insert(), [{"node_id": split.head_id, "payload": split.lm_head}, {"node_id": node.node_id, "payload": split.lm_tail}])
        conn.execute(
            nodes.update()
            .where(nodes.c.node_id == node.node_id)
            .values(parent_id=split.head_id, start=node.start + k, n_tokens=node.n_tokens - k, first_token=int(tokens[k]), keep=_keep_text(keep))
        )
        run = conn.execute(sa.select(search_ranges).where(search_ranges.c.node_id == node.node_id)).first()
        if run is not None:  # the points stay where they are; the slot run is cut in two
            conn.execute(
                search_ranges.update()
                .where(search_ranges.c.node_id == node.node_id)
                .values(first_slot=run.first_slot + k, n_tokens=run.n_tokens - k)
            )
            conn.execute(search_ranges.insert().values(node_id=split.head_id, index_key=run.index_key, first_slot=run.first_slot, n_tokens=k))

    def delete_session(self, session_id: str) -> None:
        """Uncount the session on its path. Nodes no session uses drop out of search at once
        (their refcount is 0) and off the disk at ``gc``; re-ingesting revives them."""
        with self._write() as conn:
            path = [r[0] for r in conn.execute(sa.select(_path_cte(session_id).c.node_id))]
            conn.execute(nodes.update().where(nodes.c.node_id.in_(path)).values(refcount=nodes.c.refcount - 1))
            conn.execute(sessions.delete().where(sessions.c.session_id == session_id))

    def gc(self) -> dict[str, int]:
        """Delete the nodes no session uses, with every tier stored for them."""
        with self._write() as conn:
            dead = sa.select(nodes.c.node_id).where(nodes.c.refcount <= 0)
            counts = conn.execute(
                sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(nodes.c.n_tokens), 0)).where(nodes.c.refcount <= 0)
            ).one()
            freed = conn.execute(
                sa.select(sa.func.coalesce(sa.func.sum(sa.func.octet_length(token_blocks.c.data)), 0)).where(token_blocks.c.node_id.in_(dead))
            ).scalar_one()
            for table in (token_blocks, token_streams, node_logprobs, search_ranges, node_lm, node_kv):
                conn.execute(table.delete().where(table.c.node_id.in_(dead)))
            conn.execute(nodes.delete().where(nodes.c.refcount <= 0))
        return {"nodes": int(counts[0]), "tokens": int(counts[1]), "token_bytes": int(freed)}

    def drop_tiers(self, drops: dict[str, set[str]], tokens_back: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> None:
        """Drop tiers from nodes (``drops``: node id -> tiers; search slots become tombstones;
        the token tier goes with its log-probabilities), and give nodes held in tier L only their
        tokens and log-probabilities back, in one transaction."""
        with self._write() as conn:
            for row in conn.execute(sa.select(nodes).where(nodes.c.node_id.in_(list(drops)))).all():
                node = _node_row(row)
                tiers = drops[node.node_id]
                conn.execute(nodes.update().where(nodes.c.node_id == node.node_id).values(keep=_keep_text(node.keep - tiers)))
                for tier, table in (("search", search_ranges), ("lm", node_lm), ("kv", node_kv), ("tokens", token_blocks), ("tokens", node_logprobs)):
                    if tier in tiers:
                        conn.execute(table.delete().where(table.c.node_id == node.node_id))
            for node_id, (tokens, logprobs) in (tokens_back or {}).items():
                self._put_tokens_back(conn, node_id, tokens, logprobs)

    def add_kv(self, node_id: str, codebook_id: str, streams: dict[int, np.ndarray]) -> None:
        """Give an existing node tier K (a shared prefix stored before without it)."""
        with self._write() as conn:
            node = _node_row(conn.execute(sa.select(nodes).where(nodes.c.node_id == node_id)).one())
            if "kv" in node.keep:
                return
            self._put_kv(conn, node_id, codebook_id, streams)
            conn.execute(nodes.update().where(nodes.c.node_id == node_id).values(keep=_keep_text(node.keep | {"kv"})))

    def node_kv(self, node_id: str) -> tuple[str, dict[int, np.ndarray]] | None:
        """(codebook_id, {codebook size: token-major code symbols}) of a node, or None."""
        with self.engine.connect() as conn:
            return self._kv_streams(conn, node_id)

    def put_codebooks(self, codebook_id: str, model_id: str, preset: str, data: bytes) -> None:
        with self._write() as conn:
            if conn.execute(sa.select(codebooks.c.codebook_id).where(codebooks.c.codebook_id == codebook_id)).first() is None:
                conn.execute(codebooks.insert().values(codebook_id=codebook_id, model_id=model_id, preset=preset, created_at=_now(), data=data))

    def codebooks_for(self, model_id: str) -> tuple[str, bytes] | None:
        """The newest codebook set trained for a model: (codebook_id, serialized codebooks)."""
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(codebooks.c.codebook_id, codebooks.c.data)
                .where(codebooks.c.model_id == model_id)
                .order_by(codebooks.c.created_at.desc())
                .limit(1)
            ).first()
        return None if row is None else (row[0], row[1])

    def codebook_data(self, codebook_id: str) -> bytes:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(codebooks.c.data).where(codebooks.c.codebook_id == codebook_id)).scalar_one()

    def node_lm_payload(self, node_id: str) -> bytes | None:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(node_lm.c.payload).where(node_lm.c.node_id == node_id)).scalar()

    # the trie -------------------------------------------------------------------------
    def children(self, parent_id: str | None, model_id: str, first_token: int) -> list[NodeRow]:
        parent = nodes.c.parent_id.is_(None) if parent_id is None else nodes.c.parent_id == parent_id
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(nodes).where(parent, nodes.c.model_id == model_id, nodes.c.first_token == first_token)
            ).all()
        return [_node_row(r) for r in rows]

    def node_path(self, node_id: str) -> list[NodeRow]:
        """The nodes from the root down to ``node_id`` (a session id names its leaf)."""
        cte = _path_cte(node_id)
        with self.engine.connect() as conn:
            return [_node_row(r) for r in conn.execute(sa.select(cte).order_by(cte.c.start))]

    def nodes_of(self, model_ids: list[str]) -> list[NodeRow]:
        """Every node of these models (unused ones too, until gc), parents before children."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(nodes).where(nodes.c.model_id.in_(model_ids)).order_by(nodes.c.start, nodes.c.node_id)
            ).all()
        return [_node_row(r) for r in rows]

    def shared_nodes(self) -> list[NodeRow]:
        """Nodes on the paths of two or more sessions: the shared prefixes, shortest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(nodes).where(nodes.c.refcount >= 2).order_by(nodes.c.start, nodes.c.node_id)).all()
        return [_node_row(r) for r in rows]

    def node_tokens(self, node_id: str, start: int = 0, end: int | None = None) -> np.ndarray:
        with self.engine.connect() as conn:
            return self._node_tokens(conn, node_id, start, end)

    @staticmethod
    def _node_tokens(conn, node_id: str, start: int = 0, end: int | None = None) -> np.ndarray:
        """Token ids [start, end) of a node, decoded from only the blocks the range touches."""
        stream = conn.execute(sa.select(token_streams).where(token_streams.c.node_id == node_id)).one()
        end = stream.n_tokens if end is None else end
        needed = fractal.blocks_for_range(start, end, stream.block_size)
        if not needed:
            return np.zeros(0, dtype=np.int64)
        blobs = conn.execute(
            sa.select(token_blocks.c.data)
            .where(token_blocks.c.node_id == node_id, token_blocks.c.block_no.between(needed.start, needed.stop - 1))
            .order_by(token_blocks.c.block_no)
        ).scalars().all()
        if len(blobs) != len(needed):  # a node held in tier L only: Archive decodes those
            raise ValueError(f"node {node_id} holds no token blocks for tokens [{start}, {end})")
        return fractal.decode_range(blobs, stream.alphabet, stream.block_size, start, end)

    def load_tokens(self, session_id: str, start: int = 0, end: int | None = None) -> np.ndarray:
        """Token ids [start, end) of a session, from the nodes of its path that the range touches."""
        return self.path_tokens(self.node_path(session_id), start, end)

    def path_tokens(self, path: list[NodeRow], start: int = 0, end: int | None = None) -> np.ndarray:
        """Token ids [start, end) along a node path the caller has read already."""
        end = path[-1].end if end is None else end
        with self.engine.connect() as conn:
            pieces = [
                self._node_tokens(conn, n.node_id, max(start, n.start) - n.start, min(end, n.end) - n.start)
                for n in path
                if n.start < end and n.end > start
            ]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    def load_logprobs(self, session_id: str) -> np.ndarray:
        path = self.node_path(session_id)
        with self.engine.connect() as conn:
            blobs = [
                conn.execute(sa.select(node_logprobs.c.logprobs).where(node_logprobs.c.node_id == n.node_id)).scalar_one()
                for n in path
            ]
        return np.frombuffer(b"".join(blobs), dtype="<f4").copy()

    def node_shapes(self) -> list[tuple[NodeRow, int, int]]:
        """Every node with its token stream's alphabet and block size: the trie's shape."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(nodes, token_streams.c.alphabet, token_streams.c.block_size).join(
                    token_streams, token_streams.c.node_id == nodes.c.node_id
                )
            ).all()
        return [(_node_row(r), int(r.alphabet), int(r.block_size)) for r in rows]

    def stored_blobs(self, tier: str, sample: int | None = None):
        """(owner id, part, bytes) of every stored blob of a tier, or of an evenly spread sample of
        about ``sample``: what verify reads. The part is the block number for "tokens", the
        alphabet the block was coded for for "kv", and 0 for "lm" and "codebooks"."""
        table, key, part, data, order = {
            "tokens": (token_blocks, token_blocks.c.node_id, token_blocks.c.block_no, token_blocks.c.data, (token_blocks.c.node_id, token_blocks.c.block_no)),
            "kv": (node_kv, node_kv.c.node_id, node_kv.c.alphabet, node_kv.c.data, (node_kv.c.node_id, node_kv.c.alphabet, node_kv.c.block_no)),
            "lm": (node_lm, node_lm.c.node_id, sa.literal_column("0"), node_lm.c.payload, (node_lm.c.node_id,)),
            "codebooks": (codebooks, codebooks.c.codebook_id, sa.literal_column("0"), codebooks.c.data, (codebooks.c.codebook_id,)),
        }[tier]
        numbered = sa.select(
            key.label("owner"), part.label("part"), data.label("data"), sa.func.row_number().over(order_by=order).label("n")
        ).subquery()
        query = sa.select(numbered.c.owner, numbered.c.part, numbered.c.data).order_by(numbered.c.n)
        with self.engine.connect() as conn:
            if sample is not None:
                count = conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
                query = query.where((numbered.c.n - 1) % max(1, count // max(sample, 1)) == 0)
            yield from conn.execute(query)

    def dangling_references(self) -> list[tuple[str, str, str, str]]:
        """(what refers, its id, what it names, the missing id) of references to rows that are not
        stored: sessions and nodes naming an unregistered model, KV codes naming codebooks that are gone."""
        checks = (
            ("session", sessions.c.session_id, "model", sessions.c.model_id, models.c.model_id),
            ("node", nodes.c.node_id, "model", nodes.c.model_id, models.c.model_id),
            ("KV codes of node", node_kv.c.node_id, "codebooks", node_kv.c.codebook_id, codebooks.c.codebook_id),
        )
        with self.engine.connect() as conn:
            return [
                (what, row_id, kind, missing)
                for what, ref_from, kind, ref, target in checks
                for row_id, missing in conn.execute(sa.select(ref_from, ref).distinct().where(ref.not_in(sa.select(target))))
            ]

    def logprob_lengths(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(node_logprobs.c.node_id, sa.func.octet_length(node_logprobs.c.logprobs)))
            return {r[0]: int(r[1]) // 4 for r in rows}

    def load_blocks(self, wanted: list[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        """Token blocks by (node_id, block_no), in one query."""
        if not wanted:
            return {}
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(token_blocks.c.node_id, token_blocks.c.block_no, token_blocks.c.data).where(
                    sa.tuple_(token_blocks.c.node_id, token_blocks.c.block_no).in_(wanted)
                )
            )
            return {(r[0], int(r[1])): r[2] for r in rows}

    # sessions -------------------------------------------------------------------------
    def has_session(self, session_id: str) -> bool:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sessions.c.session_id).where(sessions.c.session_id == session_id)).first() is not None

    def list_sessions(self) -> list[SessionRow]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(sessions).order_by(sessions.c.created_at, sessions.c.session_id)).all()
        return [_session_row(r) for r in rows]

    def match_sessions(self, ref: str) -> list[SessionRow]:
        """Sessions whose id starts with ``ref`` or whose name equals it."""
        prefix = ref.lower()
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(sessions).where(
                    sa.or_(sessions.c.name == ref, sa.func.starts_with(sessions.c.session_id, prefix))
                )
            ).all()
        return [_session_row(r) for r in rows]

    def get_session(self, session_id: str) -> SessionRow | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(sessions).where(sessions.c.session_id == session_id)).first()
        return None if row is None else _session_row(row)

    def max_alphabet(self, model_ids: list[str]) -> int:
        """The largest alphabet any token stream of these models was coded with (0 if none)."""
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.coalesce(sa.func.max(token_streams.c.alphabet), 0))
                    .join(nodes, nodes.c.node_id == token_streams.c.node_id)
                    .where(nodes.c.model_id.in_(model_ids))
                ).scalar_one()
            )

    def model_ids_with_tokenizer(self, tokenizer_hash: str) -> list[str]:
        with self.engine.connect() as conn:
            return list(conn.execute(sa.select(models.c.model_id).where(models.c.tokenizer_hash == tokenizer_hash)).scalars())

    # search index -------------------------------------------------------------------
    def index_state(self, index_key: str) -> IndexState | None:
        """The recorded state of one index, with every live node's first slot."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(search_indexes).where(search_indexes.c.index_key == index_key)).first()
            if row is None:
                return None
            ranges = conn.execute(
                sa.select(search_ranges.c.node_id, search_ranges.c.first_slot).where(search_ranges.c.index_key == index_key)
            ).all()
        return IndexState(index_key, row.alphabet, row.depth, int(row.ntotal), int(row.generation), {r[0]: int(r[1]) for r in ranges})

    def index_generation(self, index_key: str) -> tuple[int, int] | None:
        """(generation, ntotal) of one index: enough to tell whether a loaded copy is current."""
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(search_indexes.c.generation, search_indexes.c.ntotal).where(search_indexes.c.index_key == index_key)
            ).first()
        return None if row is None else (int(row[0]), int(row[1]))

    def tokenizer_hashes(self) -> list[str]:
        with self.engine.connect() as conn:
            return sorted(set(conn.execute(sa.select(models.c.tokenizer_hash)).scalars()))

    def index_keys(self) -> list[str]:
        with self.engine.connect() as conn:
            return list(conn.execute(sa.select(search_indexes.c.index_key)).scalars())

    def slot_runs(self, index_key: str) -> list[tuple[str, int, int, int]]:
        """(node_id, first_slot, n_tokens, start of the node on its path) of every node in an
        index that some session still uses."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(search_ranges.c.node_id, search_ranges.c.first_slot, search_ranges.c.n_tokens, nodes.c.start)
                .join(nodes, nodes.c.node_id == search_ranges.c.node_id)
                .where(search_ranges.c.index_key == index_key, nodes.c.refcount > 0)
            ).all()
        return [(r[0], int(r[1]), int(r[2]), int(r[3])) for r in rows]

    def replace_index_state(self, state: IndexState) -> None:
        """After a rebuild: the new generation and every node's slots, in one transaction."""
        with self._write() as conn:
            conn.execute(search_ranges.delete().where(search_ranges.c.index_key == state.index_key))
            self._put_index_state(conn, state)

    @staticmethod
    def _put_index_state(conn, state: IndexState) -> None:
        conn.execute(search_indexes.delete().where(search_indexes.c.index_key == state.index_key))
        conn.execute(
            search_indexes.insert().values(
                index_key=state.index_key, alphabet=state.alphabet, depth=state.depth, ntotal=state.ntotal, generation=state.generation
            )
        )
        if state.ranges:
            n_tokens = dict(conn.execute(sa.select(nodes.c.node_id, nodes.c.n_tokens).where(nodes.c.node_id.in_(list(state.ranges)))).all())
            conn.execute(
                search_ranges.insert(),
                [
                    {"node_id": nid, "index_key": state.index_key, "first_slot": first, "n_tokens": n_tokens[nid]}
                    for nid, first in state.ranges.items()
                ],
            )

    # accounting -----------------------------------------------------------------------
    def byte_counts(self) -> dict[str, int]:
        """Bytes stored per tier (payload bytes, not DuckDB's page overhead), and tokens archived."""
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(
                    sa.func.count(sessions.c.session_id),
                    sa.func.coalesce(sa.func.sum(sessions.c.n_tokens), 0),
                    sa.func.coalesce(sa.func.sum(_text_bytes(sessions.c.metadata) + _text_bytes(sessions.c.name) + _text_bytes(sessions.c.source)), 0),
                )
            ).one()
            blocks = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(sa.func.octet_length(token_blocks.c.data)), 0))).scalar_one()
            streams = conn.execute(sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(token_streams.c.n_tokens), 0))).one()
            logprob_bytes = conn.execute(
                sa.select(sa.func.coalesce(sa.func.sum(sa.func.octet_length(node_logprobs.c.logprobs)), 0))
            ).scalar_one()
            n_nodes = conn.execute(sa.select(sa.func.count()).select_from(nodes)).scalar_one()
            lm_bytes = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(sa.func.octet_length(node_lm.c.payload)), 0))).scalar_one()
            kv_bytes = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(sa.func.octet_length(node_kv.c.data)), 0))).scalar_one()
            codebook_bytes = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(sa.func.octet_length(codebooks.c.data)), 0))).scalar_one()
            kv_tokens = conn.execute(
                sa.select(sa.func.coalesce(sa.func.sum(nodes.c.n_tokens), 0)).where(nodes.c.node_id.in_(sa.select(node_kv.c.node_id)))
            ).scalar_one()
        return {
            "sessions": int(row[0]),
            "tokens": int(row[1]),
            "stored_tokens": int(streams[1]),
            "nodes": int(n_nodes),
            "metadata_bytes": int(row[2]) + NODE_ROW_BYTES * int(n_nodes),
            "token_bytes": int(blocks) + STREAM_ROW_BYTES * int(streams[0]),
            "logprob_bytes": int(logprob_bytes),
            "lm_bytes": int(lm_bytes),
            "kv_bytes": int(kv_bytes),
            "kv_tokens": int(kv_tokens),
            "codebook_bytes": int(codebook_bytes),
        }


def _text_bytes(column):
    return sa.func.octet_length(sa.cast(column, sa.LargeBinary))


def _path_cte(node_id: str):
    """Recursive walk from a node up to its root."""
    path = sa.select(nodes).where(nodes.c.node_id == node_id).cte(recursive=True)
    return path.union_all(sa.select(nodes).join(path, nodes.c.node_id == path.c.parent_id))


def _node_row(r) -> NodeRow:
    keep = frozenset(t for t in (r.keep if r.keep is not None else "search").split(",") if t)
    return NodeRow(r.node_id, r.parent_id, r.model_id, int(r.start), int(r.n_tokens), int(r.first_token), int(r.refcount), keep)


def _keep_text(keep) -> str:
    return ",".join(sorted(keep))


def _session_values(row: SessionRow) -> dict:
    return {
        "session_id": row.session_id,
        "name": row.name,
        "source": row.source,
        "model_id": row.model_id,
        "created_at": row.created_at,
        "n_tokens": row.n_tokens,
        "metadata": json.dumps(row.metadata, sort_keys=True),
    }


def _session_row(r) -> SessionRow:
    return SessionRow(r.session_id, r.name, r.source, r.model_id, r.created_at, int(r.n_tokens), json.loads(r.metadata))


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
