"""Optional tiers per trie node: the LM-coded token stream, and which optional tiers a node keeps.

The token tier is always kept (trie matching and every read use it). `keep` lists the optional
tiers a node holds ("search", "lm"), so a rebuild of the search index knows which nodes belong
in it and `compact` can drop tiers later. Nodes from 0004 keep "search", as they were built.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("keep", sa.String, server_default="search"))  # DuckDB cannot add NOT NULL columns
    op.create_table(
        "node_lm",
        sa.Column("node_id", sa.String, primary_key=True),
        sa.Column("payload", sa.LargeBinary, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("node_lm")
    op.drop_column("nodes", "keep")
