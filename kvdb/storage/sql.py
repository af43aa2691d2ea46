"""The reads every SQL backend shares, through SQLAlchemy Core with bound parameters only.

A subclass says how to reach the engine (``engine`` and ``_write``) and how its lock and
version behave; the queries are the same on a DuckDB file and on a DuckLake catalog.
"""

from __future__ import annotations

import abc
import contextlib
import json
from collections.abc import Iterator

import numpy as np
import sqlalchemy as sa

from kvdb.codecs import fractal
from kvdb.errors import StaleWrite
from kvdb.storage import schema, sql_apply
from kvdb.storage.base import (
    CodebookRow,
    IndexState,
    ModelRow,
    NodeRow,
    Plan,
    SessionRow,
    Storage,
)
from kvdb.storage.schema import (
    codebooks,
    models,
    node_kv,
    node_lm,
    node_logprobs,
    nodes,
    search_indexes,
    search_ranges,
    sessions,
    token_blocks,
    token_streams,
)
from kvdb.storage.sql_rows import (
    kv_streams,
    logprobs_blob,
    node_row,
    node_tokens,
    path_rows,
    session_row,
)

STREAM_ROW_BYTES = 12  # alphabet, block_size and n_tokens of a token_streams row, counted in its tier
SMALL_BLOB = 4096  # codebook blobs listed whole: references to shipped codebooks (trained ones are MBs)
NODE_ROW_BYTES = 112  # node, parent and model ids (32 hex chars each) and four integers, counted as metadata


class SqlStorage(Storage):
    """Reads as queries; ``apply`` runs a plan's edits in one write transaction."""

    @property
    @abc.abstractmethod
    def engine(self) -> sa.Engine:
        """The engine, connected (a backend with a lock takes it here)."""

    def _write(self):
        """A write transaction; refused on a read-only storage with a message saying what to do."""
        self.check_writable()
        return self.engine.begin()

    def _wrote(self) -> None:
        """Called after every committed plan: the storage's version moves."""

    @contextlib.contextmanager
    def writable(self):
        """A read-only storage's connection is closed, opened again for writing, and given back after."""
        if not self.read_only:
            yield
            return
        self.close()
        self.read_only = False
        try:
            yield
        finally:
            self.close()
            self.read_only = True

    def apply(self, plan: Plan, based_on=None) -> dict | None:
        with self._write() as conn:
            if based_on is not None and self.version() != based_on:  # the write lock is held: nobody commits meanwhile
                raise StaleWrite(f"{self.describe()} changed while this write was planned; plan again")
            result = sql_apply.apply(conn, plan)
        self._wrote()
        return result

    # models and codebooks -----------------------------------------------------------
    def get_model(self, model_id: str) -> ModelRow | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(models).where(models.c.model_id == model_id)).first()
        return None if row is None else ModelRow(row.model_id, row.name, row.weights_hash, row.tokenizer_hash, json.loads(row.config))

    def model_ids_with_tokenizer(self, tokenizer_hash: str) -> list[str]:
        with self.engine.connect() as conn:
            return list(conn.execute(sa.select(models.c.model_id).where(models.c.tokenizer_hash == tokenizer_hash)).scalars())

    def tokenizer_hashes(self) -> list[str]:
        with self.engine.connect() as conn:
            return sorted(set(conn.execute(sa.select(models.c.tokenizer_hash)).scalars()))

    def codebooks_for(self, model_id: str) -> tuple[str, bytes] | None:
        query = sa.select(codebooks.c.codebook_id, codebooks.c.data).where(codebooks.c.model_id == model_id)
        with self.engine.connect() as conn:
            row = conn.execute(query.order_by(codebooks.c.created_at.desc()).limit(1)).first()
        return None if row is None else (row[0], row[1])

    def codebook_data(self, codebook_id: str) -> bytes:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(codebooks.c.data).where(codebooks.c.codebook_id == codebook_id)).scalar_one()

    def codebook_rows(self) -> list[CodebookRow]:
        size = sa.func.octet_length(codebooks.c.data)
        small = sa.case((size <= SMALL_BLOB, codebooks.c.data), else_=sa.null())
        query = sa.select(codebooks.c.codebook_id, codebooks.c.model_id, codebooks.c.preset, codebooks.c.created_at, size, small)
        with self.engine.connect() as conn:
            return [CodebookRow(*row) for row in conn.execute(query.order_by(codebooks.c.created_at, codebooks.c.codebook_id))]

    # sessions -------------------------------------------------------------------------
    def has_session(self, session_id: str) -> bool:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sessions.c.session_id).where(sessions.c.session_id == session_id)).first() is not None

    def get_session(self, session_id: str) -> SessionRow | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(sessions).where(sessions.c.session_id == session_id)).first()
        return None if row is None else session_row(row)

    def list_sessions(self) -> list[SessionRow]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(sessions).order_by(sessions.c.created_at, sessions.c.session_id)).all()
        return [session_row(r) for r in rows]

    def match_sessions(self, ref: str) -> list[SessionRow]:
        named_or_prefixed = sa.or_(sessions.c.name == ref, sa.func.starts_with(sessions.c.session_id, ref.lower()))
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(sessions).where(named_or_prefixed)).all()
        return [session_row(r) for r in rows]

    # the trie -------------------------------------------------------------------------
    def children(self, parent_id: str | None, model_id: str, first_token: int) -> list[NodeRow]:
        parent = nodes.c.parent_id.is_(None) if parent_id is None else nodes.c.parent_id == parent_id
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(nodes).where(parent, nodes.c.model_id == model_id, nodes.c.first_token == first_token)).all()
        return [node_row(r) for r in rows]

    def node_path(self, node_id: str) -> list[NodeRow]:
        with self.engine.connect() as conn:
            return path_rows(conn, node_id)

    def nodes_of(self, model_ids: list[str]) -> list[NodeRow]:
        query = sa.select(nodes).where(nodes.c.model_id.in_(model_ids)).order_by(nodes.c.start, nodes.c.node_id)
        with self.engine.connect() as conn:
            return [node_row(r) for r in conn.execute(query).all()]

    def shared_nodes(self) -> list[NodeRow]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(nodes).where(nodes.c.refcount >= 2).order_by(nodes.c.start, nodes.c.node_id)).all()
        return [node_row(r) for r in rows]

    def node_shapes(self) -> list[tuple[NodeRow, int, int]]:
        query = sa.select(nodes, token_streams.c.alphabet, token_streams.c.block_size).join(token_streams, token_streams.c.node_id == nodes.c.node_id)
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [(node_row(r), int(r.alphabet), int(r.block_size)) for r in rows]

    # tiers ----------------------------------------------------------------------------
    def node_tokens(self, node_id: str, start: int = 0, end: int | None = None) -> np.ndarray:
        with self.engine.connect() as conn:
            return node_tokens(conn, node_id, start, end)

    def path_tokens(self, path: list[NodeRow], start: int = 0, end: int | None = None) -> np.ndarray:
        end = path[-1].end if end is None else end
        with self.engine.connect() as conn:
            pieces = [node_tokens(conn, n.node_id, max(start, n.start) - n.start, min(end, n.end) - n.start) for n in path if n.start < end and n.end > start]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    def nodes_tokens(self, node_ids: list[str]) -> dict[str, np.ndarray]:
        if not node_ids:
            return {}
        with self.engine.connect() as conn:
            coded = {r.node_id: r for r in conn.execute(sa.select(token_streams).where(token_streams.c.node_id.in_(node_ids)))}
            blobs: dict[str, list[bytes]] = {node_id: [] for node_id in coded}
            query = sa.select(token_blocks.c.node_id, token_blocks.c.data).where(token_blocks.c.node_id.in_(node_ids))
            for node_id, data in conn.execute(query.order_by(token_blocks.c.node_id, token_blocks.c.block_no)):
                blobs[node_id].append(data)
        out = {}
        for node_id in node_ids:
            row = coded.get(node_id)
            if row is None or len(blobs[node_id]) != len(fractal.blocks_for_range(0, int(row.n_tokens), int(row.block_size))):
                raise ValueError(f"node {node_id} holds no token blocks (held in tier L only: the services decode those)")
            out[node_id] = fractal.decode_range(blobs[node_id], int(row.alphabet), int(row.block_size), 0, int(row.n_tokens))
        return out

    def load_blocks(self, wanted: list[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        if not wanted:
            return {}
        key = sa.tuple_(token_blocks.c.node_id, token_blocks.c.block_no)
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(token_blocks.c.node_id, token_blocks.c.block_no, token_blocks.c.data).where(key.in_(wanted)))
            return {(r[0], int(r[1])): r[2] for r in rows}

    def load_logprobs(self, session_id: str) -> np.ndarray:
        with self.engine.connect() as conn:
            blobs = [logprobs_blob(conn, n.node_id) for n in path_rows(conn, session_id)]
        return np.frombuffer(b"".join(blobs), dtype="<f4").copy()

    def logprob_lengths(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(node_logprobs.c.node_id, sa.func.octet_length(node_logprobs.c.logprobs)))
            return {r[0]: int(r[1]) // 4 for r in rows}

    def max_alphabet(self, model_ids: list[str]) -> int:
        query = (
            sa.select(sa.func.coalesce(sa.func.max(token_streams.c.alphabet), 0))
            .join(nodes, nodes.c.node_id == token_streams.c.node_id)
            .where(nodes.c.model_id.in_(model_ids))
        )
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

    def node_lm_payload(self, node_id: str) -> bytes | None:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(node_lm.c.payload).where(node_lm.c.node_id == node_id)).scalar()

    def node_kv(self, node_id: str) -> tuple[str, dict[int, np.ndarray]] | None:
        with self.engine.connect() as conn:
            return kv_streams(conn, node_id)

    # search index bookkeeping ---------------------------------------------------------
    def index_state(self, index_key: str, from_slot: int = 0) -> IndexState | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(search_indexes).where(search_indexes.c.index_key == index_key)).first()
            if row is None:
                return None
            query = sa.select(search_ranges.c.node_id, search_ranges.c.first_slot).where(
                search_ranges.c.index_key == index_key, search_ranges.c.first_slot >= from_slot
            )
            ranges = {r[0]: int(r[1]) for r in conn.execute(query).all()}
        return IndexState(index_key, row.alphabet, row.depth, int(row.ntotal), int(row.generation), ranges)

    def index_generation(self, index_key: str) -> tuple[int, int] | None:
        query = sa.select(search_indexes.c.generation, search_indexes.c.ntotal).where(search_indexes.c.index_key == index_key)
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
        return None if row is None else (int(row[0]), int(row[1]))

    def index_keys(self) -> list[str]:
        with self.engine.connect() as conn:
            return list(conn.execute(sa.select(search_indexes.c.index_key)).scalars())

    def slot_runs(self, index_key: str) -> list[tuple[str, int, int, int]]:
        query = (
            sa.select(search_ranges.c.node_id, search_ranges.c.first_slot, search_ranges.c.n_tokens, nodes.c.start)
            .join(nodes, nodes.c.node_id == search_ranges.c.node_id)
            .where(search_ranges.c.index_key == index_key, nodes.c.refcount > 0)
        )
        with self.engine.connect() as conn:
            return [(r[0], int(r[1]), int(r[2]), int(r[3])) for r in conn.execute(query).all()]

    # checks and accounting ------------------------------------------------------------
    def stored_blobs(self, tier: str, sample: int | None = None) -> Iterator[tuple[str, int, bytes]]:
        """The part is the block number for "tokens", the alphabet the block was coded for for
        "kv", and 0 for "lm" and "codebooks"."""
        table, key, part, data, order = {
            "tokens": (token_blocks, token_blocks.c.node_id, token_blocks.c.block_no, token_blocks.c.data, (token_blocks.c.node_id, token_blocks.c.block_no)),
            "kv": (node_kv, node_kv.c.node_id, node_kv.c.alphabet, node_kv.c.data, (node_kv.c.node_id, node_kv.c.alphabet, node_kv.c.block_no)),
            "lm": (node_lm, node_lm.c.node_id, sa.literal_column("0"), node_lm.c.payload, (node_lm.c.node_id,)),
            "codebooks": (codebooks, codebooks.c.codebook_id, sa.literal_column("0"), codebooks.c.data, (codebooks.c.codebook_id,)),
        }[tier]
        numbered = sa.select(key.label("owner"), part.label("part"), data.label("data"), sa.func.row_number().over(order_by=order).label("n")).subquery()
        query = sa.select(numbered.c.owner, numbered.c.part, numbered.c.data).order_by(numbered.c.n)
        with self.engine.connect() as conn:
            if sample is not None:
                count = conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
                query = query.where((numbered.c.n - 1) % max(1, count // max(sample, 1)) == 0)
            yield from conn.execute(query)

    def dangling_references(self) -> list[tuple[str, str, str, str]]:
        """Sessions and nodes naming an unregistered model, KV codes naming codebooks that are gone."""
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

    def table_rows(self, table: str) -> Iterator[dict]:
        t = schema.metadata.tables[table]
        with self.engine.connect() as conn:
            for row in conn.execute(sa.select(t).order_by(*t.columns)).mappings():
                yield dict(row)

    def byte_counts(self) -> dict[str, int]:
        """Payload bytes, not the engine's page overhead (that is ``footprint``)."""

        def total(column):
            return sa.select(sa.func.coalesce(sa.func.sum(sa.func.octet_length(column)), 0))

        text_bytes = _text_bytes(sessions.c.metadata) + _text_bytes(sessions.c.name) + _text_bytes(sessions.c.source)
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(
                    sa.func.count(sessions.c.session_id), sa.func.coalesce(sa.func.sum(sessions.c.n_tokens), 0), sa.func.coalesce(sa.func.sum(text_bytes), 0)
                )
            ).one()
            streams = conn.execute(sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(token_streams.c.n_tokens), 0))).one()
            n_nodes = conn.execute(sa.select(sa.func.count()).select_from(nodes)).scalar_one()
            blobs = {
                name: conn.execute(total(column)).scalar_one()
                for name, column in (
                    ("blocks", token_blocks.c.data),
                    ("logprobs", node_logprobs.c.logprobs),
                    ("lm", node_lm.c.payload),
                    ("kv", node_kv.c.data),
                    ("codebooks", codebooks.c.data),
                )
            }
            kv_tokens = conn.execute(
                sa.select(sa.func.coalesce(sa.func.sum(nodes.c.n_tokens), 0)).where(nodes.c.node_id.in_(sa.select(node_kv.c.node_id)))
            ).scalar_one()
        return {
            "sessions": int(row[0]),
            "tokens": int(row[1]),
            "stored_tokens": int(streams[1]),
            "nodes": int(n_nodes),
            "metadata_bytes": int(row[2]) + NODE_ROW_BYTES * int(n_nodes),
            "token_bytes": int(blobs["blocks"]) + STREAM_ROW_BYTES * int(streams[0]),
            "logprob_bytes": int(blobs["logprobs"]),
            "lm_bytes": int(blobs["lm"]),
            "kv_bytes": int(blobs["kv"]),
            "kv_tokens": int(kv_tokens),
            "codebook_bytes": int(blobs["codebooks"]),
        }


def _text_bytes(column):
    return sa.func.octet_length(sa.cast(column, sa.LargeBinary))


def quoted(text) -> str:
    """A value inside a SQL string literal, for the statements DuckDB takes no parameters in (ATTACH, SET)."""
    return str(text).replace("'", "''")
