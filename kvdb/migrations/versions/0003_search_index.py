"""Search index bookkeeping: which FAISS slots belong to which session, per tokenizer.

The points themselves are derived from the token streams and live in a sidecar file; these
tables bind that file to the database (generation, slot count) and map slots to sessions.
Archives from 0002 get empty tables; their index is built from the tokens on first use.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "search_indexes",
        sa.Column("index_key", sa.String, primary_key=True),
        sa.Column("alphabet", sa.Integer, nullable=False),
        sa.Column("depth", sa.Integer, nullable=False),
        sa.Column("ntotal", sa.BigInteger, nullable=False),
        sa.Column("generation", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "search_ranges",
        sa.Column("session_id", sa.String, primary_key=True),
        sa.Column("index_key", sa.String, nullable=False),
        sa.Column("first_slot", sa.BigInteger, nullable=False),
        sa.Column("n_tokens", sa.Integer, nullable=False),
    )
    op.create_index("ix_search_ranges_key", "search_ranges", ["index_key"])


def downgrade() -> None:
    op.drop_index("ix_search_ranges_key", "search_ranges")
    op.drop_table("search_ranges")
    op.drop_table("search_indexes")
