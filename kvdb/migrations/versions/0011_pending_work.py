"""Work the model owes the archive: ingest archives the token tiers at the tokenizer's speed and
queues what only a forward pass can make (a session's log-probabilities, its exact cache), for
`kvdb upkeep` and the idle time of `kvdb watch` and `kvdb serve` (issue 53, decision 0053).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pending_work",
        sa.Column("session_id", sa.String, primary_key=True),
        sa.Column("work", sa.String, primary_key=True),
        sa.Column("queued_at", sa.DateTime, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("pending_work")
