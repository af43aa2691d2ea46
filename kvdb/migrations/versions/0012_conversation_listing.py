"""Conversations listed in SQL: each conversation's row holds what listing filters, orders and
pages by (its versions, its latest version and when that was said, its agent, its project's
folders), so that ``kvdb sessions``, MCP ``sessions`` and a filtered search read one row a
conversation instead of every session's metadata (issue 53). Existing rows are filled by the
rule of ``_frozen_0012_conversation_listing``; each write of a session keeps them after.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

from kvdb.migrations import _frozen_0012_conversation_listing as frozen

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

TYPES = {"INTEGER": sa.Integer, "TIMESTAMP": sa.DateTime, "VARCHAR": sa.String}


def upgrade() -> None:
    for name, kind in frozen.COLUMNS:
        op.add_column("conversations", sa.Column(name, TYPES[kind], nullable=True))
    conn = op.get_bind()

    def execute(query: str, params: list) -> list[tuple]:
        result = conn.exec_driver_sql(query, tuple(params))  # DuckDB's own ? parameters, many rows a statement
        return [tuple(r) for r in result.fetchall()] if result.returns_rows else []

    frozen.fill(execute)


def downgrade() -> None:
    for name, _ in reversed(frozen.COLUMNS):
        op.drop_column("conversations", name)
