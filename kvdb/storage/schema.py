"""The archive's tables, as SQLAlchemy Core definitions: the one description every SQL backend
queries through. Alembic migrations create them; tests/storage/test_schema_matches_migrations.py
checks that the two agree. ``REVISION`` is the migration these definitions correspond to: an
archive at it opens without importing alembic.
"""

from __future__ import annotations

import sqlalchemy as sa

from kvdb.storage.engine import REVISION  # noqa: F401 (the head of kvdb/migrations/versions, named where the tables are)

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
    sa.Column("first_token", sa.Integer, nullable=False),
    sa.Column("refcount", sa.Integer, nullable=False),  # sessions whose path runs through this node
    # tiers the node holds, comma-separated: "tokens", "search", "lm", "kv"
    sa.Column("keep", sa.String, server_default="search"),
    # how a walk finds it under its parent: base.child_key (since 0014)
    sa.Column("child_key", sa.String, nullable=True),
)

# Tier L: a node's tokens range-coded against the model's own next-token distribution (kvdb.model.lmcode),
# given the context of its parent path.
node_lm = sa.Table(
    "node_lm",
    metadata,
    sa.Column("node_id", sa.String, primary_key=True),
    sa.Column("payload", sa.LargeBinary, nullable=False),
)

# A node's token stream: fractal-coded blocks of anchors (kvdb.codecs.fractal), one row per block,
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

# Search index bookkeeping (kvdb.index.walk): the sorted walk keys live in a sidecar file bound to the
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

# Tier K: residual-VQ codebooks (kvdb.codecs.quant) and each node's code streams, one fractal-coded
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

# The semantic tier: chunks of text (positions [start, stop) on the path, stop inside the node: a
# chunk is stored with the node holding its last token) and their sentence embeddings, float16.
node_chunks = sa.Table(
    "node_chunks",
    metadata,
    sa.Column("node_id", sa.String, primary_key=True),
    sa.Column("chunk_no", sa.Integer, primary_key=True),
    sa.Column("start", sa.Integer, nullable=False),
    sa.Column("stop", sa.Integer, nullable=False),
    sa.Column("embedder", sa.String, nullable=False),
    sa.Column("vector", sa.LargeBinary, nullable=False),
)

# Conversations: the sessions that are states of one conversation (grown, forked) share its id;
# ``title`` is the user's name for it (NULL: its latest session's name). kvdb.storage.conversation_rows
# decides, inside each session's write, which conversation the session joins.
conversations = sa.Table(
    "conversations",
    metadata,
    sa.Column("conversation_id", sa.String, primary_key=True),
    sa.Column("title", sa.String, nullable=True),
    # What listing filters, orders and pages by in SQL, kept by each write of its sessions (migration 0012):
    sa.Column("versions", sa.Integer, nullable=True),
    sa.Column("updated_at", sa.DateTime, nullable=True),  # its latest version's created_at
    sa.Column("latest_id", sa.String, nullable=True),  # its latest version: the last by (created_at, session_id)
    # when its latest version was said (Session.said_at), as its log wrote it, without a zone
    sa.Column("said_at", sa.DateTime, nullable=True),
    sa.Column("agent", sa.String, nullable=True),  # its first version's format
    sa.Column("cwd", sa.String, nullable=True),  # the first working directory a version records
    sa.Column("folder", sa.String, nullable=True),  # its first version's file's folder; its project: cwd, else this
)

conversation_sessions = sa.Table(
    "conversation_sessions",
    metadata,
    sa.Column("session_id", sa.String, primary_key=True),
    sa.Column("conversation_id", sa.String, nullable=False),
)

# `kvdb watch`'s checkpoint: each file it follows as it last archived it (status: an IngestStatus,
# or "waiting" for a log whose last line was still being written; detail: the error, or what waits).
watched_files = sa.Table(
    "watched_files",
    metadata,
    sa.Column("path", sa.String, primary_key=True),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("mtime_ns", sa.BigInteger, nullable=False),
    sa.Column("checked_at", sa.DateTime, nullable=False),
    sa.Column("status", sa.String, nullable=False),
    sa.Column("detail", sa.Text, nullable=True),
)

# Work the model owes a session (kvdb.services.upkeep): "logprobs", the log-probabilities of the
# nodes on its path that have none (ingest ran no model), with its exact cache warmed on the way.
pending_work = sa.Table(
    "pending_work",
    metadata,
    sa.Column("session_id", sa.String, primary_key=True),
    sa.Column("work", sa.String, primary_key=True),
    sa.Column("queued_at", sa.DateTime, nullable=False),
)

# Lookups the hot paths make: sessions by name, a node's children by their first tokens, an index's slot runs.
sa.Index("ix_sessions_name", sessions.c.name)
sa.Index("ix_nodes_child_key", nodes.c.child_key)
sa.Index("ix_search_ranges_key", search_ranges.c.index_key)
sa.Index("ix_conversation_sessions_conversation", conversation_sessions.c.conversation_id)
# DuckDB scans an index only for a filter on all its columns: keys that begin with node_id
# do not serve ``where node_id = ?`` (migration 0013)
for _table in (token_blocks, node_kv, node_chunks, search_ranges):
    sa.Index(f"ix_{_table.name}_node", _table.c.node_id)
