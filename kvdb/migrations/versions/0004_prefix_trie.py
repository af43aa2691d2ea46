"""Prefix trie: every tier is stored per trie node, so a prefix shared by sessions is stored once.

A session is the path from a root node to its leaf, and the leaf's id equals the session's id
(both are the content hash of the model and the token path). Archives from 0003 get one root
node per session; prefixes they already share stay duplicated until re-ingested.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

from kvdb.migrations import _frozen_0002_fractal as fractal  # frozen: never the live kvdb.codecs.fractal

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("node_id", sa.String, primary_key=True),
        sa.Column("parent_id", sa.String, nullable=True),
        sa.Column("model_id", sa.String, nullable=False),
        sa.Column("start", sa.Integer, nullable=False),
        sa.Column("n_tokens", sa.Integer, nullable=False),
        sa.Column("first_token", sa.Integer, nullable=False),
        sa.Column("refcount", sa.Integer, nullable=False),
    )
    op.create_index("ix_nodes_children", "nodes", ["parent_id", "first_token"])
    conn = op.get_bind()
    rows = conn.execute(
        sa.text(
            "select s.session_id, s.model_id, t.alphabet, t.n_tokens, b.data from sessions s "
            "join token_streams t on t.session_id = s.session_id "
            "join token_blocks b on b.session_id = s.session_id and b.block_no = 0"
        )
    ).all()
    for session_id, model_id, alphabet, n_tokens, first_block in rows:
        first = int(fractal.decode_block(first_block, alphabet, 0, 1)[0])
        conn.execute(
            sa.text("insert into nodes values (:n, NULL, :m, 0, :len, :first, 1)"),
            {"n": session_id, "m": model_id, "len": n_tokens, "first": first},
        )
    op.alter_column("token_streams", "session_id", new_column_name="node_id")
    op.alter_column("token_blocks", "session_id", new_column_name="node_id")
    op.rename_table("session_logprobs", "node_logprobs")
    op.alter_column("node_logprobs", "session_id", new_column_name="node_id")
    op.drop_index("ix_search_ranges_key", "search_ranges")
    op.alter_column("search_ranges", "session_id", new_column_name="node_id")
    op.create_index("ix_search_ranges_key", "search_ranges", ["index_key"])


def downgrade() -> None:
    raise NotImplementedError("schema 0004 shares nodes between sessions; there is no lossless way back to 0003")
