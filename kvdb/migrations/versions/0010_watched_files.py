"""What `kvdb watch` last archived of each file it follows (its size and modification time),
so that a watcher started again resumes where it was: a file unchanged since is not read again.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "watched_files",
        sa.Column("path", sa.String, primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("mtime_ns", sa.BigInteger, nullable=False),
        sa.Column("checked_at", sa.DateTime, nullable=False),
        sa.Column("status", sa.String, nullable=False),
        sa.Column("detail", sa.Text, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("watched_files")
