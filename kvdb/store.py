"""The archive's tables in one DuckDB file, reached only through SQLAlchemy Core.

Every table access of kvdb goes through this module, so the storage can later move
(DuckLake, several shards) without touching the rest. Statements use bound parameters
only. The schema is created and upgraded by alembic whenever an archive is opened.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.ddl.impl import DefaultImpl
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from kvdb import fractal
from kvdb.errors import ArchiveError, NewerArchiveError



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

# A session's token stream: fractal-coded blocks of anchors (kvdb.fractal), one row per block,
# so reading a range fetches only the blocks it touches.
token_streams = sa.Table(
    "token_streams",
    metadata,
    sa.Column("session_id", sa.String, primary_key=True),
    sa.Column("alphabet", sa.Integer, nullable=False),
    sa.Column("block_size", sa.Integer, nullable=False),
    sa.Column("n_tokens", sa.Integer, nullable=False),
)

token_blocks = sa.Table(
    "token_blocks",
    metadata,
    sa.Column("session_id", sa.String, primary_key=True),
    sa.Column("block_no", sa.Integer, primary_key=True),
    sa.Column("data", sa.LargeBinary, nullable=False),
)

# float32 natural-log probability of each token under the model, from the ingest forward pass.
session_logprobs = sa.Table(
    "session_logprobs",
    metadata,
    sa.Column("session_id", sa.String, primary_key=True),
    sa.Column("logprobs", sa.LargeBinary, nullable=False),
)

# Search index bookkeeping (kvdb.index): the FAISS points live in a sidecar file bound to the
# database by generation and slot count; these rows map slot runs to sessions.
search_indexes = sa.Table(
    "search_indexes",
    metadata,
    sa.Column("index_key", sa.String, primary_key=True),
    sa.Column("alphabet", sa.Integer, nullable=False),
    sa.Column("dim", sa.Integer, nullable=False),
    sa.Column("ntotal", sa.BigInteger, nullable=False),
    sa.Column("generation", sa.BigInteger, nullable=False),
)

search_ranges = sa.Table(
    "search_ranges",
    metadata,
    sa.Column("session_id", sa.String, primary_key=True),
    sa.Column("index_key", sa.String, nullable=False),
    sa.Column("first_slot", sa.BigInteger, nullable=False),
    sa.Column("n_tokens", sa.Integer, nullable=False),
)

STREAM_ROW_BYTES = 12  # alphabet, block_size and n_tokens of a token_streams row, counted in its tier


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
    dim: int
    ntotal: int
    generation: int
    ranges: dict[str, int]  # session_id -> first slot, for the sessions this commit adds (or all, on rebuild)


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
    """One open archive file. Not shared between processes: DuckDB admits one writer."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.exists() and self.path.is_dir():
            raise ArchiveError(f"{self.path} is a directory; give the path of an archive file (e.g. {self.path}/archive.duckdb)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.engine = sa.create_engine(f"duckdb:///{self.path}", poolclass=sa.pool.SingletonThreadPool)
            with self.engine.connect() as conn:
                conn.exec_driver_sql("select 1")
        except Exception as exc:  # duckdb raises its own IOException family for locks and bad files
            raise ArchiveError(f"cannot open archive {self.path}: {_first_line(exc)}") from exc
        self._migrate()

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
        self.engine.dispose()

    def schema_revision(self) -> str | None:
        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    # models ---------------------------------------------------------------------------
    def put_model(self, row: ModelRow) -> None:
        with self.engine.begin() as conn:
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

    # sessions -------------------------------------------------------------------------
    def has_session(self, session_id: str) -> bool:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sessions.c.session_id).where(sessions.c.session_id == session_id)).first() is not None

    def put_sessions(
        self, items: list[tuple[SessionRow, np.ndarray, np.ndarray]], alphabet: int, index: IndexState | None = None
    ) -> None:
        """Write sessions with their streams (and their search slots) in one transaction."""
        with self.engine.begin() as conn:
            for row, tokens, logprobs in items:
                conn.execute(
                    sessions.insert().values(
                        session_id=row.session_id,
                        name=row.name,
                        source=row.source,
                        model_id=row.model_id,
                        created_at=row.created_at,
                        n_tokens=row.n_tokens,
                        metadata=json.dumps(row.metadata, sort_keys=True),
                    )
                )
                conn.execute(
                    token_streams.insert().values(
                        session_id=row.session_id, alphabet=alphabet, block_size=fractal.DEFAULT_BLOCK, n_tokens=len(tokens)
                    )
                )
                blocks = fractal.encode_blocks(tokens, alphabet, fractal.DEFAULT_BLOCK)
                if blocks:
                    conn.execute(
                        token_blocks.insert(),
                        [{"session_id": row.session_id, "block_no": k, "data": blob} for k, blob in enumerate(blocks)],
                    )
                conn.execute(
                    session_logprobs.insert().values(
                        session_id=row.session_id, logprobs=np.asarray(logprobs, dtype="<f4").tobytes()
                    )
                )
            if index is not None:
                self._put_index_state(conn, index)

    # search index -------------------------------------------------------------------
    def index_state(self, index_key: str) -> IndexState | None:
        """The recorded state of one index, with every live session's first slot."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(search_indexes).where(search_indexes.c.index_key == index_key)).first()
            if row is None:
                return None
            ranges = conn.execute(
                sa.select(search_ranges.c.session_id, search_ranges.c.first_slot).where(search_ranges.c.index_key == index_key)
            ).all()
        return IndexState(index_key, row.alphabet, row.dim, int(row.ntotal), int(row.generation), {r[0]: int(r[1]) for r in ranges})

    def slot_runs(self, index_key: str) -> list[tuple[str, int, int]]:
        """(session_id, first_slot, n_tokens) of every live session in an index."""
        with self.engine.connect() as conn:
            return [
                (r[0], int(r[1]), int(r[2]))
                for r in conn.execute(
                    sa.select(search_ranges.c.session_id, search_ranges.c.first_slot, search_ranges.c.n_tokens).where(
                        search_ranges.c.index_key == index_key
                    )
                )
            ]

    def sessions_with_tokenizer(self, tokenizer_hash: str) -> list[SessionRow]:
        """Sessions whose model has this tokenizer, oldest first: what one search index covers."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(sessions)
                .join(models, models.c.model_id == sessions.c.model_id)
                .where(models.c.tokenizer_hash == tokenizer_hash)
                .order_by(sessions.c.created_at, sessions.c.session_id)
            ).all()
        return [_session_row(r) for r in rows]

    def replace_index_state(self, state: IndexState) -> None:
        """After a rebuild: the new generation and every session's slots, in one transaction."""
        with self.engine.begin() as conn:
            conn.execute(search_ranges.delete().where(search_ranges.c.index_key == state.index_key))
            self._put_index_state(conn, state)

    @staticmethod
    def _put_index_state(conn, state: IndexState) -> None:
        conn.execute(search_indexes.delete().where(search_indexes.c.index_key == state.index_key))
        conn.execute(
            search_indexes.insert().values(
                index_key=state.index_key, alphabet=state.alphabet, dim=state.dim, ntotal=state.ntotal, generation=state.generation
            )
        )
        if state.ranges:
            n_tokens = dict(
                conn.execute(
                    sa.select(token_streams.c.session_id, token_streams.c.n_tokens).where(
                        token_streams.c.session_id.in_(list(state.ranges))
                    )
                ).all()
            )
            conn.execute(
                search_ranges.insert(),
                [
                    {"session_id": sid, "index_key": state.index_key, "first_slot": first, "n_tokens": n_tokens[sid]}
                    for sid, first in state.ranges.items()
                ],
            )

    # sessions (continued) ---------------------------------------------------------------
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

    def load_tokens(self, session_id: str, start: int = 0, end: int | None = None) -> np.ndarray:
        """Token ids [start, end) of a session, decoded from only the blocks the range touches."""
        with self.engine.connect() as conn:
            stream = conn.execute(sa.select(token_streams).where(token_streams.c.session_id == session_id)).one()
            end = stream.n_tokens if end is None else end
            needed = fractal.blocks_for_range(start, end, stream.block_size)
            if not needed:
                return np.zeros(0, dtype=np.int64)
            blobs = conn.execute(
                sa.select(token_blocks.c.data)
                .where(token_blocks.c.session_id == session_id, token_blocks.c.block_no.between(needed.start, needed.stop - 1))
                .order_by(token_blocks.c.block_no)
            ).scalars().all()
        return fractal.decode_range(blobs, stream.alphabet, stream.block_size, start, end)

    def load_logprobs(self, session_id: str) -> np.ndarray:
        with self.engine.connect() as conn:
            blob = conn.execute(
                sa.select(session_logprobs.c.logprobs).where(session_logprobs.c.session_id == session_id)
            ).scalar_one()
        return np.frombuffer(blob, dtype="<f4").copy()

    def delete_session(self, session_id: str) -> None:
        with self.engine.begin() as conn:
            for table in (token_blocks, token_streams, session_logprobs, search_ranges):
                conn.execute(table.delete().where(table.c.session_id == session_id))
            conn.execute(sessions.delete().where(sessions.c.session_id == session_id))

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
            n_streams = conn.execute(sa.select(sa.func.count()).select_from(token_streams)).scalar_one()
            logprob_bytes = conn.execute(
                sa.select(sa.func.coalesce(sa.func.sum(sa.func.octet_length(session_logprobs.c.logprobs)), 0))
            ).scalar_one()
        return {
            "sessions": int(row[0]),
            "tokens": int(row[1]),
            "metadata_bytes": int(row[2]),
            "token_bytes": int(blocks) + STREAM_ROW_BYTES * int(n_streams),
            "logprob_bytes": int(logprob_bytes),
        }


def _text_bytes(column):
    return sa.func.octet_length(sa.cast(column, sa.LargeBinary))


def _session_row(r) -> SessionRow:
    return SessionRow(r.session_id, r.name, r.source, r.model_id, r.created_at, int(r.n_tokens), json.loads(r.metadata))


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
