"""Tier K: residual-VQ codebooks per model, and each trie node's KV code streams.

Code streams are token-major (for each position: kind > layer > stage > head), one stream per
codebook size, fractal-coded in blocks like the token tier.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "codebooks",
        sa.Column("codebook_id", sa.String, primary_key=True),
        sa.Column("model_id", sa.String, nullable=False),
        sa.Column("preset", sa.String, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "node_kv",
        sa.Column("node_id", sa.String, primary_key=True),
        sa.Column("alphabet", sa.Integer, primary_key=True),
        sa.Column("block_no", sa.Integer, primary_key=True),
        sa.Column("codebook_id", sa.String, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("node_kv")
    op.drop_table("codebooks")
