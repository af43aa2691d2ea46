"""A node's rows found through an index of their own: DuckDB 1.5.5 scans an index only for a
filter on every column of it, so the primary keys that begin with ``node_id`` (a node's token
blocks, its KV blocks, its chunks, its search ranges) never served ``where node_id = ?`` and
each such read scanned the whole table: 4-7 ms a read of ``token_blocks`` at 1e7 tokens, and
six a session while a backfill plans (decision 0064).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

TABLES = ("token_blocks", "node_kv", "node_chunks", "search_ranges")


def upgrade() -> None:
    for table in TABLES:
        op.create_index(f"ix_{table}_node", table, ["node_id"])


def downgrade() -> None:
    for table in TABLES:
        op.drop_index(f"ix_{table}_node", table)
