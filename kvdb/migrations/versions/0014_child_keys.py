"""A node's children found by a key of their own: ``child_key``, the parent and the child's
first tokens (``kvdb.storage.base.child_key``). DuckDB 1.5.5 scans an index only for a filter on
one column alone, so ``ix_nodes_children (parent_id, first_token)`` served no walk of the trie:
each step of every session's walk scanned ``nodes`` whole and read every child that opens with
the token, a third of a backfill's time at 1e8 tokens (decision 0066). The nodes before this
revision get the key of their first token alone; a walk finds them by it, and tells them apart
by their tokens as it did.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

from kvdb.migrations._frozen_0014_child_keys import FIRST_TOKEN_KEY

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_nodes_children", "nodes")
    op.add_column("nodes", sa.Column("child_key", sa.String, nullable=True))
    op.create_index(
        "ix_nodes_child_key", "nodes", ["child_key"]
    )  # before the keys: DuckDB indexes no table with updates outstanding
    op.execute(f"update nodes set child_key = {FIRST_TOKEN_KEY}")


def downgrade() -> None:
    op.drop_index("ix_nodes_child_key", "nodes")
    op.drop_column("nodes", "child_key")
    op.create_index("ix_nodes_children", "nodes", ["parent_id", "first_token"])
