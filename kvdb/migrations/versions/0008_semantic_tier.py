"""The semantic tier: each trie node's chunks (spans of its sessions' text that end in it) and
their sentence embeddings, fp16.

A chunk is stored with the node that holds its last token: every session whose path runs
through that node holds the whole chunk, so a shared prefix's chunks are embedded once.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_chunks",
        sa.Column("node_id", sa.String, primary_key=True),
        sa.Column("chunk_no", sa.Integer, primary_key=True),
        sa.Column("start", sa.Integer, nullable=False),
        sa.Column("stop", sa.Integer, nullable=False),
        sa.Column("embedder", sa.String, nullable=False),
        sa.Column("vector", sa.LargeBinary, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("node_chunks")
